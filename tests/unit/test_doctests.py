"""Every module whose docstrings hold examples runs them, and each run executes at least one.

The examples are documentation (``hook_vs_gloo`` in benchmarks/train.py is the training
benchmark's correctness criterion), so a module with ``>>>`` lines whose examples all went
missing, or are all skipped, fails here instead of passing with nothing checked. Modules are found
through the installed packages, so the wheel environment checks what it installed.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

# pyproject.toml's [tool.setuptools] packages: each maps one source folder.
PACKAGES = ("redsrv", "redsrv.horovod", "redsrv.core", "redsrv.adapters", "redsrv.adapters.horovod", "redsrv.cli", "redsrv.bench",
            "redsrv.examples")


def modules_with_examples() -> list[str]:
    found = []
    for package in PACKAGES:
        folder = Path(importlib.import_module(package).__file__ or "").parent
        for source in sorted(folder.glob("*.py")):
            if ">>> " in source.read_text(encoding="utf-8"):
                found.append(package if source.stem == "__init__" else f"{package}.{source.stem}")
    return found


def test_the_search_finds_the_modules_the_issue_named() -> None:
    # A broken search (a package moved, a glob that matches nothing) would run no example at all.
    assert {"redsrv.bench.train", "redsrv.core.config", "redsrv.core.commons", "redsrv.cli.plan",
            "redsrv.adapters.horovod.common"} <= set(modules_with_examples())


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run_and_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), raise_on_error=False, report=True)
    assert result.attempted > 0, f"{name} has '>>>' lines but no example ran (all skipped or not in a docstring)"
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples in {name} failed"
