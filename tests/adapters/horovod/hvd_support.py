"""Starting and waiting for the worker processes of a Horovod-API test run; the check that the
public ``redsrv.horovod`` paths re-export the implementation in ``redsrv.adapters.horovod``."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conftest import ProcessTracker, child_env
from tests_support import worker_results

#: Workers import torch or TensorFlow before their first collective (hvd.init()); on a loaded
#: machine one rank may start many seconds after another, longer than the tests' shrunk 20 s
#: operation timeout. Failures these tests look for arrive as errors at once, not as timeouts.
START_ENV = {"REDSRV_OP_TIMEOUT": "120"}


def start_ranks(tracker: ProcessTracker, n: int, reducers: list[str], job: str, prefix_of: Callable[[int], str],
                args_of: Callable[[str], list[str]], extra_env: dict[str, str] | None = None,
                ) -> tuple[list[subprocess.Popen], list[str]]:  # type: ignore[type-arg]
    """``n`` workers running ``python *args_of(prefix)``, each with its rank, the world size, the
    reducers and the job in its environment; output goes to ``prefix + ".err"``."""
    workers, prefixes = [], []
    for rank in range(n):
        prefix = prefix_of(rank)
        env = child_env({"REDSRV_REDUCERS": ",".join(reducers), "REDSRV_JOB": job, "RANK": str(rank), "WORLD_SIZE": str(n),
                         **START_ENV, **(extra_env or {})})
        err = open(prefix + ".err", "w")  # a file, not a pipe: a chatty child can never block
        tracker.files.append(err)
        workers.append(tracker.popen([sys.executable, *args_of(prefix)], env=env, stdout=err, stderr=subprocess.STDOUT))
        prefixes.append(prefix)
    return workers, prefixes


def wait_ranks(workers: list[subprocess.Popen], prefixes: list[str], timeout: float) -> None:  # type: ignore[type-arg]
    """Every worker exited 0 within ``timeout`` seconds, else an error showing its output."""
    deadline = time.monotonic() + timeout
    for proc, prefix in zip(workers, prefixes):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {prefix} still running after {timeout} s") from None
        if proc.returncode != 0:
            with open(prefix + ".err") as f:
                raise AssertionError(f"worker {prefix} exited with {proc.returncode}:\n{f.read()}")


def run_worker_ranks(tmp: Path, n: int, job: str, worker: str,
                     extra_env: dict[str, str]) -> Iterator[tuple[list[Any], list[Any]]]:
    """A module fixture's body: one reducer and ``n`` ranks of ``python worker PREFIX``, waited
    for; yields every rank's arrays and facts (:func:`tests_support.worker_results`), then ends
    every process it started."""
    tracker = ProcessTracker()
    try:
        reducer = tracker.start_reducer()
        workers, prefixes = start_ranks(tracker, n, [reducer.address], job, lambda rank: str(tmp / f"rank{rank}"),
                                        lambda prefix: [worker, prefix], extra_env)
        wait_ranks(workers, prefixes, timeout=200)
        outputs = [worker_results(prefix) for prefix in prefixes]
        yield [arrays for arrays, _facts in outputs], [facts for _arrays, facts in outputs]
    finally:
        tracker.cleanup()


IMPLEMENTATION = "redsrv.adapters.horovod"
PUBLIC = "redsrv.horovod"


def public_name(implementation: str) -> str:
    """Where users import a module of the implementation: ``redsrv.adapters.horovod.torch.mpi_ops``
    is ``redsrv.horovod.torch.mpi_ops``."""
    assert implementation.startswith(IMPLEMENTATION), implementation
    return PUBLIC + implementation.removeprefix(IMPLEMENTATION)


def implementation_modules() -> list[str]:
    """Every module below ``redsrv.adapters.horovod``, found in its folder without importing a framework."""
    spec = importlib.util.find_spec(IMPLEMENTATION)
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    names = []
    for source in sorted(root.rglob("*.py")):
        parts = source.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join((IMPLEMENTATION, *parts)))
    return names


def assert_reexported(implementation: str) -> None:
    """The public module holds exactly the implementation's ``__all__``, each name the very same
    object (``isinstance`` and ``hvd.init()``'s process-wide state are shared), a submodule's name
    as the public path's own submodule; and it is an attribute of its public package, as
    ``import horovod.torch`` gives ``hvd.mpi_ops``."""
    impl = importlib.import_module(implementation)
    public = importlib.import_module(public_name(implementation))
    if implementation != IMPLEMENTATION:  # the package itself is only a docstring
        assert list(public.__all__) == list(impl.__all__), f"{public.__name__}.__all__ differs from {implementation}'s"
    for name in getattr(impl, "__all__", ()):
        ours, theirs = getattr(public, name), getattr(impl, name)
        if isinstance(theirs, types.ModuleType):
            assert isinstance(ours, types.ModuleType) and ours.__name__ == public_name(theirs.__name__), (public, name)
        else:
            assert ours is theirs, f"{public.__name__}.{name} is not {implementation}.{name}"
    parent, _, leaf = public.__name__.rpartition(".")
    if implementation != IMPLEMENTATION:
        assert getattr(sys.modules[parent], leaf) is public, f"{parent}.{leaf} is not the module {public.__name__}"
