"""One Keras process for the TensorFlow adapter tests.

    python keras_worker.py SPEC_JSON OUT_PREFIX

SPEC: {"mode": "worker"|"reference", "devices": n, "seed": s (model init; workers add their index),
       "samples": n, "features": f, "batch_size": b, "epochs": e, "job": "...", "strategy": {...kwargs},
       "progress": bool (write OUT_PREFIX.progress after each epoch),
       "backup": dir name (redsrv.tf.BackupAndRestore next to OUT_PREFIX), "stop_at": [epoch, batch] (write
       OUT_PREFIX.stopped there and wait to be killed), "save_model": bool (model.save on the chief),
       "steps_per_execution": k, "jit_compile": bool, "keras": "keras" (Keras 3, default) | "tf_keras" (Keras 2),
       "model": "mlp" (default) | "bn" (BatchNormalization and Dropout),
       "save": bool (save weights to worker{index}.weights.h5 or reference.weights.h5 next to OUT_PREFIX each
       epoch; ReductionServerStrategy workers pass the callback through strategy.chief_only)}

"reference" is a single process with a stock MirroredStrategy over n logical CPUs; "worker" is one
ReductionServerStrategy worker (its cluster from the strategy kwargs or TF_CONFIG). Writes
OUT_PREFIX.npz (final weights "w0", "w1", ...) and OUT_PREFIX.json (history, initial-weight digest,
strategy facts, and the error type and message if training raised).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def make_data(samples: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """The same data in every process (a fixed seed): a noisy linear target."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((samples, features)).astype(np.float32)
    w = rng.standard_normal((features, 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.1 * rng.standard_normal((samples, 1))).astype(np.float32)
    return x, y


def main() -> int:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * spec["devices"])
    devices = [f"/cpu:{i}" for i in range(spec["devices"])]

    if spec.get("keras") == "tf_keras":  # Keras 2, the tf-keras package
        import tf_keras as keras
    else:
        import keras

    import redsrv.tf

    report: dict = {"error": None}
    strategy = None
    try:
        if spec["mode"] == "reference":
            strategy = tf.distribute.MirroredStrategy(devices)
            index = 0
        else:
            strategy = redsrv.tf.ReductionServerStrategy(devices=devices, job=spec.get("job", "tf-test"),
                                                          **spec.get("strategy", {}))
            index = strategy.worker_index
            report.update(worker_index=index, num_workers=strategy.num_workers,
                          should_checkpoint=strategy.extended.should_checkpoint,
                          client=type(strategy.cross_device_ops.client).__name__)
        report["num_replicas_in_sync"] = strategy.num_replicas_in_sync
        keras.utils.set_random_seed(spec.get("seed", 0) + index)  # workers differ on purpose
        report["seed_probe"] = float(np.random.random())  # shows they do
        x, y = make_data(spec.get("samples", 96), spec.get("features", 6))
        with strategy.scope():
            if spec.get("model") == "bn":  # statistics synchronised across replicas, dropout masks from a seed
                layers = [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Activation("tanh"),
                          keras.layers.Dropout(0.25)]
            else:
                layers = [keras.layers.Dense(8, activation="tanh")]
            model = keras.Sequential([keras.Input((x.shape[1],)), *layers, keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"],
                          steps_per_execution=spec.get("steps_per_execution", 1),
                          jit_compile=spec.get("jit_compile", False))
        report["initial"] = [float(np.sum(np.abs(w.numpy()))) for w in model.weights]

        class Progress(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                with open(prefix + ".progress", "w") as f:
                    f.write(str(epoch + 1))

        class Record(keras.callbacks.Callback):
            """Epochs run and per-batch losses (Keras's per-step logs), for the report."""

            def on_epoch_begin(self, epoch, logs=None):
                report.setdefault("epochs_run", []).append(epoch)

            def on_train_batch_end(self, batch, logs=None):
                report.setdefault("batch_losses", []).append(float(logs["loss"]))
                if spec.get("stop_at") == [report["epochs_run"][-1], batch]:
                    # Tell the test where we are, then wait (bounded) to be killed mid-epoch.
                    with open(prefix + ".stopped", "w") as f:
                        f.write(f"{batch}")
                    threading.Event().wait(120)
                    raise TimeoutError("stop_at: the test did not kill this worker within 120 s")

        callbacks = [Record()] + ([Progress()] if spec.get("progress") else [])
        if spec.get("backup"):
            callbacks.append(redsrv.tf.BackupAndRestore(os.path.join(os.path.dirname(prefix), spec["backup"])))
        if spec.get("save"):
            name = "reference" if spec["mode"] == "reference" else f"worker{index}"
            path = os.path.join(os.path.dirname(prefix), f"{name}.weights.h5")
            saver = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
            callbacks += strategy.chief_only(saver) if spec["mode"] == "worker" else [saver]
        started = time.monotonic()
        history = model.fit(x, y, batch_size=spec.get("batch_size", 32), epochs=spec.get("epochs", 3),
                            shuffle=False, verbose=0, callbacks=callbacks)
        report["fit_seconds"] = time.monotonic() - started
        report["history"] = history.history
        report["evaluate"] = model.evaluate(x, y, batch_size=spec.get("batch_size", 32), verbose=0, return_dict=True)
        report["predict"] = model.predict(x, batch_size=spec.get("batch_size", 32), verbose=0).tolist()
        report["weights"] = [getattr(w, "path", w.name) for w in model.weights]
        if spec.get("save_model") and spec["mode"] == "worker" and strategy.extended.should_checkpoint:  # the chief alone
            model.save(os.path.join(os.path.dirname(prefix), f"worker{index}.keras"))
        np.savez(prefix + ".npz", **{f"w{i}": w.numpy() for i, w in enumerate(model.weights)})
    except Exception as exc:  # the test reads the type and message
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        if strategy is not None and spec["mode"] == "worker":
            try:
                strategy.check()
            except Exception as typed:
                report["error"]["redsrv_type"] = type(typed).__name__
                report["error"]["redsrv_message"] = str(typed)
    finally:
        if strategy is not None and spec["mode"] == "worker":
            strategy.close()
    with open(prefix + ".json", "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
