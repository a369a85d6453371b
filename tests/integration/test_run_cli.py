"""``redsrv run -np N``: workers get rank, size, reducers, job and a secret; output carries
rank prefixes; a failing worker or Ctrl-C stops everything and sets the exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from conftest import child_env
from tests_support import poll

RUN = [sys.executable, "-m", "redsrv", "run"]

# A worker that reports what it was given, then either exits with RUNTEST_EXIT's status
# (rank 1 only) or blocks reading stdin (a worker stuck in training) until it is stopped.
WORKER = """
import os, sys
env = os.environ
print("pid", os.getpid(), "rank", env["RANK"], "of", env["WORLD_SIZE"], "local", env["LOCAL_RANK"],
      "reducers", len(env["REDSRV_REDUCERS"].split(",")), "job", env["REDSRV_JOB"],
      "secret", len(env.get("REDSRV_SECRET", "")), flush=True)
if "RUNTEST_DIR" in env:  # say it is up; rank 1 fails only once every rank is (a poll with a deadline)
    import time
    open(os.path.join(env["RUNTEST_DIR"], env["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(env["RUNTEST_DIR"])) < int(env["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.02)
if env["RANK"] == "1" and "RUNTEST_EXIT" in env:
    sys.exit(int(env["RUNTEST_EXIT"]))
if "RUNTEST_BLOCK" in env:
    sys.stdin.read()
"""


def wait_for_lines(path: str, count: int, timeout: float = 60.0) -> list[str]:
    def lines() -> list[str] | None:
        with open(path) as f:
            found = [line for line in f if " pid " in line]
        return found if len(found) >= count else None

    return poll(lines, timeout, f"{count} worker lines in {path}")  # type: ignore[no-any-return]


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def pids_of(lines: list[str]) -> list[int]:
    return [int(line.split()[2]) for line in lines]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker pid {pid} is still running")


def test_workers_get_their_placement_and_a_failure_stops_the_rest(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = str(tmp_path / "run.log")
    (tmp_path / "up").mkdir()
    env = child_env({"RUNTEST_EXIT": "3", "RUNTEST_BLOCK": "1", "RUNTEST_DIR": str(tmp_path / "up")})
    with open(log, "w") as out:
        proc = procs.popen([*RUN, "-np", "3", "--reducers", "2", sys.executable, "-c", WORKER], env=env, stdout=out,
                           stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
        assert proc.wait(timeout=90) == 3  # rank 1's status; ranks 0 and 2 were blocked and got stopped
    lines = wait_for_lines(log, 3)
    by_rank = {line.split()[4]: line for line in lines}
    assert sorted(by_rank) == ["0", "1", "2"]
    for rank, line in by_rank.items():
        words = line.split()
        assert words[0] == f"[{rank}]" and words[6] == "3" and words[8] == rank  # prefix, size, local rank
        assert words[10] == "2" and words[12].startswith("run-") and words[14] == "64"  # reducers, job, secret
    assert len({line.split()[12] for line in lines}) == 1  # one job
    assert "rank 1 exited with status 3" in read(log)
    assert_gone(pids_of(lines))


def wait_or_dump(proc: subprocess.Popen, timeout: float, log: str) -> int:  # type: ignore[type-arg]
    """``proc``'s exit status; if it is still running after ``timeout``, its threads' stacks (it
    runs with PYTHONFAULTHANDLER=1, which prints them on SIGABRT) in the failure."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)  # its workers and reducers, left behind by an abort
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=30)
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=10)
        raise AssertionError(f"redsrv run still running {timeout} s after the signal; its log and stacks:\n"
                             + read(log)[-6000:]) from None


def _interruptible() -> None:
    # As Ctrl-C finds a command run from a terminal. A background job of a non-interactive shell
    # (a CI runner's, a nohup'd script's) inherits SIGINT ignored, and Python then leaves it so:
    # the launcher would never see this test's signal (its stacks, in a clean-clone run, showed it
    # still waiting for its workers).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupt_stops_workers_and_reducers(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = str(tmp_path / "run.log")
    with open(log, "w") as out:
        proc = procs.popen([*RUN, "-np", "2", sys.executable, "-c", WORKER],
                           env=child_env({"RUNTEST_BLOCK": "1", "PYTHONFAULTHANDLER": "1"}),
                           stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE, preexec_fn=_interruptible)
        lines = wait_for_lines(log, 2)
        proc.send_signal(signal.SIGINT)
        assert wait_or_dump(proc, 30, log) == 130
    assert "interrupted" in read(log)
    assert_gone(pids_of(lines))


def test_success_exits_zero(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = subprocess.run([*RUN, "-np", "2", sys.executable, "-c", WORKER], env=child_env(), capture_output=True,
                            text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(line.split()[0] for line in result.stdout.splitlines()) == ["[0]", "[1]"]


def test_a_command_that_cannot_start_is_reported() -> None:
    result = subprocess.run([*RUN, "-np", "2", "/nonexistent/trainer"], env=child_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 127
    assert "cannot start '/nonexistent/trainer'" in result.stderr


RENDEZVOUS_WORKER = """
import os, sys
env = os.environ
print(env["RANK"], env["MASTER_ADDR"], env["MASTER_PORT"], *(env[f"HOROVOD_{name}"] for name in
      ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")), flush=True)
print("complaint from", env["RANK"], file=sys.stderr, flush=True)
"""


def test_workers_get_a_torch_rendezvous_and_horovodruns_variables_and_keep_stderr_apart() -> None:
    inherited = child_env({"MASTER_PORT": "1", "HOROVOD_RANK": "7"})  # a launcher's leftovers never reach a worker
    result = subprocess.run([*RUN, "-np", "2", sys.executable, "-c", RENDEZVOUS_WORKER], env=inherited,
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = sorted(line.split()[1:] for line in result.stdout.splitlines())
    assert [row[0] for row in rows] == ["0", "1"]
    assert len({(row[1], row[2]) for row in rows}) == 1 and rows[0][1] == "127.0.0.1" and int(rows[0][2]) > 1
    assert [row[3:] for row in rows] == [["0", "2", "0", "2", "0", "1"], ["1", "2", "1", "2", "0", "1"]]
    assert sorted(result.stderr.splitlines()) == ["[0] complaint from 0", "[1] complaint from 1"]
    assert "complaint" not in result.stdout
