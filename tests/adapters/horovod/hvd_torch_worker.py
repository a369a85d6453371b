"""One rank of a Horovod-API test run: ``python hvd_torch_worker.py SCENARIO OUT_PREFIX``, with
rank, size and reducers in the environment (the test, ``redsrv run`` or ``mpirun`` sets them).

It saves every input it used and every result it got (``OUT_PREFIX.pt``) plus facts and error
descriptions (``OUT_PREFIX.json``); the test recomputes each result with PyTorch alone and
compares. Scenarios: ``api`` (everything, 3 ranks), ``mini`` (a few collectives, any size),
``lost`` (rank 1 dies after init).
"""

from __future__ import annotations

import json
import sys

import torch

import redsrv.horovod.torch as hvd

DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
          "i64": torch.int64, "u8": torch.uint8, "i8": torch.int8}
OPS = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}


def make(rank: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic per-rank data: small integers (exact in every dtype, products stay small)."""
    g = torch.Generator().manual_seed(1000 * rank + tag)
    values = torch.randint(1, 4, shape, generator=g) if dtype is torch.uint8 else torch.randint(-3, 4, shape, generator=g)
    if dtype.is_floating_point:
        values = values + torch.rand(shape, generator=g).round(decimals=2)
    return values.to(dtype)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 4)
        self.fc2 = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class NormModel(torch.nn.Module):
    def __init__(self, norm: type[torch.nn.Module]) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 4)
        self.norm = norm(4)
        self.fc2 = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def norm_model(norm: type[torch.nn.Module]) -> NormModel:
    torch.manual_seed(0)
    return NormModel(norm).double()


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def fresh_model(seed: int) -> Model:
    torch.manual_seed(seed)
    return Model().double()


def train(model: Model, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int, passes: int = 1) -> None:
    """``steps`` optimizer steps on (x, y), each over ``passes`` micro-batches whose losses add
    up to the mean loss over x."""
    for _ in range(steps):
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            loss = torch.nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))
            loss.backward()
        optimizer.step()


def describe(exc: BaseException) -> dict[str, object]:
    return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}


def api(out: dict[str, torch.Tensor], facts: dict[str, object]) -> None:
    r, n = hvd.rank(), hvd.size()
    facts["basics"] = [r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()]
    # allreduce: every dtype with every op that applies
    for dname, dtype in DTYPES.items():
        x = make(r, 1, (4, 5), dtype)
        out[f"in.{dname}"] = x
        for oname, op in OPS.items():
            out[f"allreduce.{dname}.{oname}"] = hvd.allreduce(x, op=op, name=f"ar.{dname}.{oname}")
    x = make(r, 2, (6,), torch.float64)
    out["in.x64"] = x
    out["allreduce.scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    out["allreduce.average_flag"] = hvd.allreduce(x, average=True)
    inplace = x.clone()
    returned = hvd.allreduce_(inplace, op=hvd.Sum)
    facts["allreduce_.same_object"] = returned is inplace
    out["allreduce_"] = inplace
    handle = hvd.allreduce_async(x, op=hvd.Max, name="async")
    out["allreduce_async"] = hvd.synchronize(handle)
    facts["poll_after_sync_raises"] = _raises(lambda: hvd.poll(handle))
    inplace2 = x.clone()
    handle = hvd.allreduce_async_(inplace2, op=hvd.Sum, name="async_")
    while not hvd.poll(handle):
        pass
    hvd.synchronize(handle)
    out["allreduce_async_"] = inplace2
    strided = make(r, 3, (4, 6), torch.float32)[:, ::2]  # not contiguous: staged and copied back
    hvd.allreduce_(strided, op=hvd.Sum)
    out["in.strided"] = make(r, 3, (4, 6), torch.float32)[:, ::2].contiguous()
    out["allreduce_.strided"] = strided.contiguous()
    # compression
    y = make(r, 4, (8,), torch.float32)
    out["in.y"] = y
    out["allreduce.fp16"] = hvd.allreduce(y, op=hvd.Sum, compression=hvd.Compression.fp16)
    out["allreduce.bf16"] = hvd.allreduce(y, op=hvd.Sum, compression=hvd.Compression.bf16)
    # grouped
    group = [make(r, 5, (3,), torch.float32), make(r, 6, (2, 2), torch.float64)]
    out["in.g0"], out["in.g1"] = group
    g0, g1 = hvd.grouped_allreduce(group, op=hvd.Sum, name="grouped")
    out["grouped.0"], out["grouped.1"] = g0, g1
    copies = [t.clone() for t in group]
    hvd.grouped_allreduce_(copies, op=hvd.Sum)
    out["grouped_.0"], out["grouped_.1"] = copies
    a0, a1 = hvd.synchronize(hvd.grouped_allreduce_async(group, op=hvd.Average))
    out["grouped_async.0"], out["grouped_async.1"] = a0, a1
    # allgather: first dimensions differ per rank
    z = make(r, 7, (r + 1, 3), torch.float32)
    out["in.z"] = z
    out["allgather"] = hvd.allgather(z)
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(z.to(torch.int64), name="ag"))
    # broadcast from global rank 1
    b = make(r, 8, (3, 2), torch.float64)
    out["in.b"] = b
    out["broadcast"] = hvd.broadcast(b, root_rank=1)
    b2 = b.clone()
    hvd.broadcast_(b2, 1)
    out["broadcast_"] = b2
    out["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(b, 1))
    b3 = b.clone()
    hvd.synchronize(hvd.broadcast_async_(b3, 1, name="b3"))
    out["broadcast_async_"] = b3
    # alltoall with splits: rank r sends j + 1 rows to rank j
    splits = [j + 1 for j in range(n)]
    t = make(r, 9, (sum(splits), 2), torch.float32)
    out["in.t"] = t
    received, counts = hvd.alltoall(t, splits=torch.tensor(splits, dtype=torch.int32))
    out["alltoall"], out["alltoall.splits"] = received, counts
    even = make(r, 10, (n * 2, 3), torch.int32)
    out["in.even"] = even
    out["alltoall.even"] = hvd.alltoall(even)
    # reducescatter of 7 rows over 3 ranks: 3, 2, 2
    s = make(r, 11, (7, 2), torch.float64)
    out["in.s"] = s
    out["reducescatter.avg"] = hvd.reducescatter(s)
    out["reducescatter.sum"] = hvd.reducescatter(s, op=hvd.Sum)
    # autograd through allreduce, allgather and broadcast
    v = make(r, 12, (4,), torch.float64).requires_grad_()
    (hvd.allreduce(v, op=hvd.Sum) * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    out["grad.allreduce"] = v.grad
    w = make(r, 13, (r + 1, 2), torch.float64).requires_grad_()
    gathered = hvd.allgather(w)
    (gathered * torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape)).sum().backward()
    out["grad.allgather"] = w.grad
    # named asynchronous operations issued in a different order on different ranks
    first, second = make(r, 14, (3,), torch.float32), make(r, 15, (3,), torch.float32)
    out["in.first"], out["in.second"] = first, second
    if r % 2:
        h_first = hvd.allreduce_async(first, name="first", op=hvd.Sum)
        h_second = hvd.allreduce_async(second, name="second", op=hvd.Sum)
    else:
        h_second = hvd.allreduce_async(second, name="second", op=hvd.Sum)
        h_first = hvd.allreduce_async(first, name="first", op=hvd.Sum)
    out["reordered.first"], out["reordered.second"] = hvd.synchronize(h_first), hvd.synchronize(h_second)
    # objects, barrier, join
    facts["broadcast_object"] = hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=2)
    facts["allgather_object"] = hvd.allgather_object(("rank", r))
    hvd.barrier()
    facts["join"] = hvd.join()
    gaps(out, facts)
    process_sets(out, facts)
    optimizers(out, facts)
    misuse(facts)
    errors(facts)


def gaps(out: dict[str, torch.Tensor], facts: dict[str, object]) -> None:
    """What Horovod's own tests found missing: int16, duplicate names, Horovod's gradients for
    broadcast/allgather/reducescatter and the grouped ops, float16 scaling, sparse tensors."""
    r, n = hvd.rank(), hvd.size()
    # int16: reduced (in int32 on the wire), gathered, broadcast and exchanged as itself
    i16 = make(r, 30, (n * 2, 3), torch.int16) * 10000  # sums of three ranks overflow int16: they wrap
    out["in.i16"] = i16
    out["i16.sum"] = hvd.allreduce(i16, op=hvd.Sum)
    out["i16.max"] = hvd.allreduce(i16, op=hvd.Max)
    out["i16.allgather"] = hvd.allgather(i16[: r + 1])
    out["i16.broadcast"] = hvd.broadcast(i16, root_rank=2)
    out["i16.alltoall"] = hvd.alltoall(i16)
    out["i16.reducescatter"] = hvd.reducescatter(i16, op=hvd.Sum)
    # a name in flight is taken until this rank synchronized it
    x = torch.ones(3)
    first = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
    facts["dup.second_raises"] = _raises(lambda: hvd.allreduce_async(x, name="dup", op=hvd.Sum), ValueError)
    facts["dup.other_kind_ok"] = hvd.synchronize(hvd.broadcast_async(x, 0, name="dup")).tolist()
    hvd.synchronize(first)
    facts["dup.after_sync"] = hvd.synchronize(hvd.allreduce_async(x, name="dup", op=hvd.Sum)).tolist()
    polled = hvd.allreduce_async(x, name="polled", op=hvd.Sum)
    while not hvd.poll(polled):  # seen finished: the name is free before synchronize
        pass
    again = hvd.allreduce_async(x * 2, name="polled", op=hvd.Sum)
    facts["dup.after_poll"] = [hvd.synchronize(polled).tolist(), hvd.synchronize(again).tolist()]
    # gradients as Horovod defines them
    ones = torch.ones(4, 2, dtype=torch.float64)
    b = make(r, 31, (4, 2), torch.float64).requires_grad_()
    hvd.broadcast(b, root_rank=1).backward(ones * (r + 1))
    out["grad.broadcast"] = b.grad
    for label, op in (("sum", hvd.Sum), ("avg", hvd.Average)):
        s = make(r, 32, (2 * n, 2), torch.float64).requires_grad_()
        hvd.reducescatter(s, op=op, prescale_factor=0.5).backward(torch.full((2, 2), float(r + 1), dtype=torch.float64))
        out[f"grad.reducescatter.{label}"] = s.grad
    g0, g1 = (make(r, 33, (3,), torch.float64).requires_grad_(), make(r, 34, (r + 1, 2), torch.float64).requires_grad_())
    a0, a1 = hvd.grouped_allreduce([g0, g0 * 2], op=hvd.Sum)
    (a0 * (r + 1) + a1).sum().backward()
    out["grad.grouped_allreduce"] = g0.grad
    (gathered,) = hvd.grouped_allgather([g1])
    (gathered * (r + 1)).sum().backward()
    out["grad.grouped_allgather"] = g1.grad
    h = make(r, 35, (2 * n,), torch.float64).requires_grad_()
    (part,) = hvd.grouped_reducescatter([h], op=hvd.Sum)
    (part * (r + 1)).sum().backward()
    out["grad.grouped_reducescatter"] = h.grad
    # float16 scaled in float32, rounded once
    half = make(r, 36, (16,), torch.float16)
    out["in.half"] = half
    out["half.prescaled"] = hvd.allreduce(half, op=hvd.Sum, prescale_factor=0.37)
    out["half.postscaled"] = hvd.allreduce(half, op=hvd.Sum, postscale_factor=0.37)
    # sparse: Horovod's sparse_allreduce_async, and sparse gradients through the optimizer
    dense = make(r, 37, (6, 3), torch.float32) * (torch.rand(6, 1, generator=torch.Generator().manual_seed(r)) > 0.5)
    out["in.sparse"] = dense
    out["sparse.sum"] = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)().to_dense()
    out["sparse.avg"] = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Average)().to_dense()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    out["embedding.before"] = embedding.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1))
    facts["embedding.names"] = sorted(opt._parameter_names.values())  # what Horovod's test reads
    embedding(torch.tensor([r, r + 1, 9, 9])).sum().backward()
    opt.step()
    out["embedding.after"] = embedding.weight.detach().clone()
    # broadcast_optimizer_state of a fresh optimizer over a parameter without a gradient
    fixed, free = torch.nn.Parameter(torch.ones(2), requires_grad=False), torch.nn.Parameter(torch.ones(2))
    sgd = hvd.DistributedOptimizer(torch.optim.SGD([fixed, free], lr=0.1, momentum=0.9),
                                   named_parameters=[("fixed", fixed), ("free", free)])
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    facts["no_grad.grads"] = [fixed.grad is None, None if free.grad is None else free.grad.tolist()]


def process_sets(out: dict[str, torch.Tensor], facts: dict[str, object]) -> None:
    r = hvd.rank()
    low, high = hvd.add_process_set([0, 1]), hvd.add_process_set(hvd.ProcessSet([1, 2]))
    facts["sets"] = [low.size(), low.rank(), low.included(), high.rank(), high.included()]
    x = make(r, 20, (5,), torch.float32)
    out["in.ps"] = x
    handles = {}
    if low.included():
        handles["low"] = hvd.allreduce_async(x, op=hvd.Sum, name="ps", process_set=low)
    if high.included():
        handles["high"] = hvd.allreduce_async(x, op=hvd.Sum, name="ps", process_set=high)
        handles["high.bcast"] = hvd.broadcast_async(x, root_rank=2, name="ps", process_set=high)
    handles["global"] = hvd.allreduce_async(x, op=hvd.Sum, name="ps")  # concurrently, on the global set
    for label, handle in handles.items():
        out[f"ps.{label}"] = hvd.synchronize(handle)
    if high.included():
        out["ps.high.allgather"] = hvd.allgather(x, process_set=high)
        facts["ps.high.object"] = hvd.allgather_object(r, process_set=high)
    facts["ps.duplicate_raises"] = _raises(lambda: hvd.add_process_set([0, 1]), ValueError)
    if r == 2:
        facts["ps.non_member_raises"] = _raises(lambda: hvd.allreduce(x, process_set=low), ValueError)
    facts["ps.unregistered_raises"] = _raises(lambda: hvd.allreduce(x, process_set=hvd.ProcessSet([0])), ValueError)
    facts["ps.removed"] = [hvd.remove_process_set(low), hvd.remove_process_set(low),
                           hvd.remove_process_set(hvd.global_process_set)]
    edge = hvd.add_process_set([0, 2])
    if edge.included():
        out["ps.edge"] = hvd.allreduce(x, op=hvd.Sum, process_set=edge)
    hvd.barrier()


def optimizers(out: dict[str, torch.Tensor], facts: dict[str, object]) -> None:
    r, n = hvd.rank(), hvd.size()
    x, y = global_batch()
    local = slice(4 * r, 4 * r + 4)
    # 1. DistributedOptimizer == single-process training on the global batch; non-root ranks
    #    start from other weights, which broadcast_parameters overwrites.
    model = fresh_model(seed=0 if r == 0 else 100 + r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    facts["optimizer.class"] = [type(opt).__name__, isinstance(opt, torch.optim.SGD)]
    train(model, opt, x[local], y[local], steps=4)
    for name, p in model.named_parameters():
        out[f"train.{name}"] = p.detach().clone()
    # 2. backward_passes_per_step=2 with gradient_predivide_factor and groups: same reference
    model = fresh_model(seed=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2,
                                   gradient_predivide_factor=2.0, groups=2)
    train(model, opt, x[local], y[local], steps=4, passes=2)
    for name, p in model.named_parameters():
        out[f"train2.{name}"] = p.detach().clone()
    opt.zero_grad()
    for _ in range(2):
        torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
    third = _raises(lambda: torch.nn.functional.mse_loss(model(x[local]), y[local]).backward(), AssertionError)
    facts["passes.third_backward_raises"] = third
    facts["passes.zero_grad_raises"] = _raises(opt.zero_grad, AssertionError)
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    # 3. fp16 compression and Sum through the optimizer, no named_parameters (names by position)
    model = fresh_model(seed=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=hvd.Compression.fp16,
                                   op=hvd.Sum)
    train(model, opt, x[local], y[local], steps=2)
    for name, p in model.named_parameters():
        out[f"train3.{name}"] = p.detach().clone()
    # 4. SyncBatchNorm: statistics of the global batch, so training equals BatchNorm on it
    model = norm_model(hvd.SyncBatchNorm)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    train(model, opt, x[local], y[local], steps=3)
    for name, value in model.state_dict().items():
        out[f"syncbn.{name}"] = value.clone()
    model.eval()
    out["syncbn.eval"] = model(x[local]).detach()
    # 5. broadcast_optimizer_state: rank 0's Adam has stepped; the others' are fresh, other lr
    model = fresh_model(seed=0)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 if r == 0 else 0.5 + r, betas=(0.8, 0.9))
    if r == 0:
        train(model, adam, x, y, steps=3)
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    state = adam.state_dict()
    facts["adam.lr"] = [g["lr"] for g in state["param_groups"]]
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            out[f"adam.{pid}.{key}"] = torch.as_tensor(value).clone()
    facts["n"] = n


def misuse(facts: dict[str, object]) -> None:
    x = torch.ones(3)
    facts["misuse"] = {
        "adasum": _raises(lambda: hvd.allreduce(x, op=hvd.Adasum), NotImplementedError),
        "op_and_average": _raises(lambda: hvd.allreduce(x, average=True, op=hvd.Sum), ValueError),
        "complex": _raises(lambda: hvd.allreduce(torch.ones(3, dtype=torch.complex64)), ValueError),
        "predivide_with_sum": _raises(lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(x)], lr=1),
                                                                       op=hvd.Sum, gradient_predivide_factor=2.0), ValueError),
    }


def errors(facts: dict[str, object]) -> None:
    """Ranks that disagree: every rank gets an error that is both Horovod's and redsrv's."""
    r = hvd.rank()
    for label, tensor in (("shape", torch.ones(r + 2)),
                          ("dtype", torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64)),
                          ("gather_dims", torch.ones(2, r + 1)),
                          ("same_size", torch.ones(6) if r == 0 else torch.ones(3, 2)),  # as many elements, other shape
                          ("reducescatter_same_size", torch.ones(6, 2) if r == 0 else torch.ones(3, 4))):
        try:
            if label == "gather_dims":
                hvd.allgather(tensor, name=label)
            elif label.startswith("reducescatter"):
                hvd.reducescatter(tensor, name=label)
            else:
                hvd.allreduce(tensor, name=label)
            facts[f"error.{label}"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            facts[f"error.{label}"] = describe(exc)


def _raises(fn, kind: type[BaseException] = Exception) -> str | None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except kind as exc:
        return type(exc).__name__ + ": " + str(exc)
    return None


def mini(out: dict[str, torch.Tensor], facts: dict[str, object]) -> None:
    r = hvd.rank()
    facts["basics"] = [r, hvd.size(), hvd.local_rank(), hvd.local_size()]
    out["sum"] = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum)
    out["gather"] = hvd.allgather(torch.full((r + 1,), r, dtype=torch.int64))
    facts["object"] = hvd.broadcast_object(f"hello from {r}", root_rank=hvd.size() - 1)


def lost(out: dict[str, torch.Tensor], facts: dict[str, object]) -> None:
    """Rank 1 dies after init; rank 0's next collective must fail fast, in Horovod's idiom."""
    import os
    import time

    if hvd.rank() == 1:
        os._exit(17)
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(4), name="after-loss")
        facts["error"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        facts["error"] = describe(exc)
    facts["seconds"] = time.monotonic() - started


def main() -> None:
    scenario, prefix = sys.argv[1], sys.argv[2]
    hvd.init()
    out: dict[str, torch.Tensor] = {}
    facts: dict[str, object] = {}
    {"api": api, "mini": mini, "lost": lost}[scenario](out, facts)
    torch.save({k: v.detach().clone() for k, v in out.items()}, prefix + ".pt")
    with open(prefix + ".json", "w") as f:
        json.dump(facts, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
