"""Isolation between jobs, bounded memory, shutdown under load, stall warnings, replay."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import redsrv
from redsrv.core import auth, wire

from conftest import child_env
from tests_support import read_frames, rss_bytes, wait_for_open_operations

pytestmark = pytest.mark.timeout(120)

FAST = dict(heartbeat_interval=0.2, heartbeat_misses=5, op_timeout=20.0, close_timeout=3.0, connect_timeout=5.0,
            reconnect_window=0.0)
MIB = 1 << 20


def handshake(sock: socket.socket, job: str, rank: int, world: int, secret: bytes | None = None) -> tuple[wire.Challenge, bytes]:
    """A raw-socket handshake; returns the challenge and every byte this side sent."""
    hello = wire.Hello(job, rank, world, int.from_bytes(auth.new_nonce()[:8], "little"), auth.new_nonce())
    sent = wire.encode(hello)
    sock.sendall(sent)
    challenge = read_frame(sock)
    assert isinstance(challenge, wire.Challenge), challenge
    proof = auth.client_proof(secret, hello, challenge.nonce, challenge.incarnation) if secret else auth.NO_PROOF
    proof_bytes = wire.encode(wire.Proof(proof))
    sock.sendall(proof_bytes)
    return challenge, sent + proof_bytes


def read_frame(sock: socket.socket, timeout: float = 5.0) -> wire.Frame | None:
    sock.settimeout(timeout)
    decoder = wire.FrameDecoder()
    while True:
        frame = decoder.next_frame()
        if frame is not None:
            return frame
        data = sock.recv(65536)
        if not data:
            return None
        decoder.receive_data(data)


MALFORMED = [
    b"GET / HTTP/1.1\r\n\r\n",
    wire.PREFIX.pack(b"RDSV", 7, 1, 60, 1) + bytes(61),  # unsupported version
    wire.PREFIX.pack(b"RDSV", 1, 99, 0, 0),  # unknown frame type
    wire.PREFIX.pack(b"RDSV", 1, 5, 44, 2**31),  # oversized payload
    wire.encode(wire.Heartbeat())[:7],  # truncated, then closed
]


def test_a_rogue_job_cannot_touch_a_healthy_jobs_sums(procs) -> None:  # type: ignore[no-untyped-def]
    reducers = [procs.start_reducer(env={"REDSRV_JOB_BUDGET_BYTES": str(8 * MIB)}) for _ in range(2)]
    addresses = [r.address for r in reducers]
    steps = 1000
    wrong: list[int] = []
    done = threading.Event()

    def healthy(rank: int) -> None:
        with redsrv.Client(addresses, rank=rank, world_size=2, job="job-a", **FAST) as c:
            for step in range(steps):
                x = np.full(257, step * 2 + rank, np.float32)
                out = c.allreduce(x, key=step)
                if not np.array_equal(out, np.full(257, 4 * step + 1, np.float32)):
                    wrong.append(step)
        done.set()

    threads = [threading.Thread(target=healthy, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    # Job B: rank 0 floods the reducers past its budget while rank 1 never contributes ...
    b0 = redsrv.Client(addresses, rank=0, world_size=2, job="job-b", **FAST)
    b1 = redsrv.Client(addresses, rank=1, world_size=2, job="job-b", **FAST)
    flood = [b0.allreduce_async(np.ones(MIB, np.float32), key=("flood", i)) for i in range(12)]
    # ... a rogue sends every kind of malformed frame, on its own connections and inside job B ...
    for blob in MALFORMED:
        with socket.create_connection((reducers[0].host, reducers[0].port), timeout=5) as rogue:
            try:
                rogue.sendall(blob)
                rogue.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the reducer may already have rejected and closed the connection
            read_frames(rogue)
    with socket.create_connection((reducers[1].host, reducers[1].port), timeout=5) as rogue:
        handshake(rogue, "job-b", 1, 2)
        rogue.sendall(wire.PREFIX.pack(b"RDSV", 1, 5, 44, 8) + bytes(44) + bytes(8))  # a push with garbage fields
        read_frames(rogue)
    # ... and loses a worker.
    b1.close()
    for fut in flood:
        with pytest.raises(redsrv.RedsrvError):
            fut.result(timeout=30)
    b0.close()
    for t in threads:
        t.join(120)
    assert done.is_set(), "the healthy job did not finish"
    assert wrong == [], f"wrong sums at steps {wrong[:10]}"
    assert all(r.proc.poll() is None for r in reducers), "a reducer died"


def test_slow_reader_gets_backpressure_and_is_dropped_with_memory_bounded(procs) -> None:  # type: ignore[no-untyped-def]
    budget = 8 * MIB
    reducer = procs.start_reducer(env={"REDSRV_JOB_BUDGET_BYTES": str(budget), "REDSRV_OP_TIMEOUT": "3"})
    baseline = rss_bytes(reducer.proc.pid)
    sock = socket.create_connection((reducer.host, reducer.port), timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    try:
        challenge, _ = handshake(sock, "slow", 0, 1)
        assert isinstance(read_frame(sock), wire.Welcome)
        payload = bytes(MIB)
        peak = 0
        sent = 0
        started = time.monotonic()
        sock.settimeout(0.5)
        dropped_after = None
        for i in range(200):  # a single-rank job: every push closes at once and a result is due
            push = wire.Push(i, challenge.incarnation, MIB // 4, 0, MIB // 4, 0, wire.DType.FLOAT32, payload=payload)
            frame = wire.encode(push)
            try:
                sock.sendall(frame)
                sent += 1
            except TimeoutError:
                pass  # backpressure: the reducer stopped reading us
            except OSError:
                dropped_after = time.monotonic() - started
                break
            peak = max(peak, rss_bytes(reducer.proc.pid))
            if time.monotonic() - started > 15:
                break
        # we never read a single result
        if dropped_after is None:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                peak = max(peak, rss_bytes(reducer.proc.pid))
                try:
                    sock.sendall(bytes(4096))
                except TimeoutError:
                    continue
                except OSError:
                    dropped_after = time.monotonic() - started
                    break
                time.sleep(0.1)  # noqa: TID251 - the pace of a client that writes and never reads, within the deadline above
    finally:
        sock.close()
    assert dropped_after is not None, "the reducer never dropped a client that does not read"
    assert sent < 200, "no backpressure: the reducer accepted everything"
    # Held data is bounded by the job budget (plus the receive buffer of one frame in flight).
    assert peak - baseline < budget + 24 * MIB, f"reducer RSS grew by {(peak - baseline) / MIB:.1f} MiB"
    assert reducer.proc.poll() is None


def test_sigterm_under_load_fails_open_steps_and_exits_zero(procs) -> None:  # type: ignore[no-untyped-def]
    # A short stall warning is how the test learns that the pushes have arrived.
    reducer = procs.start_reducer(env={"REDSRV_CLOSE_TIMEOUT": "3", "REDSRV_STALL_WARNING": "0.05"})
    with redsrv.Client([reducer.address], rank=0, world_size=2, job="term", **FAST) as c0, \
         redsrv.Client([reducer.address], rank=1, world_size=2, job="term", **FAST):
        pending = [c0.allreduce_async(np.ones(100_000, np.float32), key=k) for k in range(5)]
        wait_for_open_operations(reducer.log, len(pending))  # rank 1 never contributes
        started = time.monotonic()
        reducer.signal(signal.SIGTERM)
        for fut in pending:
            with pytest.raises(redsrv.ReducerShutdownError) as info:
                fut.result(timeout=10)
            assert "SIGTERM" in str(info.value) and info.value.job == "term" and info.value.peer == reducer.address
        assert reducer.proc.wait(timeout=5) == 0
        assert time.monotonic() - started < 3.0 + 1.0


def test_stall_warning_names_the_missing_ranks(procs) -> None:  # type: ignore[no-untyped-def]
    reducer = procs.start_reducer(env={"REDSRV_STALL_WARNING": "0.5"})
    with redsrv.Client([reducer.address], rank=1, world_size=3, job="stall", **FAST) as c:
        fut = c.allreduce_async(np.ones(10, np.float32), key="stuck")
        wait_for_open_operations(reducer.log, 1)
        warning = next(line for line in reducer.log if "open for" in line)
        assert "job 'stall'" in warning and "waiting for rank(s) 0, 2" in warning
        c.close()
        with pytest.raises(redsrv.ClientClosedError):
            fut.result(timeout=5)


SECRET = b"0123456789abcdef-a-shared-secret"


def test_a_replayed_handshake_is_rejected(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    reducer = procs.start_reducer("--secret-file", str(secret_file))
    with socket.create_connection((reducer.host, reducer.port), timeout=5) as s:
        _, captured = handshake(s, "auth", 0, 1, SECRET)
        assert isinstance(read_frame(s), wire.Welcome)
    # An attacker replays the worker's bytes verbatim: the reducer's nonce is new, the proof stale.
    with socket.create_connection((reducer.host, reducer.port), timeout=5) as s:
        s.sendall(captured)
        frames = read_frames(s)
    assert any(isinstance(f, wire.Error) and f.code is wire.ErrorCode.AUTHENTICATION for f in frames), frames
    assert not any(isinstance(f, wire.Welcome) for f in frames)


def test_binding_a_public_address_without_a_secret_warns_loudly(procs) -> None:  # type: ignore[no-untyped-def]
    args = [sys.executable, "-m", "redsrv", "reducer", "--host", "0.0.0.0", "--port", "0"]
    proc = procs.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert "listening on 0.0.0.0:" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "without a secret" in err and "WARNING" in err
    assert proc.returncode == 0


def test_the_default_bind_address_is_loopback() -> None:
    from redsrv.cli import build_parser
    from redsrv.core.constants import DEFAULT_BIND_HOST

    assert build_parser().parse_args(["reducer"]).host is None  # resolved at start-up:
    assert DEFAULT_BIND_HOST == "127.0.0.1"  # ... to loopback unless a cluster spec lists this reducer


def test_a_reducer_under_tf_config_listens_where_the_spec_says(procs) -> None:  # type: ignore[no-untyped-def]
    import json

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"cluster": {"worker": ["127.0.0.1:1"], "reducer": ["127.0.0.1:1", f"127.0.0.1:{port}"]},
            "task": {"type": "reducer", "index": 1}}
    proc = procs.popen([sys.executable, "-m", "redsrv", "reducer"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True, env=child_env({"TF_CONFIG": json.dumps(spec)}))
    assert f"listening on 127.0.0.1:{port} " in proc.stdout.readline()
    proc.terminate()
    proc.wait(10)
