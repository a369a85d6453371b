"""TensorFlow adapter tests: two logical CPU devices in this process (children configure their own).

TensorFlow fixes its device list when its runtime starts (the first op), so the split happens here,
at collection time, before any test touches TensorFlow.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep C++ INFO/WARNING lines out of test output

try:
    import tensorflow as tf
except ImportError:  # each test module skips itself with pytest.importorskip
    tf = None

LOCAL_DEVICES = 2

if tf is not None:
    _cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(_cpu) or ()) != LOCAL_DEVICES:
        tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * LOCAL_DEVICES)


@pytest.fixture
def daemon():  # type: ignore[no-untyped-def]
    """An in-process reducer on a free loopback port: its address."""
    import redsrv

    reducer = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, heartbeat_interval=0.2,
                                                         close_timeout=3))
    host, port = reducer.start()
    yield f"{host}:{port}"
    reducer.stop()
