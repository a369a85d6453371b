"""The exception policy (docs/architecture.md, "Exceptions"), pinned for representative mistakes in
the core and in every adapter: configuration mistakes raise ``ConfigError``, argument misuse a
plain ``TypeError`` / ``ValueError`` (``LocalProtocolError`` only for misuse of the wire protocol),
runtime failures redsrv's typed errors. Each adapter's checks run before anything connects, so no
reducer is needed; an adapter whose framework is not installed is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import redsrv
from redsrv.core import collectives, wire

BAD_ENV = {"REDSRV_NO_SUCH_SETTING": "1", "REDSRV_REDUCERS": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "1"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No REDSRV_* or launcher variables from the outer environment."""
    for name in list(os.environ):
        if name.startswith("REDSRV_") or name in ("RANK", "WORLD_SIZE", "TF_CONFIG", "CLUSTER_SPEC"):
            monkeypatch.delenv(name)
    yield monkeypatch


def raises_exactly(kind: type[BaseException], call: Callable[[], Any], match: str) -> BaseException:
    """``call()`` raises ``kind`` itself: a plain ValueError is not a RedsrvError in disguise."""
    with pytest.raises(kind, match=match) as info:
        call()
    assert type(info.value) is kind, f"{type(info.value).__name__}: {info.value}"
    return info.value


def bad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in BAD_ENV.items():
        monkeypatch.setenv(name, value)


# --- the core ---


def test_core_configuration_mistakes_are_config_errors(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(redsrv.ConfigError, match="op_timeout"):
        redsrv.Config(reducers=("127.0.0.1:1",), op_timeout=-1.0)
    with pytest.raises(redsrv.ConfigError, match="no reducers given"):
        redsrv.Client([], rank=0, world_size=2)
    bad_env(clean_env)
    with pytest.raises(redsrv.ConfigError, match="REDSRV_NO_SUCH_SETTING"):
        redsrv.Config.from_env()


def test_wire_misuse_is_a_local_protocol_error() -> None:
    with pytest.raises(redsrv.LocalProtocolError, match="not supported on the wire"):
        wire.dtype_code(np.dtype(np.complex64))


# --- PyTorch ---


def test_torch_argument_misuse_and_configuration(clean_env: pytest.MonkeyPatch) -> None:
    rtorch = pytest.importorskip("redsrv.torch")
    raises_exactly(ValueError, lambda: rtorch.HookState(["127.0.0.1:1"], rank=0, world_size=1, timeout=-1), "timeout")
    bad_env(clean_env)
    with pytest.raises(redsrv.ConfigError, match="REDSRV_NO_SUCH_SETTING"):
        rtorch.HookState()
    with pytest.raises(redsrv.ConfigError, match="REDSRV_NO_SUCH_SETTING"):
        rtorch.register_backend()


# --- TensorFlow ---


def test_tf_argument_misuse_and_configuration(clean_env: pytest.MonkeyPatch) -> None:
    rtf = pytest.importorskip("redsrv.tf")
    raises_exactly(ValueError, lambda: rtf.ReductionServerCrossDeviceOps(timeout=-1), "timeout")
    raises_exactly(TypeError, lambda: rtf.ReductionServerCrossDeviceOps(client=object(), rank=0),  # type: ignore[arg-type]
                   "either a client or the arguments")
    with pytest.raises(redsrv.ConfigError, match="REDSRV_NO_SUCH_SETTING"):
        rtf.ReductionServerStrategy(environ=BAD_ENV)


# --- JAX ---


def test_jax_argument_misuse_and_configuration(clean_env: pytest.MonkeyPatch) -> None:
    rjax = pytest.importorskip("redsrv.jax")
    raises_exactly(ValueError, lambda: rjax.init(["127.0.0.1:1"], rank=0, world_size=1, timeout=-1), "timeout")
    raises_exactly(ValueError, rjax.default_communicator, "not initialised")
    bad_env(clean_env)
    with pytest.raises(redsrv.ConfigError, match="REDSRV_NO_SUCH_SETTING"):
        rjax.init()


# --- collectives every adapter shares ---


def test_exact_broadcast_argument_misuse_before_anything_is_sent() -> None:
    # The checks run before the client is touched: no connection is needed to see them.
    client: Any = None
    raises_exactly(TypeError, lambda: collectives.broadcast_exact_async(client, np.array([object()]), key=0), "fixed-size")
    raises_exactly(ValueError, lambda: collectives.broadcast_exact_async(client, np.zeros(3), key=0, out=np.zeros(2)),
                   "out must be")
    raises_exactly(ValueError, lambda: collectives.broadcast_exact_in_place_async(client, np.zeros((3, 2))[:, 0], key=0),
                   "C-contiguous, writeable")
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    raises_exactly(ValueError, lambda: collectives.broadcast_exact_in_place_async(client, readonly, key=0), "writeable")
    raises_exactly(TypeError, lambda: collectives.broadcast_exact_in_place_async(client, np.array([object()]), key=0),
                   "fixed-size")


def test_allgather_of_objects_is_a_type_error_before_anything_is_sent() -> None:
    client: Any = None  # the checks run before the client is touched
    raises_exactly(TypeError, lambda: collectives.allgather_async(client, np.array([object()]), key=0), "fixed-size")
