"""``torch.distributed`` as FSDP2, DTensor, tensor-parallel and ``torch.compile`` users call it,
on the redsrv backend against gloo.

The same script (``dtensor_worker.py``) runs at world size 2 twice, once with
``init_process_group("gloo")`` and once with ``init_process_group("redsrv")``, every mesh the
default one. Both must finish every case and agree bitwise: at world size 2 every sum has one
order, and the gathers, scatters and all-to-alls travel the same gloo code either way (the
redsrv group's peer links), so there is nothing for rounding to differ on.

Before RedsrvProcessGroup defined the coalesced all-gather and reduce-scatter that the
functional collectives call from C++, every case but the functional all-reduce and broadcast
failed on the redsrv backend with "No backend type associated with device type cpu"
(``full_tensor()`` after FSDP2 training among them); defining them by handing the peer links to
c10d as the group's backend instead deadlocked now and then (see the comment there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import numpy as np  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(400)]

WORKER = os.path.join(os.path.dirname(__file__), "dtensor_worker.py")
CASES = ["functional", "redistribute", "tensor_parallel", "fsdp2", "compiled", "checkpoint"]
WORLD_SIZE = 2
RUN_TIMEOUT = 300.0
#: The prefix of each case's results in the workers' files.
RESULTS = {"functional": "funcol/", "redistribute": "redistribute/", "tensor_parallel": "tp/", "fsdp2": "fsdp2/",
           "compiled": "compile/", "checkpoint": "dcp/"}


def launch(backend: str, tmp: str) -> tuple[list[dict[str, np.ndarray]], list[dict]]:  # type: ignore[type-arg]
    from conftest import ProcessTracker, child_env
    from tests_support import wait_all, worker_results

    tracker = ProcessTracker()
    try:
        env = {"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"}
        if backend == "redsrv":
            reducers = [tracker.start_reducer(env=env).address for _ in range(2)]
            env |= {"REDSRV_REDUCERS": ",".join(reducers), "REDSRV_JOB": "dtensor"}
        prefixes, workers = [], []
        for rank in range(WORLD_SIZE):
            spec = {"rank": rank, "world_size": WORLD_SIZE, "cases": CASES, "store": os.path.join(tmp, "store"),
                    "checkpoint": os.path.join(tmp, "checkpoint")}
            prefix = os.path.join(tmp, f"rank{rank}")
            log = open(prefix + ".log", "w")  # a file, never a pipe that could fill up
            tracker.files.append(log)
            workers.append(tracker.popen([sys.executable, WORKER, backend, json.dumps(spec), prefix],
                                         env=child_env({**env, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}),
                                         stdout=log, stderr=subprocess.STDOUT))
            prefixes.append(prefix)
        wait_all(workers, RUN_TIMEOUT)
        results, reports = zip(*(worker_results(prefix) for prefix in prefixes), strict=True)
        return list(results), list(reports)
    finally:
        tracker.cleanup()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict[str, np.ndarray]], list[dict]]]:  # type: ignore[type-arg]
    return {backend: launch(backend, str(tmp_path_factory.mktemp(backend))) for backend in ("gloo", "redsrv")}


@pytest.mark.parametrize("case", CASES)
def test_matches_gloo(runs, case: str) -> None:  # type: ignore[no-untyped-def]
    for backend, (_results, reports) in runs.items():
        for rank, report in enumerate(reports):
            error = report["errors"].get(case, "not run")
            assert error is None, f"{backend} rank {rank} failed {case}:\n{error}"
    gloo, ours = runs["gloo"][0], runs["redsrv"][0]
    prefix = RESULTS[case]
    for rank in range(WORLD_SIZE):
        names = sorted(k for k in gloo[rank] if k.startswith(prefix))
        assert names, f"no {case} results"
        assert sorted(k for k in ours[rank] if k.startswith(prefix)) == names
        for name in names:
            assert gloo[rank][name].tobytes() == ours[rank][name].tobytes(), (
                f"{name}: rank {rank} differs from gloo ({gloo[rank][name]} vs {ours[rank][name]})")


def test_compiled_equals_eager(runs) -> None:  # type: ignore[no-untyped-def]
    for rank, result in enumerate(runs["redsrv"][0]):
        np.testing.assert_allclose(result["compile/result"], result["compile/eager"], rtol=1e-6, err_msg=f"rank {rank}")


def test_checkpoint_resumes_where_it_stopped(runs) -> None:  # type: ignore[no-untyped-def]
    """Training saved half way, restarted in a new process group and loaded ends with the weights
    of the same training run without a stop (the "fsdp2" case: same model, data and optimizer),
    bit for bit: the optimizer's state came back too."""
    for backend, (results, _reports) in runs.items():
        for rank, result in enumerate(results):
            assert result["dcp/params"].tobytes() == result["fsdp2/params"].tobytes(), f"{backend} rank {rank}"
