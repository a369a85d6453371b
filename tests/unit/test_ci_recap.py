"""``.ci/recap.py``: what CI prints at the end of its output, where a failure in an early tox
environment would otherwise have scrolled out of the part CI keeps."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

RECAP = os.path.join(os.path.dirname(__file__), "..", "..", ".ci", "recap.py")

LOG = """\
lint: commands[0]> ruff check .
All checks passed!
jax: commands[0]> pytest tests/adapters/jax
tests/adapters/jax/test_jax_multiprocess.py ..F..                        [100%]

=================================== FAILURES ===================================
____________ test_a_killed_reducer_surfaces_as_an_error_on_the_host ____________

    def test_a_killed_reducer_surfaces_as_an_error_on_the_host():
>       assert "127.0.0.1:1" in message
E       AssertionError: the error names another reducer
E       assert '127.0.0.1:1' in 'reducer 127.0.0.1:2: rank 1 disconnected'

tests/adapters/jax/test_jax_multiprocess.py:161: AssertionError
=========================== short test summary info ============================
SKIPPED [1] tests/adapters/jax/test_jax_local.py:9: not here
FAILED tests/adapters/jax/test_jax_multiprocess.py::test_a_killed_reducer_surfaces_as_an_error_on_the_host - AssertionError
========================= 1 failed, 4 passed in 40.00s =========================
tf: commands[0]> pytest tests/adapters/tf
E   this line is outside any failure and is not repeated
  lint: OK (32.51=setup[26.30]+cmd[0.10,6.10] seconds)
  jax: FAIL code 1 (74.52=setup[31.72]+cmd[42.80] seconds)
  tf: OK (258.71=setup[50.95]+cmd[207.76] seconds)
  evaluation failed :( (2371.81 seconds)
"""


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ci_recap", RECAP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recap_names_the_environment_the_failed_test_its_assertion_and_every_outcome() -> None:
    lines = _module().recap(LOG.splitlines())
    assert lines == [
        "[jax] failure: test_a_killed_reducer_surfaces_as_an_error_on_the_host",
        "    E       AssertionError: the error names another reducer",
        "    E       assert '127.0.0.1:1' in 'reducer 127.0.0.1:2: rank 1 disconnected'",
        "[jax] FAILED tests/adapters/jax/test_jax_multiprocess.py::test_a_killed_reducer_surfaces_as_an_error_on_the_host"
        " - AssertionError",
        "  lint: OK (32.51=setup[26.30]+cmd[0.10,6.10] seconds)",
        "  jax: FAIL code 1 (74.52=setup[31.72]+cmd[42.80] seconds)",
        "  tf: OK (258.71=setup[50.95]+cmd[207.76] seconds)",
    ]


def test_a_long_recap_keeps_its_end_within_the_limit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    module = _module()
    many = "".join(f"FAILED tests/t.py::test_{i} - {'x' * 200}\n" for i in range(200))
    log = tmp_path / "log"
    log.write_text("core: commands[0]> pytest\n" + many + "  core: FAIL code 1 (1.00 seconds)\n")
    printed = subprocess.run([sys.executable, RECAP, str(log)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert printed.startswith("==== recap of the tox run ====\n... (recap cut at the front)\n")
    assert len(printed) < module.TOTAL_LIMIT + 200
    assert printed.rstrip().endswith("core: FAIL code 1 (1.00 seconds)")
