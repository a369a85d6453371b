"""The JAX adapter across processes: 2 processes x 2 CPU devices against real reducer processes,
compared with one process on 4 devices using JAX's own collectives (the reference).

Tolerances: float32 results differ from the reference only by summation order (1e-6 relative);
bfloat16 by the rounding of partial sums (2 ulp, 2e-2); integers are exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

import numpy as np  # noqa: E402

pytestmark = [pytest.mark.jax, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "jax_worker.py")
LOCAL_DEVICES = 2


def jax_env(devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    from conftest import child_env  # the fast REDSRV_* timeouts, no inherited RANK/WORLD_SIZE

    env = child_env(extra)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def start_worker(procs, spec: dict, prefix: str, devices: int) -> subprocess.Popen:  # type: ignore[no-untyped-def,type-arg]
    return procs.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=jax_env(devices),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, prefix: str, timeout: float = 150) -> tuple[dict, dict]:  # type: ignore[type-arg]
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"JAX worker pid {proc.pid} still running after {timeout}s: a hang") from None
    assert proc.returncode == 0, f"worker exited with {proc.returncode}:\n{output}"
    with open(prefix + ".json") as f:
        report = json.load(f)
    with np.load(prefix + ".npz") as data:
        results = {k: data[k] for k in data.files}
    return results, report


@pytest.mark.parametrize("per_host", [1, 2], ids=["one-process-per-host", "two-processes-per-host"])
def test_collectives_across_processes_equal_jax_collectives_over_all_devices(fleet, procs, tmp_path,  # type: ignore[no-untyped-def]
                                                                             per_host: int) -> None:
    """2 processes, or 2 emulated hosts of 2 processes each (host-level reduction inside each host
    first, core/host_client.py), every process with 2 devices, against one process with them all."""
    reducers = [r.address for r in fleet(2)]
    world = 2 * per_host
    runs = []
    for rank in range(world):
        spec = {"mode": "redsrv", "scenario": "collectives", "reducers": reducers, "rank": rank, "world_size": world,
                "job": f"jax-collectives-{per_host}"}
        if per_host > 1:
            spec["config"] = {"host_reduce": "host", "local_rank": rank % per_host, "local_size": per_host,
                              "host_id": f"host{rank // per_host}"}
        runs.append((start_worker(procs, spec, str(tmp_path / f"r{rank}"), LOCAL_DEVICES), str(tmp_path / f"r{rank}")))
    ref_prefix = str(tmp_path / "ref")
    reference = start_worker(procs, {"mode": "lax", "scenario": "collectives"}, ref_prefix, world * LOCAL_DEVICES)
    outputs = []
    for proc, prefix in runs:
        results, report = finish(proc, prefix)
        assert report["error"] is None, report["error"]
        assert report["devices"] == LOCAL_DEVICES
        assert report["client"] == ("HostClient" if per_host > 1 else "Client")
        outputs.append(results)
    want, report = finish(reference, ref_prefix)
    assert report["error"] is None and report["devices"] == world * LOCAL_DEVICES
    compared = 0
    for name, expected in want.items():
        got = np.concatenate([out[name] for out in outputs])  # rank-major = global device order
        if name.endswith(".n"):
            np.testing.assert_array_equal(got, expected, err_msg=name)
        elif name.endswith(".h"):
            np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2, err_msg=name)
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=name)
        compared += 1
    # pmap and shard_map (check_vma on and off): psum and pmean of a 4-leaf tree, and gradients
    assert compared == 3 * (4 + 2 + 2) and {n.split(".")[0] for n in want} == {"pmap", "smap0", "smap1"}
    # every device of every process holds byte-identical sums (the reducers add in rank order, or
    # in host order with several processes per host)
    for name in (n for n in want if ".grad_" not in n):
        for out in outputs:
            np.testing.assert_array_equal(outputs[0][name][0], out[name][0], err_msg=name)
            np.testing.assert_array_equal(out[name][0], out[name][1], err_msg=name)
    for out in outputs:  # broadcast_tree from the last rank
        np.testing.assert_array_equal(out["broadcast.w"], np.full((2, 3), world, np.float32))
        np.testing.assert_array_equal(out["broadcast.k"], np.full(2, world - 1))
        np.testing.assert_array_equal(out["broadcast.j"], np.full(4, world - 1))
        assert bool(out["broadcast.j_is_jax"])


def test_optax_training_on_2_processes_x_2_devices_equals_1_process_x_4_devices(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reducers = ",".join(r.address for r in fleet(2))
    steps = "30"
    runs = []
    for rank in range(2):
        out = str(tmp_path / f"rank{rank}.npz")
        cmd = [sys.executable, "-m", "redsrv.examples.jax_optax", "--rank", str(rank), "--world-size", "2",
               "--steps", steps, "--out", out]
        # reducers and job from the environment, as a launcher would set them
        env = jax_env(LOCAL_DEVICES, {"REDSRV_REDUCERS": reducers, "REDSRV_JOB": "jax-optax"})
        runs.append((procs.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    ref_out = str(tmp_path / "ref.npz")
    reference = procs.popen([sys.executable, "-m", "redsrv.examples.jax_optax", "--reference", "--steps", steps,
                             "--out", ref_out], env=jax_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = []
    for proc, out in [*runs, (reference, ref_out)]:
        try:
            output, _ = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"training process pid {proc.pid} did not finish: a hang") from None
        assert proc.returncode == 0, output
        with np.load(out) as data:
            results.append({k: data[k] for k in data.files})
    rank0, rank1, ref = results
    assert int(rank0["devices"]) == int(ref["devices"]) == 4
    np.testing.assert_array_equal(rank0["weights"], rank1["weights"])
    assert float(ref["last_loss"]) < 0.5 * float(ref["first_loss"]), "the reference did not learn"
    np.testing.assert_allclose(rank0["weights"], ref["weights"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(rank0["losses"], ref["losses"], rtol=1e-6, atol=1e-6)


def test_a_killed_reducer_surfaces_as_an_error_on_the_host_not_a_hang(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    runs = []
    for rank in range(2):
        spec = {"mode": "redsrv", "scenario": "loop", "reducers": [r.address for r in reducers], "rank": rank,
                "world_size": 2, "job": "jax-kill", "loop_seconds": 90}
        prefix = str(tmp_path / f"k{rank}")
        runs.append((start_worker(procs, spec, prefix, LOCAL_DEVICES), prefix))
    from tests_support import poll

    def trained() -> bool:
        assert all(proc.poll() is None for proc, _ in runs), "a worker exited before the kill"
        return all(_progress(prefix) >= 3 for _, prefix in runs)

    poll(trained, 120, "every worker completing 3 steps", every=0.1)
    killed_at = time.time()
    reducers[1].signal(signal.SIGKILL)
    for proc, prefix in runs:
        _, report = finish(proc, prefix, timeout=60)
        error = report["error"]
        assert error is not None, f"no error after the reducer died ({report.get('steps')} steps)"
        assert "PeerLostError" in error["mro"], error
        assert reducers[1].address in error["message"], error
        assert error["at"] - killed_at < 10, f"the error took {error['at'] - killed_at:.1f}s"


def _progress(prefix: str) -> int:
    try:
        with open(prefix + ".progress") as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def test_a_failure_on_one_process_fails_the_others_promptly(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 alone fails; its communicator closes the client, so rank 0 hears of it from the
    reducers well before its own operation timeout (20 s in tests) instead of waiting."""
    reducers = [r.address for r in fleet(1)]
    runs = []
    for rank in range(2):
        spec = {"mode": "redsrv", "scenario": "loop", "reducers": reducers, "rank": rank, "world_size": 2,
                "job": "jax-one-fails", "loop_seconds": 90, **({"fail_at_step": 5} if rank == 1 else {})}
        prefix = str(tmp_path / f"f{rank}")
        runs.append((start_worker(procs, spec, prefix, LOCAL_DEVICES), prefix))
    (_, survivor), (_, failed) = (finish(proc, prefix, timeout=90) for proc, prefix in runs)
    assert failed["error"]["type"] == "RemoteProtocolError" and "injected" in failed["error"]["message"]
    assert any("redsrv.jax.psum at" in note for note in failed["error"]["notes"]), failed["error"]
    error = survivor["error"]
    assert error is not None and "PeerError" in error["mro"], error
    assert error["at"] - failed["error"]["at"] < 10, f"rank 0 learned after {error['at'] - failed['error']['at']:.1f}s"
