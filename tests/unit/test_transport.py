"""The transport over a socket pair: frames from many threads, inline and queued, never interleave."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from redsrv.core import wire
from redsrv.core.transport import ConnectionBroken, FramedSocket, Sender, congestion_control, set_congestion_control

pytestmark = pytest.mark.timeout(60)


def test_concurrent_inline_and_queued_frames_arrive_whole_and_in_order_per_thread() -> None:
    a, b = socket.socketpair()
    errors: list[ConnectionBroken] = []
    sender = Sender(a, name="redsrv-test-send", heartbeat_interval=0.05, send_timeout=10, on_error=errors.append)
    reader = FramedSocket(b, read_timeout=10)
    threads, per_thread, size = 4, 150, 20_000

    def produce(t: int) -> None:
        for i in range(per_thread):
            data = np.full(size + (i % 7), t * 1000 + i, dtype=np.int32)
            result = wire.Result(t, i, data.size, 0, wire.DType.INT32, 1, b"\x01")
            sender.send(wire.result_header(result, data.nbytes), data.view(np.uint8).data, data.nbytes, inline=bool(i % 2))

    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for p in producers:
        p.start()
    seen = {t: 0 for t in range(threads)}
    received = 0
    while received < threads * per_thread:
        header = reader.read_header()
        if header.type is wire.FrameType.HEARTBEAT:
            continue
        frame = wire.parse_payload(header, reader.read_bytes(header.payload_len))
        assert isinstance(frame, wire.Result)
        values = np.frombuffer(bytes(frame.payload), dtype=np.int32)
        assert values.size == size + frame.offset % 7
        assert (values == frame.key * 1000 + frame.offset).all(), "a frame was torn"
        assert frame.offset == seen[frame.key], "frames of one thread were reordered"
        seen[frame.key] += 1
        received += 1
    for p in producers:
        p.join()
    sender.stop()
    sender.join(5)
    a.close()
    b.close()
    assert not errors


def test_a_silent_peer_times_out_and_a_closed_one_is_eof() -> None:
    a, b = socket.socketpair()
    reader = FramedSocket(b, read_timeout=0.3)
    with pytest.raises(ConnectionBroken) as info:
        reader.read_header()
    assert info.value.kind == "timeout"
    a.close()
    with pytest.raises(ConnectionBroken) as info:
        reader.read_header()
    assert info.value.kind == "eof"
    b.close()


def test_sender_sends_heartbeats_when_idle() -> None:
    a, b = socket.socketpair()
    sender = Sender(a, name="redsrv-test-hb", heartbeat_interval=0.05, send_timeout=5, on_error=lambda e: None)
    reader = FramedSocket(b, read_timeout=1)
    assert reader.read_header().type is wire.FrameType.HEARTBEAT
    sender.stop()
    sender.join(5)
    a.close()
    b.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
    return client, accepted


def test_a_large_payload_arriving_in_pieces_is_read_whole_and_the_next_header_still_wakes_the_reader() -> None:
    # Over TCP a payload piece is awaited with a receive low-water mark; it must be reset after, or
    # the small frame that follows would never wake the reader (it would time out instead).
    a, b = _tcp_pair()
    reader = FramedSocket(b, read_timeout=5)
    data = np.arange(256 * 1024, dtype=np.int32)  # 1 MiB
    result = wire.Result(7, 0, data.size, 0, wire.DType.INT32, 1, b"\x01")
    raw = wire.result_header(result, data.nbytes) + data.tobytes()

    def trickle() -> None:
        for start in range(0, len(raw), 100_000):
            a.sendall(raw[start : start + 100_000])
            time.sleep(0.01)
        time.sleep(0.2)  # the reader is now blocked on the next header
        a.sendall(wire.encode(wire.Heartbeat()))

    writer = threading.Thread(target=trickle)
    started = time.monotonic()
    writer.start()
    header = reader.read_header()
    out = bytearray(header.payload_len)
    reader.read_into(memoryview(out))
    frame = wire.parse_payload(header, out)
    assert isinstance(frame, wire.Result)
    assert np.array_equal(np.frombuffer(bytes(frame.payload), dtype=np.int32), data)
    assert reader.read_header().type is wire.FrameType.HEARTBEAT
    # The writer is done after about 0.3 s; a reader left waiting on a stale mark sits out the 5 s
    # read timeout (measured: 5.25 s without the reset).
    assert time.monotonic() - started < 2, "the reader waited for the read timeout"
    writer.join(5)
    a.close()
    b.close()


def test_a_peer_that_stops_in_the_middle_of_a_large_payload_times_out() -> None:
    a, b = _tcp_pair()
    reader = FramedSocket(b, read_timeout=0.5)
    a.sendall(b"\0" * 300_000)  # less than the piece awaited below
    started = time.monotonic()
    with pytest.raises(ConnectionBroken) as info:
        reader.read_into(memoryview(bytearray(1024 * 1024)))
    assert info.value.kind == "timeout"
    assert time.monotonic() - started < 3
    a.close()
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
