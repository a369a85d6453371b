"""The native frame writer (``native/writer.c``) against the reference (``transport.FrameWriter``).

Both writers run the same calls in lockstep, each on a socket pair of its own with the same small
send buffer, and a reader that takes the same bytes from each: after every call both must have
queued the same frames, kept the same clocks, handed back the same callbacks, raised the same
errors, and put the same bytes on the wire. Hypothesis makes the calls (frames of one to many
views, made by a callable or given, sent ahead or deferred; flushes, partial reads, a peer that
closes, a goodbye's ``finish_frame``, ``abandon``)."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import plane
from redsrv.core.transport import ConnectionBroken, FrameWriter

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built")]

SEND_BUFFER = 8192  # small, so that frames of a few KiB queue and partial writes happen


def _native() -> Any:
    return plane.kernels_for("native").frame_writer


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    return a, b


def _read(sock: socket.socket, most: int) -> bytes:
    got = bytearray()
    with contextlib.suppress(BlockingIOError, ConnectionError):
        while len(got) < most:
            chunk = sock.recv(most - len(got))
            if not chunk:
                break
            got += chunk
    return bytes(got)


class _Side:
    """One writer, its socket pair, what it handed back and what its peer read."""

    def __init__(self, kind: Any) -> None:
        self.a, self.b = _pair()
        self.writer = kind(self.a, 0.0)
        self.finished: list[Callable[[bool], None]] = []
        self.received = bytearray()
        self.made: list[int] = []  # frames whose views a callable made, in the order it was asked

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def state(self) -> tuple[int, float, float, list[str], bytes]:
        names = [getattr(done, "name", "?") for done in self.finished]
        return self.writer.queued, self.writer.last_send, self.writer.last_progress, names, bytes(self.received)


class _Done:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, ok: bool) -> None:  # pragma: no cover - the owner runs it, not these tests
        pass


def _frame(index: int, sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytes([(index * 7 + j) % 251]) * size) for j, size in enumerate(sizes)]


def _call(side: _Side, op: tuple[Any, ...], now: float) -> tuple[str, str] | None:
    """Run one call on one side: None, or the class and message of what it raised."""
    kind = op[0]
    try:
        if kind == "send":
            _, index, sizes, ahead, defer, lazy, with_done = op
            views: Any = _frame(index, sizes)
            if lazy:
                made = views

                def views() -> list[memoryview]:
                    side.made.append(index)
                    return made
            side.writer.send(views, _Done(f"f{index}") if with_done else None, now, side.finished, ahead=ahead,
                             defer=defer)
        elif kind == "flush":
            side.writer.flush(now, side.finished)
        elif kind == "read":
            side.received += _read(side.b, op[1])
        elif kind == "close_peer":
            side.received += _read(side.b, 1 << 20)
            side.b.shutdown(socket.SHUT_RDWR)
        elif kind == "abandon":
            side.finished += side.writer.abandon()
    except ConnectionBroken as exc:
        return "ConnectionBroken", f"{exc.kind}: {exc.detail}"
    return None


_ops = st.one_of(
    # A frame starts with its prefix: the first view is never empty (the reference would make a
    # system call for an empty one, the native writer none).
    st.tuples(st.just("send"), st.integers(0, 10**6),
              st.tuples(st.sampled_from([1, 20, 700, 5000, 20_000]),
                        st.lists(st.sampled_from([0, 1, 20, 700, 5000, 20_000]), max_size=4)).map(lambda t: [t[0], *t[1]]),
              st.booleans(), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("flush")),
    st.tuples(st.just("read"), st.sampled_from([1, 100, 4096, 30_000, 1 << 20])),
    st.tuples(st.just("close_peer")),
    st.tuples(st.just("abandon")),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ops, min_size=1, max_size=25))
def test_both_writers_make_the_same_calls_end_alike(ops: list[tuple[Any, ...]]) -> None:
    reference, native = _Side(FrameWriter), _Side(_native())
    try:
        for step, op in enumerate(ops, start=1):
            now = float(step)
            outcomes = [_call(side, op, now) for side in (reference, native)]
            if op[0] == "close_peer":
                continue  # the same bytes were read; the next write finds the peer gone on both
            assert outcomes[0] == outcomes[1], f"call {step} {op[0]}"
            assert reference.state() == native.state(), f"after call {step} {op[0]}"
            assert reference.made == native.made
        # The rest goes out once the peer reads, unless it is gone.
        for side in (reference, native):
            deadline = time.monotonic() + 10
            while side.writer.queued and time.monotonic() < deadline:
                if _call(side, ("flush",), 1000.0) is not None:
                    break
                side.received += _read(side.b, 1 << 20)
            side.received += _read(side.b, 1 << 20)
        assert reference.state() == native.state()
    finally:
        reference.close()
        native.close()


@pytest.mark.parametrize("ahead", [False, True])
def test_finish_frame_writes_the_frame_on_the_wire_and_drops_the_rest_on_both(ahead: bool) -> None:
    # A client's goodbye (client_connect.say_goodbye): the frame half on the wire is finished
    # while the peer reads, within the deadline; the frames queued behind it are handed back.
    sides = [_Side(FrameWriter), _Side(_native())]
    try:
        results = []
        for side in sides:
            for index in range(3):
                side.writer.send(_frame(index, [40_000]), _Done(f"f{index}"), 1.0, side.finished)
            side.writer.send(_frame(9, [20]), _Done("control"), 1.0, side.finished, ahead=ahead)
            assert side.writer.queued == 4 and not side.finished
            reader = threading.Thread(target=lambda s=side: s.received.extend(_read_until(s.b, 40_000)))
            reader.start()
            between, callbacks = side.writer.finish_frame(time.monotonic() + 10)
            reader.join(10)
            results.append((between, [(done.name, ok) for done, ok in callbacks], side.writer.queued))
            assert bytes(side.received) == b"".join(bytes(v) for v in _frame(0, [40_000]))
        assert results[0] == results[1]
        assert results[0][0] is True and results[0][2] == 0
        assert results[0][1][-1] == ("f0", True)
    finally:
        for side in sides:
            side.close()


def _read_until(sock: socket.socket, nbytes: int) -> bytes:
    """A blocking reader with a deadline: what a peer that reads looks like to a writer."""
    got = bytearray()
    sock.settimeout(10)
    with contextlib.suppress(OSError):
        while len(got) < nbytes:
            chunk = sock.recv(nbytes - len(got))
            if not chunk:
                break
            got += chunk
    sock.setblocking(False)
    return bytes(got)


def test_finish_frame_gives_up_at_its_deadline_on_both() -> None:
    sides = [_Side(FrameWriter), _Side(_native())]
    try:
        for side in sides:
            side.writer.send(_frame(0, [200_000]), _Done("big"), 1.0, side.finished)
            started = time.monotonic()
            between, callbacks = side.writer.finish_frame(started + 0.05)
            assert between is False and callbacks == []
            assert time.monotonic() - started < 5
            between, callbacks = side.writer.finish_frame(time.monotonic() - 1)  # already past
            assert between is False
    finally:
        for side in sides:
            side.close()


@pytest.mark.parametrize("kind", ["reference", "native"])
def test_a_closed_socket_fails_as_a_broken_connection_and_is_never_written_to(kind: str) -> None:
    # The native writer asks the socket for its descriptor before each write: after close() the
    # number may belong to another socket, which must never get this connection's frames.
    cls = FrameWriter if kind == "reference" else _native()
    a, b = _pair()
    writer = cls(a, 0.0)
    a.close()
    c, d = socket.socketpair()  # likely reuses a's descriptor number
    try:
        with pytest.raises(ConnectionBroken) as raised:
            writer.send([memoryview(b"x" * 10)], None, 1.0, [])
        assert raised.value.kind == "reset" and "[Errno 9]" in raised.value.detail
        d.setblocking(False)
        with pytest.raises(BlockingIOError):
            d.recv(1)
    finally:
        for sock in (b, c, d):
            sock.close()


def test_the_native_writer_holds_the_buffers_of_queued_frames_and_lets_them_go() -> None:
    side = _Side(_native())
    try:
        data = bytearray(100_000)
        side.writer.send([memoryview(data)], None, 1.0, side.finished)
        assert side.writer.queued == 1
        with pytest.raises(BufferError):  # exported to the writer until the frame is out
            data.extend(b"x")
        side.writer.abandon()
        data.extend(b"x")  # released
    finally:
        side.close()


def test_the_native_writer_refuses_a_call_made_while_another_runs() -> None:
    side = _Side(_native())
    try:
        raised: list[BaseException] = []

        def views() -> list[memoryview]:
            try:
                side.writer.send([memoryview(b"inner")], None, 1.0, side.finished)
            except RuntimeError as exc:
                raised.append(exc)
            return [memoryview(b"outer")]

        side.writer.send(views, None, 1.0, side.finished)
        assert len(raised) == 1 and "while another runs" in str(raised[0])
        assert _read(side.b, 100) == b"outer"
        with pytest.raises(ValueError, match="boom"):  # a callable that fails: its error, nothing queued
            side.writer.send(lambda: (_ for _ in ()).throw(ValueError("boom")), None, 2.0, side.finished)
        assert side.writer.queued == 0
        with pytest.raises(TypeError):
            side.writer.send([1, 2], None, 2.0, side.finished)
        assert side.writer.queued == 0
    finally:
        side.close()


def test_a_frame_of_many_views_goes_out_whole() -> None:
    # More views than one sendmsg takes (MAX_IOV in native/writer.c).
    sides = [_Side(FrameWriter), _Side(_native())]
    try:
        for side in sides:
            views = [memoryview(bytes([i % 256]) * (1 + i % 5)) for i in range(300)]
            expected = b"".join(bytes(v) for v in views)
            side.writer.send(views, _Done("many"), 1.0, side.finished)  # the reference consumes the list
            deadline = time.monotonic() + 10
            while side.writer.queued and time.monotonic() < deadline:
                side.received += _read(side.b, 1 << 16)
                side.writer.flush(2.0, side.finished)
            side.received += _read(side.b, 1 << 16)
            assert bytes(side.received) == expected
        assert sides[0].state() == sides[1].state()
    finally:
        for side in sides:
            side.close()


def test_a_writer_in_a_reference_cycle_is_collected() -> None:
    # A queued frame's callback that reaches its writer (the daemon's callbacks reach the daemon,
    # which holds the writer): the cycle goes through the writer's queue, which the collector sees.
    class Token:
        pass

    side = _Side(_native())
    try:
        token = Token()
        holder: dict[str, Any] = {"writer": side.writer, "token": token}
        side.writer.send([memoryview(b"y" * 100_000)], lambda ok, h=holder: h, 1.0, side.finished)
        assert side.writer.queued == 1  # the frame, and so the cycle, stays in the queue
        probe = weakref.ref(token)
        side.writer = None
        del holder, token
        gc.collect()
        assert probe() is None
    finally:
        side.close()
