"""Tests wait on events, not fixed sleeps: ruff's banned-API rule (TID251) enforces it in tests/.

A sleep that guesses how long a reducer takes to reach a state passes on a fast machine and
decides what the test exercises on a slow one. pyproject.toml bans ``time.sleep`` under tests/
only; the library and the benchmarks pace and back off on purpose.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")
ROOT = Path(__file__).resolve().parents[2]
SLEEPER = "import time\n\n\ndef wait() -> None:\n    time.sleep(0.3)\n"


def ruff_on(filename: str, source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "--stdin-filename", filename, "-"], input=source, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_a_fixed_sleep_in_a_test_fails_the_lint() -> None:
    result = ruff_on("tests/integration/test_probe.py", SLEEPER)
    assert result.returncode == 1 and "TID251" in result.stdout, result.stdout + result.stderr


def test_the_same_sleep_outside_tests_is_allowed() -> None:
    result = ruff_on("benchmarks/probe.py", SLEEPER)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_sleep_that_says_why_it_is_not_a_synchronisation_is_allowed() -> None:
    result = ruff_on("tests/integration/test_probe.py", SLEEPER.replace("0.3)", "0.3)  # noqa: TID251 - pacing"))
    assert result.returncode == 0, result.stdout + result.stderr
