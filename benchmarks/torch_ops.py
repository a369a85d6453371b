"""``redsrv bench torch-ops``: every c10d operation through the redsrv backend against gloo,
in the same run, per message size.

Worker processes on 127.0.0.1 (default 2) join a gloo group and a redsrv group (reducers
started here), each used for nothing but the timed operations; barriers and timekeeping run on
the default group. For each operation and size the groups take turns, in orders where each follows
each other equally often (:func:`balanced_orders`): per rep, a barrier, then the operation timed
on every rank (below 256 KiB, the mean of a batch of back-to-back calls); a rep's time is the
slowest rank's, and the table gives the median over reps and the median ratio within back-to-back samples. A
second gloo group timed the same way (``gloo2``) is the control: its ratio to gloo shows how far
gloo strays from itself on this machine in this run. ``relay`` rows time the alternative design for the
data-moving operations, through the reducers (one broadcast per rank with the core's
``allgather_into_async``), to show why the backend sends them over its peer links instead.

Loopback measures CPU and memory copies on shared cores, not a network: ratios near 1 say the
backend adds no cost of its own, not that either wins on a cluster. The workers share this host,
so the redsrv group reduces and broadcasts in shared memory (docs/torch_backend.md, "One host"),
and ``relay`` runs there too; REDSRV_HOST_REDUCE=flat times the reducers instead.

Every call is checked, warm-ups included, outside the timed region: each call of a batch has
its own buffers, reset before the sample to small-integer inputs (so every sum is exact in any
order) and its outputs to NaN, and each output is compared bit for bit with what the operation
must give. A wrong result is reported per operation, size and group, and the command exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from redsrv.cli.fleet import _Fleet, free_port, run_local_workers, start_reducers, stop_processes
from redsrv.cli.units import size_in

OPS = ("send_recv", "broadcast", "gather", "scatter", "all_to_all_single", "all_gather_into_tensor",
       "reduce_scatter_tensor", "all_reduce")
#: Operations whose alternative through the reducers is timed too.
RELAYED = ("all_gather_into_tensor",)
SIZES_KIB = (4, 64, 1024, 16 * 1024, 64 * 1024)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser(
        "torch-ops", help="every c10d op: the redsrv backend against gloo, same run, 4 KiB to 64 MiB",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    b.add_argument("--reducers", type=int, default=2, help="reducer processes (default 2)")
    b.add_argument("--sizes", type=size_in("KiB", whole=True), nargs="+", default=list(SIZES_KIB), metavar="SIZE",
                   help="per-rank sizes, e.g. 4KiB 64MiB; a bare number is KiB (default 4 64 1024 16384 65536)")
    b.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, help="operations (default all)")
    b.add_argument("--rounds", type=int, default=3, help="alternations of gloo and redsrv per size (default 3)")
    b.add_argument("--json", help="write every measurement to this JSON file")
    b.add_argument("--verify", action="store_true",
                   help="register the backend with verify_collectives=True (the cross-rank check before every peer-link "
                        "collective, as under TORCH_DISTRIBUTED_DEBUG=DETAIL; off by default, as in the backend)")
    b.set_defaults(func=lambda a: run(workers=a.workers, reducers=a.reducers, sizes_kib=a.sizes, ops=a.ops,
                                      rounds=a.rounds, json_path=a.json, verify=a.verify))



def run(*, workers: int, reducers: int, sizes_kib: list[int], ops: list[str], rounds: int, json_path: str | None,
        verify: bool = False, fleet: _Fleet | None = None) -> int:
    """Run the comparison; 0 when every result was right, 1 otherwise. ``fleet``: reducers that
    are already running, instead of ``reducers`` new ones."""
    owned = fleet is None
    if fleet is None:
        fleet = start_reducers(reducers)
    try:
        spec = {"reducers": fleet.addresses, "world_size": workers, "store": f"tcp://127.0.0.1:{free_port()}",
                "sizes_kib": sizes_kib, "ops": ops, "rounds": rounds, "verify": verify}
        results = run_local_workers("redsrv.bench.torch_ops", spec, workers, json_path)
    finally:
        if owned:
            stop_processes(fleet.procs)
    if results is None:
        return 1
    print_table(results)
    wrong = [(row["op"], row["kib"], name, count) for row in results for name, count in row["wrong"].items() if count]
    for op, kib, name, count in wrong:
        print(f"redsrv bench torch-ops: WRONG RESULTS: {op} at {kib} KiB through {name}: {count} call(s) "
              "(on all ranks together)", file=sys.stderr)
    return 1 if wrong else 0


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'op':<24} {'size':>8} {'gloo ms':>10} {'redsrv ms':>10} {'redsrv/gloo':>12} {'gloo2/gloo':>11} {'relay ms':>10}"
          "  check")
    # Ratios: the median over reps of the ratio within back-to-back samples; gloo2 is a second
    # gloo group, the control (gloo against itself).
    for row in results:
        size = row["kib"]
        label = f"{size // 1024} MiB" if size >= 1024 else f"{size} KiB"
        relay = f"{row['relay_ms']:10.3f}" if row.get("relay_ms") is not None else f"{'':>10}"
        check = "exact" if not any(row["wrong"].values()) else "WRONG " + ",".join(k for k, v in row["wrong"].items() if v)
        print(f"{row['op']:<24} {label:>8} {row['gloo_ms']:10.3f} {row['redsrv_ms']:10.3f} "
              f"{row['ratio']:12.3f} {row['control_ratio']:11.3f} {relay}  {check}")


def balanced_orders(k: int) -> list[list[int]]:
    """Orders of ``k`` variants in which each variant immediately follows each other one equally
    often (a Williams design: ``k`` orders for even ``k``, ``2k`` for odd), and each comes at
    each position equally often. A plain rotation makes one variant follow a given other in
    ``k - 1`` of ``k`` orders."""
    first = [0]
    low, high = 1, k - 1
    while len(first) < k:
        first.append(low)
        low += 1
        if len(first) < k:
            first.append(high)
            high -= 1
    orders = [[(v + shift) % k for v in first] for shift in range(k)]
    if k % 2:
        orders += [order[::-1] for order in orders]
    return orders


# --- one worker ---------------------------------------------------------------------------


def _reps(kib: int) -> int:
    # Enough reps for a stable median at small sizes, few at 64 MiB (each is tens of ms).
    return max(3, min(15, 65536 // (kib * 16) + 3))


def _worker(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import redsrv.torch
    from redsrv.core import collectives

    rank, n = spec["rank"], spec["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["store"], rank=rank, world_size=n)
    redsrv.torch.register_backend(spec["reducers"], job=f"torch-ops-{os.getppid()}", verify_collectives=spec["verify"])
    ours = dist.new_group(backend="redsrv")
    # The timed gloo group is a group of its own, not the default one: the default group runs
    # every sample's barrier and time-keeping all-reduce, and a group whose connections were used
    # just before runs a small operation faster (its control read 1.02-1.09 against it). The
    # timed groups are used for nothing else, as the redsrv group's peer links are.
    timed_gloo = dist.new_group(backend="gloo")
    # A second gloo group, timed like the others: how far gloo strays from itself in this run.
    control = dist.new_group(backend="gloo")
    rows = []
    key = iter(range(1 << 62))

    def one_op(op: str, pg: Any, b: dict[str, Any]) -> None:
        x = b["x"]
        if op == "send_recv":
            # Rank 0 to rank 1, one way; the other ranks only wait at the barrier.
            if rank == 0:
                dist.send(x, dst=1, group=pg)
            elif rank == 1:
                dist.recv(b["recv"], src=0, group=pg)
        elif op == "broadcast":
            dist.broadcast(x, src=0, group=pg)
        elif op == "gather":
            dist.gather(x, b["gathered"] if rank == 0 else None, dst=0, group=pg)
        elif op == "scatter":
            dist.scatter(b["recv"], b["scattered"] if rank == 0 else None, src=0, group=pg)
        elif op == "all_to_all_single":
            dist.all_to_all_single(b["cat"], b["cat_in"], group=pg)
        elif op == "all_gather_into_tensor":
            dist.all_gather_into_tensor(b["cat"], x, group=pg)
        elif op == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(x, b["cat_in"], group=pg)
        elif op == "all_reduce":
            dist.all_reduce(x, group=pg)
        elif op == "relay":
            client = ours.client  # the same reducers and job as the redsrv group
            collectives.allgather_into_async(client, x.numpy(), b["cat"].numpy(), key=("bench-relay", next(key))).result()

    def timed(op: str, pg: Any, calls: list[dict[str, Any]], reps: int, fresh: dict[str, Any],
              want: Any) -> tuple[list[float], int]:
        """``reps`` samples of ``len(calls)`` back-to-back calls, each on its own buffers; the
        slowest rank's time per call, and how many of this rank's calls gave a wrong result."""
        times = []
        wrong = 0
        for _ in range(reps):
            for b in calls:
                _reset(b, fresh)
            dist.barrier()
            started = time.perf_counter()
            for b in calls:
                one_op(op, pg, b)
            elapsed = torch.tensor([(time.perf_counter() - started) / len(calls)], dtype=torch.float64)
            wrong += sum(not _correct(op, b, want) for b in calls)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            times.append(float(elapsed))
        return times, wrong

    for op in spec["ops"]:
        for kib in spec["sizes_kib"]:
            numel = kib * 1024 // 4
            reps = _reps(kib)
            # Small operations are timed in batches (one sample: the mean of ``batch`` back to
            # back) so that one descheduling on a busy machine does not decide a sample.
            batch = max(1, 256 // kib)
            calls = [_buffers(numel, n) for _ in range(batch)]
            fresh = _inputs(numel, rank, n)
            want = {name: _expected(name, numel, rank, n) for name in (op, "relay")}
            variants = {"gloo": timed_gloo, "redsrv": ours, "control": control}
            if op in RELAYED:
                variants["relay"] = "relay"
            samples: dict[str, list[float]] = {name: [] for name in variants}
            wrong = dict.fromkeys(variants, 0)
            for name, pg in variants.items():  # warm-up: connections, buffers, first-use costs
                what = "relay" if name == "relay" else op
                _, bad = timed(what, pg if name != "relay" else ours, calls, 2, fresh, want[what])
                wrong[name] += bad
            # Paired reps: gloo and redsrv back to back, so that load from elsewhere on the
            # machine (which changes over seconds) hits both alike; the ratio is the median of
            # the per-pair ratios. An operation leaves work behind that the next one pays for
            # (gloo's 1 MiB all-reduce slows whatever follows it by 0.1-0.4 ms here), so the
            # order is balanced: each variant follows each other one equally often.
            order = list(variants.items())
            sequences = balanced_orders(len(order))
            rows_of_reps = -(-spec["rounds"] * reps // len(sequences)) * len(sequences)  # whole designs
            for rep in range(rows_of_reps):
                for index in sequences[rep % len(sequences)]:
                    name, pg = order[index]
                    what = "relay" if name == "relay" else op
                    got, bad = timed(what, pg if name != "relay" else ours, calls, 1, fresh, want[what])
                    samples[name] += got
                    wrong[name] += bad
            counts = torch.tensor([wrong[name] for name in variants], dtype=torch.int64)
            dist.all_reduce(counts)  # every rank's wrong calls, for rank 0's report
            ratios = [r / g for r, g in zip(samples["redsrv"], samples["gloo"], strict=True)]
            control_ratios = [c / g for c, g in zip(samples["control"], samples["gloo"], strict=True)]
            row = {"op": op, "kib": kib, "reps": len(samples["gloo"]),
                   "gloo_ms": statistics.median(samples["gloo"]) * 1e3, "redsrv_ms": statistics.median(samples["redsrv"]) * 1e3,
                   "ratio": statistics.median(ratios), "control_ratio": statistics.median(control_ratios),
                   "relay_ms": statistics.median(samples["relay"]) * 1e3 if "relay" in samples else None,
                   "wrong": {name: int(c) for name, c in zip(variants, counts.tolist(), strict=True)},
                   "samples_ms": {k: [round(v * 1e3, 4) for v in vs] for k, vs in samples.items()}}
            rows.append(row)
            if rank == 0:
                print(f"{op} {kib} KiB: gloo {row['gloo_ms']:.3f} ms, redsrv {row['redsrv_ms']:.3f} ms", flush=True)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group(ours)
    dist.destroy_process_group(control)
    dist.destroy_process_group(timed_gloo)
    dist.destroy_process_group()


def _inputs(numel: int, rank: int, n: int) -> dict[str, Any]:
    """Rank ``rank``'s inputs: small integers, so every sum is exact whatever the order of
    additions (gloo's ring and the reducers' rank order agree bit for bit). ``cat_in``'s block j
    goes to rank j (all-to-all) or is summed into rank j's share (reduce-scatter); ``scattered``
    is the root's list."""
    import torch

    base = torch.arange(numel, dtype=torch.float32) % 8
    return {"x": base + rank + 1, "cat_in": torch.cat([base + 16 * rank + j for j in range(n)]),
            "scattered": [base + 32 + j for j in range(n)]}


def _buffers(numel: int, n: int) -> dict[str, Any]:
    import torch

    return {"x": torch.empty(numel), "recv": torch.empty(numel), "gathered": [torch.empty(numel) for _ in range(n)],
            "scattered": [torch.empty(numel) for _ in range(n)], "cat": torch.empty(numel * n),
            "cat_in": torch.empty(numel * n)}


def _reset(b: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Inputs back to this rank's values (``fresh``), outputs to NaN (so a call that writes
    nothing fails)."""
    b["x"].copy_(fresh["x"])
    b["cat_in"].copy_(fresh["cat_in"])
    for t, v in zip(b["scattered"], fresh["scattered"], strict=True):
        t.copy_(v)
    for t in (b["recv"], b["cat"], *b["gathered"]):
        t.fill_(float("nan"))


def _expected(op: str, numel: int, rank: int, n: int) -> Any:
    """What ``op`` must leave in this rank's output (a tensor, a list for gather's root), or None
    where this rank receives nothing (send_recv but rank 1, gather but the root)."""
    import torch

    of = [_inputs(numel, r, n) for r in range(n)]
    mine = slice(rank * numel, (rank + 1) * numel)
    if op == "send_recv":
        return of[0]["x"] if rank == 1 else None
    if op == "broadcast":
        return of[0]["x"]
    if op == "gather":
        return [of[r]["x"] for r in range(n)] if rank == 0 else None
    if op == "scatter":
        return of[0]["scattered"][rank]
    if op == "all_to_all_single":
        return torch.cat([of[r]["cat_in"][mine] for r in range(n)])
    if op in ("all_gather_into_tensor", "relay"):
        return torch.cat([of[r]["x"] for r in range(n)])
    if op == "reduce_scatter_tensor":
        return sum(of[r]["cat_in"][mine] for r in range(n))
    if op == "all_reduce":
        return sum(of[r]["x"] for r in range(n))
    raise ValueError(f"no check for {op!r}")


#: Where each operation leaves its output on a rank (``_buffers``' names).
_OUTPUT = {"send_recv": "recv", "broadcast": "x", "gather": "gathered", "scatter": "recv", "all_to_all_single": "cat",
           "all_gather_into_tensor": "cat", "relay": "cat", "reduce_scatter_tensor": "x", "all_reduce": "x"}


def _correct(op: str, b: dict[str, Any], want: Any) -> bool:
    """Whether this rank's output of one call is exactly ``want`` (``_expected``)."""
    import torch

    if want is None:
        return True
    got = b[_OUTPUT[op]]
    if isinstance(want, list):
        return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return torch.equal(got, want)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
