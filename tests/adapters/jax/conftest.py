"""JAX adapter tests: two CPU devices in this process and in every child.

XLA reads the flag when JAX creates its CPU backend, which happens at first use, so setting it at
collection time works even if JAX was imported before.
"""

from __future__ import annotations

import os

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS with ``devices`` host devices, keeping any other flags the environment sets."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
    return " ".join([*kept, f"{DEVICE_FLAG}={devices}"])


if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = xla_flags(2)
