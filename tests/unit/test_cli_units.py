"""One unit convention across the command line (cli/units.py): sizes take suffixes everywhere,
rate flags name Gbit/s (-gbit) or GB/s (-gbyte), --json takes a PATH, help text is plain text."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from redsrv.cli import build_parser, main
from redsrv.cli.units import parse_size, plain_text, size_in

SIZE_DEST = re.compile(r"(^|_)(sizes?|mib|kib|mb)$")


def parsers(parser: argparse.ArgumentParser, path: str = "redsrv") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def options() -> Iterator[tuple[str, argparse.Action]]:
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings:
                yield path, action


def test_sizes_parse_with_and_without_suffixes() -> None:
    assert parse_size("4KiB") == 4096 and parse_size("64MiB") == 64 << 20 and parse_size("2GB") == 2 * 10**9
    assert parse_size("0.00390625", bare_unit="MiB") == 4096  # the old spelling of 4 KiB still means 4 KiB
    assert size_in("KiB", whole=True)("1MiB") == 1024
    for bad in ("fast", "-1", "4 parsecs", "1.5B"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number of KiB"):
        size_in("KiB", whole=True)("100B")


def test_every_size_flag_takes_a_suffix() -> None:
    sized = [(path, a) for path, a in options() if SIZE_DEST.search(a.dest) and a.type is not None]
    assert {("redsrv bench local", "sizes"), ("redsrv bench emulate", "sizes"), ("redsrv bench torch-ops", "sizes"),
            ("redsrv bench allreduce", "sizes_kib"), ("redsrv bench plan-check", "size"),
            ("redsrv plan", "message_mib")} <= {(path, a.dest) for path, a in sized}
    for path, action in sized:
        assert action.type("4KiB") in (4, 4096, 4 / 1024, 4 / 1024**2), f"{path} {action.option_strings}"


@pytest.mark.parametrize(("argv", "dest", "value"), [
    (["bench", "local", "--sizes", "4KiB", "64MiB"], "sizes", [4 / 1024, 64.0]),
    (["bench", "emulate", "--sizes", "4KiB", "16"], "sizes", [4 / 1024, 16.0]),
    (["bench", "torch-ops", "--sizes", "4KiB", "1MiB"], "sizes", [4, 1024]),
    (["bench", "allreduce", "--sizes", "4KiB", "256MiB"], "sizes_kib", [4, 262144]),
    (["bench", "allreduce", "--sizes-kib", "4"], "sizes_kib", [4]),
    (["bench", "train", "--piece-kib", "1MiB"], "piece_kib", 1024),
    (["plan", "--workers", "4", "--worker-gbit", "1", "--reducer-gbit", "1", "--message-mib", "1GiB"], "message_mib", 1024.0),
])
def test_each_command_reads_sizes_in_its_own_unit(argv: list[str], dest: str, value: object) -> None:
    assert getattr(build_parser().parse_args(argv), dest) == value


def test_rate_flags_name_their_unit() -> None:
    rates = [flag for _, a in options() for flag in a.option_strings if re.search(r"-(gbps|gbit|gbyte)$", flag)]
    assert "--worker-gbit" in rates and "--core-gbyte" in rates
    assert not [flag for flag in rates if flag.endswith("-gbps")], "GB/s flags end in -gbyte, Gbit/s flags in -gbit"


def test_json_always_takes_a_path() -> None:
    for path, action in options():
        if "--json" in action.option_strings:
            assert action.nargs in (None, "?") and action.const in (None, "-"), f"{path} --json is a switch"


def test_plan_json_path_writes_the_file_with_unit_named_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--workers", "4", "--worker-gbit", "25", "--reducer-gbit", "25", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["worker_gbit"] == 25 and "worker_gbps" not in doc and doc["algbw_gbps"] > 0
    assert f"wrote {out}" in capsys.readouterr().out


def test_help_is_plain_text() -> None:
    assert plain_text("``--framework jax`` and :func:`redsrv.bench.train.run`") == "--framework jax and redsrv.bench.train.run"
    for path, parser in parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text and not re.search(r":[a-z]+:`", text), f"{path} --help prints reST"
