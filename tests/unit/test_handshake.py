"""The handshake state machines (core/handshake.py), fed bytes: whole, byte by byte, with
garbage, and over the pre-authentication cap. The reducer's event loop and the client drive
exactly these objects."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import auth, wire
from redsrv.core.handshake import (
    PRE_AUTH_MAX_BYTES,
    PRE_AUTH_MAX_PAYLOAD,
    ClientHandshake,
    HandshakeState,
    ServerHandshake,
)

SECRET = b"s" * 32
INC = 0x1234


def hello(op_timeout_ms: int = 300_000) -> wire.Hello:
    return wire.Hello("job", 1, 4, 77, auth.new_nonce(), op_timeout_ms=op_timeout_ms)


def pump(client: ClientHandshake, server: ServerHandshake, step: int | None = None) -> None:
    """Exchange bytes until neither side has any to send; ``step`` bytes at a time if given."""
    for _ in range(10):
        moved = False
        for source, sink in ((client, server), (server, client)):
            data = source.data_to_send()
            moved |= bool(data)
            chunks = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
            for chunk in chunks:
                if chunk:
                    sink.receive_data(chunk)
        if server.state is HandshakeState.DONE and not moved:
            return


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("step", [None, 1, 7])
def test_a_handshake_completes_fed_whole_or_byte_by_byte(secret: bytes | None, step: int | None) -> None:
    client = ClientHandshake(hello(), secret=secret)
    server = ServerHandshake(incarnation=INC, secret=secret, max_op_timeout_ms=600_000)
    pump(client, server, step)
    assert server.state is HandshakeState.DONE and server.hello is not None and server.hello.rank == 1
    client.receive_data(ServerHandshake.welcome(INC, 1 << 20, 1000))
    assert client.state is HandshakeState.DONE
    assert client.accepted is not None and client.accepted.incarnation == INC and client.accepted.heartbeat_ms == 1000


def test_reading_bytes_needed_never_takes_bytes_past_the_handshake() -> None:
    client = ClientHandshake(hello(), secret=None)
    server = ServerHandshake(incarnation=INC, secret=None, max_op_timeout_ms=600_000)
    pump(client, server)
    stream = ServerHandshake.welcome(INC, 1 << 20, 1000) + wire.encode(wire.Heartbeat())
    taken = 0
    while client.state is HandshakeState.RUNNING:
        n = client.bytes_needed
        client.receive_data(stream[taken : taken + n])
        taken += n
    assert client.state is HandshakeState.DONE
    assert stream[taken:] == wire.encode(wire.Heartbeat()), "the heartbeat after WELCOME belongs to the data path"


@pytest.mark.parametrize("client_secret", [None, b"x" * 32])
def test_a_wrong_or_missing_secret_fails_on_both_sides_without_saying_which(client_secret: bytes | None) -> None:
    client = ClientHandshake(hello(), secret=client_secret)
    server = ServerHandshake(incarnation=INC, secret=SECRET, max_op_timeout_ms=600_000)
    pump(client, server)
    failed = [side for side in (client, server) if side.state is HandshakeState.FAILED]
    assert failed, "someone must refuse"
    for side in failed:
        assert side.failure is not None and side.failure.code is wire.ErrorCode.AUTHENTICATION
        assert side.failure.message == "authentication failed"


def test_a_server_with_a_forged_proof_is_refused_by_the_client() -> None:
    client = ClientHandshake(hello(), secret=SECRET)
    impostor = ServerHandshake(incarnation=INC, secret=b"y" * 32, max_op_timeout_ms=600_000)
    impostor.receive_data(client.data_to_send())
    client.receive_data(impostor.data_to_send())
    assert client.state is HandshakeState.FAILED and client.failure is not None
    assert client.failure.code is wire.ErrorCode.AUTHENTICATION
    assert wire.FrameType.ERROR == client.data_to_send()[5], "the client tells the impostor it failed"


def test_the_operation_timeout_a_worker_asks_for_is_capped_by_the_reducer() -> None:
    for asked, granted in ((10_000_000, 600_000), (0, 600_000), (1_000, 1_000)):
        server = ServerHandshake(incarnation=INC, secret=None, max_op_timeout_ms=600_000)
        server.receive_data(ClientHandshake(hello(asked), secret=None).data_to_send())
        assert server.hello is not None and server.hello.op_timeout_ms == granted


def test_a_header_announcing_more_than_the_pre_auth_cap_is_refused_at_the_header() -> None:
    server = ServerHandshake(incarnation=INC, secret=SECRET, max_op_timeout_ms=600_000)
    # a HELLO's prefix announcing 64 MiB
    huge = wire.encode(wire.Hello("j", 0, 1, 1, bytes(32)))[:8] + (64 * 2**20).to_bytes(4, "little")
    server.receive_data(huge)
    assert server.state is HandshakeState.FAILED and server.failure is not None
    assert "exceeds the cap" in server.failure.message
    assert server.bytes_needed == 0
    assert PRE_AUTH_MAX_PAYLOAD < 8192 and PRE_AUTH_MAX_BYTES < 8192


def test_a_data_frame_before_authentication_is_a_protocol_error() -> None:
    server = ServerHandshake(incarnation=INC, secret=None, max_op_timeout_ms=600_000)
    server.receive_data(wire.encode(wire.Heartbeat()))
    assert server.state is HandshakeState.FAILED and server.failure is not None
    assert server.failure.code is wire.ErrorCode.PROTOCOL and "expected HELLO" in server.failure.message
    assert server.data_to_send()[5] == wire.FrameType.ERROR


def test_a_refusal_from_the_reducer_is_reported_as_remote() -> None:
    client = ClientHandshake(hello(), secret=None)
    client.receive_data(wire.encode(wire.Error(wire.ErrorCode.JOB_MISMATCH, True, "world_size differs")))
    assert client.state is HandshakeState.FAILED and client.failure is not None
    assert client.failure.remote and client.failure.code is wire.ErrorCode.JOB_MISMATCH


def test_eof_mid_handshake_fails_without_raising() -> None:
    server = ServerHandshake(incarnation=INC, secret=None, max_op_timeout_ms=600_000)
    server.receive_data(ClientHandshake(hello(), secret=None).data_to_send()[:5])
    server.receive_data(b"")
    assert server.state is HandshakeState.FAILED and server.failure is not None
    assert "closed the connection" in server.failure.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(1, 64))
def test_arbitrary_bytes_end_in_a_verdict_never_an_exception_or_unbounded_buffering(data: bytes, step: int) -> None:
    server = ServerHandshake(incarnation=INC, secret=SECRET, max_op_timeout_ms=600_000)
    for i in range(0, len(data), step):
        if server.state is not HandshakeState.RUNNING:
            break
        server.receive_data(data[i : i + min(step, server.bytes_needed or 1)])
        assert server._decoder.buffered <= PRE_AUTH_MAX_BYTES
    assert server.state in (HandshakeState.RUNNING, HandshakeState.FAILED)  # never authenticated without the secret
