"""The runner of Horovod's own test_torch.py (``horovod_suite.py``, ``tox -e horovod-suite``):
the parts that do not need Horovod's file. The suite itself runs by hand or in its tox env."""

from __future__ import annotations

import os
import subprocess
import sys
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


def _report(path: Path, inner: str) -> Path:
    path.write_text(f'<testsuites><testsuite><testcase name="t">{inner}</testcase></testsuite></testsuites>')
    return path


def test_outcome_fails_if_a_rank_failed_or_left_no_report_and_skips_only_if_every_rank_skipped(tmp_path: Path) -> None:
    passed = _report(tmp_path / "p.xml", "")
    skipped = _report(tmp_path / "s.xml", '<skipped message="No GPUs available"/>')
    failed = _report(tmp_path / "f.xml", '<failure message="AssertionError: wrong"/>')
    assert horovod_suite.outcome([passed, passed]) == ("passed", "")
    assert horovod_suite.outcome([skipped, skipped]) == ("skipped", "No GPUs available")
    assert horovod_suite.outcome([passed, skipped]) == ("passed", "")
    assert horovod_suite.outcome([passed, failed]) == ("failed", "AssertionError: wrong")
    assert horovod_suite.outcome([passed, tmp_path / "missing.xml"])[0] == "failed"


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
