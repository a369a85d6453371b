"""The suite's own leak checks fail the tests they are meant to fail.

A copy of ``tests/conftest.py`` drives a small inner pytest run, so what is checked is the real
fixture: a test that leaves a process running is reported as an error, the process is ended by
pid, and a test that ends what it started passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

INNER_TESTS = '''
import subprocess
import sys

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def test_leaves_a_process_running() -> None:
    proc = subprocess.Popen(SLEEPER)
    with open({pid_file!r}, "w") as f:
        f.write(str(proc.pid))


def test_ends_what_it_started() -> None:
    proc = subprocess.Popen(SLEEPER)
    proc.kill()
    proc.wait(timeout=10)


def test_a_tracked_process_is_ended_by_the_fixture(procs) -> None:
    procs.popen(SLEEPER)
'''


def test_a_test_that_leaks_a_process_fails_and_the_process_is_ended(tmp_path: Path) -> None:
    pid_file = tmp_path / "leaked.pid"
    inner = tmp_path / "inner"
    inner.mkdir()
    for helper in ("conftest.py", "tests_support.py", "worker_main.py"):  # conftest imports the other two
        (inner / helper).write_text((CONFTEST.parent / helper).read_text())
    (inner / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS.format(pid_file=str(pid_file))))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(inner)],
                         cwd=inner, capture_output=True, text=True, timeout=120, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # the leaking test passes its body and errors at teardown
    assert "ERROR at teardown of test_leaves_a_process_running" in out, out
    assert "processes left running after the test" in out and "time.sleep(300)" in out, out
    leaked_pid = int(pid_file.read_text())
    assert not psutil.pid_exists(leaked_pid) or psutil.Process(leaked_pid).status() == psutil.STATUS_ZOMBIE, (
        f"the leaked process {leaked_pid} is still running")
