"""Fixtures shared by the adapter tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def daemon():  # type: ignore[no-untyped-def]
    """An in-process reducer on a free loopback port (short heartbeats): its address."""
    import redsrv

    reducer = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, heartbeat_interval=0.2,
                                                         close_timeout=3))
    host, port = reducer.start()
    yield f"{host}:{port}"
    reducer.stop()
