"""JAX adapter tests: two CPU devices in this process and in every child.

XLA reads the flag when JAX creates its CPU backend, which happens at first use, so setting it at
collection time works even if JAX was imported before.
"""

from __future__ import annotations

import os

import pytest

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS with ``devices`` host devices, keeping any other flags the environment sets."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
    return " ".join([*kept, f"{DEVICE_FLAG}={devices}"])


if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = xla_flags(2)


@pytest.fixture
def daemon():  # type: ignore[no-untyped-def]
    """An in-process reducer on a free loopback port: its address."""
    import redsrv

    reducer = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, heartbeat_interval=0.2,
                                                         close_timeout=3))
    host, port = reducer.start()
    yield f"{host}:{port}"
    reducer.stop()
