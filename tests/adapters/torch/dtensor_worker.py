"""One rank of ``test_dtensor.py``: ``torch.distributed`` as FSDP2, DTensor, tensor-parallel and
``torch.compile`` users call it, with the default process group on one backend (``argv[1]``:
"gloo" or "redsrv"), writing every result to ``<prefix>.npz`` and what failed to
``<prefix>.json``. The test runs it once per backend and compares the files.

The default group is the backend under test and every mesh is the default one
(``init_device_mesh("cpu", ...)``), as a user's script has it: that is the path where the
functional collectives reach the backend from C++ (RedsrvProcessGroup's coalesced methods).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import redsrv.torch

STEPS = 8


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


def init(backend: str, store: str, rank: int, size: int) -> None:
    dist.init_process_group(backend, init_method="file://" + store, rank=rank, world_size=size)


def functional(rank: int, size: int, out: dict[str, np.ndarray]) -> None:
    """Every functional collective on the default group."""
    group = dist.group.WORLD
    x = torch.arange(6 * size, dtype=torch.float32) * (rank + 1) + 0.25
    out["funcol/all_reduce"] = funcol.all_reduce(x, "sum", group).numpy().copy()
    out["funcol/all_gather"] = funcol.all_gather_single(x, 0, group).numpy().copy()
    out["funcol/reduce_scatter"] = funcol.reduce_scatter_single(x, "sum", 0, group).numpy().copy()
    out["funcol/all_to_all"] = funcol.all_to_all_single(x, None, None, group).numpy().copy()
    out["funcol/broadcast"] = funcol.broadcast(x, 0, group).numpy().copy()


def redistribute(rank: int, size: int, out: dict[str, np.ndarray]) -> None:
    mesh = init_device_mesh("cpu", (size,))
    whole = torch.arange(4 * size * 3, dtype=torch.float32).reshape(4 * size, 3) + rank  # replicated: rank 0's wins
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    out["redistribute/shard_to_replicate"] = sharded.redistribute(mesh, [Replicate()]).to_local().numpy().copy()
    replicated = DTensor.from_local(torch.full((2 * size, 3), float(rank + 1)), mesh, [Replicate()], run_check=False)
    out["redistribute/replicate_to_shard"] = replicated.redistribute(mesh, [Shard(0)]).to_local().numpy().copy()
    partial = DTensor.from_local(torch.arange(size * 2, dtype=torch.float32) * (rank + 1), mesh,
                                 [torch.distributed.tensor.Partial()], run_check=False)
    out["redistribute/partial_to_replicate"] = partial.redistribute(mesh, [Replicate()]).to_local().numpy().copy()
    out["redistribute/partial_to_shard"] = partial.redistribute(mesh, [Shard(0)]).to_local().numpy().copy()


def tensor_parallel(rank: int, size: int, out: dict[str, np.ndarray]) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8 * size), nn.ReLU(), nn.Linear(8 * size, 4))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, target = data(0, step)  # tensor parallelism: every rank sees the same batch
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out["tp/losses"] = np.array(losses)
    out["tp/params"] = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach().numpy().copy()


def fsdp2(rank: int, size: int, out: dict[str, np.ndarray]) -> None:
    """FSDP2 with the default mesh, then the full weights for saving, as users export a model."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard_model(fully_shard)
    train(model, rank, 0, STEPS, out, "fsdp2")
    out["fsdp2/params"] = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach().numpy().copy()


def fully_shard_model(fully_shard: Callable[..., nn.Module]) -> nn.Module:
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def train(model: nn.Module, rank: int, first: int, steps: int, out: dict[str, np.ndarray], name: str,
          optimizer: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(first, first + steps):
        x, target = data(rank, step)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out[f"{name}/losses_{first}"] = np.array(losses)
    return optimizer


def compiled(rank: int, size: int, out: dict[str, np.ndarray]) -> None:
    """A function that calls functional collectives, compiled by inductor for the CPU."""
    group = dist.group.WORLD

    def step(x: torch.Tensor) -> torch.Tensor:
        total = funcol.all_reduce(x * 2.0, "sum", group)
        gathered = funcol.all_gather_single(total + 1.0, 0, group)
        return funcol.reduce_scatter_single(gathered.sin(), "sum", 0, group)

    fn = torch.compile(step, backend="inductor", fullgraph=True)
    x = torch.linspace(-1.0, 1.0, 4 * size) * (rank + 1)
    out["compile/result"] = fn(x).numpy().copy()
    out["compile/eager"] = step(x).numpy().copy()


def checkpoint(backend: str, spec: dict, out: dict[str, np.ndarray]) -> None:
    """FSDP2 trains, saves a distributed checkpoint, the process group is torn down and made
    again (as after a restart), a fresh model loads the checkpoint and training continues."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, size = spec["rank"], spec["world_size"]
    model = fully_shard_model(fully_shard)
    optimizer = train(model, rank, 0, STEPS // 2, out, "dcp")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=spec["checkpoint"])
    dist.destroy_process_group()

    init(backend, spec["store"] + ".2", rank, size)
    model = fully_shard_model(fully_shard)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=spec["checkpoint"])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, rank, STEPS // 2, STEPS // 2, out, "dcp", optimizer)
    out["dcp/params"] = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach().numpy().copy()


CASES: dict[str, Callable[[int, int, dict[str, np.ndarray]], None]] = {
    "functional": functional, "redistribute": redistribute, "tensor_parallel": tensor_parallel, "fsdp2": fsdp2,
    "compiled": compiled}


def main() -> int:
    backend, spec_text, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.loads(spec_text)
    torch.set_num_threads(1)
    rank, size = spec["rank"], spec["world_size"]
    out: dict[str, np.ndarray] = {}
    errors: dict[str, str | None] = {}
    if backend == "redsrv":
        redsrv.torch.register_backend()
    init(backend, spec["store"], rank, size)
    try:
        for name in spec["cases"]:
            try:
                if name == "checkpoint":
                    checkpoint(backend, spec, out)  # last: it makes the group again
                else:
                    CASES[name](rank, size, out)
                errors[name] = None
            except Exception:
                errors[name] = traceback.format_exc()
    finally:
        np.savez(prefix + ".npz", **out)
        with open(prefix + ".json", "w") as f:
            json.dump({"errors": errors, "backend": backend}, f)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    sys.exit(main())
