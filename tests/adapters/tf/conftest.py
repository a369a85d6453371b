"""TensorFlow adapter tests: two logical CPU devices in this process (children configure their own).

TensorFlow fixes its device list when its runtime starts (the first op), so the split happens here,
at collection time, before any test touches TensorFlow.
"""

from __future__ import annotations

import os

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

