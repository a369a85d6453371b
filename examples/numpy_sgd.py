"""Data-parallel training of a small NumPy MLP through redsrv (no framework needed).

Each worker holds an equal shard of a synthetic classification set, computes its gradient and
averages it across workers with ``client.allreduce(grad, op="mean")``: full-batch gradient
descent, so the result must match one process training on all the data.

Run a fleet by hand::

    redsrv reducer --port 29600 &  redsrv reducer --port 29601 &
    for r in 0 1 2; do
      REDSRV_REDUCERS=127.0.0.1:29600,127.0.0.1:29601 python -m redsrv.examples.numpy_sgd --rank $r --world-size 3 &
    done; wait
"""

from __future__ import annotations

import argparse
import time

import numpy as np

FEATURES, HIDDEN, CLASSES, ROWS_PER_WORKER = 256, 1024, 10, 512
LEARNING_RATE = 0.5


def make_data(world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole data set, identical in every process (fixed seed); worker r uses shard r."""
    rng = np.random.default_rng(1234)
    n = world_size * ROWS_PER_WORKER
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1)
    return x, y


def init_params() -> np.ndarray:
    rng = np.random.default_rng(99)
    w1 = rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) / np.sqrt(FEATURES)
    w2 = rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) / np.sqrt(HIDDEN)
    return np.concatenate([w1.ravel(), w2.ravel()])


def loss_and_grad(params: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over the rows of x, and its gradient (flat, float32)."""
    w1 = params[: FEATURES * HIDDEN].reshape(FEATURES, HIDDEN)
    w2 = params[FEATURES * HIDDEN :].reshape(HIDDEN, CLASSES)
    h = np.tanh(x @ w1)
    logits = h @ w2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d_logits = p
    d_logits[np.arange(n), y] -= 1
    d_logits /= n
    g2 = h.T @ d_logits
    g1 = x.T @ ((d_logits @ w2.T) * (1 - h * h))
    return loss, np.concatenate([g1.ravel(), g2.ravel()]).astype(np.float32)


def train_worker(*, rank: int, world_size: int, reducers: list[str], job: str, steps: int,
                 wire_dtype: str | None = None) -> dict:
    """Train on shard ``rank``; returns the final weights and figures for the summary."""
    import redsrv

    x, y = make_data(world_size)
    shard = slice(rank * ROWS_PER_WORKER, (rank + 1) * ROWS_PER_WORKER)
    params = init_params()
    with redsrv.Client(reducers, rank=rank, world_size=world_size, job=job, wire_dtype=wire_dtype) as client:
        # Identical start everywhere, as with a real model: broadcast rank 0's initial weights.
        params = client.broadcast(params, root=0)
        losses = []
        start = time.perf_counter()
        for _ in range(steps):
            loss, grad = loss_and_grad(params, x[shard], y[shard])
            grad = client.allreduce(grad, op="mean")
            params -= LEARNING_RATE * grad
            losses.append(client.allreduce(np.array([loss], np.float32), op="mean")[0])
        seconds = time.perf_counter() - start
        pushed, pulled = client.bytes_pushed, client.bytes_pulled
    return {"weights": params, "seconds": seconds, "steps": steps, "bytes_pushed": pushed, "bytes_pulled": pulled,
            "first_loss": losses[0] if losses else float("nan"), "last_loss": losses[-1] if losses else float("nan")}


def train_reference(*, world_size: int, steps: int) -> np.ndarray:
    """The same training in one process on all the data."""
    x, y = make_data(world_size)
    params = init_params()
    for _ in range(steps):
        # The mean of per-shard mean gradients equals the full-batch gradient for equal shards;
        # computing it per shard keeps the float32 rounding close to the distributed run.
        grads = [loss_and_grad(params, x[r * ROWS_PER_WORKER : (r + 1) * ROWS_PER_WORKER],
                               y[r * ROWS_PER_WORKER : (r + 1) * ROWS_PER_WORKER])[1] for r in range(world_size)]
        total = grads[0].copy()
        for g in grads[1:]:
            total += g
        params -= LEARNING_RATE * (total / np.float32(world_size))
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--job", default="numpy-sgd")
    args = parser.parse_args()
    from redsrv.core.config import Config

    reducers = list(Config.from_env(rank=args.rank, world_size=args.world_size).reducers)
    out = train_worker(rank=args.rank, world_size=args.world_size, reducers=reducers, job=args.job, steps=args.steps)
    print(f"rank {args.rank}: loss {out['first_loss']:.4f} -> {out['last_loss']:.4f} in {out['seconds']:.2f}s")


if __name__ == "__main__":
    main()
