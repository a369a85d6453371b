"""Faults a user can cause or suffer: each must raise a clear typed error, never hang."""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import redsrv
from redsrv.core import wire
from redsrv.core.constants import PROTOCOL_VERSION

from tests_support import make_input, poll, rank_order_sum, read_frames, read_one_operation, scripted_handshake

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_BOUND = 0.2 * 5  # FAST_ENV: interval x misses
# reconnect_window=0: these tests check that a lost reducer fails the step at once (R2); the
# recovery tests (test_recovery.py) turn reconnects on.
FAST = dict(heartbeat_interval=0.2, heartbeat_misses=5, op_timeout=20.0, close_timeout=3.0, connect_timeout=5.0,
            reconnect_window=0.0)


def loop_spec(**extra) -> dict:  # type: ignore[no-untyped-def,type-arg]
    return {"loop_until_error": True, "loop_size": 20_000, "loop_seconds": 60, "step_pause": 0.01, **extra}


def assert_typed(report: dict, expected: type, *, job: str = "test") -> dict:  # type: ignore[type-arg]
    error = report["error"]
    assert error is not None, f"rank {report['rank']} raised nothing"
    assert expected.__name__ in error["mro"], error
    assert error["job"] == job and error["rank"] == report["rank"], error
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_reducer_makes_every_worker_raise_within_two_seconds(fleet, workers, sig: int) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    run = workers(reducers, 3, loop_spec())
    run.wait_for_steps(3)
    killed_at = time.time()
    reducers[1].signal(sig)
    _, reports = run.wait(timeout=30)
    for report in reports:
        error = assert_typed(report, redsrv.PeerLostError)
        # Either this worker saw the reducer die, or the surviving reducer told it first that a
        # rank which saw it die has gone.
        told_by_survivor = "disconnected" in error["message"] and error["peer"] == reducers[0].address
        assert error["peer"] == reducers[1].address or told_by_survivor, error
        assert error["at"] - killed_at < 2.0, f"rank {report['rank']} took {error['at'] - killed_at:.2f}s"
        assert report.get("steps", 0) > 0
    if sig == signal.SIGTERM:
        assert reducers[1].proc.wait(timeout=5) == 0  # a clean exit within the close timeout


def test_frozen_reducer_is_detected_by_heartbeats(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    run = workers(reducers, 2, loop_spec())
    run.wait_for_steps(3)
    frozen_at = time.time()
    reducers[0].signal(signal.SIGSTOP)
    try:
        _, reports = run.wait(timeout=30)
    finally:
        reducers[0].signal(signal.SIGCONT)
    for report in reports:
        error = assert_typed(report, redsrv.PeerTimeoutError)
        assert error["peer"] == reducers[0].address, error
        elapsed = error["at"] - frozen_at
        assert elapsed < HEARTBEAT_BOUND + 2.0, f"detected after {elapsed:.2f}s"


def test_killed_worker_fails_the_others_naming_its_rank(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    run = workers(reducers, 3, loop_spec())
    run.wait_for_steps(3)
    killed_at = time.time()
    run.procs[1].kill()
    run.procs[1].wait()
    survivors = [p for i, p in enumerate(run.procs) if i != 1]
    run.procs, run.prefixes = survivors, [run.prefixes[0], run.prefixes[2]]
    _, reports = run.wait(timeout=30)
    for report in reports:
        error = assert_typed(report, redsrv.PeerLostError)
        assert "rank 1" in error["message"], error
        assert error["at"] - killed_at < 3.0


def test_frozen_worker_fails_the_others_within_the_heartbeat_bound(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(1)
    run = workers(reducers, 3, loop_spec())
    run.wait_for_steps(3)
    frozen_at = time.time()
    run.procs[2].send_signal(signal.SIGSTOP)
    try:
        survivors = run.procs[:2]
        frozen = run.procs[2]
        run.procs, run.prefixes = survivors, run.prefixes[:2]
        _, reports = run.wait(timeout=30)
    finally:
        frozen.send_signal(signal.SIGCONT)
    for report in reports:
        error = assert_typed(report, redsrv.PeerLostError)
        assert "rank 2" in error["message"]
        assert error["at"] - frozen_at < HEARTBEAT_BOUND + 3.0


def test_mismatched_dtypes_fail_every_rank_naming_both(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    run_a = workers(reducers, 2, {"ops": [{"size": 1000, "dtype": "float32"}]}, ranks=[0])
    run_b = workers(reducers, 2, {"ops": [{"size": 1000, "dtype": "float16"}]}, ranks=[1])
    (_, rep_a), (_, rep_b) = run_a.wait(), run_b.wait()
    for report in rep_a + rep_b:
        assert report["error"]["type"] == "ContributionMismatchError", report
        message = report["error"]["message"]
        assert "float32[" in message and "float16[" in message and "rank 0" in message and "rank 1" in message


def test_mismatched_lengths_fail_every_rank(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(1)
    run_a = workers(reducers, 2, {"ops": [{"size": 1000}]}, ranks=[0])
    run_b = workers(reducers, 2, {"ops": [{"size": 1001}]}, ranks=[1])
    for report in run_a.wait()[1] + run_b.wait()[1]:
        assert report["error"]["type"] == "ContributionMismatchError"
        assert "of 1000" in report["error"]["message"] and "of 1001" in report["error"]["message"]


def _raw_hello(job: str = "rogue", rank: int = 0, world: int = 1) -> bytes:
    return wire.encode(wire.Hello(job, rank, world, 1, bytes(32)))


GARBAGE = {
    "http request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad version": struct.pack("<4sBBHI", b"RDSV", 9, 1, 60, 0) + bytes(60),
    "push before hello": wire.encode(wire.Push(1, 1, 4, 0, 4, 0, wire.DType.FLOAT32, payload=bytes(16))),
    "oversized length": struct.pack("<4sBBHI", b"RDSV", PROTOCOL_VERSION, 5, 44, 2**32 - 1) + bytes(44),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_garbage_gets_an_error_frame_and_only_that_connection_closes(fleet, name: str) -> None:  # type: ignore[no-untyped-def]
    (reducer,) = fleet(1)
    with redsrv.Client([reducer.address], rank=0, world_size=1, job="healthy", **FAST) as client:
        x = np.arange(1000, dtype=np.float32)
        with socket.create_connection((reducer.host, reducer.port), timeout=5) as rogue:
            rogue.sendall(GARBAGE[name])
            frames = read_frames(rogue)
        errors = [f for f in frames if isinstance(f, wire.Error)]
        assert errors and errors[-1].fatal, frames
        assert client.allreduce(x).tobytes() == x.tobytes()  # the daemon and the healthy job carry on
    assert reducer.proc.poll() is None


def test_malformed_push_after_a_valid_handshake_closes_only_that_connection(fleet) -> None:  # type: ignore[no-untyped-def]
    (reducer,) = fleet(1)
    with redsrv.Client([reducer.address], rank=0, world_size=2, job="healthy", **FAST) as c0, \
         redsrv.Client([reducer.address], rank=1, world_size=2, job="healthy", **FAST) as c1:
        with socket.create_connection((reducer.host, reducer.port), timeout=5) as rogue:
            rogue.sendall(_raw_hello("rogue"))
            challenge = _read_one(rogue)
            assert isinstance(challenge, wire.Challenge)
            rogue.sendall(wire.encode(wire.Proof(bytes(32))))
            assert isinstance(_read_one(rogue), wire.Welcome)
            # a push whose header claims 4 float32 but whose dtype code is unknown
            rogue.sendall(struct.pack("<4sBBHI", b"RDSV", PROTOCOL_VERSION, 5, 44, 16)
                          + struct.pack("<QQQQIIBBH", 1, challenge.incarnation, 4, 0, 4, 0, 99, 0, 0) + bytes(16))
            frames = read_frames(rogue)
            assert any(isinstance(f, wire.Error) and f.code is wire.ErrorCode.PROTOCOL for f in frames), frames
        for step in range(20):
            xs = [make_input(step, r, 3000, "float32") for r in range(2)]
            f0 = c0.allreduce_async(xs[0], key=step)
            out1 = c1.allreduce(xs[1], key=step)
            assert f0.result(10).tobytes() == out1.tobytes() == rank_order_sum(xs).tobytes()


def test_a_slow_but_steady_push_is_not_taken_for_a_frozen_worker(fleet) -> None:  # type: ignore[no-untyped-def]
    """The reducer waits for each piece of a large payload with a low-water mark; a push that
    takes longer than the heartbeat bound but never pauses that long must still complete, and
    (one worker: every rank's bytes are in) its sums leave in pieces while it trickles in."""
    (reducer,) = fleet(1)
    x = np.arange(256 * 1024, dtype=np.float32)  # 1 MiB
    payload = x.tobytes()
    piece = 64 * 1024
    with socket.create_connection((reducer.host, reducer.port), timeout=5) as slow:
        slow.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        slow.sendall(_raw_hello("slow"))
        challenge = _read_one(slow)
        assert isinstance(challenge, wire.Challenge)
        slow.sendall(wire.encode(wire.Proof(bytes(32))))
        assert isinstance(_read_one(slow), wire.Welcome)
        push = wire.Push(7, challenge.incarnation, x.size, 0, x.size, 0, wire.DType.FLOAT32)
        slow.sendall(wire.push_header(push, len(payload)))
        started = time.monotonic()
        for offset in range(0, len(payload), piece):
            slow.sendall(payload[offset : offset + piece])
            time.sleep(0.15)  # noqa: TID251 - the pacing of the slow peer under test, not a synchronisation
        assert time.monotonic() - started > 2 * HEARTBEAT_BOUND  # longer than any silence allowed
        decoder = wire.FrameDecoder(max_payload=len(payload) + 64)
        slow.settimeout(5)
        results: list[wire.Result] = []
        while sum(r.count for r in results) < x.size:
            data = slow.recv(1 << 20)
            assert data, "the reducer closed the connection"
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                assert not isinstance(frame, wire.Error), frame
                if isinstance(frame, wire.Result):
                    results.append(frame)
        assert [r.offset for r in results] == [sum(r.count for r in results[:i]) for i in range(len(results))]
        assert len(results) > 1  # cut-through: sums left before the last byte came in
        assert b"".join(bytes(r.payload) for r in results) == payload


def _read_one(sock: socket.socket) -> wire.Frame:
    decoder = wire.FrameDecoder()
    sock.settimeout(5)
    while True:
        decoder.receive_data(sock.recv(4096))
        frame = decoder.next_frame()
        if frame is not None:
            return frame


def test_restarted_reducer_fails_the_step_in_flight_then_new_clients_succeed(procs, fleet) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    clients = [redsrv.Client([r.address for r in reducers], rank=i, world_size=2, job="restart", **FAST) for i in range(2)]
    try:
        x = np.ones(50_000, np.float32)
        pending = clients[0].allreduce_async(x, key="step-1")  # rank 1 has not pushed yet
        reducers[1].signal(signal.SIGKILL)
        reducers[1].proc.wait(5)
        with pytest.raises(redsrv.PeerLostError) as info:
            pending.result(timeout=5)
        # the killed reducer, or the survivor reporting that rank 1 (which saw it die) has gone
        assert reducers[1].address in str(info.value) or "rank 1" in str(info.value)
        with pytest.raises(redsrv.PeerLostError):  # the broken client says so on the next call
            clients[0].allreduce(x)
        with pytest.raises(redsrv.PeerLostError):
            clients[1].allreduce(x, key="step-1")
    finally:
        for c in clients:
            c.close()
    restarted = procs.restart_reducer(reducers[1])
    assert restarted.incarnation != reducers[1].incarnation
    addresses = [reducers[0].address, restarted.address]
    results: list = [None, None]  # type: ignore[type-arg]

    def run(rank: int) -> None:
        with redsrv.Client(addresses, rank=rank, world_size=2, job="restart", **FAST) as c:
            results[rank] = c.allreduce(np.full(1000, rank + 1, np.float32), key="step-2")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None and (r == 3).all() for r in results)


def test_operation_timeout_names_the_waiting_reducers(fleet) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    with redsrv.Client([r.address for r in reducers], rank=0, world_size=2, job="lonely", **{**FAST, "op_timeout": 1.0}) as c:
        started = time.monotonic()
        with pytest.raises(redsrv.PeerTimeoutError) as info:
            c.allreduce(np.ones(10, np.float32), key="never")
        elapsed = time.monotonic() - started
    assert elapsed < 3.0
    message = str(info.value)
    assert "job='lonely'" in message and "rank=0" in message and "timeout=" in message


def test_unreachable_reducer_fails_connect_within_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        started = time.monotonic()
        with pytest.raises(redsrv.PeerTimeoutError, match="cannot connect"):
            redsrv.Client([f"127.0.0.1:{port}"], rank=0, world_size=1, job="x", connect_timeout=1.0)
    assert time.monotonic() - started < 3.0


def test_job_parameter_mismatch_names_both_values(fleet) -> None:  # type: ignore[no-untyped-def]
    (reducer,) = fleet(1)
    with redsrv.Client([reducer.address], rank=0, world_size=2, job="j", **FAST):
        with pytest.raises(redsrv.JobMismatchError, match="world_size: job has 2, rank 1 sent 3"):
            redsrv.Client([reducer.address], rank=1, world_size=3, job="j", **FAST)


def test_closed_client_raises_and_close_is_idempotent(fleet) -> None:  # type: ignore[no-untyped-def]
    (reducer,) = fleet(1)
    client = redsrv.Client([reducer.address], rank=0, world_size=2, job="j", **FAST)
    pending = client.allreduce_async(np.ones(4, np.float32))
    started = time.monotonic()
    client.close()
    client.close()
    assert time.monotonic() - started < 3.0
    with pytest.raises(redsrv.ClientClosedError):
        pending.result(timeout=1)
    with pytest.raises(redsrv.ClientClosedError):
        client.allreduce(np.ones(4, np.float32))


SECRET = "s3cret-shared-by-the-fleet-0123456789"


def test_authentication(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    reducer = procs.start_reducer("--secret-file", str(secret_file), "--require-secret")
    with redsrv.Client([reducer.address], rank=0, world_size=1, job="auth", secret=SECRET, **FAST) as c:
        assert c.allreduce(np.ones(3, np.float32)).tolist() == [1, 1, 1]
    for secret in ("a-wrong-secret-of-enough-length", None):
        started = time.monotonic()
        with pytest.raises((redsrv.AuthenticationError, redsrv.PeerLostError)) as info:
            redsrv.Client([reducer.address], rank=0, world_size=1, job="auth", secret=secret, **FAST)
        assert time.monotonic() - started < 0.5
        if secret is not None:
            assert isinstance(info.value, redsrv.AuthenticationError)
            # it must not say which side's proof was wrong, nor echo anything secret
            assert info.value.detail == f"authentication with reducer {reducer.address} failed"
    # a worker with a secret refuses a reducer without one (mutual authentication)
    plain = procs.start_reducer()
    with pytest.raises(redsrv.AuthenticationError):
        redsrv.Client([plain.address], rank=0, world_size=1, job="auth", secret=SECRET, **FAST)


def test_daemon_required_to_authenticate_refuses_to_start_without_a_secret(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import child_env

    for extra in (["--require-secret"], ["--secret-file", str(tmp_path / "missing")]):
        proc = subprocess.run([sys.executable, "-m", "redsrv", "reducer", "--port", "0", *extra],
                              capture_output=True, text=True, timeout=30, env=child_env())
        assert proc.returncode == 2, proc
        assert "secret" in proc.stderr


def test_unknown_environment_variable_stops_the_daemon_at_start_up() -> None:
    from conftest import child_env

    proc = subprocess.run([sys.executable, "-m", "redsrv", "reducer", "--port", "0"], capture_output=True, text=True,
                          timeout=30, env=child_env({"REDSRV_HEARTBEAT": "1"}))
    assert proc.returncode == 2 and "REDSRV_HEARTBEAT" in proc.stderr


def _scripted_reducer(answer) -> tuple[str, threading.Thread, socket.socket]:  # type: ignore[no-untyped-def]
    """A one-connection reducer that handshakes, reads the pushes of one operation, and answers
    with the byte strings ``answer(pushes)`` yields, each sent before the next is asked for (so a
    generator can wait for the client to reach a state between two): for client behaviour no real
    reducer shows."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            pushes = read_one_operation(scripted_handshake(conn, 5))
            for data in answer(pushes):
                conn.sendall(data)
            try:
                while conn.recv(1 << 16):  # until the client closes
                    pass
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    host, port = listener.getsockname()[:2]
    return f"{host}:{port}", thread, listener


def _piece(push: wire.Push, start: int, stop: int, value: float) -> bytes:
    data = np.full(stop - start, value, np.float32).tobytes()
    return wire.encode(wire.Result(push.key, push.offset + start, stop - start, push.chunk, push.dtype, 1, b"\x01", data))


@pytest.mark.parametrize("order", ["in order", "a gap", "an overlap", "past the end"])
def test_a_chunk_result_in_pieces_is_accepted_only_when_they_tile_it_in_order(order: str) -> None:
    x = np.arange(1000, dtype=np.float32)
    cuts = {"in order": [(0, 300), (300, 1000)], "a gap": [(0, 300), (400, 1000)],
            "an overlap": [(0, 300), (200, 1000)], "past the end": [(0, 300), (300, 1001)]}[order]

    def answer(pushes: list[wire.Push]) -> list[bytes]:
        (push,) = pushes  # one chunk: 4 KB is far below the smallest span
        return [b"".join(_piece(push, a, b, i + 1.0) for i, (a, b) in enumerate(cuts))]

    address, thread, listener = _scripted_reducer(answer)
    try:
        with redsrv.Client([address], rank=0, world_size=1, job="pieces", **FAST) as client:
            if order == "in order":
                out = client.allreduce(x, timeout=10)
                assert out.tolist() == [1.0] * 300 + [2.0] * 700
            else:
                with pytest.raises(redsrv.RemoteProtocolError, match=r"expected at most 700 at 300"):
                    client.allreduce(x, timeout=10)
    finally:
        thread.join(10)
        listener.close()


def test_an_error_instead_of_the_rest_of_a_chunk_in_pieces_is_seen_within_a_tick() -> None:
    """While the client waits for the rest of a chunk whose first piece came, its loop sleeps
    until that many bytes are in; an ERROR that comes instead is smaller, and the client's
    periodic tick must find it (here well before the reducer's silence would be called a
    freeze)."""
    x = np.zeros(2**20, dtype=np.float32)
    sent: list[float] = []
    clients: list[redsrv.Client] = []

    def waiting_for_the_rest() -> bool:
        (conn,) = clients[0].connections()
        return conn.receive_lowat > 1  # the piece was read and the loop now sleeps until the rest is in

    def answer(pushes: list[wire.Push]) -> Iterator[bytes]:
        largest = max(pushes, key=lambda p: p.count)
        assert (largest.count - 1000) * 4 >= 65536  # the rest is worth a raised low-water mark
        yield _piece(largest, 0, 1000, 1.0)
        poll(waiting_for_the_rest, 10, "the client waiting for the rest of the chunk with a raised low-water mark",
             every=0.01)
        sent.append(time.monotonic())
        yield wire.encode(
            wire.Error(wire.ErrorCode.PEER_LOST, False, "rank 7 of job 'pieces' disconnected", largest.key, largest.chunk))

    address, thread, listener = _scripted_reducer(answer)
    try:
        with redsrv.Client([address], rank=0, world_size=1, job="pieces", **dict(FAST, heartbeat_misses=25)) as client:
            clients.append(client)
            with pytest.raises(redsrv.PeerLostError, match="rank 7"):
                client.allreduce(x, timeout=10)
            assert time.monotonic() - sent[0] < 1.0  # a tick is 0.1 s; silence is called a freeze after 5 s
    finally:
        thread.join(10)
        listener.close()
