"""The reducer serves every connection from one event loop: many jobs and streams cost it no
threads, and it still sums each job exactly."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import redsrv

from tests_support import poll

pytestmark = pytest.mark.timeout(60)


def _reducer_threads() -> list[str]:
    # Clients in this process name theirs redsrv-io; the daemon's are these.
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("redsrv-loop", "redsrv-hello", "redsrv-conn")))


def test_many_connections_cost_the_reducer_no_threads() -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    clients: list[redsrv.Client] = []
    try:
        # Three jobs of two ranks, eight streams each: 48 connections.
        for job in ("a", "b", "c"):
            clients += [redsrv.Client([f"{host}:{port}"], rank=r, world_size=2, job=job, streams_per_reducer=8)
                        for r in range(2)]
        for step in range(3):
            futures = [c.allreduce_async(np.full(300_000, c.rank + step, dtype=np.float32), key=step) for c in clients]
            for c, f in zip(clients, futures):
                assert np.array_equal(c.wait(f), np.full(300_000, 1 + 2 * step, dtype=np.float32))
        # handshake threads end once their worker joined
        poll(lambda: _reducer_threads() == ["redsrv-loop"], 5, "the reducer's handshake threads ending", every=0.02)
        assert sum(entry["connections"] for entry in daemon.snapshot().values()) == 48  # type: ignore[misc]
    finally:
        for c in clients:
            c.close()
        daemon.stop()


def test_a_bug_while_serving_one_connection_costs_only_that_connection() -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    real_begin_push, real_tick = daemon.core.begin_push, daemon.core.tick
    ticks_failed = []

    def begin_push(conn, push, payload_len, now):  # type: ignore[no-untyped-def]
        if push.key == 666:
            raise RuntimeError("injected bug")
        return real_begin_push(conn, push, payload_len, now)

    def tick(now):  # type: ignore[no-untyped-def]
        if not ticks_failed:
            ticks_failed.append(now)
            raise RuntimeError("injected tick bug")
        return real_tick(now)

    daemon.core.begin_push = begin_push  # type: ignore[method-assign]
    daemon.core.tick = tick  # type: ignore[method-assign]
    address = f"{host}:{port}"
    try:
        with redsrv.Client([address], rank=0, world_size=1, job="healthy", heartbeat_interval=0.2) as healthy, \
             redsrv.Client([address], rank=0, world_size=1, job="buggy", heartbeat_interval=0.2) as buggy:
            x = np.arange(1000, dtype=np.float32)
            assert np.array_equal(healthy.allreduce(x, key=1), x)
            with pytest.raises(redsrv.PeerLostError):
                buggy.allreduce(x, key=666, timeout=10)
            poll(lambda: ticks_failed, 5, "the reducer's tick failing", every=0.02)
            for key in range(2, 6):  # the loop and the other job carry on
                assert np.array_equal(healthy.allreduce(x, key=key), x)
        assert daemon.failure is None
    finally:
        daemon.stop()


def test_cut_through_wakes_the_reducer_per_piece_only_where_sums_leave_in_pieces() -> None:
    """Where every rank must contribute, the reducer wakes for every piece of a push (it forwards
    sums as they arrive); in the straggler modes results leave whole, so it waits for the rest of
    each payload at once. Both sum exactly."""
    piece = 64 * 1024
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2, result_piece_bytes=piece))
    host, port = daemon.start()
    address = f"{host}:{port}"
    try:
        # The same chunks in both jobs (by default the straggler mode picks the chunk size too).
        same = {"chunks_per_span": 32}
        with redsrv.Client([address], rank=0, world_size=2, job="all", **same) as a0, \
             redsrv.Client([address], rank=1, world_size=2, job="all", **same) as a1, \
             redsrv.Client([address], rank=0, world_size=2, job="firstm", straggler_mode="first_m", min_contributors=2,
                           **same) as f0, \
             redsrv.Client([address], rank=1, world_size=2, job="firstm", straggler_mode="first_m", min_contributors=2,
                           **same) as f1:
            x = np.arange(1_000_000, dtype=np.float32)
            for c0, c1 in ((a0, a1), (f0, f1)):
                fut = c0.allreduce_async(x, key=1)
                assert np.array_equal(c1.allreduce(x * 2, key=1), x * 3)
                assert np.array_equal(c0.wait(fut), x * 3)
            marks = {}
            with daemon._lock:
                for conn in daemon._conns.values():
                    marks.setdefault(daemon.core._conns[conn.id].job, set()).add(conn.reader.max_lowat)
            assert marks == {"all": {piece}, "firstm": {redsrv.core.constants.MAX_RECEIVE_LOWAT_BYTES}}
            stats = {job: entry["stats"] for job, entry in daemon.snapshot().items()}
            assert stats["all"].chunks_closed == stats["firstm"].chunks_closed > 1  # type: ignore[attr-defined]
    finally:
        daemon.stop()
