"""Canary for the private TensorFlow API the adapter overrides (``redsrv.adapters._tf_internals``).

When a TensorFlow release moves one of these names, this test fails first and says which name
moved and what the adapter needed it for; fix ``_tf_internals.py`` (only) and re-pin the ``tf`` extra.
"""

from __future__ import annotations

import inspect
import re

import pytest

tf = pytest.importorskip("tensorflow")

from redsrv.adapters import _tf_internals  # noqa: E402

pytestmark = pytest.mark.tf


def test_every_private_name_the_adapter_uses_still_exists() -> None:
    moved = [f"{getattr(owner, '__name__', owner)}.{name} ({why})"
             for owner, name, why in _tf_internals.PRIVATE_API if not hasattr(owner, name)]
    assert not moved, (f"TensorFlow {tf.__version__} no longer has: " + "; ".join(moved)
                       + f". redsrv.adapters._tf_internals was written for TensorFlow {_tf_internals.TESTED_TF}.")


def test_overridden_methods_keep_their_parameters() -> None:
    changed = {}
    for name, expected in _tf_internals.OVERRIDDEN_SIGNATURES.items():
        try:
            actual = _tf_internals.signature_of(name)
        except AttributeError:
            actual = ("<missing>",)
        if actual != expected:
            changed[name] = (expected, actual)
    assert not changed, "MirroredExtended methods redsrv overrides changed their parameters (expected, now): " + repr(changed)


def test_one_replica_shortcut_still_reads_num_between_graph_workers() -> None:
    # CrossDeviceOps.batch_reduce skips the implementation for one replica unless
    # _num_between_graph_workers > 1; CrossDeviceOpsBase relies on exactly that switch.
    source = inspect.getsource(tf.distribute.CrossDeviceOps.batch_reduce)
    assert "_num_between_graph_workers" in source, "CrossDeviceOps.batch_reduce changed its one-replica shortcut"
    calls = []

    class Probe(_tf_internals.CrossDeviceOpsBase):
        _redsrv_num_workers = 2

        def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):  # type: ignore[no-untyped-def]
            calls.append(len(value_destination_pairs))
            return [v for v, _ in value_destination_pairs]

    Probe().batch_reduce(tf.distribute.ReduceOp.SUM, [(tf.constant(1.0), "/cpu:0")])
    assert calls == [1]


def test_tensorflow_is_the_tested_minor() -> None:
    minor = ".".join(tf.__version__.split(".")[:2])
    assert minor == _tf_internals.TESTED_TF, (
        f"TensorFlow {tf.__version__} is installed; the adapter is tested on {_tf_internals.TESTED_TF}.x "
        "(pyproject's tf extra pins it)")


def test_tf_keras_reads_only_the_attributes_we_provide() -> None:
    utils = pytest.importorskip("tf_keras.src.distribute.distributed_file_utils")
    source = inspect.getsource(utils)
    read = set(re.findall(r"extended\.(_[a-z_]+)\b(?!\()", source))
    assert read <= {"_in_multi_worker_mode", *_tf_internals.KERAS2_READS}, (
        f"tf_keras's distributed_file_utils now reads {sorted(read)} from the strategy's extended object")


def test_keras_3_trainer_still_keys_its_multi_worker_paths_on_mwms() -> None:
    trainer = pytest.importorskip(_tf_internals.KERAS_TRAINER)
    moved = [f"{name} ({why})" for name, why in _tf_internals.KERAS_PRIVATE_API if not hasattr(trainer, name)]
    assert not moved, "Keras's TensorFlow trainer no longer has: " + "; ".join(moved)
    # Still an isinstance test on MultiWorkerMirroredStrategy: if Keras asks the strategy instead
    # (extended._in_multi_worker_mode() alone), the shim is no longer needed.
    source = inspect.getsource(trainer._collective_all_reduce_multi_worker)
    assert "MultiWorkerMirroredStrategy" in source and "_in_multi_worker_mode" in source, source
    assert inspect.signature(trainer.reduce_per_replica).parameters.keys() == {"values", "strategy", "reduction"}
    assert inspect.signature(trainer._multi_worker_concat).parameters.keys() == {"v", "strategy"}


def test_keras_shim_is_installed_once_and_leaves_other_strategies_alone() -> None:
    trainer = pytest.importorskip(_tf_internals.KERAS_TRAINER)
    _tf_internals.install_keras_multi_worker_paths()
    installed = trainer.reduce_per_replica
    _tf_internals.install_keras_multi_worker_paths()
    assert trainer.reduce_per_replica is installed and installed._redsrv_original is not None
    stock = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    value = stock.experimental_distribute_values_from_function(lambda c: tf.constant([float(c.replica_id_in_sync_group)]))
    assert installed(value, stock, "concat").numpy().tolist() == [0.0, 1.0]


def test_tf_keras_2_multi_worker_paths_are_where_the_shim_expects_them() -> None:
    training = pytest.importorskip(_tf_internals.TF_KERAS_TRAINING)
    moved = [f"{name} ({why})" for name, why in _tf_internals.TF_KERAS_PRIVATE_API if not hasattr(training, name)]
    assert not moved, f"tf-keras moved what the ReductionServerStrategy relies on: {moved}"
    _tf_internals.install_keras_multi_worker_paths()
    installed = training._collective_all_reduce_multi_worker
    _tf_internals.install_keras_multi_worker_paths()
    assert training._collective_all_reduce_multi_worker is installed and installed._redsrv_original is not None
    # other strategies keep Keras 2's answer
    assert installed(tf.distribute.MirroredStrategy(["/cpu:0"])) is False
