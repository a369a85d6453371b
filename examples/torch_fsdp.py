"""FSDP2 (``fully_shard``) training of a small PyTorch MLP over the ``redsrv`` c10d backend.

Every rank holds a shard of each layer's parameters; FSDP2 gathers a layer's parameters before
using it (all-gather) and hands each rank its shard of the averaged gradients (reduce-scatter).
With the redsrv backend those two travel over the group's peer links (direct links between the
workers, a gloo group built from the same store, as under gloo), while every reduction the
script makes itself (the loss averaged for the log) goes through the reducers. So the workers
must reach the reducers *and* each other; docs/torch_backend.md explains the split.

Run it with torchrun against a local fleet::

    redsrv reducer --port 29600 &
    redsrv reducer --port 29601 &
    REDSRV_REDUCERS=127.0.0.1:29600,127.0.0.1:29601 REDSRV_JOB=fsdp-$(date +%s) \\
        torchrun --standalone --nproc-per-node 2 -m redsrv.examples.torch_fsdp --steps 20

``--checkpoint DIR`` resumes from a distributed checkpoint in DIR if there is one and saves
one there at the end (``torch.distributed.checkpoint``: every rank writes its own shards), so
running the command twice trains 2 x ``--steps`` steps; at the end rank 0 gathers the full
weights (``full_tensor()``, as for exporting the model) and prints their sum.

``--backend gloo`` runs the same training over gloo: the per-step losses print identically
(FSDP2's collectives move the same bytes either way, and the logged loss is a mean of two or
three numbers, exact in either order at these sizes only up to float32 rounding).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import redsrv.torch

FEATURES, HIDDEN, CLASSES, ROWS_PER_WORKER = 32, 64, 4, 64


def make_model() -> nn.Module:
    torch.manual_seed(99)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, CLASSES))


def shard(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of a synthetic set that is identical in every process (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(world_size * ROWS_PER_WORKER, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    rows = slice(rank * ROWS_PER_WORKER, (rank + 1) * ROWS_PER_WORKER)
    return x[rows], y[rows]


def train(steps: int, backend: str, checkpoint: str | None = None) -> list[float]:
    """Train for ``steps`` steps; returns the loss averaged over the ranks at each step."""
    torch.set_num_threads(1)
    if backend == "redsrv":
        redsrv.torch.register_backend()  # REDSRV_REDUCERS, REDSRV_JOB; rank and size from torchrun
    dist.init_process_group(backend)  # torchrun's MASTER_ADDR/MASTER_PORT: the store the peer links meet at
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model = make_model()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)  # one all-gather and one reduce-scatter per layer
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if checkpoint is not None and os.path.exists(os.path.join(checkpoint, ".metadata")):
            state = _state(model, optimizer)
            dcp.load(state, checkpoint_id=checkpoint)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        x, y = shard(rank, world_size)
        losses = []
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # SUM: gloo has no AVG
            losses.append(float(logged) / world_size)
        if checkpoint is not None:
            dcp.save(_state(model, optimizer), checkpoint_id=checkpoint)
        full = [p.full_tensor() for p in model.parameters()]  # every rank takes part in the gathers
        if rank == 0:
            print(f"{backend}: weights sum {float(sum(p.double().sum() for p in full)):.9f}", flush=True)
        return losses
    finally:
        dist.destroy_process_group()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, object]]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", choices=["redsrv", "gloo"], default="redsrv")
    parser.add_argument("--checkpoint", help="resume from and save to this distributed checkpoint folder")
    args = parser.parse_args()
    losses = train(args.steps, args.backend, args.checkpoint)
    if os.environ.get("RANK", "0") == "0":
        print(f"{args.backend}: loss " + " ".join(f"{loss:.6f}" for loss in losses), flush=True)


if __name__ == "__main__":
    main()
