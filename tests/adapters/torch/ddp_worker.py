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
from datetime import timedelta

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
    # DDP over the redsrv group with gradient accumulation, alone and with torch's own
    # allreduce hook (which chains on the group's Work.get_future()).
    "backend_ddp_no_sync": Case(ddp=SMALL, hook="none", no_sync=True),
    "backend_ddp_no_sync_grad_view": Case(ddp={**SMALL, "gradient_as_bucket_view": True}, hook="none", no_sync=True),
    "backend_ddp_allreduce_hook": Case(ddp=SMALL, hook="torch_allreduce", no_sync=True),
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
    elif case.hook == "torch_allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif case.hook == "bf16":
        ddp.register_comm_hook(None, bf16_reference_hook)
    train(reference, ddp, case, case_index, rank, steps)

    model = build(case)
    if case.hook in ("none", "torch_allreduce"):
        ddp = DDP(model, process_group=group, **case.ddp)
        if case.hook == "torch_allreduce":
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    else:
        ddp = DDP(model, **case.ddp)
        state = redsrv.torch.HookState(client=client, key_prefix=name)
        hook = {"redsrv": redsrv.torch.redsrv_hook,
                "fp16": redsrv.torch.fp16_compress_wrapper(redsrv.torch.redsrv_hook),
                "bf16": redsrv.torch.bf16_compress_wrapper(redsrv.torch.redsrv_hook)}[case.hook]
        ddp.register_comm_hook(state, hook)
    train(model, ddp, case, case_index, rank, steps)
    if case.hook not in ("none", "torch_allreduce"):
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

    # Under TORCH_DISTRIBUTED_DEBUG=DETAIL (test_backend_ops.py) the redsrv groups check their
    # collectives across ranks; the gloo oracle is made first at level OFF, since DETAIL's wrapper
    # would check its sequence numbers, which the mismatch cases of run_ops put out of step.
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    dist.set_debug_level(dist.DebugLevel.OFF)
    dist.init_process_group("gloo", init_method="file://" + spec["store"], rank=spec["rank"],
                            world_size=spec["world_size"])
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    redsrv.torch.register_backend(spec["reducers"], job=spec["job"])
    group = dist.new_group(backend="redsrv")
    client = redsrv.Client(spec["reducers"], rank=spec["rank"], world_size=spec["world_size"], job=spec["job"] + ".hook")
    report["hook_client"] = type(client).__name__  # HostClient where the launcher put several workers on a host
    try:
        for index, name in enumerate(spec["configs"]):
            started = time.perf_counter()
            try:
                if name == "collectives":
                    run_collectives(spec, group, out)
                elif name == "ops":
                    run_ops(spec, group, out, report)
                elif name in FSDP:
                    run_fsdp(name, spec, group, out, report)
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



# --- every c10d operation, gloo against redsrv --------------------------------------------

#: The ops run_ops checks; each writes "ops/<name>/<gloo|redsrv>" (raw bytes).
OPS = ["all_reduce_max_fp32", "all_reduce_min_fp64", "all_reduce_product_fp32", "all_reduce_product_int64",
       "all_reduce_max_int8", "all_reduce_min_uint8", "all_reduce_band_int64",
       "all_reduce_bor_int32", "all_reduce_bxor_uint8", "all_reduce_sum_complex64", "all_reduce_sparse",
       "all_reduce_coalesced_max", "all_reduce_coalesced_min", "all_reduce_coalesced_product",
       "all_reduce_coalesced_sum", "reduce_sum", "reduce_max", "reduce_product_int", "send_recv_tags",
       "isend_irecv_ring", "recv_any_source", "batch_isend_irecv", "scatter", "gather", "all_gather_coalesced",
       "all_gather_into_tensor_bf16", "reduce_scatter", "reduce_scatter_tensor_max", "all_to_all",
       "relay_all_gather_into_tensor_bf16", "relay_all_gather_coalesced", "relay_reduce_scatter",
       "relay_reduce_scatter_tensor_max", "relay_all_gather_bool", "all_to_all_single_splits", "monitored_barrier",
       "monitored_barrier_names_late_rank", "broadcast_object_list", "all_gather_object", "gather_object",
       "scatter_object_list", "get_future", "subgroup_ops", "new_subgroups", "ddp_refuses_no_grad_model"]


def run_ops(spec: dict, group: dist.ProcessGroup, out: dict[str, np.ndarray], report: dict) -> None:  # noqa: C901 - one case per op
    """Every operation of the c10d API that gloo implements on CPU, through gloo (the default
    group) and through the redsrv group, on the same inputs."""
    import pickle

    rank, n = spec["rank"], spec["world_size"]
    g = torch.Generator().manual_seed(11 + rank)
    x32 = torch.randn(6, 5, generator=g)
    i64 = torch.randint(-50, 50, (13,), generator=g)
    small = torch.randint(1, 4, (9,), generator=g)

    report["op_errors"] = {}

    def both(name: str, fn, ours: dist.ProcessGroup = group) -> None:  # type: ignore[no-untyped-def]
        # One op's failure is recorded and the others still run (a failed collective may leave
        # the rest of the list out of step; the first error is the one to read).
        for label, pg in (("gloo", None), ("redsrv", ours)):
            try:
                out[f"ops/{name}/{label}"] = _raw(fn(pg))
            except Exception:
                report["op_errors"][f"{name}/{label}"] = traceback.format_exc()

    def all_reduce(t: torch.Tensor, op):  # type: ignore[no-untyped-def]
        def fn(pg):  # type: ignore[no-untyped-def]
            x = t.clone()
            dist.all_reduce(x, op=op, group=pg)
            return x
        return fn

    R = dist.ReduceOp
    both("all_reduce_max_fp32", all_reduce(x32, R.MAX))
    both("all_reduce_min_fp64", all_reduce(x32.double(), R.MIN))
    both("all_reduce_product_fp32", all_reduce(x32, R.PRODUCT))
    both("all_reduce_product_int64", all_reduce(small, R.PRODUCT))
    both("all_reduce_max_int8", all_reduce(i64.to(torch.int8), R.MAX))
    both("all_reduce_min_uint8", all_reduce((i64 + 60).to(torch.uint8), R.MIN))
    both("all_reduce_band_int64", all_reduce(i64, R.BAND))
    both("all_reduce_bor_int32", all_reduce(i64.to(torch.int32), R.BOR))
    both("all_reduce_bxor_uint8", all_reduce((i64 + 60).to(torch.uint8), R.BXOR))
    both("all_reduce_sum_complex64", all_reduce(torch.complex(x32, x32 * 2), R.SUM))

    def sparse(pg):  # type: ignore[no-untyped-def]
        x = torch.sparse_coo_tensor(torch.tensor([[rank, n]]), torch.tensor([1.0 + rank, 2.0]), (n + 1,))
        dist.all_reduce(x, group=pg)
        return x.to_dense()

    both("all_reduce_sparse", sparse)

    def coalesced(op):  # type: ignore[no-untyped-def]
        def fn(pg):  # type: ignore[no-untyped-def]
            xs = [x32.clone(), x32[0].clone() * 2]
            dist.all_reduce_coalesced(xs, op=op, group=pg)
            return torch.cat([xs[0].view(-1), xs[1]])
        return fn

    both("all_reduce_coalesced_max", coalesced(R.MAX))
    both("all_reduce_coalesced_min", coalesced(R.MIN))
    both("all_reduce_coalesced_product", coalesced(R.PRODUCT))
    both("all_reduce_coalesced_sum", coalesced(R.SUM))

    def reduce(t: torch.Tensor, op, root: int):  # type: ignore[no-untyped-def]
        def fn(pg):  # type: ignore[no-untyped-def]
            x = t.clone()
            dist.reduce(x, dst=root, op=op, group=pg)
            return x if rank == root else torch.zeros(0)  # elsewhere torch leaves it unspecified
        return fn

    both("reduce_sum", reduce(x32, R.SUM, n - 1))
    both("reduce_max", reduce(x32, R.MAX, 0))
    both("reduce_product_int", reduce(small, R.PRODUCT, 1))

    def send_recv(pg):  # type: ignore[no-untyped-def]
        # Two messages with different tags on one link, received in the other order.
        got = [torch.zeros(4), torch.zeros(4)]
        if rank == 0:
            # A send completes when it is received: both in flight, or this would deadlock.
            works = [dist.isend(torch.full((4,), 1.0), dst=1, tag=7, group=pg),
                     dist.isend(torch.full((4,), 2.0), dst=1, tag=9, group=pg)]
            for work in works:
                work.wait()
        elif rank == 1:
            dist.recv(got[1], src=0, tag=9, group=pg)
            dist.recv(got[0], src=0, tag=7, group=pg)
        return torch.cat(got)

    both("send_recv_tags", send_recv)

    def ring(pg):  # type: ignore[no-untyped-def]
        got = torch.zeros(5, dtype=torch.float64)
        works = [dist.isend(x32[0].double() + rank, dst=(rank + 1) % n, group=pg),
                 dist.irecv(got, src=(rank - 1) % n, group=pg)]
        for work in works:
            work.wait()
        return got

    both("isend_irecv_ring", ring)

    def any_source(pg):  # type: ignore[no-untyped-def]
        if rank != 0:
            dist.send(torch.full((2,), float(rank)), dst=0, tag=3, group=pg)
            return torch.zeros(0)
        received = {}
        for _ in range(n - 1):
            t = torch.zeros(2)
            sender = dist.recv(t, tag=3, group=pg)
            received[sender] = t
        assert sorted(received) == list(range(1, n)), sorted(received)
        return torch.cat([received[s] for s in sorted(received)])

    both("recv_any_source", any_source)

    def batch_p2p(pg):  # type: ignore[no-untyped-def]
        got = torch.zeros(3, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, i64[:3] + rank, (rank + 1) % n, group=pg, tag=4),
               dist.P2POp(dist.irecv, got, (rank - 1) % n, group=pg, tag=4)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got

    both("batch_isend_irecv", batch_p2p)

    def scatter(pg):  # type: ignore[no-untyped-def]
        x = torch.zeros(3)
        parts = [torch.full((3,), 10.0 * r) + x32[0, :3] for r in range(n)] if rank == 0 else None
        dist.scatter(x, parts, src=0, group=pg)
        return x

    both("scatter", scatter)

    def gather(pg):  # type: ignore[no-untyped-def]
        outs = [torch.zeros(5) for _ in range(n)] if rank == n - 1 else None
        dist.gather(x32[1], outs, dst=n - 1, group=pg)
        return torch.stack(outs) if outs else torch.zeros(0)

    both("gather", gather)

    def gather_coalesced(pg):  # type: ignore[no-untyped-def]
        ins = [x32[2].clone(), x32[3, :4].clone()]
        outs = [[torch.zeros(5), torch.zeros(4)] for _ in range(n)]
        dist.all_gather_coalesced(outs, ins, group=pg)
        return torch.cat([t.view(torch.uint8) for pair in outs for t in pair])

    both("all_gather_coalesced", gather_coalesced)

    def into_tensor(pg):  # type: ignore[no-untyped-def]
        result = torch.zeros(n * 30, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(result, x32.view(-1).bfloat16(), group=pg)
        return result

    both("all_gather_into_tensor_bf16", into_tensor)

    def reduce_scatter(pg):  # type: ignore[no-untyped-def]
        result = torch.zeros(4)
        dist.reduce_scatter(result, [x32[0, :4] * (r + 1) for r in range(n)], group=pg)
        return result

    both("reduce_scatter", reduce_scatter)

    def reduce_scatter_tensor(pg):  # type: ignore[no-untyped-def]
        result = torch.zeros(2, 5)
        dist.reduce_scatter_tensor(result, x32[: 2 * n].clone() if n <= 3 else None, op=R.MAX, group=pg)
        return result

    both("reduce_scatter_tensor_max", reduce_scatter_tensor)

    def all_to_all(pg):  # type: ignore[no-untyped-def]
        outs = [torch.zeros(3) for _ in range(n)]  # gloo wants every part the same size
        dist.all_to_all(outs, [torch.full((3,), 10.0 * rank + r) for r in range(n)], group=pg)
        return torch.cat(outs)

    both("all_to_all", all_to_all)

    # A group without peer links: all-gather and reduce-scatter go through the reducers.
    redsrv.torch.register_backend(spec["reducers"], job=spec["job"], peer_links=False)
    relayed = dist.new_group(backend="redsrv")
    redsrv.torch.register_backend(spec["reducers"], job=spec["job"])
    both("relay_all_gather_into_tensor_bf16", into_tensor, relayed)
    both("relay_all_gather_coalesced", gather_coalesced, relayed)
    both("relay_reduce_scatter", reduce_scatter, relayed)
    both("relay_reduce_scatter_tensor_max", reduce_scatter_tensor, relayed)

    def all_gather_bool(pg):  # type: ignore[no-untyped-def]
        outs = [torch.zeros(3, dtype=torch.bool) for _ in range(n)]
        dist.all_gather(outs, torch.tensor([True, rank % 2 == 0, False]), group=pg)
        return torch.stack(outs)

    both("relay_all_gather_bool", all_gather_bool, relayed)
    dist.destroy_process_group(relayed)

    def all_to_all_single(pg):  # type: ignore[no-untyped-def]
        # Rank r sends j + 1 rows to rank j, so it receives r + 1 rows from each.
        send = torch.arange(sum(j + 1 for j in range(n)) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
        result = torch.zeros(n * (rank + 1), 2)
        dist.all_to_all_single(result, send, output_split_sizes=[rank + 1] * n,
                               input_split_sizes=[j + 1 for j in range(n)], group=pg)
        return result

    both("all_to_all_single_splits", all_to_all_single)

    def monitored(pg):  # type: ignore[no-untyped-def]
        # dist.monitored_barrier refuses every backend but gloo by name; redsrv groups have the method.
        if pg is None:
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        else:
            pg.monitored_barrier(timedelta(seconds=30), True)
        return torch.ones(1)

    both("monitored_barrier", monitored)

    def late_rank(pg):  # type: ignore[no-untyped-def]
        # Rank 1 never arrives: rank 0's barrier fails naming it (on a group of its own, since
        # the missing rank leaves that group's links out of step).
        backend = "gloo" if pg is None else "redsrv"
        sub = dist.new_group(backend=backend)
        message = ""
        if rank == 0:
            try:
                if pg is None:
                    dist.monitored_barrier(group=sub, timeout=timedelta(seconds=1))
                else:
                    sub.monitored_barrier(timedelta(seconds=1), False)
            except RuntimeError as exc:  # gloo's error; redsrv's PeerTimeoutError is a TimeoutError
                message = f"RuntimeError {exc}"
            except TimeoutError as exc:
                message = f"TimeoutError {exc}"
            assert "Rank 1 failed to pass monitoredBarrier" in message, message
        dist.barrier()
        dist.destroy_process_group(sub)
        return torch.ones(1)

    both("monitored_barrier_names_late_rank", late_rank)

    def as_bytes(obj: object) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    def bcast_objects(pg):  # type: ignore[no-untyped-def]
        objects = [{"rank": rank, "data": [1, 2]}, "x" * rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(objects, src=1, group=pg)
        return as_bytes(objects)

    both("broadcast_object_list", bcast_objects)

    def gather_objects(pg):  # type: ignore[no-untyped-def]
        objects = [None] * n
        dist.all_gather_object(objects, {"rank": rank, "pad": "y" * (rank * 3)}, group=pg)
        return as_bytes(objects)

    both("all_gather_object", gather_objects)

    def gather_object(pg):  # type: ignore[no-untyped-def]
        objects = [None] * n if rank == 0 else None
        dist.gather_object(("from", rank), objects, dst=0, group=pg)
        return as_bytes(objects)

    both("gather_object", gather_object)

    def scatter_objects(pg):  # type: ignore[no-untyped-def]
        received = [None]
        dist.scatter_object_list(received, [{"to": r} for r in range(n)] if rank == 0 else None, src=0, group=pg)
        return as_bytes(received)

    both("scatter_object_list", scatter_objects)

    def future(pg):  # type: ignore[no-untyped-def]
        work = dist.all_reduce(x32.clone(), op=R.MAX, group=pg, async_op=True)
        value = work.get_future().then(lambda f: f.value()[0] * 2).wait()
        assert work.wait() and work.is_completed()
        return value

    both("get_future", future)

    def subgroup(pg):  # type: ignore[no-untyped-def]
        # A two-rank subgroup of the same backend: reduce ops, point-to-point, then destroyed.
        backend = "gloo" if pg is None else "redsrv"
        sub = dist.new_group([0, 1], backend=backend)
        if rank > 1:
            return torch.zeros(0)
        assert isinstance(sub.group_name, str) and sub.group_name
        x = x32[0].clone()
        dist.all_reduce(x, op=R.MIN, group=sub)
        got = torch.zeros(5)
        if rank == 0:
            dist.send(x32[1], dst=1, group=sub)
        else:
            dist.recv(got, src=0, group=sub)
        dist.destroy_process_group(sub)
        return torch.cat([x, got])

    both("subgroup_ops", subgroup)

    def subgroups(pg):  # type: ignore[no-untyped-def]
        backend = "gloo" if pg is None else "redsrv"
        mine, all_groups = dist.new_subgroups(group_size=1, backend=backend)
        x = x32[0].clone()
        dist.all_reduce(x, op=R.PRODUCT, group=mine)
        for sub in all_groups:
            dist.destroy_process_group(sub)
        return x

    both("new_subgroups", subgroups)

    def no_grad_model(pg):  # type: ignore[no-untyped-def]
        model = nn.Linear(2, 2)
        model.requires_grad_(False)
        try:
            DDP(model, process_group=pg)
        except RuntimeError as exc:
            assert "parameter that requires a gradient" in str(exc), exc
            return torch.ones(1)
        return torch.zeros(1)

    both("ddp_refuses_no_grad_model", no_grad_model)

    # A peer-link operation that cannot complete fails at the group's deadline with redsrv's
    # typed error (gloo's own words kept in the message), on a group of its own.
    short = dist.new_group(backend="redsrv", timeout=timedelta(seconds=1))
    if rank == 0:
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(1), src=1, group=short)  # rank 1 never sends
            report["peer_timeout"] = "no error"
        except Exception as exc:  # noqa: BLE001 - reported for the test to name
            report["peer_timeout"] = f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"
    dist.barrier()
    dist.destroy_process_group(short)

    # Contributions that disagree across ranks fail on every rank with the redsrv error.
    mismatch = torch.ones(3 + rank)
    try:
        dist.all_reduce(mismatch, op=R.MAX, group=group)
        report["mismatch"] = "no error"
    except redsrv.ContributionMismatchError as exc:
        report["mismatch"] = f"ContributionMismatchError: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported for the test to name
        report["mismatch"] = f"{type(exc).__name__}: {exc}"

    # Peer-link collectives whose ranks disagree fail on every rank with the redsrv error, before
    # gloo sees a byte (so the group stays usable): sizes that differ by rank, a dtype, an op.
    report["peer_mismatch"] = {}
    f32 = torch.float32
    wrong_dtype = torch.float32 if rank == 0 else torch.float64
    mismatches = {
        "gather": lambda: dist.gather(torch.ones(2 + rank), [torch.ones(2) for _ in range(n)] if rank == 0 else None,
                                      dst=0, group=group),
        "gather_dtype": lambda: dist.gather(torch.ones(2, dtype=wrong_dtype),
                                            [torch.ones(2) for _ in range(n)] if rank == 0 else None, dst=0, group=group),
        "scatter": lambda: dist.scatter(torch.ones(2 + rank), [torch.ones(2) for _ in range(n)] if rank == 0 else None,
                                        src=0, group=group),
        "all_to_all": lambda: dist.all_to_all([torch.ones(1) for _ in range(n)], [torch.ones(1 + rank) for _ in range(n)],
                                              group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.ones(n), torch.ones(n * (1 + rank)), group=group),
        "all_to_all_single_splits": lambda: dist.all_to_all_single(
            torch.ones(n), torch.ones(n + rank), output_split_sizes=[1] * n,
            input_split_sizes=[1] * (n - 1) + [1 + rank], group=group),
        "all_gather": lambda: dist.all_gather([torch.ones(2 + rank) for _ in range(n)], torch.ones(2 + rank), group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.ones(n * (2 + rank)), torch.ones(2 + rank),
                                                                      group=group),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.ones(2 + rank), [torch.ones(2 + rank) for _ in range(n)],
                                                      group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.ones(2 + rank, dtype=f32),
                                                                    torch.ones(n * (2 + rank)), group=group),
        "reduce_scatter_op": lambda: dist.reduce_scatter_tensor(torch.ones(2), torch.ones(2 * n), group=group,
                                                                op=R.SUM if rank == 0 else R.MAX),
        "op": lambda: (dist.gather(torch.ones(2), [torch.ones(2) for _ in range(n)], dst=0, group=group) if rank == 0
                       else dist.scatter(torch.ones(2), None, src=0, group=group)),
        "broadcast": lambda: dist.broadcast(torch.ones(2 + rank), src=0, group=group),
    }
    for name, call in mismatches.items():
        started = time.monotonic()
        try:
            call()
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - reported for the test to name
            outcome = f"{type(exc).__name__}: {exc}"
        report["peer_mismatch"][name] = {"outcome": outcome, "seconds": time.monotonic() - started}
    # The group is still in step: a consistent peer-link collective after the mismatches works.
    after = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(after, torch.full((2,), float(rank)), group=group)
    report["after_mismatch"] = [float(t[0]) for t in after]


# --- FSDP, gloo against redsrv ------------------------------------------------------------

#: FSDP1 (FullyShardedDataParallel) refuses to run without an accelerator in torch 2.13 ("FSDP
#: needs a non-CPU accelerator device"), under gloo as under redsrv: FSDP2 only.
FSDP = ["fsdp2"]


def run_fsdp(name: str, spec: dict, group: dist.ProcessGroup, out: dict[str, np.ndarray], report: dict) -> None:
    """A small model trained with FSDP2 (``fully_shard``) over gloo and over redsrv: the
    per-step losses and the final full parameters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank, steps = spec["rank"], spec["steps"]
    for label, pg in (("gloo", dist.group.WORLD), ("redsrv", group)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        mesh = DeviceMesh.from_group(pg, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped: nn.Module = fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        losses = []
        for step in range(steps):
            x, target = batch(100, rank, step, 0, torch.float32)
            loss = nn.functional.mse_loss(wrapped(x), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[f"{name}/{label}/losses"] = np.array(losses)
        full = [p.full_tensor() for p in wrapped.parameters()]
        out[f"{name}/{label}/params"] = torch.cat([p.reshape(-1) for p in full]).detach().numpy().copy()


if __name__ == "__main__":
    sys.exit(main())
