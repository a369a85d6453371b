"""Keras 3 ``model.fit`` on several worker processes through redsrv's ReductionServerStrategy.

A small classifier on generated data (a fixed seed, identical in every process). Each worker
replicates the model over its own devices; the reducers add the workers' gradients. The program is
the single-process Keras program with one change, the strategy: ``fit``'s ``batch_size`` is the
global batch (each worker reads its shard of it), the initial weights are worker 0's, the epoch
metrics (``History``, ``EarlyStopping``) are global, and only worker 0 writes checkpoints.

Two workers with two CPU devices each, against two reducers, on one machine::

    redsrv reducer --port 29600 &  redsrv reducer --port 29601 &
    for i in 0 1; do
      REDSRV_REDUCERS=127.0.0.1:29600,127.0.0.1:29601 REDSRV_JOB=keras-demo RANK=$i WORLD_SIZE=2 \\
        python -m redsrv.examples.keras_fit --devices 2 --out worker$i.npz &
    done; wait

The same training in one process on four devices with TensorFlow's own MirroredStrategy, and the
comparison (float32 summation order only: about 1e-7)::

    python -m redsrv.examples.keras_fit --reference --devices 4 --out ref.npz --compare worker0.npz

On a cluster, ``TF_CONFIG`` (or Vertex AI's ``CLUSTER_SPEC``) names the workers and the reducers;
the chief, if any, is worker 0::

    TF_CONFIG='{"cluster": {"worker": ["w0:2222", "w1:2222"], "reducer": ["r0:29600", "r1:29600"]},
                "task": {"type": "worker", "index": 0}}' python -m redsrv.examples.keras_fit --devices 2

``--devices N`` splits the CPU into N logical devices (GPUs, if present, are used instead when
``--devices`` is not given). Every worker must use the same number.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

FEATURES, CLASSES, SAMPLES = 32, 8, 4096
SEED = 1234


def make_data(samples: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and labels of a random teacher network; the same in every process."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((samples, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(np.tanh(x) @ teacher + 0.3 * rng.standard_normal((samples, CLASSES)), axis=1).astype(np.int32)
    return x, y


def split_cpu(devices: int | None) -> list[str] | None:
    """Make ``devices`` logical CPU devices (before TensorFlow starts its runtime); their names."""
    if not devices:
        return None
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    return [f"/cpu:{i}" for i in range(devices)]


def build_model() -> Any:
    import keras

    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def train(*, reference: bool = False, devices: int | None = None, epochs: int = 5, batch_size: int = 256,
          samples: int = SAMPLES, checkpoint_dir: str | None = None, verbose: int = 2, **strategy_args: Any) -> dict[str, Any]:
    """Train and return the final weights (flattened), the history and the timing.

    ``reference``: one process, stock ``tf.distribute.MirroredStrategy`` over its devices.
    Otherwise one worker of a ``redsrv.tf.ReductionServerStrategy`` (``strategy_args``: reducers,
    num_workers, worker_index, job, wire_dtype ...; missing ones from the environment).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    device_names = split_cpu(devices)
    import keras
    import tensorflow as tf

    import redsrv.tf

    if reference:
        strategy = tf.distribute.MirroredStrategy(device_names)
    else:
        strategy = redsrv.tf.ReductionServerStrategy(devices=device_names, **strategy_args)
    try:
        # The same seed everywhere keeps the shuffle order identical, so the workers' shards of each
        # global batch are disjoint. (The initial weights would be worker 0's whatever the seed.)
        keras.utils.set_random_seed(SEED)
        x, y = make_data(samples)
        train_data = (tf.data.Dataset.from_tensor_slices((x[: samples * 7 // 8], y[: samples * 7 // 8]))
                      .shuffle(samples, seed=SEED).batch(batch_size))
        val_data = tf.data.Dataset.from_tensor_slices((x[samples * 7 // 8:], y[samples * 7 // 8:])).batch(batch_size)
        with strategy.scope():
            model = build_model()
        callbacks: list[Any] = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=3)]  # global logs: all stop alike
        if checkpoint_dir:
            os.makedirs(checkpoint_dir, exist_ok=True)
            checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "model.keras"))
            callbacks += [checkpoint] if reference else strategy.chief_only(checkpoint)
        first = model.evaluate(val_data, verbose=0, return_dict=True)
        started = time.perf_counter()
        # shuffle=False: the dataset shuffles itself
        history = model.fit(train_data, validation_data=val_data, epochs=epochs, callbacks=callbacks, shuffle=False,
                            verbose=verbose if (reference or strategy.is_chief) else 0)
        seconds = time.perf_counter() - started
        weights = np.concatenate([w.numpy().ravel() for w in model.weights])
        out: dict[str, Any] = {
            "weights": weights, "seconds": seconds, "first_loss": first["loss"],
            "last_loss": history.history["val_loss"][-1], "val_accuracy": history.history["val_accuracy"][-1],
            "epochs": len(history.history["loss"]), "replicas": strategy.num_replicas_in_sync,
        }
        if not reference:
            client = strategy.cross_device_ops.client
            out["bytes_pushed"], out["bytes_pulled"] = client.bytes_pushed, client.bytes_pulled
        return out
    finally:
        if not reference:
            strategy.close()


def train_worker(*, rank: int, world_size: int, reducers: list[str], job: str, steps: int,
                 wire_dtype: str | None = None) -> dict[str, Any]:
    """One worker of ``redsrv demo`` (the local launcher's interface): one CPU device, ``steps``
    global batches of 32 per worker in one epoch (a global batch the replicas divide evenly:
    Keras builds differently shaped state on replicas given uneven shares)."""
    batch = 32 * world_size
    return train(devices=1, epochs=1, batch_size=batch, samples=batch * steps * 8 // 7, verbose=0, reducers=reducers,
                 num_workers=world_size, worker_index=rank, job=job, wire_dtype=wire_dtype)


def train_reference(*, world_size: int, steps: int) -> np.ndarray:
    """The weights of :func:`train_worker`'s workers, computed in this process with stock
    MirroredStrategy over ``world_size`` logical CPUs (call before anything starts TensorFlow)."""
    batch = 32 * world_size
    return np.asarray(train(reference=True, devices=world_size, epochs=1, batch_size=batch, samples=batch * steps * 8 // 7,
                            verbose=0)["weights"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redsrv.examples.keras_fit", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=None, help="logical CPU devices in this process")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch")
    parser.add_argument("--reducers", default=None, help="host:port,host:port (default: TF_CONFIG or REDSRV_REDUCERS)")
    parser.add_argument("--num-workers", type=int, default=None)
    parser.add_argument("--worker-index", type=int, default=None)
    parser.add_argument("--job", default=None)
    parser.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None)
    parser.add_argument("--checkpoint-dir", default=None, help="worker 0 saves model.keras here after each epoch")
    parser.add_argument("--reference", action="store_true", help="one process, stock MirroredStrategy")
    parser.add_argument("--out", default=None, help="write the weights and results to this .npz")
    parser.add_argument("--compare", default=None, help="an .npz from another run: print the largest weight difference")
    args = parser.parse_args(argv)
    strategy_args = {} if args.reference else dict(
        reducers=args.reducers.split(",") if args.reducers else None, num_workers=args.num_workers,
        worker_index=args.worker_index, job=args.job, wire_dtype=args.wire_dtype)
    out = train(reference=args.reference, devices=args.devices, epochs=args.epochs, batch_size=args.batch_size,
                checkpoint_dir=args.checkpoint_dir, **strategy_args)
    print(f"{out['epochs']} epochs on {out['replicas']} replicas in {out['seconds']:.1f}s: validation loss "
          f"{out['first_loss']:.4f} -> {out['last_loss']:.4f}, accuracy {out['val_accuracy']:.3f}", flush=True)
    if args.out:
        np.savez(args.out, **{k: np.asarray(v) for k, v in out.items()})  # type: ignore[arg-type]
    if args.compare:
        with np.load(args.compare) as other:
            print(f"largest weight difference from {args.compare}: {np.abs(other['weights'] - out['weights']).max():.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
