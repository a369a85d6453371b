"""The runner of Horovod's own tests (``horovod_suite.py``, ``tox -e horovod-suite``): the parts
that do not need Horovod's files, and launches of a small file of our own in each mode. The
suite itself runs by hand or in its tox env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)

import horovod_suite  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_names_are_the_test_methods_of_torch_tests_in_file_order() -> None:
    source = ("class Other:\n    def test_no(self): pass\n"
              "class TorchTests:\n    def helper(self): pass\n    def test_b(self): pass\n    def test_a(self): pass\n")
    assert horovod_suite.test_names(source) == ["test_b", "test_a"]


def _junit(*cases: str) -> str:
    return "<testsuites><testsuite>" + "".join(cases) + "</testsuite></testsuites>"


def _case(name: str, inner: str = "") -> str:
    return f'<testcase classname="TensorFlowTests" name="{name}">{inner}</testcase>'


def test_read_report_reads_every_test_case() -> None:
    text = _junit(_case("test_a"), _case("test_b", '<skipped message="No GPUs available"/>'),
                  _case("test_c", '<failure message="AssertionError: wrong">trace</failure>'),
                  _case("test_d", "<error>RuntimeError:\n  boom</error>"),
                  _case("test_h", '<failure message="UnknownError: Graph execution error: [+2 more lines]">trace\n'
                                  'E   UnknownError: Graph execution error:\nE   ranks disagree</failure>'),
                  # pytest reports an error in teardown as a second case of the same name
                  _case("test_e"), _case("test_e", '<error message="error in teardown"/>'),
                  # TensorFlow's graph and eager modes are subtests: one child each
                  _case("test_f", '<skipped message="graph only"/><failure message="eager: wrong"/>'),
                  _case("test_g", '<skipped message="eager mode"/>'), _case("test_g"))
    assert horovod_suite.read_report(text) == {
        "test_a": ("passed", ""), "test_b": ("skipped", "No GPUs available"), "test_c": ("failed", "AssertionError: wrong"),
        "test_d": ("failed", "RuntimeError: boom"), "test_e": ("failed", "error in teardown"),
        "test_f": ("failed", "eager: wrong"), "test_g": ("skipped", "eager mode"),
        "test_h": ("failed", "UnknownError: Graph execution error: ranks disagree")}


def test_outcome_passes_a_test_only_if_it_passed_on_every_rank(tmp_path: Path) -> None:
    rank0 = tmp_path / "r.0.xml"
    rank1 = tmp_path / "r.1.xml"
    rank0.write_text(_junit(_case("test_a"), _case("test_b"), _case("test_c", '<skipped message="No GPUs"/>'),
                            _case("test_d", '<skipped message="No GPUs"/>'), _case("test_e")))
    rank1.write_text(_junit(_case("test_a"), _case("test_b", '<failure message="wrong sum"/>'),
                            _case("test_c", '<skipped message="No GPUs"/>'), _case("test_d")))
    verdicts = horovod_suite.outcome([rank0, rank1], ["test_a", "test_b", "test_c", "test_d", "test_e"])
    assert verdicts["test_a"] == ("passed", "")
    assert verdicts["test_b"] == ("failed", "rank 1: wrong sum")  # passed on rank 0, failed on rank 1
    assert verdicts["test_c"] == ("skipped", "No GPUs")
    assert verdicts["test_d"][0] == "skipped" and "rank 0 only" in verdicts["test_d"][1]  # not passed on every rank
    assert verdicts["test_e"] == ("failed", "no result from rank 1")  # rank 1 never reported it (interrupted)


def test_outcome_fails_every_test_of_a_rank_without_a_readable_report(tmp_path: Path) -> None:
    rank0 = tmp_path / "r.0.xml"
    rank0.write_text(_junit(_case("test_a")))
    verdicts = horovod_suite.outcome([rank0, tmp_path / "r.1.xml"], ["test_a"])
    assert verdicts["test_a"][0] == "failed" and "no report r.1.xml" in verdicts["test_a"][1]
    (tmp_path / "r.1.xml").write_text("<testsuites><testsuite>")  # cut short
    assert "unreadable" in horovod_suite.outcome([rank0, tmp_path / "r.1.xml"], ["test_a"])["test_a"][1]


def test_a_parameterized_method_is_judged_by_its_cases() -> None:
    methods = ["test_fit", "test_fit_twice", "test_plain"]
    reported = {"test_fit_0_sgd", "test_fit_1_adam", "test_fit_twice", "test_plain"}
    assert horovod_suite.expected_names(methods, reported) == ["test_fit_0_sgd", "test_fit_1_adam", "test_fit_twice",
                                                               "test_plain"]
    assert horovod_suite.expected_names(methods, set()) == methods  # no result at all: each method fails as such


def test_the_alias_makes_horovods_import_paths_ours(tmp_path: Path) -> None:
    """Inside the ranks, ``import horovod.torch as hvd`` is ``redsrv.horovod.torch`` (the very
    module, so hvd.init()'s state is shared), and the stand-in helpers import."""
    source = tmp_path / "src" / "test" / "parallel"
    source.mkdir(parents=True)
    (source / "test_torch.py").write_text("class TorchTests:\n    def test_x(self): pass\n")
    folder = tmp_path / "run"
    folder.mkdir()
    assert horovod_suite.prepare(tmp_path / "src", folder) == ["test_torch.py::TorchTests::test_x"]
    check = ("import horovod.torch as hvd, horovod.torch.mpi_ops, redsrv.horovod.torch as ours, common\n"
             "assert hvd is ours and horovod.torch.mpi_ops is ours.mpi_ops\n"
             "assert common.mpi_env_rank_and_size() == (0, 1)\n"
             "with common.temppath() as path: assert path.endswith('temp_test_file')\n"
             "import horovod.common.util as u; assert u.is_version_greater_equal_than('2.21.0', '2.6.0')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    done = subprocess.run([sys.executable, "-c", check], cwd=folder, env={**env, "PYTHONPATH": str(folder)},
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr


def test_the_test_class_is_the_first_tests_class_with_tests() -> None:
    source = ("class BaseTensorFlowTests:\n    def helper(self): pass\n"
              "class TensorFlowTests(BaseTensorFlowTests):\n    def test_a(self): pass\n")
    assert horovod_suite.test_class(source) == ("TensorFlowTests", ["test_a"])


def test_exclusions_are_listed_in_the_docs() -> None:
    docs = Path(HERE, "..", "..", "..", "docs", "horovod.md").read_text()
    for excluded in horovod_suite.EXCLUDED_BY_FILE.values():
        for name in excluded:
            assert f"`{name}`" in docs, name


#: A stand-in for Horovod's test file: a pass, a failure on rank 1 only, a skip, a test that
#: outlives the whole run's deadline (last: pytest runs a TestCase's tests in name order).
FAKE_TESTS = """import os, threading, unittest
RANK = int(os.environ.get("HOROVOD_RANK", "0"))


class TorchTests(unittest.TestCase):
    def test_passes(self):
        pass

    def test_fails_on_rank_1(self):
        self.assertEqual(RANK, 0)

    def test_skips(self):
        self.skipTest("No GPUs available")

    def test_waits_past_the_deadline(self):
        if os.environ.get("FAKE_SLOW"):  # a collective that never completes, bounded as the ranks' own are
            threading.Event().wait(120)
"""


@pytest.mark.parametrize("mode", [[], ["--per-test"]], ids=["one-launch", "per-test"])
def test_a_run_of_a_file_in_each_mode(tmp_path: Path, mode: list[str]) -> None:
    parallel = tmp_path / "src" / "test" / "parallel"
    parallel.mkdir(parents=True)
    (parallel / "test_torch.py").write_text(FAKE_TESTS)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HOROVOD_", "REDSRV_"))}
    done = subprocess.run([sys.executable, os.path.join(HERE, "horovod_suite.py"), "--horovod-src", str(tmp_path / "src"),
                           "--report", str(report), *mode], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stdout + done.stderr  # a test failed
    assert "SUITE horovod-torch passed=2 failed=1 skipped=1 excluded=0" in done.stdout, done.stdout
    results = json.loads(report.read_text())
    assert results["test_fails_on_rank_1"]["detail"].startswith("rank 1: AssertionError")


def test_the_deadline_ends_a_run_and_fails_the_tests_without_a_result(tmp_path: Path) -> None:
    parallel = tmp_path / "src" / "test" / "parallel"
    parallel.mkdir(parents=True)
    (parallel / "test_torch.py").write_text(FAKE_TESTS)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HOROVOD_", "REDSRV_"))}
    started = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(HERE, "horovod_suite.py"), "--horovod-src", str(tmp_path / "src"),
                           "--report", str(report), "--deadline", "15", "--timeout", "300", "-k", "passes", "-k", "waits"],
                          env={**env, "FAKE_SLOW": "1"}, capture_output=True, text=True, timeout=100)
    assert time.monotonic() - started < 90
    assert "SUITE horovod-torch passed=1 failed=1 skipped=0 excluded=0" in done.stdout, done.stdout + done.stderr
    detail = json.loads(report.read_text())["test_waits_past_the_deadline"]["detail"]
    assert "no result" in detail and "deadline" in detail
