"""Differential tests: DDP through redsrv against DDP through gloo, same seeds, same batches.

Real reducer processes and real worker processes (``ddp_worker.py``); every worker trains each
configuration twice, once with gloo DDP (the oracle) and once through redsrv, for ``STEPS``
steps, and the final parameters (and buffers) are compared.

Tolerances, as the largest ``|redsrv - gloo|`` over the largest ``|gloo|`` of each parameter:

* world size 2: ``a + b`` is the same in either order and halving is exact, so every
  configuration agrees **bitwise**, whatever the parameter dtype (float32, float64, float16,
  bfloat16, mixed) — except subnormal 16-bit values, which only wire compression produces.
* world size 3: gloo's ring adds the ranks in an order that differs per chunk, the reducers add
  in rank order: float32 1e-6, float64 1e-12, float16 4 * 2**-10, bfloat16 4 * 2**-7 (a few
  roundings of the format over the steps). A mixed-dtype model gets the tolerance of its least
  precise parameter for all of them: differences travel between layers through the forward pass.
* 16-bit wire formats, against torch's own fp16/bf16 compress hooks over gloo (same rounding of
  the inputs; torch divides before the sum, the core after, and sums in float32): one rounding,
  2**-10 (fp16) and 2**-7 (bf16).

Collectives: world size 2 bitwise for all; world size 3 bitwise for integers, broadcast and
gather, the float tolerances above for sums, and the float32 sum is checked bitwise against a
NumPy sum in rank order (the reducers' documented order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

pytest.importorskip("torch")

import numpy as np  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
STEPS = 5
RUN_TIMEOUT = 240.0

TRAINING = ["fp32", "grad_as_bucket_view", "static_graph", "find_unused", "no_sync", "mixed_dtypes", "fp16_params",
            "bf16_params", "fp64_params", "wire_fp16", "wire_bf16", "backend_ddp", "backend_ddp_unused", "backend_ddp_buffers"]
#: A world size that is not a power of two, where summation order shows; fewer configurations
#: because every extra rank costs a process that imports torch and DDP (~12 s of CPU here).
TRAINING_WORLD3 = ["fp32", "fp64_params", "fp16_params", "bf16_params", "mixed_dtypes", "wire_bf16", "backend_ddp"]

WORLD3_TOLERANCE = {"float32": 1e-6, "float64": 1e-12, "float16": 4 * 2**-10, "bfloat16": 4 * 2**-7, "int64": 0.0}
WIRE_TOLERANCE = {"wire_fp16": 2**-10, "wire_bf16": 2**-7}

COLLECTIVES = ["all_reduce_sum_fp32", "all_reduce_sum_int64", "all_reduce_sum_int32", "all_reduce_sum_fp64",
               "all_reduce_sum_bf16", "all_reduce_sum_fp16", "all_reduce_avg_fp32", "all_reduce_noncontiguous",
               "all_reduce_async", "broadcast_fp32", "broadcast_bf16", "broadcast_bool", "broadcast_int8_odd",
               "broadcast_int64", "all_gather_fp32_special", "all_gather_int64", "all_gather_bool_odd",
               "all_gather_bf16", "all_gather_into_tensor", "barrier"]
#: Float sums whose result depends on the order of addition, and the dtype that sets the tolerance.
ORDER_DEPENDENT = {"all_reduce_sum_fp32": "float32", "all_reduce_sum_fp64": "float64", "all_reduce_sum_bf16": "bfloat16",
                   "all_reduce_sum_fp16": "float16", "all_reduce_avg_fp32": "float32",
                   "all_reduce_noncontiguous": "float32", "all_reduce_async": "float32"}


@dataclass
class Run:
    world_size: int
    results: list[dict[str, np.ndarray]]
    reports: list[dict]  # type: ignore[type-arg]
    exit_codes: list[int | None]
    seconds: float


#: These tests compare numbers, not failure detection: heartbeats looser than the suite's
#: (1 s) so that several torch processes on two busy cores never look frozen to each other.
RELAXED = {"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"}


def run_workers(world_size: int, configs: list[str], tmp: str, env_of: Callable[[int], dict[str, str]] | None = None) -> Run:
    """``env_of(rank)``: variables a launcher would give that rank besides the usual ones."""
    from conftest import ProcessTracker, child_env
    from tests_support import wait_all, worker_results

    tracker = ProcessTracker()
    try:
        reducers = [tracker.start_reducer(env=RELAXED).address for _ in range(2)]
        started = time.monotonic()
        prefixes, workers = [], []
        for rank in range(world_size):
            spec = {"rank": rank, "world_size": world_size, "reducers": reducers, "job": f"diff{world_size}",
                    "store": os.path.join(tmp, "gloo-store"), "configs": configs, "steps": STEPS}
            prefix = os.path.join(tmp, f"rank{rank}")
            log = open(prefix + ".log", "w")  # a file, never a pipe that could fill up
            tracker.files.append(log)
            env = {**RELAXED, **(env_of(rank) if env_of else {})}
            workers.append(tracker.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=child_env(env),
                                         stdout=log, stderr=subprocess.STDOUT))
            prefixes.append(prefix)
        wait_all(workers, RUN_TIMEOUT)
        exit_codes = [p.poll() for p in workers]
        seconds = time.monotonic() - started
        results, reports = zip(*(worker_results(prefix) for prefix in prefixes), strict=True)
        return Run(world_size, list(results), list(reports), exit_codes, seconds)
    finally:
        tracker.cleanup()


#: Two emulated hosts of two workers each, as torchrun would launch them (``--nproc-per-node 2``
#: on each of two nodes): the hook's client and the backend's world group reduce inside each
#: host first (core/host_client.py). Sums then run in host order: world3's tolerances apply.
TRAINING_TWO_PER_HOST = ["fp32", "bf16_params", "mixed_dtypes", "wire_bf16", "backend_ddp"]
TWO_PER_HOST_COLLECTIVES = ["all_reduce_sum_fp32", "all_reduce_sum_int64", "all_reduce_avg_fp32", "broadcast_bf16",
                            "broadcast_int8_odd", "all_gather_int64", "barrier"]


def two_per_host(rank: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2",
            "REDSRV_HOST_ID": f"node{rank // 2}"}


@pytest.fixture(scope="module")
def world4_two_per_host(tmp_path_factory) -> Run:  # type: ignore[no-untyped-def]
    return run_workers(4, TRAINING_TWO_PER_HOST + ["collectives"], str(tmp_path_factory.mktemp("world4")), two_per_host)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> Run:  # type: ignore[no-untyped-def]
    return run_workers(2, TRAINING + ["collectives"], str(tmp_path_factory.mktemp("world2")))


@pytest.fixture(scope="module")
def world3(tmp_path_factory) -> Run:  # type: ignore[no-untyped-def]
    return run_workers(3, TRAINING_WORLD3 + ["collectives"], str(tmp_path_factory.mktemp("world3")))


def relative_error(expected: np.ndarray, actual: np.ndarray) -> float:
    scale = float(np.abs(expected.astype(np.float64)).max()) or 1.0
    return float(np.abs(expected.astype(np.float64) - actual.astype(np.float64)).max()) / scale


def parameters(run: Run, rank: int, config: str) -> list[tuple[np.ndarray, np.ndarray, str]]:
    report = run.reports[rank]
    assert report["errors"].get(config, "not run") is None, f"rank {rank} failed {config}:\n{report['errors'].get(config)}"
    data = run.results[rank]
    dtypes = report["dtypes"][config]
    return [(data[f"{config}/gloo/{i}"], data[f"{config}/redsrv/{i}"], dtype) for i, dtype in enumerate(dtypes)]


def check_training(run: Run, config: str) -> None:
    for rank in range(run.world_size):
        for i, (gloo, ours, dtype) in enumerate(parameters(run, rank, config)):
            if config in WIRE_TOLERANCE:
                tolerance = WIRE_TOLERANCE[config]
            elif run.world_size == 2:
                assert gloo.tobytes() == ours.tobytes(), (
                    f"{config}: rank {rank} parameter {i} ({dtype}) differs from gloo DDP "
                    f"(relative {relative_error(gloo, ours):.3g}); expected bitwise equality at world size 2")
                continue
            else:
                # Rounding differences in one layer reach every other layer through the next
                # steps' forward passes: a model is as precise as its least precise parameter.
                tolerance = max(WORLD3_TOLERANCE[d] for d in run.reports[rank]["dtypes"][config])
            error = relative_error(gloo, ours)
            assert error <= tolerance, f"{config}: rank {rank} parameter {i} ({dtype}) off by {error:.3g} > {tolerance:.3g}"
    # Every rank ends with the same parameters (DDP's contract), bit for bit. Not buffers: DDP
    # broadcasts them before each forward, which then updates them locally.
    count = run.reports[0]["parameters"][config]
    first = [ours.tobytes() for _, ours, _ in parameters(run, 0, config)][:count]
    for rank in range(1, run.world_size):
        theirs = [ours.tobytes() for _, ours, _ in parameters(run, rank, config)][:count]
        assert theirs == first, f"{config}: rank {rank} diverged"


def check_collective(run: Run, name: str) -> None:
    for rank in range(run.world_size):
        report = run.reports[rank]
        assert report["errors"].get("collectives", "not run") is None, report["errors"].get("collectives")
        gloo = run.results[rank][f"collectives/{name}/gloo"]
        ours = run.results[rank][f"collectives/{name}/redsrv"]
        if run.world_size == 2 or name not in ORDER_DEPENDENT:
            assert gloo.tobytes() == ours.tobytes(), f"{name}: rank {rank} differs from gloo"
            continue
        dtype = ORDER_DEPENDENT[name]
        import ml_dtypes

        view = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
        error = relative_error(gloo.view(view), ours.view(view))
        assert error <= WORLD3_TOLERANCE[dtype], f"{name}: rank {rank} off by {error:.3g}"


@pytest.mark.parametrize("config", TRAINING)
def test_training_matches_gloo_ddp_world2(world2: Run, config: str) -> None:
    check_training(world2, config)


@pytest.mark.parametrize("config", TRAINING_WORLD3)
def test_training_matches_gloo_ddp_world3(world3: Run, config: str) -> None:
    check_training(world3, config)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_backend_collective_matches_gloo_world2(world2: Run, name: str) -> None:
    check_collective(world2, name)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_backend_collective_matches_gloo_world3(world3: Run, name: str) -> None:
    check_collective(world3, name)


def test_backend_sum_is_the_rank_order_sum(world3: Run) -> None:
    inputs = [run["collectives/all_reduce_sum_fp32/input"] for run in world3.results]
    expected = inputs[0].copy()
    for x in inputs[1:]:
        expected += x
    for rank in range(world3.world_size):
        ours = world3.results[rank]["collectives/all_reduce_sum_fp32/redsrv"]
        assert ours.tobytes() == expected.tobytes(), f"rank {rank}: not the float32 sum in rank order"


@pytest.mark.parametrize("world", ["world2", "world3", "world4_two_per_host"])
def test_workers_exit_by_themselves(request: pytest.FixtureRequest, world: str) -> None:
    run: Run = request.getfixturevalue(world)
    assert run.exit_codes == [0] * run.world_size, f"worker exit codes {run.exit_codes} (None: still running, a hang)"


@pytest.mark.parametrize("config", TRAINING_TWO_PER_HOST)
def test_training_with_two_workers_per_host_matches_gloo_ddp(world4_two_per_host: Run, config: str) -> None:
    assert all(r["hook_client"] == "HostClient" for r in world4_two_per_host.reports), "the host-level path was not used"
    check_training(world4_two_per_host, config)


@pytest.mark.parametrize("name", TWO_PER_HOST_COLLECTIVES)
def test_backend_collective_with_two_workers_per_host_matches_gloo(world4_two_per_host: Run, name: str) -> None:
    check_collective(world4_two_per_host, name)
