"""The transport: the event loops' frame reader and writer, fed through real sockets (frames
arrive whole and in order, payloads land where the owner said, large payloads wake the reader
once), and the handshakes' blocking reads (deadlines)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from redsrv.core import plane, wire
from redsrv.core.transport import (
    SKIP,
    WAIT,
    ConnectionBroken,
    FrameReader,
    FrameWriter,
    congestion_control,
    send_views,
    set_congestion_control,
)

pytestmark = pytest.mark.timeout(60)

#: Both frame writers: the reference and the native plane's (native/writer.c), where built.
WRITERS = [pytest.param(FrameWriter, id="python"),
           pytest.param("native", id="native",
                        marks=pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built"))]


@pytest.fixture(params=WRITERS)
def writer_class(request: pytest.FixtureRequest) -> Any:
    return plane.kernels_for("native").frame_writer if request.param == "native" else request.param


class _Collector:
    """A reader's owner that keeps each RESULT payload in a buffer of its own (but skips the keys
    in ``skip_keys``) and keeps ERROR frames."""

    def __init__(self, sock: socket.socket, *, wait_first: int = 0, skip_keys: tuple[int, ...] = ()) -> None:
        self.results: list[tuple[wire.FrameHeader, bytearray]] = []  # from its header on
        self.completed = 0  # results whose payload is all in
        self.payload_in = threading.Event()  # set when a result's payload is all in
        self.errors: list[wire.Error] = []
        self.skipped = 0
        self.skip_keys = skip_keys
        self.headers_asked = 0
        self.wait_first = wait_first  # answer WAIT this many times first (budget backpressure)
        self.reader = FrameReader(sock, max_payload=1 << 26, now=time.monotonic(), data_frame=wire.FrameType.RESULT,
                                  sender="the test", on_header=self.on_header, on_payload=self.on_payload,
                                  on_error=self.errors.append)

    def on_header(self, header: wire.FrameHeader) -> tuple[memoryview, str] | str:
        self.headers_asked += 1
        if self.wait_first:
            self.wait_first -= 1
            return WAIT
        if header.fields[0] in self.skip_keys:
            self.skipped += 1
            return SKIP
        buffer = bytearray(header.payload_len)
        self.results.append((header, buffer))
        return memoryview(buffer), "a result"

    def on_payload(self) -> None:
        self.completed += 1
        self.payload_in.set()
        return None


def _drive(reader: FrameReader, until: Callable[[], bool], timeout: float = 10.0, max_frames: int = 16) -> None:
    """A one-socket event loop: poll, read what is there, until ``until()`` or the deadline."""
    poller = select.poll()
    poller.register(reader.sock, select.POLLIN)
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"reader stuck in {reader.what} ({len(reader.decoder.buffer())} bytes to go)"
        if poller.poll(100):
            reader.read(time.monotonic(), max_frames)


def _result_frame(key: int, index: int, data: np.ndarray) -> tuple[bytes, memoryview]:
    header = wire.result_header(wire.Result(key, index, data.size, 0, wire.DType.INT32, 1, b"\x01"), data.nbytes)
    return header, memoryview(data.tobytes())  # the header ends with the bitmap


def test_frames_written_from_many_threads_arrive_whole_and_in_order(writer_class: Any) -> None:
    # Callers write under their owner's lock, as the client's do; what the socket does not take
    # waits in the writer until the owner flushes it.
    a, b = socket.socketpair()
    with a, b:  # closed even when an assertion fails, or the next test reports the leak
        a.setblocking(False)
        b.setblocking(False)
        writer = writer_class(a, time.monotonic())
        lock = threading.Lock()
        threads, per_thread, size = 4, 100, 20_000
        done: list[bool] = []
        queued = threading.Event()  # set under the lock while the writer holds bytes the socket did not take

        def produce(t: int) -> None:
            for i in range(per_thread):
                header, payload = _result_frame(t, i, np.full(size + (i % 7), t * 1000 + i, dtype=np.int32))
                finished: list[Callable[[bool], None]] = []
                views = [memoryview(header), payload] if i % 2 else (lambda h=header, p=payload: [memoryview(h), p])
                with lock:
                    writer.send(views, done.append, time.monotonic(), finished)
                    if writer.out:
                        queued.set()
                for callback in finished:
                    callback(True)

        def flush_until_done() -> None:
            # What an owner's event loop does: wait for queued bytes and a socket that takes more.
            deadline = time.monotonic() + 30
            while len(done) < threads * per_thread and time.monotonic() < deadline:
                if not queued.wait(0.1):
                    continue
                select.select([], [a], [], 0.1)
                finished: list[Callable[[bool], None]] = []
                with lock:
                    writer.flush(time.monotonic(), finished)
                    if not writer.out:
                        queued.clear()
                for callback in finished:
                    callback(True)

        collector = _Collector(b)
        workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        workers.append(threading.Thread(target=flush_until_done))
        for w in workers:
            w.start()
        _drive(collector.reader, lambda: collector.completed == threads * per_thread)
        for w in workers:
            w.join(10)
        seen = {t: 0 for t in range(threads)}
        for header, payload in collector.results:
            frame = wire.parse_payload(header, payload)
            assert isinstance(frame, wire.Result)
            values = np.frombuffer(bytes(frame.payload), dtype=np.int32)
            assert values.size == size + frame.offset % 7
            assert (values == frame.key * 1000 + frame.offset).all(), "a frame was torn"
            assert frame.offset == seen[frame.key], "frames of one thread were reordered"
            seen[frame.key] += 1
        assert done == [True] * (threads * per_thread)
        assert not writer.out


def test_a_frame_sent_ahead_overtakes_the_queued_frames_but_not_the_one_being_written(writer_class: Any) -> None:
    # An ACK or SAFE must not wait behind megabytes of queued data, and must not cut a frame in two.
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        writer = writer_class(a, time.monotonic())
        finished: list[Callable[[bool], None]] = []
        written: list[str] = []
        big = [_result_frame(i, 0, np.full(200_000, i, dtype=np.int32)) for i in range(3)]
        for i, (header, payload) in enumerate(big):
            writer.send([memoryview(header), payload], lambda ok, i=i: written.append(f"big{i}"), time.monotonic(),
                        finished)
        assert writer.queued == 3, "the socket took a whole 800 KB frame: the test needs it to queue"
        ack = wire.encode(wire.Ack(7))
        writer.send([memoryview(ack)], lambda ok: written.append("ack"), time.monotonic(), finished, ahead=True)
        received = bytearray()
        b.setblocking(False)
        deadline = time.monotonic() + 10
        while writer.out:
            assert time.monotonic() < deadline, "the writer did not drain"
            select.select([], [a], [], 0.1)
            writer.flush(time.monotonic(), finished)
            with contextlib.suppress(BlockingIOError):
                while chunk := b.recv(1 << 20):
                    received += chunk
        for callback in finished:
            callback(True)
        with contextlib.suppress(BlockingIOError):
            while chunk := b.recv(1 << 20):
                received += chunk
        assert written == ["big0", "ack", "big1", "big2"]
        decoder = wire.FrameDecoder()
        decoder.receive_data(bytes(received))
        kinds = []
        while (frame := decoder.next_frame()) is not None:
            kinds.append(frame.key if isinstance(frame, wire.Result) else type(frame).__name__)
        assert kinds == [0, "Ack", 1, 2]


def test_a_deferred_frame_waits_for_the_owners_flush_and_starts_the_stall_clock(writer_class: Any) -> None:
    # REDSRV_IO_THREADS > 1: a caller's thread leaves a large push to its stream's loop (IOLoop.send_frame).
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        writer = writer_class(a, 0.0)
        finished: list[Callable[[bool], None]] = []
        header, payload = _result_frame(3, 0, np.arange(1000, dtype=np.int32))
        writer.send([memoryview(header), payload], lambda ok: None, 5.0, finished, defer=True)
        assert writer.queued == 1 and not finished
        assert writer.last_progress == 5.0 and writer.last_send == 0.0  # waiting since 5.0; nothing written yet
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)
        writer.send([memoryview(wire.encode(wire.Ack(1)))], None, 6.0, finished)  # queued behind, in order
        writer.flush(7.0, finished)
        assert not writer.out and len(finished) == 1 and writer.last_send == 7.0
        received = bytearray()
        with contextlib.suppress(BlockingIOError):
            while chunk := b.recv(1 << 20):
                received += chunk
        decoder = wire.FrameDecoder()
        decoder.receive_data(bytes(received))
        kinds = []
        while (frame := decoder.next_frame()) is not None:
            kinds.append(frame.key if isinstance(frame, wire.Result) else type(frame).__name__)
        assert kinds == [3, "Ack"]


def test_the_reader_drops_heartbeats_and_what_it_is_told_to_skip_and_hands_over_errors() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    skipped_header, skipped_payload = _result_frame(5, 1, np.arange(100, dtype=np.int32))
    header, payload = _result_frame(9, 3, np.arange(10, dtype=np.int32))
    a.sendall(skipped_header + bytes(skipped_payload) + wire.encode(wire.Heartbeat()) + header + bytes(payload)
              + wire.encode(wire.Error(wire.ErrorCode.STALE, False, "late", 5, 1)))
    collector = _Collector(b, skip_keys=(5,))
    _drive(collector.reader, lambda: bool(collector.errors))
    assert collector.skipped == 1 and collector.headers_asked == 2  # the heartbeat never reached the owner
    [(result, data)] = collector.results
    assert result.fields[0] == 9 and bytes(data) == b"\x01" + bytes(payload)
    [error] = collector.errors
    assert error.message == "late" and error.code is wire.ErrorCode.STALE
    a.close()
    b.close()


def test_a_frame_of_a_type_the_reader_does_not_serve_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    push = wire.Push(5, 1, 100, 0, 100, 0, wire.DType.INT32, wire.ReduceOp.SUM, 0)
    a.sendall(wire.push_header(push, 400) + bytes(400))
    collector = _Collector(b)
    with pytest.raises(ConnectionBroken) as info:
        _drive(collector.reader, lambda: False, timeout=5)
    assert info.value.kind == "protocol" and "unexpected PUSH frame from the test" in info.value.detail
    assert collector.headers_asked == 0
    a.close()
    b.close()


def test_frames_packed_back_to_back_are_all_read_even_one_frame_per_turn() -> None:
    # One frame per turn, the rest of the burst already in the socket: each turn must leave the
    # reader ready for the next (a frame held back in user space would never wake the loop).
    a, b = socket.socketpair()
    b.setblocking(False)
    frames = [_result_frame(key, 0, np.arange(key % 7, key % 7 + 30, dtype=np.int32)) for key in range(1, 41)]
    a.sendall(b"".join(header + bytes(payload) + wire.encode(wire.Heartbeat()) for header, payload in frames)
              + wire.encode(wire.Error(wire.ErrorCode.STALE, False, "last", 40, 0)))
    collector = _Collector(b)
    _drive(collector.reader, lambda: bool(collector.errors), timeout=5, max_frames=1)
    assert [h.fields[0] for h, _ in collector.results] == list(range(1, 41))
    assert all(bytes(data) == b"\x01" + bytes(payload) for (_, data), (_, payload) in zip(collector.results, frames))
    a.close()
    b.close()


def test_a_header_answered_wait_is_asked_again_on_the_next_read() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    header, payload = _result_frame(1, 0, np.arange(4, dtype=np.int32))
    a.sendall(header + bytes(payload))
    collector = _Collector(b, wait_first=2)
    _drive(collector.reader, lambda: collector.headers_asked >= 1)
    collector.reader.read(time.monotonic(), 16)  # nothing new on the socket: the header is asked again
    collector.reader.read(time.monotonic(), 16)
    assert collector.headers_asked == 3 and len(collector.results) == 1
    assert bytes(collector.results[0][1]) == b"\x01" + bytes(payload)
    a.close()
    b.close()


def test_the_real_reader_fed_one_byte_at_a_time_lands_every_frame_as_when_fed_whole() -> None:
    # Every state of the decoder the data path runs, reached through a real socket one byte per
    # read: results landed in two parts (bitmap, then data, as the client does), a skipped
    # result, heartbeats, counts and an error.
    frames = [_result_frame(key, 0, np.arange(key, key + 9, dtype=np.int32)) for key in (1, 2, 3)]
    stream = (frames[0][0] + bytes(frames[0][1]) + wire.encode(wire.Heartbeat()) + wire.encode(wire.Ack(1))
              + frames[1][0] + bytes(frames[1][1]) + wire.encode(wire.Safe(2)) + frames[2][0] + bytes(frames[2][1])
              + wire.encode(wire.Error(wire.ErrorCode.STALE, False, "last", 3, 0)))
    bitmaps: list[bytes] = []
    data: list[bytes] = []
    counts: list[tuple[wire.FrameType, int]] = []
    errors: list[wire.Error] = []
    parts: list[bytearray] = []

    def on_header(header: wire.FrameHeader) -> tuple[memoryview, str] | str:
        if header.fields[0] == 2:
            return SKIP
        parts[:] = [bytearray(1), bytearray(header.payload_len - 1)]
        return memoryview(parts[0]), "a bitmap"

    def on_payload() -> tuple[memoryview, str] | None:
        if len(parts) == 2:
            bitmaps.append(bytes(parts.pop(0)))
            return memoryview(parts[0]), "the data"
        data.append(bytes(parts.pop()))
        return None

    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        reader = FrameReader(b, max_payload=1 << 20, now=time.monotonic(), data_frame=wire.FrameType.RESULT,
                             sender="the test", on_header=on_header, on_payload=on_payload, on_error=errors.append,
                             on_count=lambda kind, count: counts.append((kind, count)))
        for i in range(len(stream)):
            a.send(stream[i : i + 1])
            reader.read(time.monotonic(), 16)
            with pytest.raises(BlockingIOError):
                b.recv(1, socket.MSG_PEEK)  # the reader took the byte
    assert bitmaps == [b"\x01", b"\x01"]
    assert data == [bytes(frames[0][1]), bytes(frames[2][1])]
    assert counts == [(wire.FrameType.ACK, 1), (wire.FrameType.SAFE, 2)]
    assert [e.message for e in errors] == ["last"]
    assert reader.decoder.between_frames


def test_an_owner_that_closes_the_connection_from_its_callback_stops_the_reader_there() -> None:
    # The reducer closes a connection from inside its callbacks (a refused push, a fatal error);
    # whatever the callback returns then must not be acted on.
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        frames = [_result_frame(key, 0, np.arange(8, dtype=np.int32)) for key in (1, 2)]
        a.sendall(b"".join(header + bytes(payload) for header, payload in frames))
        asked: list[int] = []
        reader: FrameReader

        def on_header(header: wire.FrameHeader) -> tuple[memoryview, str]:
            asked.append(header.fields[0])
            return memoryview(bytearray(1)), "a bitmap"

        def on_payload() -> tuple[memoryview, str]:
            reader.release()
            return memoryview(bytearray(32)), "the data"  # a stale answer, after the close

        reader = FrameReader(b, max_payload=1 << 20, now=time.monotonic(), data_frame=wire.FrameType.RESULT, sender="the test",
                             on_header=on_header, on_payload=on_payload, on_error=lambda _e: None)
        reader.read(time.monotonic(), 16)
        assert reader.stopped and asked == [1], "the reader went on after its owner closed the connection"


def test_frames_read_ahead_beyond_the_turns_limit_are_decoded_before_the_reader_returns() -> None:
    # Small frames behind a header arrive in the same read (the decoder's read-ahead). Once read
    # they are in no socket buffer, so no poll would ever report them: one read() must decode all
    # of them, even past its max_frames, and leave nothing held.
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        counts: list[tuple[wire.FrameType, int]] = []
        reader = FrameReader(b, max_payload=1 << 20, now=time.monotonic(), data_frame=wire.FrameType.RESULT,
                             sender="the test", on_header=lambda _h: SKIP, on_payload=lambda: None,
                             on_error=lambda _e: None, on_count=lambda kind, count: counts.append((kind, count)))
        a.sendall(b"".join(wire.encode(wire.Safe(i)) for i in range(1, 11)))
        reader.read(time.monotonic(), 2)
        assert counts == [(wire.FrameType.SAFE, i) for i in range(1, 11)]
        assert not reader.decoder.held and reader.decoder.between_frames
        with pytest.raises(BlockingIOError):
            b.recv(1, socket.MSG_PEEK)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
    return client, accepted


def test_a_large_payload_arriving_in_pieces_is_read_whole_and_the_next_header_still_wakes_the_reader() -> None:
    # A large payload is awaited with a receive low-water mark; it must be reset after, or the
    # small frame that follows would never wake the loop.
    a, b = _tcp_pair()
    b.setblocking(False)
    data = np.arange(256 * 1024, dtype=np.int32)  # 1 MiB
    header, payload = _result_frame(7, 0, data)
    raw = header + bytes(payload)

    def trickle() -> None:
        for start in range(0, len(raw), 100_000):
            a.sendall(raw[start : start + 100_000])
            # Pacing, not a synchronisation: the reader waits on a low-water mark, so no event of
            # its own says a piece was taken; the pieces only need to arrive apart.
            time.sleep(0.01)  # noqa: TID251
        # Only once the large payload is all in does the reader wait for the next header: the
        # frame sent now must wake it.
        assert collector.payload_in.wait(5), "the large payload never completed"
        a.sendall(wire.encode(wire.Error(wire.ErrorCode.STALE, False, "next", 7, 0)))

    collector = _Collector(b)
    writer = threading.Thread(target=trickle)
    started = time.monotonic()
    writer.start()
    _drive(collector.reader, lambda: bool(collector.errors), timeout=5)
    assert time.monotonic() - started < 2, "the reader missed the small frame after the large one"
    [(_, received)] = collector.results
    assert np.array_equal(np.frombuffer(bytes(received)[1:], dtype=np.int32), data)
    assert collector.reader.lowat == 1
    writer.join(5)
    a.close()
    b.close()


def test_a_peer_that_closes_in_the_middle_of_a_payload_is_eof_naming_it() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    header, payload = _result_frame(7, 0, np.arange(1000, dtype=np.int32))
    a.sendall(header + bytes(payload)[:1000])
    a.close()
    collector = _Collector(b)
    with pytest.raises(ConnectionBroken) as info:
        _drive(collector.reader, lambda: False, timeout=5)
    assert info.value.kind == "eof" and "in the middle of a result" in info.value.detail
    b.close()


def test_congestion_control_is_chosen_per_connection_and_a_refusal_is_reported_not_raised() -> None:
    a, b = _tcp_pair()
    try:
        # reno is built into every Linux kernel and always allowed, even to unprivileged users.
        assert set_congestion_control(a, "reno") is None
        assert congestion_control(a) == "reno"
        before = congestion_control(b)
        why = set_congestion_control(b, "no_such_cc")
        assert why and "no_such_cc" not in why  # the kernel's reason (no such algorithm), for the log line
        assert congestion_control(b) == before  # the connection keeps what it had and still works
        a.sendall(b"ping")
        assert b.recv(4, socket.MSG_WAITALL) == b"ping"
    finally:
        a.close()
        b.close()
    x, y = socket.socketpair()
    with x, y:
        assert set_congestion_control(x, "cubic") == "not a TCP connection"
        assert congestion_control(x) == ""


def test_a_short_non_blocking_write_returns_at_once_without_another_system_call() -> None:
    """A ``sendmsg`` that took less than everything found the socket buffer full: the next one
    could only fail with EAGAIN, so ``send_views`` hands the rest back after one call."""
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sender.setblocking(False)

    class Counting:
        calls = 0

        def sendmsg(self, views: list[memoryview], ancillary: list[object], flags: int) -> int:
            Counting.calls += 1
            return sender.sendmsg(views, ancillary, flags)  # type: ignore[arg-type]

    try:
        payload = bytes(range(256)) * 16384  # 4 MiB: more than any socket buffer takes at once
        rest = send_views(Counting(), [memoryview(b"head"), memoryview(payload)], socket.MSG_DONTWAIT, "peer")  # type: ignore[arg-type]
        assert Counting.calls == 1 and 0 < sum(len(v) for v in rest) < len(payload)
        got = bytearray()
        receiver.settimeout(5.0)
        for _ in range(100_000):  # drain and send the rest, as the writer does on EPOLLOUT
            got += receiver.recv(1 << 20)
            if rest:
                rest = send_views(Counting(), rest, socket.MSG_DONTWAIT, "peer")  # type: ignore[arg-type]
            if not rest and len(got) == len(payload) + 4:
                break
        assert bytes(got) == b"head" + payload
    finally:
        sender.close()
        receiver.close()
