"""Transparent recovery (RELIABILITY R22): a reducer killed and restarted on its address, or
frozen and resumed, costs the workers a pause, never a failed step or a wrong sum; a reducer
that does not come back fails every rank with PeerLostError within the window plus 2 s.

Three in-process clients train against real reducer processes, reducing in place (the results
land in the input, so a resend needs the copy the client keeps); every step's result is checked
bitwise against the rank-order sum."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

import redsrv
from redsrv.core import wire
from redsrv.core.client_engine import ClientEngine

from tests_support import poll, read_one_operation, scripted_handshake, scripted_join

pytestmark = pytest.mark.timeout(120)

WORLD = 3
SIZE = 300_001  # several chunks per reducer, so a fault lands mid-operation
RECOVERING = dict(heartbeat_interval=0.2, heartbeat_misses=5, op_timeout=30.0, close_timeout=3.0, connect_timeout=5.0,
                  reconnect_window=20.0)


def step_input(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).standard_normal(SIZE).astype(np.float32)


def step_sum(step: int) -> np.ndarray:
    total = step_input(0, step)
    for rank in range(1, WORLD):
        total += step_input(rank, step)
    return total


@dataclass
class Training:
    """WORLD ranks, each in its own thread, running ``steps`` all-reduces."""

    reducers: list[str]
    steps: int
    config: dict[str, float]
    job: str
    reached: dict[int, threading.Event] = field(default_factory=dict)  # step -> rank 0 finished it
    wrong: list[tuple[int, int]] = field(default_factory=list)
    errors: list[tuple[int, BaseException, float]] = field(default_factory=list)
    step_seconds: dict[int, list[float]] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for s in range(self.steps):
            self.reached[s] = threading.Event()
        clients = [redsrv.Client(self.reducers, rank=r, world_size=WORLD, job=self.job, **self.config) for r in range(WORLD)]
        for rank, client in enumerate(clients):
            thread = threading.Thread(target=self._run, args=(client,), name=f"rank-{rank}")
            self.threads.append(thread)
            thread.start()

    def _run(self, client: redsrv.Client) -> None:
        try:
            for step in range(self.steps):
                x = step_input(client.rank, step)
                started = time.monotonic()
                try:
                    result = client.allreduce(x, key=("step", step), out=x)
                except redsrv.RedsrvError as exc:
                    self.errors.append((client.rank, exc, time.monotonic()))
                    return
                self.step_seconds.setdefault(step, []).append(time.monotonic() - started)
                if result.tobytes() != step_sum(step).tobytes():
                    self.wrong.append((client.rank, step))
                if client.rank == 0:
                    self.reached[step].set()
        finally:
            client.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a rank hung"


def train_through(procs, fault: Callable[[list], None], job: str, steps: int = 30,  # type: ignore[no-untyped-def]
                  config: dict[str, float] | None = None) -> Training:
    reducers = [procs.start_reducer() for _ in range(2)]
    training = Training([r.address for r in reducers], steps, {**RECOVERING, **(config or {})}, job)
    training.start()
    assert training.reached[4].wait(60), "training did not get going"
    fault(reducers)
    training.join(90)
    return training


# With two I/O loops the killed reducer is the second's (reducer r is on loop r % 2): its streams
# are reinstalled there while loop 0 keeps the other reducer's and the operation deadlines.
@pytest.mark.parametrize(("io_threads", "victim"), [(1, 0), (2, 1)], ids=["one-loop", "two-loops"])
def test_a_reducer_killed_and_restarted_on_its_address_costs_no_step_and_no_wrong_sum(  # type: ignore[no-untyped-def]
        procs, io_threads: int, victim: int) -> None:
    def kill_and_restart(reducers: list) -> None:  # type: ignore[type-arg]
        reducers[victim].signal(signal.SIGKILL)
        reducers[victim].proc.wait(10)
        procs.restart_reducer(reducers[victim])

    training = train_through(procs, kill_and_restart, "killed", config={"io_threads": io_threads})
    assert training.errors == [] and training.wrong == []
    assert all(len(training.step_seconds[s]) == WORLD for s in range(training.steps))


def test_a_reducer_frozen_and_resumed_costs_no_step_and_no_wrong_sum(procs) -> None:  # type: ignore[no-untyped-def]
    def freeze(reducers: list) -> None:  # type: ignore[type-arg]
        reducers[0].signal(signal.SIGSTOP)
        time.sleep(2.0)  # noqa: TID251 - the length of the freeze (twice the heartbeat bound), not a synchronisation
        reducers[0].signal(signal.SIGCONT)

    training = train_through(procs, freeze, "frozen")
    assert training.errors == [] and training.wrong == []
    assert all(len(training.step_seconds[s]) == WORLD for s in range(training.steps))


def test_past_the_window_every_rank_raises_peer_lost_within_the_window_plus_two_seconds(procs) -> None:  # type: ignore[no-untyped-def]
    window = 2.0
    reducers = [procs.start_reducer() for _ in range(2)]
    training = Training([r.address for r in reducers], 1000, {**RECOVERING, "reconnect_window": window}, "gone")
    training.start()
    assert training.reached[4].wait(60)
    reducers[0].signal(signal.SIGKILL)
    killed = time.monotonic()
    training.join(window + 20)
    assert sorted(rank for rank, _, _ in training.errors) == list(range(WORLD))
    for rank, exc, at in training.errors:
        assert isinstance(exc, redsrv.PeerLostError), (rank, exc)
        assert "reconnect window" in str(exc) and reducers[0].address in str(exc), (rank, exc)
        # +1: detection; never before the window (the reconnect thread waits until it closes)
        assert window <= at - killed <= window + 2.0 + 1.0, f"rank {rank} raised {at - killed:.2f}s after the kill"
    assert training.wrong == []


def test_clients_closed_and_made_again_for_the_same_job_keep_no_place_for_a_reconnect(procs) -> None:  # type: ignore[no-untyped-def]
    """A closed client says goodbye (wire.ErrorCode.CLOSED), so the reducer keeps no place for its
    rank: the next client for that rank is a newcomer, not a restarted worker that would void
    what the job's other new clients already sent (here rank 0's push, waiting for rank 1)."""
    from tests_support import wait_for_open_operations

    reducer = procs.start_reducer(env={"REDSRV_STALL_WARNING": "0.05"})
    config = {**RECOVERING, "op_timeout": 15.0}
    x = [np.full(1000, r + 1, np.float32) for r in range(2)]
    first = [redsrv.Client([reducer.address], rank=r, world_size=2, job="again", **config) for r in range(2)]
    futures = [c.allreduce_async(x[c.rank], key="first") for c in first]
    assert all(first[r].wait(f).tobytes() == (x[0] + x[1]).tobytes() for r, f in enumerate(futures))
    for client in first:
        client.close()
    with redsrv.Client([reducer.address], rank=0, world_size=2, job="again", **config) as rank0:
        pending = rank0.allreduce_async(x[0], key="second")
        wait_for_open_operations(reducer.log, 1)  # rank 0's push is in and waits for rank 1
        with redsrv.Client([reducer.address], rank=1, world_size=2, job="again", **config) as rank1:
            assert rank1.allreduce(x[1], key="second").tobytes() == (x[0] + x[1]).tobytes()
        assert rank0.wait(pending, timeout=15).tobytes() == (x[0] + x[1]).tobytes()


def _restarting_reducer(results_sent: threading.Event, crash: threading.Event,
                        settled: list[wire.Push]) -> tuple[str, threading.Thread, socket.socket]:
    """A scripted reducer (incarnation 5) that answers one operation's pushes with their values
    plus one, as the sum of two ranks, and never says SAFE; on ``crash`` it drops the connection and comes back as
    incarnation 6, collecting the SETTLED pushes the client then sends it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            pushes = read_one_operation(scripted_handshake(conn, 5))
            for push in pushes:
                data = (np.frombuffer(push.payload, np.float32) + 1).tobytes()
                conn.sendall(wire.encode(wire.Result(push.key, push.offset, push.count, push.chunk, push.dtype, 2,
                                                     b"\x03", data)))
            results_sent.set()
            assert crash.wait(10)
        conn, _ = listener.accept()
        with conn:
            next_frame = scripted_handshake(conn, 6)
            while sum(p.count for p in settled) < pushes[0].total:
                if isinstance(frame := next_frame(), wire.Push) and frame.op is wire.ReduceOp.SETTLED:
                    settled.append(frame)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    host, port = listener.getsockname()[:2]
    return f"{host}:{port}", thread, listener


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_a_restarted_reducer_is_given_the_results_as_they_came_even_after_the_caller_reused_its_buffer(op: str) -> None:
    """A client keeps each result until the reducer says every rank has it: a sum's lent from the
    operation's ``out`` while it can (client_ops.Copy), a mean's received into the copy and
    divided from there into ``out``. Here no SAFE ever comes: the caller gets ``out`` back and
    overwrites it, then the reducer restarts; what the client gives the new incarnation must
    still be the results as they came (before the mean), not what the caller wrote since."""
    results_sent, crash, settled = threading.Event(), threading.Event(), []
    address, thread, listener = _restarting_reducer(results_sent, crash, settled)
    x = np.arange(600_000, dtype=np.float32)  # more than one chunk
    out = np.empty_like(x)
    try:
        with redsrv.Client([address], rank=0, world_size=1, job="lent", **RECOVERING) as client:
            assert client.allreduce(x, op=op, out=out, timeout=10) is out
            assert out.tobytes() == ((x + 1) / 2 if op == "mean" else x + 1).tobytes()
            assert results_sent.wait(10)
            out.fill(-7.0)  # the caller's next step writes into the same buffer
            crash.set()
            thread.join(20)
            assert not thread.is_alive(), "the client did not give the restarted reducer its results"
        assert len(settled) > 1
        for push in settled:
            given = np.frombuffer(push.payload, np.float32)
            assert given.tobytes() == (x[push.offset : push.offset + push.count] + 1).tobytes(), push.offset
    finally:
        crash.set()
        thread.join(10)
        listener.close()


def test_results_are_acknowledged_as_they_arrive_not_at_the_next_tick(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The reducer keeps each result until every rank acknowledged it, and the client keeps a copy
    until the reducer's SAFE; a result still unsettled when its operation ends is copied out of
    ``out`` (client_ops.Op.take_back_lent). So the client acknowledges on the wake-up that read
    results once constants.PROMPT_ACK_BYTES of them are unacknowledged: with the loop's tick
    pushed out to a minute, all but less than that of a 2.4 MB operation must still settle at
    once (the last small chunks may wait for the tick)."""
    from redsrv.core import constants

    monkeypatch.setattr(constants, "TICK_INTERVAL_S", 60.0)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    acked: list[int] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            next_frame = scripted_handshake(conn, 5)
            pushes = read_one_operation(next_frame)
            for push in pushes:
                conn.sendall(wire.encode(wire.Result(push.key, push.offset, push.count, push.chunk, push.dtype, 1,
                                                     b"\x01", push.payload)))
            while not isinstance(frame := next_frame(), wire.Error):  # until the client says goodbye
                if isinstance(frame, wire.Ack):
                    acked.append(frame.results)
                    conn.sendall(wire.encode(wire.Safe(frame.results)))

    def unsettled(client: redsrv.Client) -> int:
        return sum(conn.kept_bytes for conn in client.connections())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = "{}:{}".format(*listener.getsockname()[:2])
    x = np.arange(600_000, dtype=np.float32)  # several chunks
    try:
        with redsrv.Client([address], rank=0, world_size=1, job="acks", **RECOVERING) as client:
            assert client.allreduce(x, timeout=10).tobytes() == x.tobytes()
            poll(lambda: unsettled(client) < constants.PROMPT_ACK_BYTES, 10,
                 f"the results settled but for less than {constants.PROMPT_ACK_BYTES} bytes (the client "
                 f"acknowledged {acked})", every=0.01)
        thread.join(10)
        assert not thread.is_alive(), "the client did not say goodbye"
    finally:
        listener.close()
        thread.join(10)


def test_small_results_wait_for_the_tick_to_be_acknowledged(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An ACK costs a frame each way; for a result below constants.PROMPT_ACK_BYTES it costs
    more than the copy it spares, so the client acknowledges small results with the next large
    one or at the tick, not one by one. With the tick a minute away, the first ACK the reducer
    sees comes after a large result and covers the small result before it too."""
    from redsrv.core import constants

    monkeypatch.setattr(constants, "TICK_INTERVAL_S", 60.0)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    acked: list[int] = []
    answered = [0]

    def answer(conn: socket.socket, pushes: list[wire.Push]) -> None:
        for push in pushes:
            conn.sendall(wire.encode(wire.Result(push.key, push.offset, push.count, push.chunk, push.dtype, 1,
                                                 b"\x01", push.payload)))
        answered[0] += len(pushes)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            next_frame = scripted_handshake(conn, 5)
            for _ in range(2):  # the small operation, then the large one
                pushes: list[wire.Push] = []
                while not pushes or sum(p.count for p in pushes) < pushes[0].total:
                    if isinstance(frame := next_frame(), wire.Push):
                        pushes.append(frame)
                    elif isinstance(frame, wire.Ack):
                        acked.append(frame.results)
                answer(conn, pushes)
            while not isinstance(frame := next_frame(), wire.Error):  # until the client says goodbye
                if isinstance(frame, wire.Ack):
                    acked.append(frame.results)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = "{}:{}".format(*listener.getsockname()[:2])
    small, large = np.arange(10, dtype=np.float32), np.arange(600_000, dtype=np.float32)
    try:
        with redsrv.Client([address], rank=0, world_size=1, job="acks", **RECOVERING) as client:
            assert client.allreduce(small, timeout=10).tobytes() == small.tobytes()
            assert client.allreduce(large, timeout=10).tobytes() == large.tobytes()
            poll(lambda: bool(acked), 10, "an ACK after the large results", every=0.01)
        thread.join(10)
        assert not thread.is_alive(), "the client did not say goodbye"
        assert acked and acked[0] >= 2, f"the small result was acknowledged alone, or nothing was: ACKs {acked}"
    finally:
        listener.close()
        thread.join(10)


def test_a_client_whose_loop_saw_the_close_first_still_says_goodbye(procs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """close() sets the loops' stop flag, then says goodbye on every stream; a loop that wakes
    in between (a SAFE or a result arriving) ends and drops its streams first. It must say the
    goodbye itself then, or the reducer keeps the rank's place as if the worker had crashed."""
    close = ClientEngine.close

    def close_once_the_loops_ended(engine: ClientEngine, deadline: float) -> None:
        engine.begin_close(deadline)  # as close() does first; the loop ends before close() gets to the goodbye
        for loop in engine.loops:
            loop.waker.wake()
            assert loop.thread is not None
            loop.thread.join(10)
            assert not loop.thread.is_alive()
        close(engine, deadline)

    monkeypatch.setattr(ClientEngine, "close", close_once_the_loops_ended)
    reducer = procs.start_reducer()
    with redsrv.Client([reducer.address], rank=0, world_size=1, job="bye", **RECOVERING) as client:
        assert client.allreduce(np.ones(10, np.float32)).tolist() == [1.0] * 10
    poll(lambda: any("(job 'bye' rank 0) ended: the worker closed its client" in line for line in list(reducer.log)),
         10, "the reducer logging the client's goodbye")


def test_a_peer_lost_error_while_reconnecting_names_the_reducer_this_rank_lost_too() -> None:
    """A reducer gone for good fails every rank, but not at the same instant: a rank whose window
    closed first says goodbye, and the reducers still up fail the chunks that needed it on the
    other ranks (wire.ErrorCode.PEER_LOST) before their own windows close. Their error must
    still name the reducer they lost and the window, not only the rank that left first."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    for listener in listeners:
        listener.settimeout(10)
    addresses = ["{}:{}".format(*listener.getsockname()[:2]) for listener in listeners]
    recovering = threading.Event()
    failed_after: list[wire.Push] = []

    def crashing() -> None:
        conn, _ = listeners[0].accept()
        with conn:
            next_frame = scripted_handshake(conn, 5)
            while not isinstance(next_frame(), wire.Push):
                pass
        listeners[0].close()  # gone for good: every reconnect is refused

    def failing_the_chunk() -> None:
        conn, _ = listeners[1].accept()
        with conn:
            next_frame = scripted_handshake(conn, 5)
            while not isinstance(push := next_frame(), wire.Push):
                pass
            assert recovering.wait(10)
            conn.sendall(wire.encode(wire.Error(wire.ErrorCode.PEER_LOST, False, "rank 1 of job 'lost' disconnected "
                                                "(closed); chunk cannot complete", push.key, push.chunk)))
            failed_after.append(push)
            while conn.recv(1 << 16):  # until the client closes: closing with unread bytes would reset
                pass

    threads = [threading.Thread(target=serve, daemon=True) for serve in (crashing, failing_the_chunk)]
    for thread in threads:
        thread.start()
    try:
        # The scripted reducers send no heartbeats: allow them 20 s of silence, not RECOVERING's 1 s.
        config = {**RECOVERING, "heartbeat_interval": 4.0}
        with redsrv.Client(addresses, rank=0, world_size=2, job="lost", **config) as client:
            pending = client.allreduce_async(np.ones(600_000, np.float32), key="step")
            poll(lambda: any(conn.recovering for conn in client.connections()), 10,
                 "the client reconnecting to the crashed reducer")
            recovering.set()
            with pytest.raises(redsrv.PeerLostError) as raised:
                client.wait(pending, timeout=10)
        message = str(raised.value)
        assert "rank 1 of job 'lost' disconnected" in message
        assert f"this rank lost reducer {addresses[0]} too" in message and "reconnect window left" in message
    finally:
        recovering.set()
        for thread in threads:
            thread.join(10)
        for listener in listeners:
            listener.close()
    assert failed_after and not any(thread.is_alive() for thread in threads)


def test_a_rank_that_fails_tells_the_other_ranks_why_through_the_reducers_it_still_reaches(procs) -> None:  # type: ignore[no-untyped-def]
    """Without a reconnect window a rank that loses a reducer fails at once, and says why to the
    reducers it still reaches (ClientEngine.say_failed): its goodbye carries the cause, and they
    fail the chunks that needed it on the other ranks with it. A rank that did not see the loss
    itself, or not yet (here reducer A drops rank 1's connection only, before any operation; in a
    real crash the other ranks' own loss may be read after the news), must still learn which
    reducer was lost, not only that rank 1 left."""
    reducer = procs.start_reducer()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    lost = "{}:{}".format(*listener.getsockname()[:2])
    kept: list[socket.socket] = []  # rank 0's connection to A: open, unanswered

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            hello, next_frame = scripted_join(conn, 5)
            if hello.rank == 0:
                kept.append(conn)
                continue
            conn.close()  # rank 1's: dropped at once

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    # No reconnect window; the scripted reducer sends no heartbeats: allow it 20 s of silence.
    config = {**RECOVERING, "heartbeat_interval": 4.0, "reconnect_window": 0.0}
    clients: list[redsrv.Client] = []
    try:
        for rank in range(2):
            clients.append(redsrv.Client([lost, reducer.address], rank=rank, world_size=2, job="why", **config))
        with pytest.raises(redsrv.PeerLostError, match=f"lost reducer {lost}"):
            clients[1].allreduce(np.ones(1000, np.float32), key="step", timeout=10)
        poll(lambda: any("(job 'why' rank 1) ended: the worker closed its client: it failed" in line
                         for line in list(reducer.log)), 10, "the reducer hearing why rank 1 left")
        with pytest.raises(redsrv.PeerLostError) as raised:
            clients[0].allreduce(np.ones(1 << 20, np.float32), key="step", timeout=10)
        message = str(raised.value)
        assert f"reducer {reducer.address}: rank 1 of job 'why' disconnected (the worker closed its client: " in message
        assert f"it failed: PeerLostError: lost reducer {lost}" in message, message
    finally:
        for client in clients:
            client.close()
        thread.join(10)
        for conn in kept:
            conn.close()
        listener.close()
    assert not thread.is_alive()


def test_a_client_closed_with_pushes_queued_finishes_the_frame_on_the_wire_and_says_goodbye() -> None:
    """A goodbye goes between whole frames. A client closed while its writer still holds pushes
    (a reducer reading slower than the client sends) finishes the frame on the wire, drops the
    rest and says goodbye, within the close timeout: without it the reducer would keep the
    rank's place as if the worker had crashed (client_connect.say_goodbye)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    start_reading = threading.Event()
    frames: list[wire.Frame] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            next_frame = scripted_handshake(conn, 5)
            assert start_reading.wait(20)  # meanwhile the client's socket fills and its writer queues pushes
            while True:
                frames.append(frame := next_frame())
                if isinstance(frame, wire.Error):
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = "{}:{}".format(*listener.getsockname()[:2])
    config = {**RECOVERING, "heartbeat_interval": 4.0}  # the scripted reducer sends no heartbeats
    try:
        client = redsrv.Client([address], rank=0, world_size=2, job="queued", **config)
        pending = client.allreduce_async(np.ones(16 << 20, np.float32), key="big")  # 64 MiB: more than a socket holds
        poll(lambda: any(conn.queued for conn in client.connections()), 10, "pushes queued in the writer")
        start_reading.set()
        client.close()
        with pytest.raises(redsrv.ClientClosedError):
            client.wait(pending, timeout=5)
        thread.join(10)
        assert not thread.is_alive(), "the reducer got no goodbye"
        last = frames[-1]
        assert isinstance(last, wire.Error) and last.code is wire.ErrorCode.CLOSED, last
        assert any(isinstance(f, wire.Push) for f in frames[:-1]), frames  # the queued pushes, then the goodbye
    finally:
        start_reading.set()
        listener.close()
        thread.join(10)
