"""Data-parallel training of a small PyTorch MLP with DDP, gradients averaged by redsrv reducers.

Each worker holds an equal shard of a synthetic classification set (generated from a fixed
seed; nothing is downloaded) and runs full-batch SGD on it through
``DistributedDataParallel`` with the redsrv communication hook, so the result equals one
process training on all the data.

DDP needs a process group besides the hook, for its own control traffic (the initial parameter
broadcast, parameter-shape checks, buffers). By default this script uses the ``redsrv`` c10d
backend for that as well: the reducers are then the only thing the workers talk to, and no
worker-to-worker port or shared file is needed. ``--backend gloo`` keeps a gloo group for the
control traffic instead (torchrun's rendezvous provides its address).

Run it with torchrun against a local fleet::

    redsrv reducer --port 29600 &
    redsrv reducer --port 29601 &
    REDSRV_REDUCERS=127.0.0.1:29600,127.0.0.1:29601 REDSRV_JOB=ddp-$(date +%s) \\
        torchrun --standalone --nproc-per-node 2 -m redsrv.examples.torch_ddp --steps 100

or across machines (reducers on other hosts, started with ``--host 0.0.0.0 --secret-file
FILE``; give the workers ``REDSRV_SECRET_FILE=FILE``), on every worker host::

    REDSRV_REDUCERS=10.0.0.5:29600,10.0.0.6:29600 REDSRV_JOB=run-17 \\
        torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 -m redsrv.examples.torch_ddp

``redsrv demo`` runs it through :func:`train_worker` and checks the result against
:func:`train_reference`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import redsrv.torch

FEATURES, HIDDEN, CLASSES, ROWS_PER_WORKER = 64, 256, 10, 256
LEARNING_RATE = 0.5


def make_data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set, identical in every process (fixed seed); worker r uses shard r."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(world_size * ROWS_PER_WORKER, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def make_model() -> nn.Module:
    torch.manual_seed(99)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def flat_weights(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def _shard(world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_data(world_size)
    rows = slice(rank * ROWS_PER_WORKER, (rank + 1) * ROWS_PER_WORKER)
    return x[rows], y[rows]


def train_worker(*, rank: int, world_size: int, reducers: list[str] | None, job: str | None, steps: int,
                 wire_dtype: str | None = None, backend: str = "redsrv") -> dict[str, Any]:
    """Train on shard ``rank``; returns the final weights and figures for the summary.

    ``reducers``/``job`` given as ``None`` come from ``REDSRV_REDUCERS``/``REDSRV_JOB``. With
    ``backend="redsrv"`` the process group needs no rendezvous (each worker passes its own
    in-memory store); ``"gloo"`` rendezvouses through torchrun's ``MASTER_ADDR``/``MASTER_PORT``.
    """
    # Two cores per machine in CI; one thread also keeps each rank's arithmetic identical to the
    # single-process reference.
    torch.set_num_threads(1)
    if backend == "redsrv":
        # DDP needs only reductions and broadcasts: no peer links, so nothing to rendezvous and
        # every collective of this group goes through the reducers.
        redsrv.torch.register_backend(reducers, job=job, peer_links=False)
        dist.init_process_group("redsrv", store=dist.HashStore(), rank=rank, world_size=world_size)  # type: ignore[attr-defined]
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        x, y = _shard(world_size, rank)
        ddp = DDP(make_model())
        with redsrv.torch.HookState(reducers, rank=rank, world_size=world_size, job=job) as state:
            hook = redsrv.torch.redsrv_hook
            if wire_dtype == "bf16":
                hook = redsrv.torch.bf16_compress_wrapper(hook)
            elif wire_dtype == "fp16":
                hook = redsrv.torch.fp16_compress_wrapper(hook)
            ddp.register_comm_hook(state, hook)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
            losses = []
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG if backend == "redsrv" else dist.ReduceOp.SUM)
                losses.append(float(mean_loss) / (1 if backend == "redsrv" else world_size))
            seconds = time.perf_counter() - start
            pushed, pulled = state.client.bytes_pushed, state.client.bytes_pulled
        weights = flat_weights(ddp.module)
    finally:
        dist.destroy_process_group()
    return {"weights": weights, "seconds": seconds, "steps": steps, "bytes_pushed": pushed, "bytes_pulled": pulled,
            "first_loss": losses[0] if losses else float("nan"), "last_loss": losses[-1] if losses else float("nan")}


def train_reference(*, world_size: int, steps: int) -> np.ndarray:
    """The same training in one process on all the data.

    Gradients are computed per shard and averaged as the reducers do (summed in rank order in
    float32, then divided by the number of ranks), so with float32 on the wire the distributed
    run matches to the last bit or close to it.
    """
    torch.set_num_threads(1)
    model = make_model()
    shards = [_shard(world_size, r) for r in range(world_size)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for _ in range(steps):
        total = None
        for x, y in shards:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
            total = grads if total is None else [t.add_(g) for t, g in zip(total, grads, strict=True)]
        assert total is not None
        for p, t in zip(model.parameters(), total, strict=True):
            p.grad = t.div_(world_size)
        optimizer.step()
    return flat_weights(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--backend", choices=["redsrv", "gloo"], default="redsrv",
                        help="process group for DDP's control traffic (default: redsrv)")
    parser.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None,
                        help="compress gradients on the wire (reducers still sum in float32)")
    args = parser.parse_args()
    from redsrv.core.config import Config

    # REDSRV_REDUCERS, REDSRV_JOB and torchrun's RANK/WORLD_SIZE.
    config = Config.from_env()
    out = train_worker(rank=config.rank, world_size=config.world_size, reducers=list(config.reducers), job=config.job,
                       steps=args.steps, wire_dtype=args.wire_dtype, backend=args.backend)
    checksum = float(np.abs(out["weights"]).sum())
    print(f"rank {config.rank}/{config.world_size}: loss {out['first_loss']:.4f} -> {out['last_loss']:.4f} "
          f"in {out['seconds']:.2f}s ({args.steps} steps); weight checksum {checksum:.6f}", flush=True)


if __name__ == "__main__":
    main()
