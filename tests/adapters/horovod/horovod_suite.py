"""Horovod's own tests (``test/parallel/test_torch.py`` of Horovod 0.28.1 by default, or with
``--test-file`` its TensorFlow and Keras files: :data:`TEST_FILES`) against ``redsrv.horovod``,
as Horovod's CI runs them: every test in its own launch of two ranks (``redsrv run -np 2``),
with ``import horovod.X`` resolved to ``redsrv.horovod.X``.

Horovod's sdist on the package index ships no tests, so the file comes from a checkout of
Horovod's repository at the release tag::

    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod horovod-src
    HOROVOD_SRC=horovod-src tox -e horovod-suite
    python tests/adapters/horovod/horovod_suite.py --horovod-src horovod-src [-k allgather] [--report out.json]

Only files of ``test/parallel`` are used. Their helper module (``test/utils/common.py``)
imports Horovod's runner, cloudpickle and mock for helpers these files do not call, so the
three helpers they do call are provided here (:data:`COMMON`), and so are the two test-support
functions of Horovod's internal ``util`` modules that they import (:data:`STANDINS`). Tests listed in
:data:`EXCLUDED` are reported with their reason and not run (``--include-excluded`` runs them
too); docs/horovod.md lists the same exclusions. It prints one line per test and a summary
(``SUITE horovod-torch passed=... failed=... skipped=... excluded=...``) and exits non-zero
when a test that is not excluded failed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: The files of Horovod's test/parallel this runner takes, each with the module its ranks import
#: from Horovod's test folder beside it (``base_test_tensorflow``).
TEST_FILES: dict[str, tuple[str, ...]] = {
    "test_torch.py": (),
    "test_tensorflow.py": ("base_test_tensorflow.py",),
    "test_tensorflow_keras.py": (),
    "test_keras.py": (),
}

#: Tests of test_torch.py not run, with the reason: each is a documented difference (docs/horovod.md).
EXCLUDED: dict[str, str] = {
    "test_horovod_join_allreduce": "join(): joined ranks do not stand in for the others' collectives (docs/horovod.md)",
    "test_horovod_join_allgather": "join(): joined ranks do not stand in for the others' collectives (docs/horovod.md)",
    "test_horovod_join_broadcast": "join(): joined ranks do not stand in for the others' collectives (docs/horovod.md)",
    # These iterate over every optimizer in torch.optim; torch 2.13's list includes Muon, which
    # takes 2-D parameters only, and the test's 1-D biases make Muon itself refuse.
    "test_broadcast_state": "iterates over torch 2.13's optimizers, which include Muon (2-D parameters only)",
    "test_broadcast_state_options": "iterates over torch 2.13's optimizers, which include Muon (2-D parameters only)",
    "test_force_allreduce": "iterates over torch 2.13's optimizers, which include Muon (2-D parameters only)",
}

#: Tests of the other files not run, by file, with the reason (docs/horovod.md lists them too).
EXCLUDED_BY_FILE: dict[str, dict[str, str]] = {"test_torch.py": EXCLUDED}

#: ``import horovod`` inside the ranks: every ``horovod.X`` module is ``redsrv.horovod.X``, except
#: Horovod's internal helpers the TensorFlow tests import, which are stand-ins (:data:`STANDINS`).
SHIM = '''"""horovod -> redsrv.horovod, for running Horovod's own tests against redsrv."""
import importlib
import importlib.abc
import importlib.util
import sys

_STANDINS = {"horovod.tensorflow.util": "hvd_standin_tf_util", "horovod.common.util": "hvd_standin_common_util"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("horovod."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(_STANDINS.get(spec.name) or "redsrv." + spec.name)
        if not hasattr(module, "__path__") and any(name.startswith(spec.name + ".") for name in _STANDINS):
            module.__path__ = []  # a stand-in lives below this module (horovod.common.util): let the import look
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Alias())
'''

#: The helpers test_torch.py imports from Horovod's test/utils/common.py, as that file
#: documents them: rank and size from MPI's variables (else 0 and 1); a GPU test skips unless
#: HOROVOD_TEST_GPU asks it to fail; a path in a fresh temporary folder.
COMMON = '''"""What test_torch.py uses of Horovod's test/utils/common.py."""
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if os.environ.get(rank_var) is not None and os.environ.get(size_var) is not None:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    else:
        test.skipTest(message)


@contextlib.contextmanager
def temppath():
    with tempfile.TemporaryDirectory() as folder:
        yield os.path.join(folder, "temp_test_file")
'''

#: What the TensorFlow files import from Horovod's internal util modules, as Horovod defines it:
#: whether TensorFlow runs eagerly; a version comparison.
STANDINS = {
    "hvd_standin_tf_util.py": '''import tensorflow as tf


def _executing_eagerly():
    return tf.executing_eagerly()
''',
    "hvd_standin_common_util.py": '''from packaging import version


def is_version_greater_equal_than(ver, target):
    return version.parse(ver) >= version.parse(target)
''',
}

#: One rank of one test: pytest with a JUnit report named after the rank.
RANK_MAIN = '''import os, sys
import pytest
rank = os.environ.get("HOROVOD_RANK", "0")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--junitxml", f"{sys.argv[2]}.{rank}.xml", sys.argv[1]]))
'''


def test_class(source: str) -> tuple[str, list[str]]:
    """The first class named ``*Tests`` with ``test_*`` methods, and those methods in file order."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Tests"):
            names = [f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
            if names:
                return node.name, names
    raise ValueError("no *Tests class with test methods in the file")


def test_names(source: str) -> list[str]:
    """The ``test_*`` methods of the file's test class, in file order."""
    return test_class(source)[1]


def prepare(horovod_src: Path, folder: Path, test_file: str = "test_torch.py") -> list[str]:
    """Lay out the test file (with the modules it imports beside it), its helpers and the
    ``horovod`` alias in ``folder``; the test ids (``file::Class::test``) in file order."""
    parallel = horovod_src / "test" / "parallel"
    source = parallel / test_file
    if not source.is_file():
        raise SystemExit(f"{source} not found: --horovod-src (or HOROVOD_SRC) must be a checkout of Horovod v0.28.1")
    for name in (test_file, *TEST_FILES.get(test_file, ())):
        shutil.copy(parallel / name, folder / name)
    (folder / "common.py").write_text(COMMON)
    for name, text in STANDINS.items():
        (folder / name).write_text(text)
    (folder / "horovod").mkdir()
    (folder / "horovod" / "__init__.py").write_text(SHIM)
    (folder / "rank_main.py").write_text(RANK_MAIN)
    cls, names = test_class(source.read_text())
    return [f"{test_file}::{cls}::{name}" for name in names]


def outcome(reports: list[Path]) -> tuple[str, str]:
    """failed when a rank failed (or left no report), skipped when every rank skipped."""
    verdicts, detail = [], ""
    for report in reports:
        if not report.is_file():
            return "failed", f"no report from {report.name}"
        case = ET.parse(report).getroot().find(".//testcase")
        if case is None:
            return "failed", f"no test case in {report.name}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            verdicts.append("failed")
            detail = detail or (problem.get("message") or "")[:300]
        elif case.find("skipped") is not None:
            verdicts.append("skipped")
            detail = detail or (case.find("skipped").get("message") or "")[:300]  # type: ignore[union-attr]
        else:
            verdicts.append("passed")
    if "failed" in verdicts:
        return "failed", detail
    return ("skipped", detail) if all(v == "skipped" for v in verdicts) else ("passed", "")


def run_one(test_id: str, folder: Path, timeout: float) -> tuple[str, str, float]:
    """One test under ``redsrv run -np 2``; ended (its whole process group) past ``timeout``."""
    name = test_id.rsplit("::", 1)[-1]
    prefix = folder / "reports" / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    log = folder / "reports" / f"{name}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "redsrv", "run", "-np", "2", sys.executable, "rank_main.py", test_id,
                                 str(prefix)], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "failed", f"timed out after {timeout:.0f} s", time.monotonic() - started
    verdict, detail = outcome([Path(f"{prefix}.{rank}.xml") for rank in range(2)])
    if verdict == "passed" and proc.returncode != 0:
        verdict, detail = "failed", f"redsrv run exited with {proc.returncode}"
    return verdict, detail, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"),
                        help="a checkout of Horovod v0.28.1 (default: $HOROVOD_SRC)")
    parser.add_argument("--test-file", default="test_torch.py", choices=sorted(TEST_FILES),
                        help="which of Horovod's test/parallel files to run (default: test_torch.py)")
    parser.add_argument("-k", action="append", default=[], help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--include-excluded", action="store_true", help="run the excluded tests too")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per test")
    parser.add_argument("--report", help="write every test's outcome to this JSON file")
    args = parser.parse_args(argv)
    if not args.horovod_src:
        parser.error("--horovod-src (or HOROVOD_SRC) is required: git clone --depth 1 --branch v0.28.1 "
                     "https://github.com/horovod/horovod")
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="horovod-suite-") as tmp:
        folder = Path(tmp)
        test_ids = prepare(Path(args.horovod_src), folder, args.test_file)
        excluded = EXCLUDED_BY_FILE.get(args.test_file, {})
        (folder / "reports").mkdir()
        for test_id in test_ids:
            name = test_id.rsplit("::", 1)[-1]
            if args.k and not any(pattern in name for pattern in args.k):
                continue
            if name in excluded and not args.include_excluded:
                results[name] = {"outcome": "excluded", "detail": excluded[name]}
            else:
                verdict, detail, seconds = run_one(test_id, folder, args.timeout)
                results[name] = {"outcome": verdict, "detail": detail, "seconds": round(seconds, 1)}
                if verdict == "failed":
                    results[name]["log"] = (folder / "reports" / f"{name}.log").read_text()[-3000:]
            print(f"{results[name]['outcome']:8} {name} {results[name]['detail']}", flush=True)
    counts = {kind: sum(1 for r in results.values() if r["outcome"] == kind)
              for kind in ("passed", "failed", "skipped", "excluded")}
    label = args.test_file.removesuffix(".py").removeprefix("test_")
    print(f"SUITE horovod-{label} " + " ".join(f"{kind}={count}" for kind, count in counts.items()))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
