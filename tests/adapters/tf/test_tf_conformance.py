"""tf.distribute conformance of ReductionServerStrategy on 2 and 3 worker processes: TensorFlow's
own ``strategy_test_lib`` checks (minimising a loss eagerly and in a graph session), replica ids,
all-reduce of values, gradients and IndexedSlices, values from a function, ``reduce`` over axes,
``gather``/``all_gather`` (ragged, any axis, gradients) and Keras ``predict``.

Two oracles: the values each check must give, written below from the replicas' inputs; and
MultiWorkerMirroredStrategy (MWMS) itself, run on the same script with three workers on loopback
ports next to ours: every check MWMS can run must give the same value under both, and the issue's
table (gather, all_gather, predict) must. Where MWMS cannot run a check here its error is reported
and the written values are the oracle. Keras 3.15 ``fit`` and ``evaluate`` fail under MWMS on this
machine (its ``_reduce_to`` is given a tuple of per-replica batches), so ``fit`` with
BackupAndRestore is checked against an uninterrupted run in test_tf_multiprocess.py instead.
Tolerance: float32 sums of small integers are exact; predictions to 1e-6.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

import numpy as np  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow, pytest.mark.timeout(360)]

WORKER = os.path.join(os.path.dirname(__file__), "conformance_worker.py")
TABLE = ("gather_of_run", "all_gather_in_run", "predict_rows")
# strategy_test_lib's graph test opens a TF1 session with its own ConfigProto, which sees one CPU
# device: logical CPU devices exist only for eager contexts. It runs with one device per worker.
SESSION_SKIP = "skipped: several logical CPU devices"


def expected(workers: int, devices: int, worker: int) -> dict[str, object]:
    """What each check returns on ``worker`` (replica g lives on worker g // devices)."""
    n = workers * devices
    mine = [worker * devices + i for i in range(devices)]
    total = n * (n + 1) // 2  # sum of g + 1
    rows = np.concatenate([np.full((g + 1, 2), float(g)) for g in range(n)])
    weighted = sum((g + 1) * np.array([g, 2.0 * g]) for g in range(n))
    mean_g = sum(range(n)) / n
    dense = np.zeros((6, 2))
    for g in range(n):
        dense[g] = g + 1
    return {
        "gather_of_run": [[float(g // devices)] for g in range(n)],
        "all_gather_in_run": [[float(g // devices) for g in range(n)]] * devices,
        "gather_ragged_in_function": rows.tolist(),
        "gather_axis_1_int32": [list(range(n)), [10 + g for g in range(n)]],
        "all_gather_gradient": [[n * 2.0 * g, n * (2.0 * g + 1)] for g in mine],
        "minimize_loss_eager": "passed",
        "minimize_loss_graph": "passed" if devices == 1 else SESSION_SKIP,
        "replica_ids": {"num_replicas_in_sync": n, "local": mine},
        "values_from_function": [[g, n] for g in mine],
        "cluster_resolver": ["worker", worker, workers],
        "all_reduce_in_function": [[[total * 1.0, total * 2.0]] * devices, [[total / n, 2 * total / n]] * devices,
                                   [total] * devices],
        "all_reduce_gradient_tape": {"SUM": [float(total)] * devices, "MEAN": [total / n] * devices},
        "all_reduce_indexed_slices": [dense.tolist()],  # reduced to one destination, /cpu:0
        "reduce_over_axes": {"sum_0": weighted.tolist(), "mean_0": (weighted / total).tolist(),
                             "sum_none": np.full((2, 3), float(sum(range(n)))).tolist(),
                             "mean_none": np.full((2, 3), mean_g).tolist(), "mean_1": [mean_g, mean_g]},
    }


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(procs, tmp_path, name: str, spec: dict, tf_configs: list[dict]) -> list[tuple[subprocess.Popen, str]]:  # type: ignore[no-untyped-def,type-arg]
    from conftest import child_env

    started = []
    for index, tf_config in enumerate(tf_configs):
        prefix = str(tmp_path / f"{name}{index}")
        output = open(prefix + ".out", "w")
        procs.files.append(output)
        # Workers import TensorFlow and trace for tens of seconds on a busy machine before their first
        # exchange: the operation timeout must outlast the slowest start, not the exchange itself.
        env = child_env({"REDSRV_OP_TIMEOUT": "180", "TF_CONFIG": json.dumps(tf_config)})
        started.append((procs.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=env, stdout=output,
                                    stderr=subprocess.STDOUT), prefix))
    return started


def collect(started: list[tuple[subprocess.Popen, str]], timeout: float = 300) -> list[dict]:  # type: ignore[type-arg]
    """Each worker's results, after it exited 0 within ``timeout`` (else the end of its output)."""
    results = []
    for proc, prefix in started:
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"conformance worker pid {proc.pid} still running after {timeout}s: a hang") from None
        if returncode != 0:
            with open(prefix + ".out") as f:
                raise AssertionError(f"{prefix} exited with {returncode}:\n{f.read()[-4000:]}")
        with open(prefix + ".json") as f:
            results.append(json.load(f))
    return results


def ours(procs, tmp_path, reducers: list[str], workers: int, devices: int):  # type: ignore[no-untyped-def]
    configs = [{"cluster": {"worker": [f"worker{i}:1" for i in range(workers)], "reducer": reducers},
                "task": {"type": "worker", "index": i}} for i in range(workers)]
    spec = {"strategy": "redsrv", "devices": devices, "job": f"conformance-{workers}x{devices}"}
    return launch(procs, tmp_path, "redsrv", spec, configs)


def mismatches(results: list[dict], workers: int, devices: int) -> list[str]:  # type: ignore[type-arg]
    found = []
    for worker, result in enumerate(results):
        for name, want in expected(workers, devices, worker).items():
            got = result[name]
            if "error" in got:
                found.append(f"worker {worker} {name}: {got['error']}")
            elif not _close(got["value"], want):
                found.append(f"worker {worker} {name}: got {got['value']}, want {want}")
    return found


def _close(got: object, want: object) -> bool:
    """Equal structure, numbers within 1e-6 (float32 sums of small integers are exact)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_close(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return isinstance(got, list) and len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    if isinstance(want, str) or isinstance(got, str):
        return got == want
    return abs(float(got) - float(want)) <= 1e-6  # type: ignore[arg-type]


def reference_predictions() -> np.ndarray:
    """predict_rows in this process, without any strategy."""
    import keras

    keras.utils.set_random_seed(7)
    x = np.arange(64, dtype="float32").reshape(32, 2) / 64
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    return model.predict(x, batch_size=8, verbose=0)


def test_two_workers_of_two_devices(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reducers = [r.address for r in fleet(2)]
    results = collect(ours(procs, tmp_path, reducers, 2, 2))
    assert not mismatches(results, 2, 2), "\n".join(mismatches(results, 2, 2))
    want = reference_predictions()
    for result in results:  # every row on every worker, in the input's order
        np.testing.assert_allclose(result["predict_rows"]["value"], want, rtol=0, atol=1e-6)


def test_three_workers_against_multi_worker_mirrored_strategy(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reducers = [r.address for r in fleet(2)]
    ports = free_ports(3)
    mwms_configs = [{"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": i}}
                    for i in range(3)]
    theirs = launch(procs, tmp_path, "mwms", {"strategy": "mwms"}, mwms_configs)
    results = collect(ours(procs, tmp_path, reducers, 3, 1))
    mwms = collect(theirs)
    assert not mismatches(results, 3, 1), "\n".join(mismatches(results, 3, 1))
    differences = []
    for worker, (mine, reference) in enumerate(zip(results, mwms)):
        for name in TABLE:
            assert "error" not in reference[name], f"MWMS failed the table row {name}: {reference[name]['error']}"
        for name, theirs_result in reference.items():
            if "error" in theirs_result:
                continue  # MWMS cannot run it here: the written values above are the oracle
            if not _close(mine[name]["value"], theirs_result["value"]):
                differences.append(f"worker {worker} {name}: ours {mine[name]['value']}, MWMS {theirs_result['value']}")
    assert not differences, "\n".join(differences)
    want = reference_predictions()
    for result in results:
        np.testing.assert_allclose(result["predict_rows"]["value"], want, rtol=0, atol=1e-6)
