"""One rank of the differential tests: the same DDP training through gloo and through redsrv.

    python ddp_worker.py SPEC_JSON OUT_PREFIX

SPEC: {"rank", "world_size", "reducers", "job", "store" (FileStore path for gloo),
       "configs": [names from CONFIGS or "collectives"], "steps"}

Gloo is the default process group (the oracle); a second group uses the ``redsrv`` backend.
For each configuration both runs start from the same seeded model and see the same batches; the
final parameters of both go to OUT_PREFIX.npz as "<config>/<gloo|redsrv>/<index>" (16-bit
floats widened to float32, which is exact). Collectives write "collectives/<name>/<gloo|redsrv>"
as raw bytes. OUT_PREFIX.json lists each configuration's error (traceback) or None, written after
every configuration so a hang still leaves the finished ones.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

# DDP imports torch._dynamo on first use (~7 s of CPU here); do it before any redsrv client
# exists, so that no connection sits idle through it on a loaded machine.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import redsrv.torch


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype | None = torch.float32  # None: the mixed fp32/fp64/bf16 model
    ddp: dict = field(default_factory=dict)
    hook: str = "redsrv"  # "redsrv", "fp16", "bf16", or "none" (DDP over the redsrv group)
    no_sync: bool = False
    unused: bool = False
    batchnorm: bool = False  # buffers DDP broadcasts from rank 0 before every forward


# Small buckets: several per step, rebuilt after the first step (after the second with
# static_graph), so keys and lengths change between steps as in a real job.
SMALL = {"bucket_cap_mb": 0.002}

CONFIGS = {
    "fp32": Case(ddp=SMALL),
    "grad_as_bucket_view": Case(ddp={**SMALL, "gradient_as_bucket_view": True}),
    "static_graph": Case(ddp={**SMALL, "static_graph": True}),
    "find_unused": Case(ddp={**SMALL, "find_unused_parameters": True}, unused=True),
    "no_sync": Case(ddp=SMALL, no_sync=True),
    "mixed_dtypes": Case(dtype=None, ddp=SMALL),
    "fp16_params": Case(dtype=torch.float16, ddp=SMALL),
    "bf16_params": Case(dtype=torch.bfloat16, ddp=SMALL),
    "fp64_params": Case(dtype=torch.float64, ddp=SMALL),
    "wire_fp16": Case(ddp=SMALL, hook="fp16"),
    "wire_bf16": Case(ddp=SMALL, hook="bf16"),
    "backend_ddp": Case(ddp=SMALL, hook="none"),
    "backend_ddp_unused": Case(ddp={**SMALL, "find_unused_parameters": True}, hook="none", unused=True),
    "backend_ddp_buffers": Case(ddp=SMALL, hook="none", batchnorm=True),
}


class MLP(nn.Module):
    def __init__(self, unused: bool, batchnorm: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        # Used on even steps only: DDP must find it unused on odd ones.
        self.extra = nn.Linear(32, 4) if unused else None
        self.norm = nn.BatchNorm1d(32) if batchnorm else nn.Identity()

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.norm(self.l1(x)))))
        out = self.l3(h)
        if self.extra is not None and step % 2 == 0:
            out = out + self.extra(h)
        return out


class Mixed(nn.Module):
    """One layer per dtype: DDP puts each dtype in buckets of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32).double()
        self.c = nn.Linear(32, 4).bfloat16()

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.double())).float()
        return self.c(h.bfloat16()).float()


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    if case.dtype is None:
        return Mixed()
    return MLP(case.unused, case.batchnorm).to(case.dtype)


def batch(case_index: int, rank: int, step: int, micro: int, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(((case_index * 1000 + step) * 10 + micro) * 100 + rank)
    x = torch.randn(8, 16, generator=g)
    target = torch.randn(8, 4, generator=g)
    return (x if dtype is None else x.to(dtype)), target


def train(model: nn.Module, ddp: DDP, case: Case, case_index: int, rank: int, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        micro_batches = 2 if case.no_sync else 1
        for micro in range(micro_batches):
            x, target = batch(case_index, rank, step, micro, case.dtype)
            if micro < micro_batches - 1:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x, step).float(), target).backward()
            else:
                nn.functional.mse_loss(ddp(x, step).float(), target).backward()
        optimizer.step()


def params(model: nn.Module) -> list[np.ndarray]:
    """Parameters, then buffers (BatchNorm statistics), as NumPy arrays."""
    out = []
    for p in [*model.parameters(), *model.buffers()]:
        t = p.detach()
        out.append((t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).numpy().copy())
    return out


def bf16_reference_hook(state, bucket):  # type: ignore[no-untyped-def]
    # torch's own bf16 hook under another name: DDP refuses the name "bf16_compress_hook"
    # without NCCL, but gloo reduces bfloat16 on CPU.
    return default_hooks.bf16_compress_hook(state, bucket)


def run_case(name: str, case_index: int, spec: dict, client: redsrv.Client, group: dist.ProcessGroup,
             out: dict[str, np.ndarray], report: dict) -> None:
    case = CONFIGS[name]
    rank, steps = spec["rank"], spec["steps"]

    reference = build(case)
    ddp = DDP(reference, **case.ddp)
    if case.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif case.hook == "bf16":
        ddp.register_comm_hook(None, bf16_reference_hook)
    train(reference, ddp, case, case_index, rank, steps)

    model = build(case)
    if case.hook == "none":
        ddp = DDP(model, process_group=group, **case.ddp)
    else:
        ddp = DDP(model, **case.ddp)
        state = redsrv.torch.HookState(client=client, key_prefix=name)
        hook = {"redsrv": redsrv.torch.redsrv_hook,
                "fp16": redsrv.torch.fp16_compress_wrapper(redsrv.torch.redsrv_hook),
                "bf16": redsrv.torch.bf16_compress_wrapper(redsrv.torch.redsrv_hook)}[case.hook]
        ddp.register_comm_hook(state, hook)
    train(model, ddp, case, case_index, rank, steps)
    if case.hook != "none":
        # One synchronised step per training step, micro-batches under no_sync() not counted.
        assert state.step == steps, f"hook counted {state.step} steps, expected {steps}"

    report["parameters"][name] = len(list(model.parameters()))
    report["dtypes"][name] = [str(p.dtype).removeprefix("torch.") for p in [*model.parameters(), *model.buffers()]]
    for i, (a, b) in enumerate(zip(params(reference), params(model), strict=True)):
        out[f"{name}/gloo/{i}"] = a
        out[f"{name}/redsrv/{i}"] = b


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()


def run_collectives(spec: dict, group: dist.ProcessGroup, out: dict[str, np.ndarray]) -> None:
    rank, n = spec["rank"], spec["world_size"]
    g = torch.Generator().manual_seed(7 + rank)

    def both(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        # fn(group, tensor-factory) -> tensor; run once through gloo (default group), once through redsrv.
        for label, pg in (("gloo", None), ("redsrv", group)):
            out[f"collectives/{name}/{label}"] = _raw(fn(pg))

    base32 = torch.randn(5, 7, generator=g)
    base64 = torch.randint(-2**40, 2**40, (9,), generator=g)
    base_i32 = torch.randint(-1000, 1000, (11,), generator=g, dtype=torch.int32)

    def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM):  # type: ignore[no-untyped-def]
        def fn(pg):  # type: ignore[no-untyped-def]
            x = t.clone()
            dist.all_reduce(x, op=op, group=pg)
            return x
        return fn

    both("all_reduce_sum_fp32", all_reduce(base32))
    out["collectives/all_reduce_sum_fp32/input"] = base32.numpy().copy()  # for the rank-order oracle
    both("all_reduce_sum_int64", all_reduce(base64))
    both("all_reduce_sum_int32", all_reduce(base_i32))
    both("all_reduce_sum_fp64", all_reduce(base32.double()))
    both("all_reduce_sum_bf16", all_reduce(base32.bfloat16()))
    both("all_reduce_sum_fp16", all_reduce(base32.half()))

    def avg(pg):  # type: ignore[no-untyped-def]
        x = base32.clone()
        if pg is None:  # gloo has no AVG
            dist.all_reduce(x)
            return x / n
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=pg)
        return x

    both("all_reduce_avg_fp32", avg)

    def strided(pg):  # type: ignore[no-untyped-def]
        x = base32.clone()
        if pg is None:
            y = x.t().contiguous()
            dist.all_reduce(y)
            return y
        view = x.t()  # not contiguous: written back through the view
        dist.all_reduce(view, group=pg)
        return view.contiguous()

    both("all_reduce_noncontiguous", strided)

    def coalesced_async(pg):  # type: ignore[no-untyped-def]
        xs = [base32.clone(), base32.t().contiguous() * 3]
        works = [dist.all_reduce(x, group=pg, async_op=True) for x in xs]
        works[0].wait()
        works[1].get_future().wait()
        return torch.cat([xs[0].view(-1).view(torch.uint8), xs[1].view(-1).view(torch.uint8)])

    both("all_reduce_async", coalesced_async)

    def broadcast(t: torch.Tensor, root: int):  # type: ignore[no-untyped-def]
        def fn(pg):  # type: ignore[no-untyped-def]
            x = t.clone()
            dist.broadcast(x, src=root, group=pg)
            return x
        return fn

    root = n - 1
    both("broadcast_fp32", broadcast(base32, root))
    both("broadcast_bf16", broadcast(base32.bfloat16(), root))
    both("broadcast_bool", broadcast(base32 > 0, root))
    both("broadcast_int8_odd", broadcast(torch.arange(rank, rank + 7, dtype=torch.int8), root))
    both("broadcast_int64", broadcast(base64, 0))

    special = torch.tensor([-0.0, float("nan"), float("inf"), rank + 0.5], dtype=torch.float32)

    def all_gather(t: torch.Tensor):  # type: ignore[no-untyped-def]
        def fn(pg):  # type: ignore[no-untyped-def]
            outs = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(outs, t, group=pg)
            return torch.stack(outs)
        return fn

    both("all_gather_fp32_special", all_gather(special))
    both("all_gather_int64", all_gather(base64))
    both("all_gather_bool_odd", all_gather(torch.tensor([True, False, rank % 2 == 0])))
    both("all_gather_bf16", all_gather(base32.bfloat16()))

    # all_gather_into_tensor is deprecated for all_gather_single in torch 2.13.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def into_tensor(pg):  # type: ignore[no-untyped-def]
        out_t = torch.empty(n * 35)
        gather_single(out_t, base32.view(-1), group=pg)
        return out_t

    both("all_gather_into_tensor", into_tensor)

    def barrier(pg):  # type: ignore[no-untyped-def]
        dist.barrier(group=pg)
        return torch.zeros(1)

    both("barrier", barrier)


def main() -> int:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    torch.set_num_threads(1)
    report: dict = {"rank": spec["rank"], "errors": {}, "seconds": {}, "dtypes": {}, "parameters": {}}
    out: dict[str, np.ndarray] = {}

    def save() -> None:
        np.savez(prefix + ".npz", **out)
        with open(prefix + ".json", "w") as f:
            json.dump(report, f)

    dist.init_process_group("gloo", init_method="file://" + spec["store"], rank=spec["rank"],
                            world_size=spec["world_size"])
    redsrv.torch.register_backend(spec["reducers"], job=spec["job"])
    group = dist.new_group(backend="redsrv")
    client = redsrv.Client(spec["reducers"], rank=spec["rank"], world_size=spec["world_size"], job=spec["job"] + ".hook")
    try:
        for index, name in enumerate(spec["configs"]):
            started = time.perf_counter()
            try:
                if name == "collectives":
                    run_collectives(spec, group, out)
                else:
                    run_case(name, index, spec, client, group, out, report)
                report["errors"][name] = None
            except Exception:
                report["errors"][name] = traceback.format_exc()
            report["seconds"][name] = time.perf_counter() - started
            save()
    finally:
        client.close()
        dist.destroy_process_group()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
