"""The reducer's state machine with a native forwarder (``ReducerCore._engage``) against the same
state machine forwarding every piece itself, on the same events.

Each runs one cut-through chunk to its end on the same Hypothesis-made schedule: every rank's push
header, its payload landing in steps in any interleaving, and now and then a connection that breaks
mid-payload and a rank that reconnects on a new connection and resends (RELIABILITY R22). The
forwarder is told each landing as the daemon's push receivers tell it (``PushReceiver.feed``); the
frames either core asks the daemon to send are written to the same connections' writers in order.
Every connection must read the same bytes from both, and both cores must end in the same books:
frames counted per connection, bytes sent, the SAFE frames an acknowledgement of everything brings."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import plane, wire
from redsrv.core.reducer import PushTicket, ReducerCore, SendError, SendResult, SendSafe

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built")]

INC = 0x5EED
NONCE = bytes(16)
RECONNECT = {"reconnect_window_ms": 5000}


class _Daemon:
    """What the daemon does for one core: a writer per connection, the frames its actions name,
    and (with a forwarder) the landings told to it."""

    def __init__(self, world: int, piece: int, native: bool) -> None:
        kernels = plane.kernels_for("native")
        self.world = world
        self.sockets: list[socket.socket] = []
        self.writers: dict[int, Any] = {}
        self.peers: dict[int, socket.socket] = {}
        self.feeds: dict[int, tuple[Any, int]] = {}
        self.failed: list[BaseException] = []
        sinks = self._sink if native else None
        self.core = ReducerCore(INC, piece_bytes=piece, rejoin_grace=5.0, kernels=kernels, result_sinks=sinks)
        for rank in range(world):
            self.join(rank, rank + 1)

    def join(self, rank: int, conn: int) -> None:
        a, b = socket.socketpair()
        for s in (a, b):
            s.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        self.writers[conn], self.peers[conn] = plane.kernels_for("native").frame_writer(a, 0.0), b
        self.sockets += [a, b]
        joined = self.run(self.core.join(conn, wire.Hello("j", rank, self.world, 100 + rank, NONCE, **RECONNECT)))
        assert not [a for a in joined if isinstance(a, SendError)]

    def _sink(self, conn: int) -> Any:
        return (self.writers[conn], lambda: None, self.failed.append)

    def run(self, actions: list) -> list:  # type: ignore[type-arg]
        """Send what the actions say, in order, as ReducerDaemon._execute does; the rest is returned."""
        left = []
        for action in actions:
            if isinstance(action, SendResult):
                for conn in action.conns:
                    finished: list[Any] = []
                    self.writers[conn].send([memoryview(action.header), action.data], None, 0.0, finished)
                    action.release()
            elif isinstance(action, SendSafe):
                finished = []
                self.writers[action.conn].send([memoryview(wire.encode(wire.Safe(action.frames)))], None, 0.0, finished)
            else:
                left.append(action)
        return left

    def begin(self, conn: int, push: wire.Push, nbytes: int) -> PushTicket:
        outcome = self.core.begin_push(conn, push, nbytes, 0.0)
        assert isinstance(outcome, PushTicket), outcome
        assert not self.run(outcome.replay)
        for fed, rank in outcome.feeds:
            self.feeds[fed] = (outcome.forwarder, rank)
        return outcome

    def land(self, ticket: PushTicket, upto: int) -> None:
        feed = self.feeds.get(ticket.conn)
        if feed is not None:
            feed[0].landed(feed[1], upto)
        assert not self.run(self.core.progress(ticket, upto, 0.0))

    def finish(self, ticket: PushTicket) -> None:
        self.feeds.pop(ticket.conn, None)
        assert not [a for a in self.run(self.core.finish_push(ticket, 0.0)) if isinstance(a, SendError)]

    def abort(self, ticket: PushTicket) -> None:
        self.feeds.pop(ticket.conn, None)
        self.core.abort_push(ticket)
        assert not [a for a in self.run(self.core.leave(ticket.conn, "connection reset", 0.0)) if isinstance(a, SendError)]

    def wire_bytes(self) -> dict[int, bytes]:
        out = {}
        for conn, peer in self.peers.items():
            got = bytearray()
            with contextlib.suppress(BlockingIOError):
                while chunk := peer.recv(1 << 20):
                    got += chunk
            out[conn] = bytes(got)
        return out

    def close(self) -> None:
        for s in self.sockets:
            s.close()


@st.composite
def _schedules(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[str, int, int]]]:
    world = draw(st.integers(1, 3))
    count = draw(st.integers(1, 600))
    piece = draw(st.integers(4, 900))
    size = count * 4
    steps: dict[int, list[int]] = {}
    for rank in range(world):
        cuts = sorted(set(draw(st.lists(st.integers(1, size), max_size=5)) + [size]))
        steps[rank] = cuts
    events: list[tuple[str, int, int]] = []
    pending = {rank: ["begin"] + [f"land:{c}" for c in steps[rank]] + ["finish"] for rank in range(world)}
    broken = set()
    while any(pending.values()):
        rank = draw(st.sampled_from(sorted(r for r, left in pending.items() if left)))
        event = pending[rank].pop(0)
        if event.startswith("land:"):
            upto = int(event[5:])
            events.append(("land", rank, upto))
            if upto < size and rank not in broken and draw(st.integers(0, 5)) == 0:
                broken.add(rank)  # its connection breaks here; it reconnects and resends the whole push
                events.append(("break", rank, upto))
                pending[rank] = ["begin"] + [f"land:{c}" for c in steps[rank] if c > upto] + ["finish"]
        else:
            events.append((event, rank, 0))
    return world, count, piece, events


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schedules(), st.integers(0, 2**32 - 1))
def test_a_forwarder_sends_what_the_state_machine_sends_and_leaves_it_the_same_books(schedule, seed) -> None:  # type: ignore[no-untyped-def]
    world, count, piece, events = schedule
    rng = np.random.default_rng(seed)
    data = [rng.standard_normal(count).astype(np.float32).view(np.uint8) for _ in range(world)]
    push = wire.Push(1, INC, count, 0, count, 0, wire.DType.FLOAT32)
    sides = [_Daemon(world, piece, native) for native in (False, True)]
    try:
        for side in sides:
            conn = {rank: rank + 1 for rank in range(world)}
            tickets: dict[int, PushTicket] = {}
            for kind, rank, upto in events:
                if kind == "begin":
                    tickets[rank] = side.begin(conn[rank], push, data[rank].nbytes)
                elif kind == "land":
                    ticket = tickets[rank]
                    ticket.buffer[:upto] = data[rank][:upto]  # a resend lands only past what was kept
                    side.land(ticket, upto)
                elif kind == "break":
                    side.abort(tickets.pop(rank))
                    conn[rank] += 100
                    side.join(rank, conn[rank])
                else:
                    side.finish(tickets.pop(rank))
        python, native = sides
        if not any(kind == "break" for kind, _, _ in events):
            assert native.core.engaged_chunks == 1  # the forwarder did the chunk's forwarding
        assert native.wire_bytes() == python.wire_bytes()
        for conn in python.writers:
            info_p, info_n = python.core._conns.get(conn), native.core._conns.get(conn)
            assert (info_p is None) == (info_n is None)
            if info_p is not None and info_n is not None:
                assert info_n.frames_sent[0] == info_p.frames_sent[0]
                safe_p = python.core.ack(conn, info_p.frames_sent[0])
                safe_n = native.core.ack(conn, info_n.frames_sent[0])
                assert safe_n == safe_p
        assert native.core.stats("j").bytes_out == python.core.stats("j").bytes_out
        assert native.core.open_chunks("j") == python.core.open_chunks("j") == 0
        assert native.failed == []
    finally:
        for side in sides:
            side.close()
