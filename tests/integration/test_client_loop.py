"""The client serves every stream from one I/O loop (or ``REDSRV_IO_THREADS`` of them): many
reducers and streams cost a worker one thread, and a bug in that loop fails the operations in
flight instead of leaving them to hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import redsrv
from redsrv.core.client_core import ClientCore

from conftest import child_env
from tests_support import poll

pytestmark = pytest.mark.timeout(60)


def _client_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("redsrv-io"))


def test_many_reducers_and_streams_cost_a_worker_one_thread() -> None:
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(4)]
    addresses = [f"{host}:{port}" for host, port in (d.start() for d in daemons)]
    before = threading.active_count()
    try:
        # Two ranks, four reducers, four streams each: 16 connections per worker.
        with redsrv.Client(addresses, rank=0, world_size=2, job="many", streams_per_reducer=4) as a, \
             redsrv.Client(addresses, rank=1, world_size=2, job="many", streams_per_reducer=4) as b:
            assert _client_threads() == ["redsrv-io", "redsrv-io"]
            for step in range(3):
                x = np.arange(2_000_000, dtype=np.float32) + step
                fa, fb = a.allreduce_async(x, key=step), b.allreduce_async(x * 2, key=step)
                assert np.array_equal(a.wait(fa), x * 3)
                assert np.array_equal(b.wait(fb), x * 3)
            # Each client adds its loop; the reducers' handshake threads end once their worker joined.
            poll(lambda: threading.active_count() <= before + 2, 5, "the reducers' handshake threads ending", every=0.02)
            assert threading.active_count() == before + 2
        assert _client_threads() == []
    finally:
        for d in daemons:
            d.stop()


@pytest.mark.parametrize("io_threads", [2, 3])
def test_k_io_threads_each_serve_their_reducers_and_close_ends_them_all(io_threads: int) -> None:
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(4)]
    addresses = [f"{host}:{port}" for host, port in (d.start() for d in daemons)]
    names = [f"redsrv-io-{i}" for i in range(io_threads)]
    try:
        with redsrv.Client(addresses, rank=0, world_size=2, job="k-loops", streams_per_reducer=2, io_threads=io_threads) as a, \
             redsrv.Client(addresses, rank=1, world_size=2, job="k-loops", streams_per_reducer=2, io_threads=io_threads) as b:
            assert _client_threads() == sorted(names * 2)
            for client in (a, b):  # reducer r's streams are registered with loop r % k and no other
                connections = client.connections()
                assert len(connections) == 4 * 2
                for conn in connections:
                    assert conn.registered == (conn.reducer % io_threads,), conn
                    assert conn.loop == f"redsrv-io-{conn.reducer % io_threads}", conn
            for step in range(3):
                x = np.arange(2_000_000, dtype=np.float32) + step
                fa, fb = a.allreduce_async(x, key=step), b.allreduce_async(x * 2, key=step)
                assert np.array_equal(a.wait(fa), x * 3)
                assert np.array_equal(b.wait(fb), x * 3)
            assert a.bytes_pulled == b.bytes_pulled == 3 * x.nbytes
            assert a.ops_completed == b.ops_completed == 3
        assert _client_threads() == []
        # More loops than reducers: the extra ones would serve nothing, so they are not started.
        with redsrv.Client(addresses[:1], rank=0, world_size=1, job="k-one", io_threads=io_threads) as c:
            assert _client_threads() == ["redsrv-io"]
            assert np.array_equal(c.allreduce(np.ones(10, np.float32)), np.ones(10, np.float32))
        assert _client_threads() == []
    finally:
        for d in daemons:
            d.stop()


@pytest.mark.parametrize("io_threads", [1, 2])
def test_with_several_io_threads_the_loops_write_the_large_pushes(io_threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written by the caller's thread, every push of an operation would be copied into its socket
    by that one thread whatever k; with k > 1 the loops write them (C.LOOP_WRITES_MIN_BYTES), and
    small frames are still written at once."""
    from redsrv.core import constants, transport

    writers: dict[str, list[int]] = {}
    real_send_views = transport.send_views

    def recording(sock, views, flags, peer):  # type: ignore[no-untyped-def]
        size = sum(len(view) for view in views)
        writers.setdefault(threading.current_thread().name, []).append(size)
        return real_send_views(sock, views, flags, peer)

    monkeypatch.setattr(transport, "send_views", recording)
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(2)]
    addresses = [f"{host}:{port}" for host, port in (d.start() for d in daemons)]
    caller = threading.current_thread().name
    try:
        # The Python plane's writer calls send_views, which records the thread; which thread writes
        # is the engine's choice (IOLoop.send_frame), the same on the native plane's writer.
        with redsrv.Client(addresses, rank=0, world_size=1, job="loop-writes", io_threads=io_threads,
                           data_plane="python") as client:
            x = np.arange(3_000_000, dtype=np.float32)
            for _ in range(3):
                assert client.allreduce(x).tobytes() == x.tobytes()  # world size 1: the sum is the input
            caller_large = [n for n in writers.get(caller, []) if n >= constants.LOOP_WRITES_MIN_BYTES]
            if io_threads == 1:
                assert caller_large, writers  # the first push of each stream goes out at once
            else:
                assert not caller_large, writers
                loops = {name for name, sizes in writers.items()  # the reducers here are in-process: their threads write too
                         if name.startswith("redsrv-io") and any(n >= constants.LOOP_WRITES_MIN_BYTES for n in sizes)}
                assert loops == {"redsrv-io-0", "redsrv-io-1"}, writers
            writers.clear()
            small = np.ones(1000, np.float32)  # one small push: written by the caller's thread whatever k
            assert client.allreduce(small).tobytes() == small.tobytes()
            assert any(n < constants.LOOP_WRITES_MIN_BYTES for n in writers.get(caller, [])), writers
    finally:
        for d in daemons:
            d.stop()


def test_a_bug_in_the_client_loop_fails_the_operation_with_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    try:
        with redsrv.Client([f"{host}:{port}"], rank=0, world_size=1, job="buggy") as client:
            x = np.arange(1000, dtype=np.float32)
            assert np.array_equal(client.allreduce(x, key=1), x)

            def broken(self, channel, *args):  # type: ignore[no-untyped-def]
                raise RuntimeError("injected bug")

            # The bug goes into the core's handling of a landed result, which the loop calls: a
            # piece at a time on the Python plane, a chunk at a time from the native receiver.
            monkeypatch.setattr(ClientCore, "payload_landed", broken)
            monkeypatch.setattr(ClientCore, "results_landed", broken)
            started = time.monotonic()
            with pytest.raises(redsrv.PeerLostError, match="internal error"):
                client.allreduce(x, key=2, timeout=30)
            assert time.monotonic() - started < 5, "the operation waited for its deadline"
            with pytest.raises(redsrv.PeerLostError):
                client.allreduce(x, key=3)  # the client stays broken, and says so
    finally:
        daemon.stop()


def test_closing_the_client_from_a_result_callback_on_its_own_loop_neither_hangs_nor_leaks() -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    try:
        client = redsrv.Client([f"{host}:{port}"], rank=0, world_size=2, job="selfclose")
        x = np.arange(1000, dtype=np.float32)
        partner = redsrv.Client([f"{host}:{port}"], rank=1, world_size=2, job="selfclose")
        pending = client.allreduce_async(x, key=2)  # never completes: the partner does not push key 2
        first = client.allreduce_async(x, key=1)
        first.add_done_callback(lambda _f: client.close())  # runs on the client's I/O loop
        assert np.array_equal(partner.allreduce(x, key=1), x * 2)
        assert np.array_equal(first.result(timeout=10), x * 2)
        with pytest.raises(redsrv.ClientClosedError):
            pending.result(timeout=10)
        poll(lambda: len(_client_threads()) <= 1, 5, "the closed client's loop ending", every=0.02)
        assert _client_threads() == ["redsrv-io"]  # the partner's
        partner.close()
    finally:
        daemon.stop()


def test_done_callbacks_run_in_completion_order_on_a_thread_that_is_not_the_io_loop() -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    try:
        with redsrv.Client([f"{host}:{port}"], rank=0, world_size=2, job="callback-thread") as client, \
             redsrv.Client([f"{host}:{port}"], rank=1, world_size=2, job="callback-thread") as partner:
            ran: list[tuple[int, threading.Thread]] = []
            all_ran = threading.Event()

            def record(step: int):  # type: ignore[no-untyped-def]
                def callback(_future) -> None:  # type: ignore[no-untyped-def]
                    ran.append((step, threading.current_thread()))
                    if len(ran) == 5:
                        all_ran.set()
                return callback

            x = np.arange(1000, dtype=np.float32)
            for step in range(5):  # the partner's push completes each one after its callback is added
                future = client.allreduce_async(x, key=step)
                future.add_done_callback(record(step))
                assert np.array_equal(partner.allreduce(x, key=step, timeout=10), x * 2)
                assert np.array_equal(client.wait(future, timeout=10), x * 2)
            assert all_ran.wait(10), f"callbacks ran for {[s for s, _ in ran]} only"
            [loop] = client.io_threads
            assert loop.name == "redsrv-io"
            assert [step for step, _ in ran] == list(range(5))
            assert all(thread is not loop for _, thread in ran), [thread.name for _, thread in ran]
            assert {thread.name for _, thread in ran} == {"redsrv-done"}
            # A callback added once the future is done runs at once, in the adding thread.
            late: list[threading.Thread] = []
            future.add_done_callback(lambda _f: late.append(threading.current_thread()))
            assert late == [threading.current_thread()]
    finally:
        daemon.stop()


def test_a_blocking_done_callback_stalls_neither_the_loop_nor_other_operations() -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    try:
        with redsrv.Client([f"{host}:{port}"], rank=0, world_size=2, job="callback-block") as a, \
             redsrv.Client([f"{host}:{port}"], rank=1, world_size=2, job="callback-block") as b:
            release = threading.Event()
            entered = threading.Event()
            outcome: list[bool] = []

            def blocking(_future) -> None:  # type: ignore[no-untyped-def]
                entered.set()
                outcome.append(release.wait(30))  # a deadline, so a failed test cannot hang the thread

            x = np.arange(200_000, dtype=np.float32)
            first = a.allreduce_async(x, key="first")
            first.add_done_callback(blocking)
            assert np.array_equal(b.allreduce(x, key="first", timeout=10), x * 2)
            assert entered.wait(10), "the callback never ran"
            # The callback holds a's completion thread: a's loop still reads, writes, keeps
            # deadlines, and completes futures (large ones, in pieces, and small ones).
            for step in range(5):
                fa = a.allreduce_async(x * step, key=step, timeout=10)
                fb = b.allreduce_async(x, key=step, timeout=10)
                assert np.array_equal(a.wait(fa, timeout=10), x * step + x)
                assert np.array_equal(b.wait(fb, timeout=10), x * step + x)
            queued_behind = threading.Event()
            fa = a.allreduce_async(x, key="late", timeout=10)
            fa.add_done_callback(lambda _f: queued_behind.set())
            b.allreduce(x, key="late", timeout=10)
            assert np.array_equal(a.wait(fa, timeout=10), x * 2)
            assert not outcome and not queued_behind.is_set(), "the blocking callback did not block its thread"
            release.set()
            assert queued_behind.wait(10), "callbacks queued behind the blocking one never ran"
            assert outcome == [True]
    finally:
        daemon.stop()


# Registered before redsrv is imported, so it runs after redsrv's own atexit hook (LIFO) and
# before finalisation, when daemon threads still run: it reports what the hook left behind.
_EXIT_WITHOUT_CLOSE = textwrap.dedent("""
    import atexit, sys, threading

    def report():
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("redsrv-"))
        print("closed" if client._closed else "open", alive, flush=True)

    atexit.register(report)
    import numpy as np
    import redsrv
    client = redsrv.Client([sys.argv[1]], rank=0, world_size=1, job="exit", op_timeout=10)
    assert client.allreduce(np.ones(1 << 20, np.float32))[0] == 1
    if sys.argv[2] == "lost":
        client.allreduce_async(np.ones(1 << 22, np.float32), key=1)  # in flight when the script ends
        sys.stdout.write("pushed\\n"); sys.stdout.flush()
        sys.stdin.readline()  # the test kills the reducer meanwhile
""")


@pytest.mark.parametrize("state", ["idle", "lost"])
def test_a_script_that_ends_without_close_exits_with_its_client_closed_before_finalisation(procs, fleet,  # type: ignore[no-untyped-def]
                                                                                           state: str) -> None:
    """A daemon thread that holds a client lock when finalisation ends it would leave ``__del__``'s
    close() waiting forever (it did under JAX); the atexit hook closes every open client while its
    threads still run, so nothing is left for finalisation."""
    (reducer,) = fleet(1)
    child = procs.popen([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, reducer.address, state], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    if state == "lost":
        assert child.stdout.readline().strip() == "pushed"
        reducer.proc.kill()
        reducer.proc.wait(10)
        child.stdin.write("\n")
        child.stdin.flush()
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert out.strip().splitlines()[-1] == "closed []", (out, err)
