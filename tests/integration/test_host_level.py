"""Host-level reduction (core/host_client.py) against real reducer processes: two or three
emulated hosts of two or three workers on this machine (``host_id`` tells the hosts apart, as
separate machines' host names would), compared bitwise with the sum in host order and with the
flat path; a local worker killed, a reducer restarted, workers that disagree."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import redsrv
from redsrv.core.combine import Combiner
from redsrv.core.host_client import HostClient

from tests_support import make_input, poll

pytestmark = pytest.mark.timeout(120)

FAST = dict(heartbeat_interval=0.2, heartbeat_misses=5, op_timeout=30.0, close_timeout=3.0, connect_timeout=10.0)


def host_config(rank: int, hosts: int, local: int, *, block: bool = True) -> dict[str, Any]:
    host = rank // local if block else rank % hosts
    local_rank = rank % local if block else rank // hosts
    return {"host_reduce": "host", "local_rank": local_rank, "local_size": local, "host_id": f"host{host}"}


def run_ranks(world: int, body: Callable[[int], Any], timeout: float = 90.0) -> list[Any]:
    """``body(rank)`` in a thread per rank (a host-level client meets its host's other workers
    while it is built, so they must be built at once); the results, or the first exception."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def host_order(inputs: list[np.ndarray], hosts: int, local: int, op: str = "sum", *, block: bool = True) -> np.ndarray:
    """Inside each host in local-rank order, across hosts in host order, with the reducers' own
    combining rule (float32 accumulation for 16-bit floats)."""
    from redsrv.core import wire

    code = {"sum": wire.ReduceOp.SUM, "max": wire.ReduceOp.MAX, "bor": wire.ReduceOp.BOR}[op]
    dtype = wire.DType(wire.dtype_code(inputs[0].dtype))
    rank = (lambda h, lr: h * local + lr) if block else (lambda h, lr: h + lr * hosts)
    combine = Combiner()
    sums = []
    for h in range(hosts):
        acc = inputs[rank(h, 0)].copy()
        combine.combine_into_first([acc.view(np.uint8)] + [inputs[rank(h, lr)].view(np.uint8) for lr in range(1, local)],
                                   dtype, code)
        sums.append(acc)
    combine.combine_into_first([s.view(np.uint8) for s in sums], dtype, code)
    return sums[0]


@pytest.mark.parametrize(("hosts", "local", "m", "block"), [(2, 2, 2, True), (3, 2, 3, False), (2, 3, 1, True)])
def test_sums_are_the_host_order_sum_bitwise_on_every_rank(fleet, hosts: int, local: int, m: int, block: bool) -> None:
    reducers = [r.address for r in fleet(m)]
    world = hosts * local
    cases = [(0, "float32", "sum"), (1, "float32", "sum"), (1001, "float64", "max"), (300_007, "float32", "sum"),
             (70_001, "bfloat16", "sum"), (5000, "int64", "bor"), (2_500_000, "float32", "sum")]

    def body(rank: int) -> list[np.ndarray]:
        with redsrv.Client(reducers, rank=rank, world_size=world, job=f"hl-{hosts}-{local}-{block}",
                           **host_config(rank, hosts, local, block=block), **FAST) as client:
            assert isinstance(client, HostClient) and client.hosts == hosts
            out = []
            for i, (size, dtype, op) in enumerate(cases):
                out.append(client.allreduce(make_input(i, rank, size, dtype), op=op, key=("case", i)))
            return out

    results = run_ranks(world, body)
    for i, (size, dtype, op) in enumerate(cases):
        expected = host_order([make_input(i, r, size, dtype) for r in range(world)], hosts, local, op, block=block)
        for rank in range(world):
            assert results[rank][i].dtype == expected.dtype and results[rank][i].tobytes() == expected.tobytes(), (i, rank)


def test_the_host_level_path_agrees_with_the_flat_path_and_keeps_every_operation_s_meaning(fleet) -> None:
    """Exact data (small integers): every path gives the same sum bit for bit, whatever the order."""
    reducers = [r.address for r in fleet(2)]
    world, size = 4, 200_003
    exact = [np.arange(size, dtype=np.float32) % 7 + r for r in range(world)]
    total = sum(exact[1:], exact[0].copy())

    def body(rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with redsrv.Client(reducers, rank=rank, world_size=world, job="hl-vs-flat", **host_config(rank, 2, 2), **FAST) as hl, \
                redsrv.Client(reducers, rank=rank, world_size=world, job="hl-vs-flat-flat", host_reduce="flat", **FAST) as flat:
            assert isinstance(hl, HostClient) and not isinstance(flat, HostClient)
            out["host"] = hl.allreduce(exact[rank], key="s")
            out["flat"] = flat.allreduce(exact[rank], key="s")
            future = hl.allreduce_async(exact[rank], op="mean", key="mean")
            out["mean"] = hl.wait(future)
            out["contributors"] = future.contributors
            out["bf16"] = hl.allreduce(exact[rank], key="bf16", wire_dtype="bf16")
            buffer = exact[rank].copy()
            out["inplace_is_buffer"] = hl.allreduce(buffer, key="inplace", out=buffer) is buffer
            out["inplace"] = buffer
            out["broadcast"] = hl.broadcast(np.full(100_001, rank, dtype=np.int64), root=3, key="b")
            out["shape"] = hl.allreduce(np.ones((3, 5), dtype=np.float32), key="shape").shape
            hl.barrier(key="barrier")
        return out

    results = run_ranks(world, body)
    for rank, got in enumerate(results):
        assert got["host"].tobytes() == total.tobytes() == got["flat"].tobytes(), rank
        assert got["mean"].tobytes() == (total / world).astype(np.float32).tobytes(), rank
        assert got["contributors"] == redsrv.Contributors(4, 4, (0, 1, 2, 3))
        assert got["bf16"].tobytes() == total.tobytes()  # small integers survive bf16 exactly
        assert got["inplace_is_buffer"] and got["inplace"].tobytes() == total.tobytes()
        assert (got["broadcast"] == 3).all() and got["shape"] == (3, 5)


def test_operations_larger_than_the_staging_area_and_many_at_once(fleet) -> None:
    reducers = [r.address for r in fleet(2)]
    world = 4
    sizes = [3_000_001, 17, 1_000_003, 0, 2_000_000]

    def body(rank: int) -> list[np.ndarray]:
        with redsrv.Client(reducers, rank=rank, world_size=world, job="hl-many", host_slot_bytes=2**22,
                           host_piece_bytes=2**20, **host_config(rank, 2, 2), **FAST) as client:
            futures = [client.allreduce_async(make_input(40 + i, rank, size, "float32"), key=("many", i))
                       for i, size in enumerate(sizes)]
            return [client.wait(f) for f in futures]

    results = run_ranks(world, body)
    for i, size in enumerate(sizes):
        expected = host_order([make_input(40 + i, r, size, "float32") for r in range(world)], 2, 2)
        assert all(results[r][i].tobytes() == expected.tobytes() for r in range(world)), i


def test_workers_that_disagree_fail_on_every_rank_of_every_host(fleet) -> None:
    reducers = [r.address for r in fleet(2)]
    world = 4

    def body(rank: int) -> tuple[str, str]:
        with redsrv.Client(reducers, rank=rank, world_size=world, job="hl-mismatch", **host_config(rank, 2, 2), **FAST) as client:
            size = 1001 if rank == 1 else 1000
            with pytest.raises(redsrv.ContributionMismatchError) as caught:
                client.allreduce(np.ones(size, np.float32), key="bad")
            # the host goes on: the next operation is fine on every rank
            ok = client.allreduce(np.ones(10, np.float32), key="good")
            assert ok.tolist() == [4.0] * 10
            return type(caught.value).__name__, str(caught.value)

    results = run_ranks(world, body)
    assert "1000 x float32 sum" in results[0][1] and "1001 x float32 sum" in results[0][1]
    assert all(kind == "ContributionMismatchError" for kind, _ in results)


def test_one_host_finishes_inside_the_host_and_never_contacts_the_reducers() -> None:
    """A job whose workers all share one host: the host's sum is the job's, so nothing is sent
    across hosts. The reducers' address is a socket that never accepts: a connection would wait
    in its backlog. Sums are the rank-order ones (the reducers' own bytes), with the staging area's
    frames reused; disagreeing workers and an operation a worker never calls keep their errors."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    reducers = [f"127.0.0.1:{listener.getsockname()[1]}"]
    world = 3
    cases = [(0, "float32", "sum"), (1001, "float64", "max"), (3_000_001, "float32", "sum"),
             (70_001, "bfloat16", "sum"), (5000, "int64", "bor")]
    timed_out_everywhere = threading.Barrier(world, timeout=30)  # rank 1 stays until the others timed out

    def body(rank: int) -> tuple[list[np.ndarray], str, str]:
        with redsrv.Client(reducers, rank=rank, world_size=world, job="hl-one-host", host_reduce="host", local_rank=rank,
                           local_size=world, host_slot_bytes=2**22, host_piece_bytes=2**20,
                           **{**FAST, "op_timeout": 2.0}) as client:
            assert isinstance(client, HostClient) and client.hosts == 1 and client.session == 0
            out = [client.allreduce(make_input(i, rank, size, dtype), op=op, key=("case", i))
                   for i, (size, dtype, op) in enumerate(cases)]
            out.append(client.broadcast(np.full(2_000_000, rank, np.int64), root=2, key="bcast"))
            with pytest.raises(redsrv.ContributionMismatchError) as mismatch:
                client.allreduce(np.ones(1000, np.float32 if rank else np.float64), key="bad")
            late = "called"
            if rank != 1:
                with pytest.raises(redsrv.PeerTimeoutError) as timed_out:
                    client.allreduce(np.ones(10, np.float32), key="rank 1 never calls")
                late = str(timed_out.value)
            timed_out_everywhere.wait()
            return out, str(mismatch.value), late

    try:
        results = run_ranks(world, body)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    for i, (size, dtype, op) in enumerate(cases):
        expected = host_order([make_input(i, r, size, dtype) for r in range(world)], 1, world, op)
        assert all(results[r][0][i].tobytes() == expected.tobytes() for r in range(world)), i
    assert all((results[r][0][-1] == 2).all() for r in range(world))
    assert "float64" in results[0][1] and "float32" in results[0][1]
    assert "waits for local ranks [1]" in results[0][2] and "waits for local ranks [1]" in results[2][2]


def test_one_host_many_small_and_large_operations_in_flight_at_once() -> None:
    """Operations submitted back to back without waiting: each is staged on its caller's thread
    when the engine is idle and nothing earlier waits for it, else by the engine, and the core
    sees them in submission order either way. Small ones are combined whole, larger ones shared,
    some larger than the staging area; every sum is the rank-order one."""
    world = 3
    sizes = [1, 1000, 300_000, 17, 2_000_003, 0, 5, 70_000] * 12

    def body(rank: int) -> list[np.ndarray]:
        with redsrv.Client(["127.0.0.1:9"], rank=rank, world_size=world, job="hl-in-flight", host_reduce="host",
                           local_rank=rank, local_size=world, host_slot_bytes=2**22, host_piece_bytes=2**20,
                           **FAST) as client:
            futures = [client.allreduce_async(make_input(i, rank, size, "float32"), key=("burst", i))
                       for i, size in enumerate(sizes)]
            return [client.wait(f) for f in futures]

    results = run_ranks(world, body)
    for i, size in enumerate(sizes):
        expected = host_order([make_input(i, r, size, "float32") for r in range(world)], 1, world)
        assert all(results[r][i].tobytes() == expected.tobytes() for r in range(world)), (i, size)


def _listening(name: bytes) -> bool:
    """Whether an abstract Unix socket ``name`` is bound (the kernel lists it as @name)."""
    with open("/proc/net/unix") as f:
        return any(line.rstrip().endswith("@" + name[1:].decode()) for line in f)


def test_a_local_rank_taken_twice_and_ranks_out_of_place_are_configuration_errors(fleet) -> None:
    from redsrv.core.config import Config
    from redsrv.core.host_client import _socket_name

    reducers = [r.address for r in fleet(1)]
    config = host_config(0, 2, 2)
    holder_failed: list[BaseException] = []

    def holder() -> None:
        try:
            redsrv.Client(reducers, rank=0, world_size=4, job="hl-twice", **config, connect_timeout=3)
        except redsrv.PeerTimeoutError as exc:  # its partner never comes; it only had to hold the name
            holder_failed.append(exc)

    thread = threading.Thread(target=holder)
    thread.start()
    name = _socket_name(Config(reducers=tuple(reducers), job="hl-twice", rank=0, world_size=4, **config), 0)
    poll(lambda: _listening(name), 10, "the first local rank 0 to listen")
    with pytest.raises(redsrv.ConfigError, match="local rank 0 of job 'hl-twice' is taken on this host"):
        redsrv.Client(reducers, rank=2, world_size=4, job="hl-twice", **config, connect_timeout=3)
    thread.join(30)
    assert holder_failed and "local ranks [1] never connected" in str(holder_failed[0])

    def out_of_place(rank: int) -> str:
        # ranks 0 and 3 on one host: neither a block nor strided
        config = {"host_reduce": "host", "local_rank": 0 if rank in (0, 1) else 1, "local_size": 2,
                  "host_id": "a" if rank in (0, 3) else "b"}
        with pytest.raises(redsrv.ConfigError) as caught:
            redsrv.Client(reducers, rank=rank, world_size=4, job="hl-place", **config, connect_timeout=10)
        return str(caught.value)

    messages = run_ranks(4, out_of_place)
    assert "ranks [0, 3]" in messages[0] and "host_reduce='flat'" in messages[0]


def test_nothing_is_left_on_disk(fleet) -> None:
    reducers = [r.address for r in fleet(1)]
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    def body(rank: int) -> None:
        with redsrv.Client(reducers, rank=rank, world_size=2, job="hl-disk", **host_config(rank, 1, 2), **FAST) as c:
            c.allreduce(np.ones(1000, np.float32))

    run_ranks(2, body)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before


def test_a_reducer_killed_and_restarted_mid_training_costs_no_step_and_no_wrong_sum(procs) -> None:
    reducers = [procs.start_reducer() for _ in range(2)]
    addresses = [r.address for r in reducers]
    world, steps, size = 4, 25, 300_001
    going = threading.Event()
    wrong: list[tuple[int, int]] = []

    def step_input(rank: int, step: int) -> np.ndarray:
        return np.random.default_rng([rank, step]).standard_normal(size).astype(np.float32)

    expected = [host_order([step_input(r, s) for r in range(world)], 2, 2) for s in range(steps)]

    def body(rank: int) -> int:
        with redsrv.Client(addresses, rank=rank, world_size=world, job="hl-restart", reconnect_window=20.0,
                           **host_config(rank, 2, 2), **FAST) as client:
            for step in range(steps):
                x = step_input(rank, step)
                if client.allreduce(x, key=("step", step), out=x).tobytes() != expected[step].tobytes():
                    wrong.append((rank, step))
                if step == 4 and rank == 0:
                    going.set()
            return steps

    def fault() -> None:
        assert going.wait(60)
        reducers[1].signal(signal.SIGKILL)
        reducers[1].proc.wait(10)
        procs.restart_reducer(reducers[1])

    thread = threading.Thread(target=fault)
    thread.start()
    done = run_ranks(world, body)
    thread.join(30)
    assert done == [steps] * world and wrong == []


def test_a_killed_local_worker_fails_every_rank_of_every_host_with_a_typed_error(fleet, workers) -> None:
    """Worker processes (a killed process's memory and links go with it): rank 1, host 0's second
    worker, is killed mid-training; its host's other worker and both workers of host 1 raise a
    typed error within seconds, and no step returns a wrong sum (none returns at all)."""
    reducers = fleet(2, env={"REDSRV_REJOIN_GRACE": "2"})
    spec = {"job": "hl-kill", "loop_until_error": True, "loop_size": 300_001, "loop_seconds": 60,
            "config": {**FAST, "op_timeout": 20.0},
            "config_by_rank": {str(r): host_config(r, 2, 2) for r in range(4)}}
    run = workers(reducers, 4, spec)
    run.wait_for_steps(3, timeout=60)
    run.procs[1].send_signal(signal.SIGKILL)
    run.procs[1].wait(10)
    survivors = [p for i, p in enumerate(run.procs) if i != 1]
    run.procs, prefixes = survivors, run.prefixes
    run.prefixes = [p for i, p in enumerate(prefixes) if i != 1]
    run.wait_for_errors(timeout=15)
    _, reports = run.wait(60)
    for report in reports:
        assert report["client"] == "HostClient"
        assert report["error"]["type"] in ("PeerLostError", "PeerTimeoutError"), report["error"]
        assert report["threads_left"] == []
    same_host = reports[0]["error"]["message"]
    assert "local rank 1" in same_host and "rank 1" in same_host, same_host


def test_first_m_closes_on_whole_hosts_and_a_late_host_gets_the_same_result(fleet) -> None:
    """Straggler mode first_m with m = 2 of 4 workers: across hosts it counts whole hosts
    (ceil(2 / 2) = 1), so host 0 completes without host 1, whose workers submit only after host
    0's have their results, and get the kept result: the same bytes, naming host 0's ranks."""
    reducers = [r.address for r in fleet(2)]
    world, size = 4, 200_001
    host0_done = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()

    def body(rank: int) -> tuple[np.ndarray, Any, np.ndarray]:
        with redsrv.Client(reducers, rank=rank, world_size=world, job="hl-first-m", straggler_mode="first_m",
                           min_contributors=2, **host_config(rank, 2, 2), **FAST) as client:
            if rank >= 2:
                assert host0_done.wait(60)
            x = make_input(5, rank, size, "float32")
            future = client.allreduce_async(x, key="s")
            total = client.wait(future)
            mean = client.allreduce(x, op="mean", key="m")
            with lock:
                finished.append(rank)
                if rank < 2 and sum(1 for r in finished if r < 2) == 2:
                    host0_done.set()
            return total, future.contributors, mean

    results = run_ranks(world, body)
    host0 = make_input(5, 0, size, "float32") + make_input(5, 1, size, "float32")
    for rank, (total, contributors, mean) in enumerate(results):
        assert total.tobytes() == host0.tobytes(), rank
        assert contributors == redsrv.Contributors(2, 2, (0, 1)), (rank, contributors)
        assert mean.tobytes() == (host0 / np.float32(1) / np.float32(2)).astype(np.float32).tobytes(), rank


def test_the_timeline_names_each_worker_not_its_host(fleet, tmp_path) -> None:
    reducers = [r.address for r in fleet(2)]
    path = str(tmp_path / "trace-{rank}.json")

    def body(rank: int) -> None:
        with redsrv.Client(reducers, rank=rank, world_size=4, job="hl-timeline", timeline=path, **host_config(rank, 2, 2),
                           **FAST) as client:
            client.allreduce(np.ones(100_000, np.float32), key="t")

    run_ranks(4, body)
    assert sorted(os.listdir(tmp_path)) == [f"trace-{r}.json" for r in range(4)]


def test_a_bug_in_the_engine_fails_the_operation_at_once_and_every_later_call(fleet, monkeypatch) -> None:
    from redsrv.core import host

    reducers = [r.address for r in fleet(1)]

    stage = host.HostCore.stage

    def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Local rank 0's engine only: with both broken, which rank learns of its own bug and which
        # of its peer's loss first is a race, and the test would assert one order. (Staging, which
        # every operation goes through: this job has one host, so no share goes across hosts.)
        if self.local_rank == 0:
            raise RuntimeError("injected")
        return stage(self, *args, **kwargs)

    monkeypatch.setattr(host.HostCore, "stage", broken)

    def body(rank: int) -> tuple[str, str]:
        with redsrv.Client(reducers, rank=rank, world_size=2, job="hl-bug", **host_config(rank, 1, 2), **FAST) as client:
            with pytest.raises(redsrv.PeerLostError) as first:
                client.allreduce(np.ones(1000, np.float32), key="a", timeout=20)
            with pytest.raises(redsrv.PeerLostError) as later:
                client.allreduce(np.ones(10, np.float32), key="b")
            return str(first.value), str(later.value)

    (first0, later0), (first1, later1) = run_ranks(2, body, timeout=40)
    assert "engine of this worker failed" in first0 and "injected" in first0 and "engine" in later0
    assert "local rank 0" in first1 and "local rank 0" in later1  # its peer's engine died: the host's reduction fails
