"""The handshake, sans-IO: one state machine per side, fed bytes, asked for bytes to send.

::

    worker                                   reducer
      HELLO (job, rank, session, nonce)  ->
                                         <-  CHALLENGE (incarnation, nonce, proof of the secret)
      PROOF (proof of the secret)        ->
                                         <-  WELCOME (or ERROR: refused, with the reason)

No sockets, threads or clocks live here (the h11 design, like :mod:`wire`): the reducer's
event loop drives :class:`ServerHandshake` for every pending connection at once, the client
drives :class:`ClientHandshake`, and the tests feed both whole, byte by byte and with garbage.
Both parse with :class:`wire.FrameDecoder` capped at :data:`PRE_AUTH_MAX_PAYLOAD`, so before
authentication a connection can make its peer hold a few KiB at most: a header announcing a
longer frame is refused at the header, before anything is allocated for it (RELIABILITY R20).
Drivers read at most :attr:`bytes_needed` bytes at a time, so nothing beyond the handshake's
last frame is taken from the socket.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from . import auth, wire
from .constants import MAX_ERROR_MESSAGE_BYTES, MAX_JOB_ID_BYTES
from .errors import RemoteProtocolError

__all__ = ["PRE_AUTH_MAX_PAYLOAD", "PRE_AUTH_MAX_BYTES", "HandshakeState", "HandshakeFailure", "ServerHandshake",
           "ClientHandshake", "Accepted"]

#: The longest payload a frame may announce before authentication: a HELLO's job id or an ERROR's
#: message. Anything longer is refused at its header.
PRE_AUTH_MAX_PAYLOAD = max(MAX_JOB_ID_BYTES, MAX_ERROR_MESSAGE_BYTES)
#: The most bytes a handshake ever buffers: one frame's prefix, largest header and payload.
PRE_AUTH_MAX_BYTES = wire.PREFIX.size + wire.MAX_HEADER_SIZE + PRE_AUTH_MAX_PAYLOAD


class HandshakeState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # server: the worker is authenticated (join it, then send WELCOME); client: WELCOME arrived
    FAILED = "failed"


@dataclass(frozen=True)
class HandshakeFailure:
    """Why a handshake failed. ``code`` is what the peer was (or should be) told; ``remote`` says
    whether the peer refused us (an ERROR frame arrived) rather than we it."""

    code: wire.ErrorCode
    message: str
    remote: bool = False


@dataclass(frozen=True)
class Accepted:
    """What the client learns from a completed handshake."""

    incarnation: int
    max_payload: int
    heartbeat_ms: int


class _Side:
    def __init__(self) -> None:
        self._decoder = wire.FrameDecoder(max_payload=PRE_AUTH_MAX_PAYLOAD)
        self._outgoing = bytearray()
        self.state = HandshakeState.RUNNING
        self.failure: HandshakeFailure | None = None

    @property
    def bytes_needed(self) -> int:
        """Read at most this many bytes before the next :meth:`receive_data` (0 once finished)."""
        if self.state is not HandshakeState.RUNNING:
            return 0
        try:
            return self._decoder.bytes_needed
        except RemoteProtocolError as exc:
            self._fail(wire.ErrorCode.PROTOCOL, str(exc), tell_peer=True)
            return 0

    def data_to_send(self) -> bytes:
        """Bytes the peer must receive now (a reply, or the ERROR that ends the handshake)."""
        data = bytes(self._outgoing)
        self._outgoing.clear()
        return data

    def receive_data(self, data: bytes) -> None:
        """Feed received bytes; ``b""`` means the peer closed the connection."""
        if self.state is not HandshakeState.RUNNING:
            return
        try:
            self._decoder.receive_data(data)
            while self.state is HandshakeState.RUNNING:
                frame = self._decoder.next_frame()
                if frame is None:
                    break
                self._on_frame(frame)
        except RemoteProtocolError as exc:
            if not data:
                self._fail(wire.ErrorCode.PROTOCOL, "the peer closed the connection during the handshake")
            else:
                self._fail(wire.ErrorCode.PROTOCOL, str(exc), tell_peer=True)
            return
        if not data and self.state is HandshakeState.RUNNING:
            self._fail(wire.ErrorCode.PROTOCOL, "the peer closed the connection during the handshake")

    def _on_frame(self, frame: wire.Frame) -> None:
        raise NotImplementedError

    def _send(self, frame: wire.Frame) -> None:
        self._outgoing += wire.encode(frame)

    def _fail(self, code: wire.ErrorCode, message: str, *, tell_peer: bool = False, remote: bool = False) -> None:
        if tell_peer:
            self._send(wire.Error(code, True, message))
        self.state = HandshakeState.FAILED
        self.failure = HandshakeFailure(code, message, remote)

    def _unexpected(self, frame: wire.Frame, wanted: str) -> None:
        if isinstance(frame, wire.Error):
            self._fail(frame.code, frame.message, remote=True)
        else:
            self._fail(wire.ErrorCode.PROTOCOL, f"expected {wanted}, got {type(frame).__name__.upper()}", tell_peer=True)


class ServerHandshake(_Side):
    """The reducer's side. Once :attr:`state` is DONE, :attr:`hello` is the authenticated
    worker's HELLO, with its operation timeout capped at ``max_op_timeout_ms`` (RELIABILITY
    R21); the owner joins it and sends WELCOME (:meth:`welcome`) or the join's refusal."""

    def __init__(self, *, incarnation: int, secret: bytes | None, max_op_timeout_ms: int) -> None:
        super().__init__()
        self.incarnation = incarnation
        self._secret = secret
        self._max_op_timeout_ms = max_op_timeout_ms
        self._nonce = b""
        self._received: wire.Hello | None = None
        self.hello: wire.Hello | None = None

    def _on_frame(self, frame: wire.Frame) -> None:
        if self.hello is None:
            if not isinstance(frame, wire.Hello):
                self._unexpected(frame, "HELLO")
                return
            self._received = frame  # the proofs cover the HELLO as sent
            if frame.op_timeout_ms > self._max_op_timeout_ms or frame.op_timeout_ms == 0:
                self.hello = _with_op_timeout(frame, self._max_op_timeout_ms)
            else:
                self.hello = frame
            self._nonce = auth.new_nonce()
            proof = (auth.server_proof(self._secret, frame, self._nonce, self.incarnation) if self._secret
                     else auth.NO_PROOF)
            self._send(wire.Challenge(self.incarnation, self._nonce, proof, self._secret is not None))
            return
        if not isinstance(frame, wire.Proof):
            self._unexpected(frame, "PROOF")
            return
        if self._secret is not None:
            assert self._received is not None
            expected = auth.client_proof(self._secret, self._received, self._nonce, self.incarnation)
            if not auth.proofs_equal(frame.proof, expected):
                self._fail(wire.ErrorCode.AUTHENTICATION, "authentication failed", tell_peer=True)
                return
        self.state = HandshakeState.DONE

    @staticmethod
    def welcome(incarnation: int, max_payload: int, heartbeat_ms: int) -> bytes:
        return wire.encode(wire.Welcome(incarnation, max_payload, heartbeat_ms))


def _with_op_timeout(hello: wire.Hello, op_timeout_ms: int) -> wire.Hello:
    return dataclasses.replace(hello, op_timeout_ms=op_timeout_ms)


class ClientHandshake(_Side):
    """The worker's side: starts with HELLO in :meth:`data_to_send`. Once DONE, :attr:`accepted`
    says what the reducer granted; once FAILED, :attr:`failure` says why (``remote``: the
    reducer refused, its ERROR's code and message)."""

    def __init__(self, hello: wire.Hello, *, secret: bytes | None) -> None:
        super().__init__()
        self.hello = hello
        self._secret = secret
        self._challenge: wire.Challenge | None = None
        self.accepted: Accepted | None = None
        self._send(hello)

    def _on_frame(self, frame: wire.Frame) -> None:
        if self._challenge is None:
            if not isinstance(frame, wire.Challenge):
                self._unexpected(frame, "CHALLENGE")
                return
            self._challenge = frame
            if self._secret is not None:
                expected = auth.server_proof(self._secret, self.hello, frame.nonce, frame.incarnation)
                if not frame.auth_required or not auth.proofs_equal(frame.proof, expected):
                    self._fail(wire.ErrorCode.AUTHENTICATION, "authentication failed", tell_peer=True)
                    return
                proof = auth.client_proof(self._secret, self.hello, frame.nonce, frame.incarnation)
            else:
                proof = auth.NO_PROOF
            self._send(wire.Proof(proof))
            return
        if not isinstance(frame, wire.Welcome):
            self._unexpected(frame, "WELCOME")
            return
        self.accepted = Accepted(self._challenge.incarnation, frame.max_payload, frame.heartbeat_ms)
        self.state = HandshakeState.DONE
