"""Config: one frozen dataclass, validated eagerly, the only reader of REDSRV_* variables."""

from __future__ import annotations

import dataclasses

import pytest

from redsrv import Config, ConfigError
from redsrv.core.config import parse_address


def test_environment_fills_what_arguments_do_not() -> None:
    env = {"REDSRV_REDUCERS": "10.0.0.5:7000, 10.0.0.6:7001", "REDSRV_JOB": "run-17", "RANK": "3", "WORLD_SIZE": "4",
           "REDSRV_CHUNK_BYTES": "1048576", "REDSRV_WIRE_DTYPE": "bf16", "REDSRV_OP_TIMEOUT": "12.5"}
    cfg = Config.from_env(env)
    assert cfg.reducers == ("10.0.0.5:7000", "10.0.0.6:7001")
    assert (cfg.job, cfg.rank, cfg.world_size, cfg.chunk_bytes) == ("run-17", 3, 4, 1 << 20)
    assert cfg.wire_dtype == "bfloat16" and cfg.op_timeout == 12.5
    assert Config.from_env(env, rank=1, job="other").rank == 1
    assert Config.from_env({**env, "REDSRV_RANK": "2"}).rank == 2  # REDSRV_* wins over torchrun's


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().job = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"REDSRV_TIMEOUT": "3"}, "unknown variable"),
        ({"REDSRV_OP_TIMEOUT": "0"}, "op_timeout must be positive"),
        ({"REDSRV_HEARTBEAT_INTERVAL": "-1"}, "heartbeat_interval must be positive"),
        ({"REDSRV_OP_TIMEOUT": "soon"}, "not a valid float"),
        ({"REDSRV_RANK": "4", "REDSRV_WORLD_SIZE": "4"}, "rank must be in 0..3"),
        ({"REDSRV_REDUCERS": "host:notaport"}, "port 'notaport' is not a number"),
        ({"REDSRV_STRAGGLER_MODE": "fastest"}, "straggler_mode must be one of"),
        ({"REDSRV_STRAGGLER_MODE": "first_m", "REDSRV_WORLD_SIZE": "4"}, "needs min_contributors"),
        ({"REDSRV_STRAGGLER_MODE": "deadline", "REDSRV_WORLD_SIZE": "4", "REDSRV_MIN_CONTRIBUTORS": "2"}, "needs a positive deadline"),
        ({"REDSRV_WIRE_DTYPE": "int8"}, "wire_dtype must be one of"),
        ({"REDSRV_SECRET": "short"}, "at least 16 bytes"),
        ({"REDSRV_SECRET_FILE": "/nonexistent/redsrv-secret"}, "cannot read secret file"),
        ({"REDSRV_CHUNK_BYTES": "0"}, "chunk_bytes must be >= 1"),
    ],
)
def test_invalid_settings_fail_at_start_up(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env)


def test_secret_file_is_read_and_never_shown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "secret"
    path.write_text("  correct horse battery staple  \n")
    cfg = Config.from_env({"REDSRV_SECRET_FILE": str(path)})
    assert cfg.secret == b"correct horse battery staple"
    assert "horse" not in repr(cfg)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("h:1", ("h", 1)), ("h", ("h", 29600)), ("[::1]:5", ("::1", 5)), ("[fe80::1]", ("fe80::1", 29600))],
)
def test_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "h:0", "h:70000", "[::1", ":5"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_address(text)
