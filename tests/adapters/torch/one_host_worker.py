"""One rank of a one-host redsrv group, for test_one_host.py.

    python one_host_worker.py SPEC_JSON OUT_PREFIX

Every rank runs on this machine, so the redsrv group reduces in shared memory. Its results are
compared here with the gloo default group's on the same inputs; the ranks that disagree,
the rank that never calls, and (scenario "lost") the rank that dies are reported in
OUT_PREFIX.json, with each outcome's exception type and text.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import redsrv
import redsrv.torch
from redsrv.adapters.torch import ONE_HOST_GATHER_BYTES, RedsrvProcessGroup

R = dist.ReduceOp
#: (name, dtype, ops): each result must be the rank-order combination (the reducers' rule) bit for
#: bit, and gloo's where gloo reduces the dtype and the order cannot matter (two ranks: one
#: combination; 16-bit floats summed in float32 and rounded once are the correctly rounded sum,
#: which gloo's 16-bit addition gives too).
CASES = [("float32", torch.float32, [R.SUM, R.PRODUCT, R.MAX, R.MIN]),
         ("float64", torch.float64, [R.SUM, R.MAX]),
         ("float16", torch.float16, [R.SUM, R.MIN]),
         ("bfloat16", torch.bfloat16, [R.SUM, R.MAX]),
         ("int64", torch.int64, [R.SUM, R.PRODUCT, R.BAND, R.BOR, R.BXOR]),
         ("int32", torch.int32, [R.SUM, R.MIN]),
         ("uint8", torch.uint8, [R.SUM, R.MAX]),
         ("int16", torch.int16, [R.SUM])]


def _input(dtype: torch.dtype, op: object, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=generator) * 4).to(dtype)
    return torch.randint(0, 3 if op == R.PRODUCT else 100, (numel,), generator=generator).to(dtype)


def _rank_order(inputs: list[torch.Tensor], op: object) -> torch.Tensor:
    """The reducers' rule: combined in rank order, 16-bit floats in float32 and rounded once."""
    wide = torch.float32 if inputs[0].dtype in (torch.float16, torch.bfloat16) else inputs[0].dtype
    acc = inputs[0].to(wide)
    combine = {R.SUM: torch.add, R.PRODUCT: torch.mul, R.MAX: torch.maximum, R.MIN: torch.minimum,
               R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
    for x in inputs[1:]:
        acc = combine(acc, x.to(wide)).to(wide)
    return acc.to(inputs[0].dtype)


def outcome(call) -> str:  # type: ignore[no-untyped-def]
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which judges the type
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _NoLinks:
    """In place of a group's peer links where an operation must not use them."""

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"the peer links were used ({name})")


def gathers_and_scatters(group, ours, rank: int, world: int, same) -> None:  # type: ignore[no-untyped-def]
    """All-gathers and reduce-scatters equal gloo's: over the peer links below
    ONE_HOST_GATHER_BYTES a rank, through shared memory from there on in a one-host group, where
    the large ones run with the links taken away (a call that used them fails)."""
    large = ONE_HOST_GATHER_BYTES // 4 + 3
    for numel, links in ((1000, True), (large, ours is None or not ours.one_host)):
        saved = None if ours is None else ours._peers
        if not links and ours is not None:
            ours._peers = _NoLinks()
        try:
            mine = torch.arange(numel, dtype=torch.float32) % 97 + rank  # integers: exact sums in any order
            gathered, want = torch.empty(world * numel), torch.empty(world * numel)
            dist.all_gather_into_tensor(gathered, mine, group=group)
            dist.all_gather_into_tensor(want, mine)
            same(f"all_gather_into_tensor {numel}", gathered, want)
            parts = [torch.empty(numel) for _ in range(world)]
            dist.all_gather(parts, mine, group=group)
            same(f"all_gather {numel}", torch.cat(parts), want)
            whole = torch.cat([mine * (r + 1) for r in range(world)])
            scattered, expected = torch.empty(numel), torch.empty(numel)
            dist.reduce_scatter_tensor(scattered, whole, group=group)
            dist.reduce_scatter_tensor(expected, whole)
            same(f"reduce_scatter_tensor {numel}", scattered, expected)
            listed = torch.empty(numel)
            dist.reduce_scatter(listed, list(whole.chunk(world)), group=group)
            same(f"reduce_scatter {numel}", listed, expected)
            if not links:
                same(f"input kept {numel}", whole, torch.cat([mine * (r + 1) for r in range(world)]))
        finally:
            if ours is not None:
                ours._peers = saved


def main() -> None:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    rank, world = spec["rank"], spec["world_size"]
    torch.set_num_threads(1)
    report: dict = {"rank": rank, "wrong": [], "checked": 0}
    dist.init_process_group("gloo", init_method="file://" + spec["store"], rank=rank, world_size=world)
    redsrv.torch.register_backend(spec["reducers"], job=spec["job"], op_timeout=spec["op_timeout"], connect_timeout=2.0)
    group = dist.new_group(backend="redsrv")
    ours = group if isinstance(group, RedsrvProcessGroup) else None
    report["one_host"] = bool(ours is not None and ours.one_host)
    report["repr"] = repr(group)

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        report["checked"] += 1
        # bit for bit: the bytes, not the values (0.0 and -0.0 differ)
        if got.dtype != want.dtype or not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            report["wrong"].append(name)

    for case, (name, dtype, ops) in enumerate(CASES):
        for op in ops:
            for numel in (1, 1000, 700_001):  # the last spans many pieces of the staging area
                inputs = [_input(dtype, op, numel, seed=case * 1000 + r) for r in range(world)]
                want = _rank_order(inputs, op)
                mine = inputs[rank].clone()
                dist.all_reduce(mine, op=op, group=group)
                same(f"all_reduce {name} {op} {numel}", mine, want)
                theirs = inputs[rank].clone()
                try:
                    dist.all_reduce(theirs, op=op)
                except RuntimeError:
                    continue  # a dtype gloo does not reduce (int16, uint8, ...): the rank-order oracle alone
                if world == 2 or not dtype.is_floating_point or op in (R.MAX, R.MIN):
                    same(f"gloo's all_reduce {name} {op} {numel}", mine, theirs)
    for numel in (3, 1_500_000):
        x = torch.full((numel,), float(rank + 1))
        dist.broadcast(x, src=world - 1, group=group)
        same(f"broadcast {numel}", x, torch.full((numel,), float(world)))
    gathers_and_scatters(group, ours, rank, world, same)
    avg = torch.full((10,), float(rank + 1))
    dist.all_reduce(avg, op=R.AVG, group=group)
    same("all_reduce avg", avg, torch.full((10,), (world + 1) / 2))
    kept = torch.full((5,), float(rank + 1))
    dist.reduce(kept, dst=0, group=group)
    same("reduce", kept, torch.full((5,), float(world * (world + 1) // 2) if rank == 0 else 1.0 + rank))
    # Callbacks on a work's future never run on the client's engine thread (an in-place result
    # completes the work where it settles only while nobody holds its future).
    ran_on = []
    for _ in range(20):
        for work in (dist.all_reduce(torch.ones(100), group=group, async_op=True),
                     dist.broadcast(torch.ones(100), src=0, group=group, async_op=True),
                     dist.reduce(torch.ones(100), dst=0, group=group, async_op=True),
                     dist.barrier(group=group, async_op=True)):
            chained = work.get_future().then(lambda _f: ran_on.append(threading.current_thread().name))
            chained.wait()
    report["callback_threads"] = sorted(set(ran_on))
    # A root outside the group is the caller's mistake, raised before anything is sent.
    outside = dist.BroadcastOptions()
    outside.rootRank = world
    beyond = dist.ReduceOptions()
    beyond.rootRank, beyond.reduceOp = world, R.SUM
    report["bad root"] = {"broadcast": outcome(lambda: group.broadcast([torch.ones(3)], outside)),
                          "reduce": outcome(lambda: group.reduce([torch.ones(3)], beyond))} if ours is not None else {}
    dist.barrier(group=group)

    # Ranks that disagree: every rank raises the typed error, and the group goes on.
    large = ONE_HOST_GATHER_BYTES // 4 + 3 + rank
    report["mismatch"] = {
        "size": outcome(lambda: dist.all_reduce(torch.ones(1000 + rank), group=group)),
        # Through shared memory only: gloo aborts the process on sizes that differ.
        **({"all_gather size": outcome(lambda: dist.all_gather_into_tensor(torch.empty(world * large), torch.ones(large),
                                                                           group=group))} if report["one_host"] else {}),
        "dtype": outcome(lambda: dist.all_reduce(torch.ones(1000, dtype=torch.float32 if rank == 0 else torch.float64),
                                                 group=group)),
        "op": outcome(lambda: dist.all_reduce(torch.ones(10), op=R.SUM if rank == 0 else R.MAX, group=group)),
        "root": outcome(lambda: dist.broadcast(torch.ones(10), src=rank, group=group)),
    }
    after = torch.ones(10)
    dist.all_reduce(after, group=group)
    same("after the mismatches", after, torch.full((10,), float(world)))

    if spec["scenario"] == "timeout":
        # The last rank never calls: the others time out with the typed error, naming what they wait for.
        if rank != world - 1:
            started = time.monotonic()
            report["timeout"] = outcome(lambda: dist.all_reduce(torch.ones(10), group=group))
            report["timeout_seconds"] = time.monotonic() - started
        dist.barrier()  # gloo's: the last rank waits here
    elif spec["scenario"] == "lost":
        dist.barrier()
        if rank == world - 1:
            os._exit(0)  # a local worker dies, without a word
        started = time.monotonic()
        report["lost"] = outcome(lambda: dist.all_reduce(torch.ones(10), group=group))
        report["lost_seconds"] = time.monotonic() - started
    with open(prefix + ".json", "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # the lost rank's gloo links would make an orderly teardown wait


if __name__ == "__main__":
    main()
