"""Admission under hostile clients (RELIABILITY R20, R21, R23, R24, R25): before authentication a
connection holds only the handshake's bytes, handshakes have one deadline and no thread, a
flood of slow connections never locks a worker out, memory stays under the reducer-wide budget,
a new job is served rather than refused because of it, and memory goes back after the attack."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import redsrv
from redsrv.core import auth, wire
from redsrv.core.constants import MAGIC
from redsrv.core.handshake import ClientHandshake, HandshakeState

from tests_support import poll, read_frames, rss_bytes

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
SECRET = b"admission-test-secret-0123456789"


def sample_max(measure, seconds: float) -> int:  # type: ignore[no-untyped-def]
    """The largest of ``measure()`` sampled every 20 ms for ``seconds`` (a measurement, not a wait)."""
    end = time.monotonic() + seconds
    peak = measure()
    while time.monotonic() < end:
        time.sleep(0.02)  # noqa: TID251 - the sampling period of a measurement, not a wait for an event
        peak = max(peak, measure())
    return peak


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def joined(address: str, job: str, rank: int, world: int, secret: bytes | None = None) -> socket.socket:
    """A raw connection that completed the production handshake (core/handshake.py)."""
    sock = connect(address)
    handshake = ClientHandshake(wire.Hello(job, rank, world, 1000 + rank, auth.new_nonce()), secret=secret)
    sock.sendall(handshake.data_to_send())
    while handshake.state is HandshakeState.RUNNING:
        handshake.receive_data(sock.recv(handshake.bytes_needed))
        sock.sendall(handshake.data_to_send())
    assert handshake.state is HandshakeState.DONE, handshake.failure
    return sock


def test_a_header_announcing_a_huge_frame_before_authentication_is_refused_and_allocates_nothing(procs) -> None:  # type: ignore[no-untyped-def]
    secret_file = procs_tmp_secret(procs)
    reducer = procs.start_reducer("--secret-file", secret_file)
    baseline = rss_bytes(reducer.proc.pid)
    # a HELLO's prefix announcing 64 MiB
    announce = wire.encode(wire.Hello("j", 0, 1, 1, bytes(32)))[:8] + (64 * MIB).to_bytes(4, "little")
    socks = [connect(reducer.address) for _ in range(40)]
    try:
        for sock in socks:
            sock.sendall(announce)
        for sock in socks:
            sock.settimeout(5)
            decoder = wire.FrameDecoder()
            while (frame := decoder.next_frame()) is None:
                data = sock.recv(4096)
                decoder.receive_data(data)
                if not data:
                    break
            assert isinstance(frame, wire.Error) and "exceeds the cap" in frame.message, frame
            assert sock.recv(1) == b"", "the connection must be closed after the refusal"
        grown = rss_bytes(reducer.proc.pid) - baseline
        assert grown < 16 * MIB, f"40 refused headers grew the reducer by {grown / MIB:.1f} MiB (was 2.6 GiB before R20)"
    finally:
        for sock in socks:
            sock.close()


def procs_tmp_secret(procs) -> str:  # type: ignore[no-untyped-def]
    import tempfile

    f = tempfile.NamedTemporaryFile("wb", prefix="redsrv-secret-", delete=False)
    f.write(SECRET)
    f.close()
    procs.files.append(open(f.name, "rb"))  # closed at teardown
    return f.name


def test_a_flood_of_trickling_connections_costs_no_threads_and_never_locks_out_a_worker() -> None:
    settings = redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2, handshake_timeout=3,
                                     max_pending_handshakes=300)
    daemon = redsrv.ReducerDaemon(settings)
    host, port = daemon.start()
    address = f"{host}:{port}"
    threads_before = threading.active_count()
    flood: list[socket.socket] = []
    try:
        for _ in range(2000):  # far more than the pending cap, each one byte into its HELLO
            sock = socket.create_connection((host, port), timeout=5)
            sock.send(MAGIC[:1])
            flood.append(sock)
        assert threading.active_count() == threads_before, "handshakes must not get threads of their own"
        started = time.monotonic()
        with redsrv.Client([address], rank=0, world_size=1, job="real", connect_timeout=10, handshake_timeout=3) as client:
            assert client.allreduce(np.arange(10, dtype=np.float32)).tolist() == list(range(10))
        assert time.monotonic() - started < 3.0, "a worker must get in while the flood goes on"
        pending = len(daemon._pending)
        assert pending <= settings.max_pending_handshakes
    finally:
        for sock in flood:
            sock.close()
        daemon.stop()


def test_a_handshake_has_one_deadline_from_accept_however_its_bytes_trickle() -> None:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2, handshake_timeout=1.0))
    host, port = daemon.start()
    hello = wire.encode(wire.Hello("slow", 0, 1, 1, auth.new_nonce()))
    try:
        sock = socket.create_connection((host, port), timeout=5)
        accepted = time.monotonic()
        sock.settimeout(0.2)
        closed_at = None
        for byte in hello:  # one byte every 0.2 s: each read is quick, the whole is too slow
            try:
                sock.send(bytes([byte]))
                if sock.recv(4096) == b"":
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_at = time.monotonic()
                break
        assert closed_at is not None, "the trickling handshake was never cut off"
        assert 0.9 <= closed_at - accepted <= 2.0, closed_at - accepted
        sock.close()
    finally:
        daemon.stop()


def test_memory_stays_under_the_reducer_wide_budget_a_new_job_is_served_and_memory_returns_after_the_attack(procs) -> None:  # type: ignore[no-untyped-def]
    """Pushes that announce 16 MiB, send 15 of it and fall silent hold what arrived, never more
    than the budget; a new job is not refused because of them: within its fair share it waits
    while their stalled pushes are dropped (slower than the minimum rate for the grace, under
    pressure), each attacker told the rate (docs/reliability.md, "Fair shares")."""
    budget = 96 * MIB
    grace = 3.0  # long enough that the attack holds its memory before the first push can be dropped, on a slow machine too
    # Silent attackers are normally dropped after the heartbeat bound; these must hold on.
    reducer = procs.start_reducer("--memory-budget", f"{budget}", env={"REDSRV_JOB_BUDGET_BYTES": str(64 * MIB),
                                                                       "REDSRV_HEARTBEAT_MISSES": "100",
                                                                       "REDSRV_SLOW_PUSH_GRACE": str(grace)})
    baseline = rss_bytes(reducer.proc.pid)
    attackers = []
    claimed = 16 * MIB
    try:
        for j in range(24):  # 24 jobs x 16 MiB claimed = 384 MiB asked for, four times the budget
            sock = joined(reducer.address, f"attack-{j}", 0, 2)
            sock.settimeout(0.3)
            header = wire.push_header(wire.Push(1, reducer.incarnation, claimed // 4, 0, claimed // 4, 0, wire.DType.FLOAT32),
                                      claimed)
            try:
                sock.sendall(header + bytes(claimed - MIB))  # all but the last MiB, then silence
            except TimeoutError:
                pass  # the reducer stopped reading this one: no memory for it
            attackers.append(sock)
        poll(lambda: (rss_bytes(reducer.proc.pid) - baseline) // MIB > 64, 20, "the attack to take hold")
        peak = sample_max(lambda: rss_bytes(reducer.proc.pid), seconds=1.0)
        grown = (peak - baseline) / MIB
        assert peak - baseline < budget + 32 * MIB, f"RSS grew {grown:.0f} MiB under a {budget / MIB:.0f} MiB budget"
        # A new job waits for the stalled pushes to be dropped, within two grace windows and a tick.
        with redsrv.Client([reducer.address], rank=0, world_size=1, job="victim", op_timeout=60) as client:
            started = time.monotonic()
            assert client.allreduce(np.ones(1000, np.float32)).sum() == 1000
            waited = time.monotonic() - started
        assert waited < 2 * grace + 2.0, f"the new job waited {waited:.1f}s for memory"
        peak = max(peak, sample_max(lambda: rss_bytes(reducer.proc.pid), seconds=0.5))
        assert peak - baseline < budget + 32 * MIB, f"RSS grew {(peak - baseline) / MIB:.0f} MiB"
        told = [frame for sock in attackers for frame in read_frames(sock, timeout=0.2) if isinstance(frame, wire.Error)]
        assert any(f.code is wire.ErrorCode.OVERLOADED and "B/s" in f.message and "REDSRV_MIN_PUSH_RATE" in f.message
                   for f in told), [f.message for f in told]
    finally:
        for sock in attackers:
            sock.close()
    poll(lambda: (rss_bytes(reducer.proc.pid) - baseline) // MIB < 24, 20,
         "RSS to return near its baseline once the attackers left")
    with redsrv.Client([reducer.address], rank=0, world_size=1, job="victim-2", op_timeout=20) as client:
        assert client.allreduce(np.ones(1000, np.float32)).sum() == 1000
