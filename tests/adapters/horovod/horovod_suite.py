"""Horovod's own tests (``test/parallel/test_torch.py`` of Horovod 0.28.1 by default, or with
``--test-file`` its TensorFlow and Keras files: :data:`TEST_FILES`) against ``redsrv.horovod``,
as Horovod's CI runs them: the whole file in one launch of two ranks (``redsrv run -np 2``; or,
with ``--per-test``, every test in its own launch, which isolates a test that hangs), with
``import horovod.X`` resolved to ``redsrv.horovod.X``.

Horovod's sdist on the package index ships no tests, so the file comes from a checkout of
Horovod's repository at the release tag::

    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod horovod-src
    HOROVOD_SRC=horovod-src tox -e horovod-suite        # or horovod-suite-tf: test_tensorflow.py
    python tests/adapters/horovod/horovod_suite.py --horovod-src horovod-src [--test-file test_tensorflow.py] \
        [-k allgather] [--per-test] [--report out.json]

Only files of ``test/parallel`` are used. Their helper module (``test/utils/common.py``)
imports Horovod's runner, cloudpickle and mock for helpers these files do not call, so the
three helpers they do call are provided here (:data:`COMMON`), and so are the two test-support
functions of Horovod's internal ``util`` modules that they import (:data:`STANDINS`). Tests listed in
:data:`EXCLUDED_BY_FILE` are reported with their reason and not run (``--include-excluded`` runs them
too); docs/horovod.md lists the same exclusions. A test passes only if it passed on every rank;
one that failed on a rank, or left no result there, failed. Inside the ranks each test has a
deadline (``--timeout``, pytest-timeout), and the whole run has one (``--deadline``): past it
the launch is interrupted, and the tests without a result are failed. It prints one line per
test and a summary (``SUITE horovod-torch passed=... failed=... skipped=... excluded=...``) and
exits non-zero when a test that is not excluded failed.
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
    "test_tensorflow2_keras.py": (),  # needs the parameterized package
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

#: Tests of test_tensorflow.py not run, with the reason (docs/horovod.md): both fail in the test's
#: own Keras 2 code under Keras 3, before any Horovod call.
EXCLUDED_TF: dict[str, str] = {
    "test_horovod_syncbn_cpu": "builds tf.keras.layers.BatchNormalization(fused=False), which Keras 3 refuses; "
                               "and no SyncBatchNormalization here (docs/horovod.md)",
    "test_partial_distributed_gradient_tape": "calls .ref() on Keras 3 variables, which have none; and no "
                                              "PartialDistributedGradientTape here (docs/horovod.md)",
}

#: Tests not run, by file, with the reason (docs/horovod.md lists them too).
EXCLUDED_BY_FILE: dict[str, dict[str, str]] = {"test_torch.py": EXCLUDED, "test_tensorflow.py": EXCLUDED_TF}

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

#: One rank: pytest on the test file, keeping the chosen tests (one, or all of them), each
#: ended past its timeout (SIGALRM: the run goes on with the next test), with a JUnit report
#: named after the rank, written when pytest ends, and beside it each test's case as soon as the
#: test is done (``.partial.xml``), which is what is left of a launch ended at the deadline. The
#: file's methods are chosen by name: a parameterized method's cases (``test_x_0_...``) are
#: kept with it, so node ids that no longer exist once the file is imported are never asked for.
RANK_MAIN = '''import os, sys
from xml.sax.saxutils import quoteattr
import pytest
selection, prefix, timeout = sys.argv[1:4]
rank = os.environ.get("HOROVOD_RANK", "0")
with open(selection) as f:
    test_file, *lines = f.read().split()
known = {line[1:] for line in lines}
chosen = {line[1:] for line in lines if line.startswith("+")}


def method(name):
    if name in known:
        return name
    cases_of = [k for k in known if name.startswith(k + "_")]
    return max(cases_of, key=len) if cases_of else name


class Select:
    def pytest_collection_modifyitems(self, config, items):
        keep = [item for item in items if method(item.name) in chosen]
        config.hook.pytest_deselected(items=[item for item in items if method(item.name) not in chosen])
        items[:] = keep


class Progress:
    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.failed:
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None) or str(report.longrepr)[-300:]
            inner = f"<failure message={quoteattr(report.when + ': ' + crash)}/>"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            inner = f"<skipped message={quoteattr(reason)}/>"
        elif report.when == "call":
            inner = ""
        else:
            return
        with open(f"{prefix}.{rank}.partial.xml", "a") as f:
            f.write(f"<testcase name={quoteattr(name)}>{inner}</testcase>\\n")


sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--timeout", timeout, "--timeout-method", "signal",
                      "--junitxml", f"{prefix}.{rank}.xml", test_file], plugins=[Select(), Progress()]))
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


def read_report(text: str) -> dict[str, tuple[str, str]]:
    """Every test of one rank's JUnit report: its name -> (passed, failed or skipped, why). A
    test case with a failure or error (in any of its subtests) failed; else one with a skip
    skipped."""
    results: dict[str, tuple[str, str]] = {}
    for case in ET.fromstring(text).iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")  # (an explicit test: an Element without children is false)
        skipped = case.find("skipped")
        if problem is not None:
            # pytest's message is the exception's first lines; its text ends with the "E" lines
            told = [line[1:].strip() for line in (problem.text or "").splitlines() if line.startswith("E ")]
            verdict, why = "failed", " ".join(told[-6:]) or problem.get("message") or (problem.text or "").strip()
        elif skipped is not None:
            verdict, why = "skipped", skipped.get("message") or ""
        else:
            verdict, why = "passed", ""
        name = case.get("name", "")
        # A test may have several results: a teardown error is a second case of its name, and
        # TensorFlow's graph and eager runs are subtests (one case with a child each, or one
        # line each in a .partial.xml). The worst stands: failed, then skipped, then passed.
        if name not in results or _SEVERITY[verdict] > _SEVERITY[results[name][0]]:
            results[name] = (verdict, " ".join(why.split())[:300])
    return results


_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}


def outcome(reports: list[Path], names: list[str]) -> dict[str, tuple[str, str]]:
    """The verdict of each test over all ranks' reports (a rank without a full report: the tests
    it finished, from its ``.partial.xml``): passed only if it passed on every rank; failed if it
    failed on one or left no result there;
    skipped if no rank failed and one skipped (Horovod's GPU tests skip on every rank)."""
    per_rank: list[dict[str, tuple[str, str]]] = []
    missing: list[str] = []
    for report in reports:
        partial = report.with_suffix(".partial.xml")
        try:
            if report.is_file():
                per_rank.append(read_report(report.read_text()))
                continue
            missing.append(f"no report {report.name}")
        except ET.ParseError as exc:
            missing.append(f"{report.name} unreadable ({exc})")
        # the tests this rank finished before its launch was ended
        per_rank.append(read_report(f"<testsuite>{partial.read_text()}</testsuite>") if partial.is_file() else {})
    verdicts: dict[str, tuple[str, str]] = {}
    for name in names:
        seen = [(rank, results.get(name)) for rank, results in enumerate(per_rank)]
        absent = [rank for rank, result in seen if result is None]
        failed = [(rank, result) for rank, result in seen if result is not None and result[0] == "failed"]
        skipped = [(rank, result) for rank, result in seen if result is not None and result[0] == "skipped"]
        if failed:
            rank, (_, why) = failed[0]
            verdicts[name] = ("failed", f"rank {rank}: {why}")
        elif absent:
            verdicts[name] = ("failed", f"no result from rank {absent[0]}" + (f" ({'; '.join(missing)})" if missing else ""))
        elif skipped:
            rank, (_, why) = skipped[0]
            only = "" if len(skipped) == len(seen) else f" (on rank {rank} only; passed on the others)"
            verdicts[name] = ("skipped", why + only)
        else:
            verdicts[name] = ("passed", "")
    return verdicts


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a launch's whole process group: SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def expected_names(methods: list[str], reported: set[str]) -> list[str]:
    """The tests to give a verdict for: each method, or in its place the cases a parameterized
    method was expanded into (``test_x_0_...``, as reported), in method order."""
    names: list[str] = []
    for name in methods:
        cases = sorted(r for r in reported if r.startswith(name + "_") and not any(
            r.startswith(longer + "_") or r == longer for longer in methods if len(longer) > len(name) and
            longer.startswith(name + "_")))
        names.extend(cases if name not in reported and cases else [name])
    return names


def launch(test_ids: list[str], all_ids: list[str], label: str, folder: Path, timeout: float, deadline: float,
           op_timeout: float) -> tuple[dict[str, tuple[str, str]], float, str]:
    """The tests ``test_ids`` (of ``all_ids``, the file's) in one ``redsrv run -np 2`` (each test
    ended past ``timeout`` inside the ranks, each collective past ``op_timeout``; the launch
    ended past the monotonic time ``deadline``): each test's verdict, the seconds taken, and a
    note when the launch did not end by itself."""
    prefix = folder / "reports" / label
    ids_file = folder / "reports" / f"{label}.ids"
    chosen = set(test_ids)
    ids_file.write_text("\n".join([all_ids[0].split("::")[0],
                                   *(("+" if t in chosen else "-") + t.rsplit("::", 1)[-1] for t in all_ids)]))
    env = {"REDSRV_OP_TIMEOUT": str(op_timeout), **os.environ,
           "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    started, note = time.monotonic(), ""
    with open(folder / "reports" / f"{label}.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "redsrv", "run", "-np", "2", sys.executable, "rank_main.py",
                                 str(ids_file), str(prefix), str(int(timeout))], cwd=folder, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=max(deadline - started, 1.0))
        except subprocess.TimeoutExpired:
            _stop(proc)
            note = f"the run's deadline passed after {time.monotonic() - started:.0f} s: the launch was interrupted"
    reports = [Path(f"{prefix}.{rank}.xml") for rank in range(2)]
    reported: set[str] = set()
    for report in reports:
        for path in (report, report.with_suffix(".partial.xml")):
            try:
                text = path.read_text()
                reported |= set(read_report(text if path == report else f"<testsuite>{text}</testsuite>"))
            except (OSError, ET.ParseError):
                pass
    names = expected_names([test_id.rsplit("::", 1)[-1] for test_id in test_ids], reported)
    verdicts = outcome(reports, names)
    if note:
        verdicts = {name: (v, why) if v != "failed" or not why.startswith("no result") else (v, f"{why}; {note}")
                    for name, (v, why) in verdicts.items()}
    elif proc.returncode != 0 and len(names) == 1 and verdicts[names[0]][0] == "passed":
        verdicts[names[0]] = ("failed", f"redsrv run exited with {proc.returncode}")
    return verdicts, time.monotonic() - started, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"),
                        help="a checkout of Horovod v0.28.1 (default: $HOROVOD_SRC)")
    parser.add_argument("--test-file", default="test_torch.py", choices=sorted(TEST_FILES),
                        help="which of Horovod's test/parallel files to run (default: test_torch.py)")
    parser.add_argument("-k", action="append", default=[], help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--include-excluded", action="store_true", help="run the excluded tests too")
    parser.add_argument("--per-test", action="store_true",
                        help="every test in its own launch (slower: isolates a test that hangs or leaves state behind)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per test (default 180)")
    parser.add_argument("--deadline", type=float, default=5400.0,
                        help="seconds for the whole run; tests without a result by then fail (default 5400)")
    # A test whose ranks wait on different collectives (a difference from Horovod) would block
    # until the collective's deadline, in a TensorFlow session out of reach of --timeout's signal.
    parser.add_argument("--op-timeout", type=float, default=60.0,
                        help="seconds per collective in the ranks (REDSRV_OP_TIMEOUT, unless set; default 60)")
    parser.add_argument("--report", help="write every test's outcome to this JSON file")
    args = parser.parse_args(argv)
    if not args.horovod_src:
        parser.error("--horovod-src (or HOROVOD_SRC) is required: git clone --depth 1 --branch v0.28.1 "
                     "https://github.com/horovod/horovod")
    results: dict[str, dict[str, object]] = {}
    started = time.monotonic()
    deadline = started + args.deadline
    with tempfile.TemporaryDirectory(prefix="horovod-suite-") as tmp:
        folder = Path(tmp)
        test_ids = prepare(Path(args.horovod_src), folder, args.test_file)
        excluded = EXCLUDED_BY_FILE.get(args.test_file, {})
        (folder / "reports").mkdir()
        chosen: list[str] = []
        for test_id in test_ids:
            name = test_id.rsplit("::", 1)[-1]
            if args.k and not any(pattern in name for pattern in args.k):
                continue
            if name in excluded and not args.include_excluded:
                results[name] = {"outcome": "excluded", "detail": excluded[name]}
                print(f"excluded {name} {excluded[name]}", flush=True)
            else:
                chosen.append(test_id)
        batches = [[test_id] for test_id in chosen] if args.per_test else ([chosen] if chosen else [])
        for batch in batches:
            label = batch[0].rsplit("::", 1)[-1] if args.per_test else "file"
            if time.monotonic() >= deadline:
                verdicts = {t.rsplit("::", 1)[-1]: ("failed", "not run: the run's deadline had passed") for t in batch}
                seconds = 0.0
            else:
                verdicts, seconds, _ = launch(batch, test_ids, label, folder, args.timeout, deadline, args.op_timeout)
            log = (folder / "reports" / f"{label}.log")
            for name, (verdict, detail) in verdicts.items():
                print(f"{verdict:8} {name} {detail}", flush=True)
                results[name] = {"outcome": verdict, "detail": detail}
                if args.per_test:
                    results[name]["seconds"] = round(seconds, 1)
                if verdict == "failed" and args.per_test and log.is_file():
                    results[name]["log"] = log.read_text()[-3000:]
            if not args.per_test and log.is_file() and any(v == "failed" for v, _ in verdicts.values()):
                results["(launch log)"] = {"outcome": "log", "detail": log.read_text()[-20000:]}
    counts = {kind: sum(1 for r in results.values() if r["outcome"] == kind)
              for kind in ("passed", "failed", "skipped", "excluded")}
    label = args.test_file.removesuffix(".py").removeprefix("test_")
    print(f"SUITE horovod-{label} " + " ".join(f"{kind}={count}" for kind, count in counts.items())
          + f" ({'per test' if args.per_test else 'one launch'}, {time.monotonic() - started:.0f} s)")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
