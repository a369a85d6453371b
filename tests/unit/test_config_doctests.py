"""The examples in core/config.py's docstrings run and hold (they are its documentation)."""

from __future__ import annotations

import doctest

from redsrv.core import config


def test_config_docstring_examples_run_and_pass() -> None:
    result = doctest.testmod(config, raise_on_error=False, report=True)
    # attempted > 0: a refactor that drops or hides the examples must not pass silently
    assert result.attempted > 0, "core/config.py has no doctest examples left"
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples in core/config.py failed"
