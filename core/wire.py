"""The redsrv wire protocol, sans-IO: bytes in, frames out; frames in, bytes out.

No sockets, threads or clocks live here (the h11 design): the transport feeds bytes and asks
where a payload should land, so payloads can be received straight into preallocated buffers.

Every frame is a fixed 12-byte prefix, a fixed-size header for its type, then a payload::

    prefix  = magic "RDSV" | version u8 | type u8 | header_len u16 | payload_len u32
    header  = per type, little-endian, sizes declared once in ``_HEADER_STRUCTS``
    payload = raw bytes (array data, UTF-8 text, a contributor bitmap)

There is no pickle, marshal or eval anywhere: array data is raw little-endian bytes with the
dtype sent as a small integer code.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from .constants import (
    DEFAULT_MAX_FRAME_PAYLOAD,
    MAGIC,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_JOB_ID_BYTES,
    MAX_WORLD_SIZE,
    PROTOCOL_VERSION,
)
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DType",
    "FrameType",
    "StragglerMode",
    "ReduceOp",
    "COMBINING_OPS",
    "BITWISE_OPS",
    "INTEGER_DTYPES",
    "DTYPE_NAMES",
    "NUMERIC_DTYPE_NAMES",
    "ErrorCode",
    "CLIENT_CLOSED_MESSAGE",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "PREFIX",
    "MAX_HEADER_SIZE",
    "Hello",
    "Challenge",
    "Proof",
    "Welcome",
    "Push",
    "Result",
    "Error",
    "Heartbeat",
    "Ack",
    "Safe",
    "Frame",
    "FrameHeader",
    "encode",
    "encode_header",
    "push_header",
    "result_header",
    "result_header_of",
    "parse_prefix",
    "parse_header",
    "parse_payload",
    "FrameParser",
    "PYTHON_PARSER",
    "FrameDecoder",
    "Event",
    "PayloadWanted",
    "PayloadLanded",
    "PayloadSkipped",
    "dtype_code",
    "numpy_dtype",
    "bitmap_from_ranks",
    "ranks_from_bitmap",
]

NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256 digest


class FrameType(enum.IntEnum):
    HELLO = 1  # worker -> reducer: who I am, the job's parameters, my nonce
    CHALLENGE = 2  # reducer -> worker: incarnation, its nonce, its proof
    PROOF = 3  # worker -> reducer: my proof
    WELCOME = 4  # reducer -> worker: accepted
    PUSH = 5  # worker -> reducer: one chunk of one operation
    RESULT = 6  # reducer -> worker: the reduced chunk and who contributed
    ERROR = 7  # either way: what went wrong; fatal errors close the connection
    HEARTBEAT = 8  # either way: I am alive (sent when a direction is idle)
    ACK = 9  # worker -> reducer: how many whole chunk results this connection delivered
    SAFE = 10  # reducer -> worker: every rank has the results up to this frame of this connection


class DType(enum.IntEnum):
    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6
    INT8 = 7
    UINT8 = 8
    BOOL = 9


_NUMPY_DTYPES: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
    DType.INT8: np.dtype("i1"),
    DType.UINT8: np.dtype("u1"),
    DType.BOOL: np.dtype("?"),
}
_CODES = {dt: code for code, dt in _NUMPY_DTYPES.items()}
#: The NumPy dtype by the raw code a header carries (a validated header's code is always here).
NUMPY_DTYPE_BY_CODE: dict[int, np.dtype] = {int(code): dt for code, dt in _NUMPY_DTYPES.items()}

#: The one dtype table: every wire dtype by its NumPy name. Frameworks name their dtypes the same
#: way (``torch.bfloat16``, ``tf.bfloat16``, ``jnp.bfloat16``), so each adapter derives its list
#: of supported dtypes from these names rather than keeping one of its own.
DTYPE_NAMES: dict[str, DType] = {_NUMPY_DTYPES[code].name: code for code in DType}
#: The wire dtypes that have a sum in every framework: all but ``bool`` (TensorFlow's ``add_n`` and
#: XLA's reductions refuse it; torch sums it as a logical or).
NUMERIC_DTYPE_NAMES: tuple[str, ...] = tuple(name for name in DTYPE_NAMES if name != "bool")


def numpy_dtype(code: DType) -> np.dtype:
    """The NumPy dtype for a wire dtype code."""
    return _NUMPY_DTYPES[code]


def dtype_code(dtype: np.dtype | type) -> DType:
    """The wire code of a NumPy dtype; ``LocalProtocolError`` for unsupported ones."""
    dt = np.dtype(dtype)
    try:
        return _CODES[dt.newbyteorder("<") if dt.byteorder == ">" else dt]
    except KeyError:
        supported = ", ".join(str(d) for d in _NUMPY_DTYPES.values())
        raise LocalProtocolError(f"dtype {dt} is not supported on the wire (supported: {supported})") from None


class StragglerMode(enum.IntEnum):
    ALL = 0  # a chunk closes when every rank contributed
    FIRST_M = 1  # closes when min_contributors ranks contributed
    DEADLINE = 2  # closes deadline_ms after its first contribution if min_contributors arrived


class ReduceOp(enum.IntEnum):
    SUM = 0
    BROADCAST = 1  # the root's data, sent to everyone; other ranks push no payload
    MIN = 2
    MAX = 3
    PRODUCT = 4
    BAND = 5  # bitwise and, or, xor: integer and bool data only
    BOR = 6
    BXOR = 7
    # A chunk's known result, pushed by a worker that has it to a reducer that restarted before
    # every rank had it (RELIABILITY R22); the reducer answers the other ranks with it.
    SETTLED = 8


#: The ops that combine every rank's data element-wise.
COMBINING_OPS = frozenset(op for op in ReduceOp if op not in (ReduceOp.BROADCAST, ReduceOp.SETTLED))
#: The bitwise ops, which are defined only for integer and bool dtypes.
BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
#: The dtypes the bitwise ops accept.
INTEGER_DTYPES = frozenset({DType.INT8, DType.UINT8, DType.INT32, DType.INT64, DType.BOOL})


class ErrorCode(enum.IntEnum):
    PROTOCOL = 1  # malformed frame
    AUTHENTICATION = 2
    JOB_MISMATCH = 3  # handshake parameters differ from the job's
    CONTRIBUTION_MISMATCH = 4  # ranks disagree on dtype / length / op for one key
    STALE = 5  # contribution for a closed chunk or an old incarnation
    TIMEOUT = 6  # the chunk did not close within the job's operation timeout
    PEER_LOST = 7  # a worker of the job disconnected; names the rank
    SHUTDOWN = 8  # the reducer is stopping
    OVERLOADED = 9  # job budget or connection limit exceeded
    DUPLICATE = 10  # a rank contributed twice to one chunk
    # worker -> reducer: the client was closed, or failed (the message says why); its rank leaves
    # the job now, keeping no place
    CLOSED = 11


# The message of a CLOSED goodbye from Client.close(); any other message is why the client failed.
CLIENT_CLOSED_MESSAGE = "the client was closed"


# --- frames ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    job: str
    rank: int
    world_size: int
    session: int  # random per client instance; a new session for a rank replaces the old one
    nonce: bytes
    mode: StragglerMode = StragglerMode.ALL
    min_contributors: int = 0  # first_m: m; deadline: the minimum; 0 = world_size
    deadline_ms: int = 0
    op_timeout_ms: int = 300_000
    # How long this client keeps reconnecting to a reducer it lost (0: it does not, and a lost
    # connection fails its operations at once). The reducer keeps the rank's place meanwhile.
    reconnect_window_ms: int = 0


@dataclass(frozen=True)
class Challenge:
    incarnation: int
    nonce: bytes
    proof: bytes  # HMAC over both nonces; all zeros when the reducer has no secret
    auth_required: bool


@dataclass(frozen=True)
class Proof:
    proof: bytes


@dataclass(frozen=True)
class Welcome:
    incarnation: int
    max_payload: int
    heartbeat_ms: int


@dataclass(frozen=True)
class Push:
    key: int
    incarnation: int
    total: int  # elements in the whole operation (all reducers)
    offset: int  # first element of this chunk within the operation
    count: int  # elements in this chunk
    chunk: int  # index of this chunk on this reducer
    dtype: DType
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    payload: bytes | memoryview = b""  # count * itemsize bytes; empty for a broadcast non-root


@dataclass(frozen=True)
class Result:
    """The sum of elements ``[offset, offset + count)``: a whole chunk, or one piece of it when
    the reducer forwards a chunk as it arrives (pieces of a chunk come in order, on the stream
    its push came on, and tile it)."""

    key: int
    offset: int
    count: int
    chunk: int
    dtype: DType
    contributors: int  # how many ranks are in the bitmap
    bitmap: bytes  # bit r set when rank r contributed
    payload: bytes | memoryview = b""


@dataclass(frozen=True)
class Error:
    code: ErrorCode
    fatal: bool  # the connection closes after this frame
    message: str
    key: int = 0
    chunk: int = 0xFFFFFFFF  # no chunk


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class Ack:
    """The worker has every result of the first ``results`` whole chunks the reducer sent on this
    connection (counted in the order they completed). The reducer keeps each result until it is
    acknowledged, so that a worker whose connection broke can be answered again (R22)."""

    results: int


@dataclass(frozen=True)
class Safe:
    """Every rank of the job has the whole results of the first ``frames`` RESULT frames sent on
    this connection: the worker may drop the copies it keeps of them (R22)."""

    frames: int


Frame = Hello | Challenge | Proof | Welcome | Push | Result | Error | Heartbeat | Ack | Safe

PREFIX = struct.Struct("<4sBBHI")

# Declared once; the decoder checks header_len against these sizes.
_HEADER_STRUCTS: dict[FrameType, struct.Struct] = {
    # rank, world_size, mode, pad, min_contributors, deadline_ms, op_timeout_ms, session, nonce, reconnect_window_ms
    FrameType.HELLO: struct.Struct(f"<IIBxxxIIIQ{NONCE_BYTES}sI"),
    # incarnation, auth_required, pad, nonce, proof
    FrameType.CHALLENGE: struct.Struct(f"<QBxxx{NONCE_BYTES}s{PROOF_BYTES}s"),
    FrameType.PROOF: struct.Struct(f"<{PROOF_BYTES}s"),
    # incarnation, max_payload, heartbeat_ms
    FrameType.WELCOME: struct.Struct("<QII"),
    # key, incarnation, total, offset, count, chunk, dtype, op, root
    FrameType.PUSH: struct.Struct("<QQQQIIBBH"),
    # key, offset, count, chunk, dtype, pad, contributors, bitmap_len
    FrameType.RESULT: struct.Struct("<QQIIBxHI"),
    # code, fatal, pad, key, chunk
    FrameType.ERROR: struct.Struct("<HBxQI"),
    FrameType.HEARTBEAT: struct.Struct("<"),
    FrameType.ACK: struct.Struct("<Q"),  # results
    FrameType.SAFE: struct.Struct("<Q"),  # frames
}

_PUSH_HEADER = _HEADER_STRUCTS[FrameType.PUSH]
_RESULT_HEADER = _HEADER_STRUCTS[FrameType.RESULT]

#: Largest type header, for preallocated receive buffers.
MAX_HEADER_SIZE = max(st.size for st in _HEADER_STRUCTS.values())


@dataclass(frozen=True)
class FrameHeader:
    """A decoded prefix plus type header: everything but the payload.

    ``fields`` holds the unpacked header tuple; :func:`parse_payload` turns header and payload
    into a :data:`Frame`. The transport reads ``payload_len`` bytes after it, wherever it wants.
    """

    type: FrameType
    payload_len: int
    fields: tuple[Any, ...] = field(default=())


def _u(value: int, bits: int, name: str) -> int:
    if not 0 <= value < (1 << bits):
        raise LocalProtocolError(f"{name}={value} does not fit in an unsigned {bits}-bit field")
    return value


def _bytes(value: bytes, size: int, name: str) -> bytes:
    if len(value) != size:
        raise LocalProtocolError(f"{name} must be {size} bytes, got {len(value)}")
    return value


def encode_header(frame_type: FrameType, header: bytes, payload_len: int) -> bytes:
    """Prefix plus an already packed type header."""
    try:
        return PREFIX.pack(MAGIC, PROTOCOL_VERSION, frame_type, len(header), payload_len) + header
    except struct.error:
        _u(payload_len, 32, "payload_len")
        raise


def _encode_parts(frame: Frame) -> tuple[FrameType, bytes, bytes | memoryview]:
    # The data path's acknowledgements first: one each way for every few results.
    if isinstance(frame, Ack):
        return FrameType.ACK, _HEADER_STRUCTS[FrameType.ACK].pack(_u(frame.results, 64, "results")), b""
    if isinstance(frame, Safe):
        return FrameType.SAFE, _HEADER_STRUCTS[FrameType.SAFE].pack(_u(frame.frames, 64, "frames")), b""
    if isinstance(frame, Hello):
        job = frame.job.encode("utf-8")
        if not 0 < len(job) <= MAX_JOB_ID_BYTES:
            raise LocalProtocolError(f"job id must be 1..{MAX_JOB_ID_BYTES} UTF-8 bytes, got {len(job)}")
        if not 0 < frame.world_size <= MAX_WORLD_SIZE or not 0 <= frame.rank < frame.world_size:
            raise LocalProtocolError(f"rank {frame.rank} / world_size {frame.world_size} out of range")
        header = _HEADER_STRUCTS[FrameType.HELLO].pack(
            frame.rank, frame.world_size, frame.mode, _u(frame.min_contributors, 32, "min_contributors"),
            _u(frame.deadline_ms, 32, "deadline_ms"), _u(frame.op_timeout_ms, 32, "op_timeout_ms"),
            _u(frame.session, 64, "session"), _bytes(frame.nonce, NONCE_BYTES, "nonce"),
            _u(frame.reconnect_window_ms, 32, "reconnect_window_ms"),
        )
        return FrameType.HELLO, header, job
    if isinstance(frame, Challenge):
        header = _HEADER_STRUCTS[FrameType.CHALLENGE].pack(
            _u(frame.incarnation, 64, "incarnation"), int(frame.auth_required),
            _bytes(frame.nonce, NONCE_BYTES, "nonce"), _bytes(frame.proof, PROOF_BYTES, "proof"),
        )
        return FrameType.CHALLENGE, header, b""
    if isinstance(frame, Proof):
        return FrameType.PROOF, _HEADER_STRUCTS[FrameType.PROOF].pack(_bytes(frame.proof, PROOF_BYTES, "proof")), b""
    if isinstance(frame, Welcome):
        header = _HEADER_STRUCTS[FrameType.WELCOME].pack(
            _u(frame.incarnation, 64, "incarnation"), _u(frame.max_payload, 32, "max_payload"),
            _u(frame.heartbeat_ms, 32, "heartbeat_ms"),
        )
        return FrameType.WELCOME, header, b""
    if isinstance(frame, Error):
        message = frame.message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES]
        header = _HEADER_STRUCTS[FrameType.ERROR].pack(
            frame.code, int(frame.fatal), _u(frame.key, 64, "key"), _u(frame.chunk, 32, "chunk")
        )
        return FrameType.ERROR, header, message
    if isinstance(frame, Heartbeat):
        return FrameType.HEARTBEAT, b"", b""
    raise LocalProtocolError(f"cannot encode {type(frame).__name__}")


def encode(frame: Frame) -> bytes:
    """The complete bytes of one frame. Copies the payload: the transport sends array data
    separately after :func:`push_header` / :func:`result_header` instead."""
    if isinstance(frame, Push):
        return push_header(frame, len(frame.payload)) + bytes(frame.payload)
    if isinstance(frame, Result):
        return result_header(frame, len(frame.payload)) + bytes(frame.payload)
    frame_type, header, payload = _encode_parts(frame)
    return encode_header(frame_type, header, len(payload)) + bytes(payload)


def push_header(push: Push, payload_len: int) -> bytes:
    """Prefix and header of a push whose ``payload_len`` payload bytes are sent separately
    (zero-copy from the caller's array). ``push.payload`` is ignored."""
    itemsize = numpy_dtype(push.dtype).itemsize
    if payload_len != push.count * itemsize and not (push.op is ReduceOp.BROADCAST and payload_len == 0):
        raise LocalProtocolError(f"push payload is {payload_len} bytes, expected {push.count * itemsize}")
    try:  # the struct checks every field's range; the checks below only name the culprit
        header = _PUSH_HEADER.pack(push.key, push.incarnation, push.total, push.offset, push.count, push.chunk,
                                   push.dtype, push.op, push.root)
    except struct.error:
        for value, bits, name in ((push.key, 64, "key"), (push.incarnation, 64, "incarnation"), (push.total, 64, "total"),
                                  (push.offset, 64, "offset"), (push.count, 32, "count"), (push.chunk, 32, "chunk"),
                                  (push.root, 16, "root")):
            _u(value, bits, name)
        raise
    return encode_header(FrameType.PUSH, header, payload_len)


def result_header(result: Result, data_len: int) -> bytes:
    """Prefix, header and bitmap of a result whose ``data_len`` data bytes are sent separately."""
    return result_header_of(result.key, result.offset, result.count, result.chunk, result.dtype, result.contributors,
                            result.bitmap, data_len)


def result_header_of(key: int, offset: int, count: int, chunk: int, dtype: DType, contributors: int, bitmap: bytes,
                     data_len: int) -> bytes:
    """:func:`result_header` from the fields, for a reducer's every result piece: a frozen
    :class:`Result` costs more to build than the header does to pack."""
    if data_len != count * _NUMPY_DTYPES[dtype].itemsize:
        raise LocalProtocolError(f"result data is {data_len} bytes, expected {count} elements")
    try:  # as in push_header
        header = _RESULT_HEADER.pack(key, offset, count, chunk, dtype, contributors, len(bitmap))
    except struct.error:
        for value, bits, name in ((key, 64, "key"), (offset, 64, "offset"), (count, 32, "count"), (chunk, 32, "chunk"),
                                  (contributors, 16, "contributors"), (len(bitmap), 32, "bitmap_len")):
            _u(value, bits, name)
        raise
    return encode_header(FrameType.RESULT, header, len(bitmap) + data_len) + bitmap


# --- decoding -------------------------------------------------------------------------------


def parse_prefix(data: bytes | memoryview, max_payload: int = DEFAULT_MAX_FRAME_PAYLOAD) -> tuple[FrameType, int, int]:
    """Validate a 12-byte prefix; returns (type, header_len, payload_len)."""
    magic, version, raw_type, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a redsrv peer")
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {version} (this build speaks {PROTOCOL_VERSION})")
    frame_type = _enum(FrameType, raw_type, "frame type")
    expected = _HEADER_STRUCTS[frame_type].size
    if header_len != expected:
        raise RemoteProtocolError(f"{frame_type.name} header is {header_len} bytes, expected {expected}")
    if payload_len > max_payload:
        raise RemoteProtocolError(f"{frame_type.name} payload of {payload_len} bytes exceeds the cap of {max_payload}")
    return frame_type, header_len, payload_len


def parse_header(frame_type: FrameType, header: bytes | memoryview, payload_len: int) -> FrameHeader:
    """Validate a type header against its payload length before any payload is read."""
    fields = _HEADER_STRUCTS[frame_type].unpack(header)
    if frame_type is FrameType.PUSH:
        _key, _inc, total, offset, count, _chunk, raw_dtype, raw_op, _root = fields
        dtype = _enum(DType, raw_dtype, "dtype")
        op = _enum(ReduceOp, raw_op, "op")
        if op in BITWISE_OPS and dtype not in INTEGER_DTYPES:
            raise RemoteProtocolError(f"push asks for {op.name} of {numpy_dtype(dtype)}: bitwise ops need integer or bool data")
        if offset + count > total:
            raise RemoteProtocolError(f"push covers [{offset}, {offset + count}) beyond the total of {total} elements")
        expected = count * numpy_dtype(dtype).itemsize
        if payload_len != expected and not (op is ReduceOp.BROADCAST and payload_len == 0):
            raise RemoteProtocolError(
                f"push payload is {payload_len} bytes but {count} x {numpy_dtype(dtype)} needs {expected}"
            )
    elif frame_type is FrameType.RESULT:
        _key, _offset, count, _chunk, raw_dtype, contributors, bitmap_len = fields
        dtype = _enum(DType, raw_dtype, "dtype")
        if bitmap_len > (MAX_WORLD_SIZE + 7) // 8:
            raise RemoteProtocolError(f"result bitmap of {bitmap_len} bytes is larger than any job")
        expected = bitmap_len + count * numpy_dtype(dtype).itemsize
        if payload_len != expected:
            raise RemoteProtocolError(f"result payload is {payload_len} bytes, expected {expected}")
    elif frame_type is FrameType.HELLO:
        rank, world_size, raw_mode = fields[0], fields[1], fields[2]
        _enum(StragglerMode, raw_mode, "straggler mode")
        if not 0 < world_size <= MAX_WORLD_SIZE or rank >= world_size:
            raise RemoteProtocolError(f"rank {rank} / world_size {world_size} out of range")
        if not 0 < payload_len <= MAX_JOB_ID_BYTES:
            raise RemoteProtocolError(f"job id of {payload_len} bytes (allowed 1..{MAX_JOB_ID_BYTES})")
    elif frame_type is FrameType.ERROR:
        _enum(ErrorCode, fields[0], "error code")
        if payload_len > MAX_ERROR_MESSAGE_BYTES:
            raise RemoteProtocolError(f"error message of {payload_len} bytes exceeds {MAX_ERROR_MESSAGE_BYTES}")
    elif payload_len != 0:
        raise RemoteProtocolError(f"{frame_type.name} frames carry no payload, got {payload_len} bytes")
    return FrameHeader(frame_type, payload_len, fields)


# Member by raw value: a dict lookup, because calling the enum class costs several times more and
# runs for every frame (profiled on the reducer's hot path).
_MEMBER_BY_VALUE: dict[type[enum.IntEnum], dict[int, enum.IntEnum]] = {
    kind: {int(m): m for m in kind} for kind in (FrameType, DType, ReduceOp, StragglerMode, ErrorCode)
}


def _enum(kind: type[enum.IntEnum], raw: int, what: str):  # type: ignore[no-untyped-def]
    member = _MEMBER_BY_VALUE[kind].get(raw)
    if member is None:
        raise RemoteProtocolError(f"unknown {what} {raw}")
    return member


class FrameParser(NamedTuple):
    """The two checks a :class:`FrameDecoder` runs on every frame, before it holds any payload:
    :func:`parse_prefix` and :func:`parse_header`, or an implementation with the same results
    and errors (the native plane's, ``redsrv.core._plane``, chosen by :func:`core.plane.kernels_for`)."""

    parse_prefix: Callable[[bytes | memoryview, int], tuple[FrameType, int, int]]
    parse_header: Callable[[FrameType, bytes | memoryview, int], FrameHeader]


#: The reference parser: the functions above.
PYTHON_PARSER = FrameParser(parse_prefix, parse_header)


def parse_payload(header: FrameHeader, payload: bytes | memoryview) -> Frame:
    """Build the frame from a validated header and its payload (kept as given, not copied)."""
    f = header.fields
    t = header.type
    if t is FrameType.PUSH:
        return Push(f[0], f[1], f[2], f[3], f[4], f[5], _enum(DType, f[6], "dtype"), _enum(ReduceOp, f[7], "op"), f[8], payload)
    if t is FrameType.RESULT:
        bitmap_len = f[6]
        dtype = _enum(DType, f[4], "dtype")
        return Result(f[0], f[1], f[2], f[3], dtype, f[5], bytes(payload[:bitmap_len]), payload[bitmap_len:])
    if t is FrameType.HELLO:
        try:
            job = bytes(payload).decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError("job id is not valid UTF-8") from None
        return Hello(job, f[0], f[1], f[6], f[7], StragglerMode(f[2]), f[3], f[4], f[5], f[8])
    if t is FrameType.CHALLENGE:
        return Challenge(f[0], f[2], f[3], bool(f[1]))
    if t is FrameType.PROOF:
        return Proof(f[0])
    if t is FrameType.WELCOME:
        return Welcome(f[0], f[1], f[2])
    if t is FrameType.ERROR:
        message = bytes(payload).decode("utf-8", errors="replace")
        return Error(ErrorCode(f[0]), bool(f[1]), message, f[2], f[3])
    if t is FrameType.ACK:
        return Ack(f[0])
    if t is FrameType.SAFE:
        return Safe(f[0])
    return Heartbeat()


# What a FrameDecoder is in the middle of.
_PREFIX, _HEADER, _WHOLE, _WANTED, _LANDING, _LANDED, _DISCARD, _DEAD = range(8)
#: In place, a new frame is received into a read-ahead buffer of this size: its prefix, header
#: and a result's bitmap (and the small frames behind it) then take one receive instead of one
#: each. What follows the header waits there until the receiver names its place, so at most
#: this many bytes of a payload are read before it does.
READ_AHEAD_BYTES = 1024
_NO_ROOM = memoryview(bytearray())
_HEADER_WHAT = {t: f"a {t.name} header" for t in FrameType}
_PAYLOAD_WHAT = {t: f"a {t.name} payload" for t in FrameType}
#: Payloads of data frames the receiver does not want land here, in turns (written, never read).
_DISCARD_BUFFER = memoryview(bytearray(256 * 1024))


@dataclass(frozen=True, slots=True)
class PayloadWanted:
    """A data frame's header is in: the receiver names where its payload lands
    (:meth:`FrameDecoder.land_payload`) or drops it (:meth:`FrameDecoder.skip_payload`). Until it
    does, :meth:`FrameDecoder.next_event` returns this event again (a receiver may wait for memory)."""

    header: FrameHeader


@dataclass(frozen=True, slots=True)
class PayloadLanded:
    """The buffer named last is full: name the next part of the same payload, or end it
    (:meth:`FrameDecoder.end_payload`)."""

    header: FrameHeader


@dataclass(frozen=True, slots=True)
class PayloadSkipped:
    """A data frame whose payload was dropped is over."""

    header: FrameHeader


#: What :meth:`FrameDecoder.next_event` returns: a whole frame, or a step of a data frame.
Event = Frame | PayloadWanted | PayloadLanded | PayloadSkipped


class FrameDecoder:
    """The one frame decoder: the handshake's and both event loops' (RELIABILITY R20).

    It owns the state machine and says where every byte goes; its driver only moves bytes. Two
    ways to drive it:

    * **In place** (the data path): :meth:`buffer` is the memory the next bytes belong in (the
      driver receives into it) and :meth:`filled` says how many arrived; :meth:`next_event`
      then returns the next :data:`Event` or ``None`` for "more bytes". Frames of the types in
      ``data_frames`` are not decoded whole: their header comes as :class:`PayloadWanted`, and
      the receiver names the buffers their payload lands in, part by part, so array data goes
      from the socket straight to its place.
    * **Fed bytes** (the handshake, tests): :meth:`receive_data` and :meth:`next_frame`, which
      copy the fed bytes through the same machine; every frame comes whole.

    Bounded: before a payload is held its header has been checked against ``max_payload`` and
    the type's own limits, so a peer can make it hold one frame's prefix, header and capped
    payload at most. ``accept`` (all types if ``None``) refuses other types at their prefix.
    ``parser`` runs those checks (:data:`PYTHON_PARSER` or the native plane's, which agree).
    After a :class:`RemoteProtocolError` the decoder is dead and raises the same error again.
    """

    __slots__ = ("_max_payload", "_data_frames", "_accept", "_parse_prefix", "_parse_header", "_head", "_stage", "_target",
                 "_got", "_frame_type", "_payload_len", "_payload_left", "_header", "_error", "_eof", "_pending", "_ready",
                 "what", "_ahead", "_ahead_at", "_ahead_end", "_reading_ahead", "_event", "_landed")

    def __init__(self, max_payload: int = DEFAULT_MAX_FRAME_PAYLOAD, *, data_frames: frozenset[FrameType] = frozenset(),
                 accept: frozenset[FrameType] | None = None, parser: FrameParser = PYTHON_PARSER) -> None:
        self._max_payload = max_payload
        self._data_frames = data_frames
        self._accept = accept
        self._parse_prefix, self._parse_header = parser
        self._head = memoryview(bytearray(PREFIX.size + MAX_HEADER_SIZE))
        self._error: RemoteProtocolError | None = None
        self._eof = False
        self._pending = bytearray()  # fed and not yet moved into the machine (receive_data)
        self._ready: Frame | None = None  # a whole frame decoded from fed bytes, not yet taken
        self._header: FrameHeader | None = None
        self._frame_type = FrameType.HEARTBEAT
        self._payload_len = self._payload_left = 0
        self._stage, self._target, self._got = _PREFIX, self._head[: PREFIX.size], 0
        self.what = "a frame"  # what the decoder waits for, for timeout messages
        self._ahead: memoryview | None = None  # the read-ahead buffer (in place only), made on first use
        self._ahead_at = self._ahead_end = 0  # its bytes not yet moved into the machine
        self._reading_ahead = False  # the last buffer() was the read-ahead buffer
        self._event: PayloadWanted | PayloadLanded | None = None  # what a data frame waits on, asked again until answered
        self._landed: PayloadLanded | None = None

    # --- in place --------------------------------------------------------------------------

    def buffer(self) -> memoryview:
        """Where the next bytes go (at most ``len()`` of them); empty while an event waits for
        the receiver's answer, while bytes read ahead wait to be placed, or once the current part
        is complete (call :meth:`next_event`). Between frames it is the read-ahead buffer
        (:data:`READ_AHEAD_BYTES`), which may take bytes of the frames after the next one too."""
        if self._ahead_end:
            self._reading_ahead = False
            return _NO_ROOM
        if self._stage == _PREFIX and not self._got:
            ahead = self._ahead
            if ahead is None:
                ahead = self._ahead = memoryview(bytearray(READ_AHEAD_BYTES))
            self._reading_ahead = True
            return ahead
        self._reading_ahead = False
        return self._target[self._got :]

    def filled(self, nbytes: int) -> None:
        """``nbytes`` arrived at the start of :meth:`buffer`."""
        if self._reading_ahead:
            if not 0 < nbytes <= READ_AHEAD_BYTES:
                raise ValueError(f"filled({nbytes}) with {READ_AHEAD_BYTES} bytes of room")
            self._reading_ahead = False
            self._ahead_at, self._ahead_end = 0, nbytes
            return
        if not 0 < nbytes <= len(self._target) - self._got:
            raise ValueError(f"filled({nbytes}) with {len(self._target) - self._got} bytes of room")
        self._got += nbytes

    @property
    def held(self) -> int:
        """Bytes read ahead (in place) that the machine has not placed yet: :meth:`next_event`
        places them, so a driver must call it before waiting for its socket again."""
        return self._ahead_end - self._ahead_at

    def next_event(self) -> Event | None:
        """The next event, or ``None`` when :meth:`buffer` must be filled first."""
        if self._error is not None:
            raise self._error
        try:
            return self._step()
        except RemoteProtocolError as exc:
            self._die(exc)
            raise

    def land_payload(self, view: memoryview, what: str = "a payload") -> None:
        """Receive the next ``view.nbytes`` bytes of the data frame's payload into ``view``."""
        if self._stage not in (_WANTED, _LANDED):
            raise ValueError("land_payload() answers PayloadWanted or PayloadLanded only")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes > self._payload_left:
            raise ValueError(f"a buffer of {view.nbytes} bytes for the {self._payload_left} left of the payload")
        self._stage, self._target, self._got, self.what = _LANDING, view, 0, what

    def skip_payload(self) -> None:
        """Drop the rest of the data frame's payload; :class:`PayloadSkipped` ends the frame."""
        if self._stage not in (_WANTED, _LANDED):
            raise ValueError("skip_payload() answers PayloadWanted or PayloadLanded only")
        self._stage, self._target, self._got = _DISCARD, _DISCARD_BUFFER[: min(self._payload_left, len(_DISCARD_BUFFER))], 0
        self.what = "a discarded payload"

    def end_payload(self) -> None:
        """The data frame is over: every byte of its payload has landed."""
        if self._stage is not _LANDED or self._payload_left:
            raise ValueError(f"end_payload() with {self._payload_left} bytes of the payload still to land")
        self._next_frame()

    def hold(self, data: bytes) -> None:
        """Bytes another reader took from the socket ahead of the next frame (the native plane's
        result receiver, ``native/receiver.c``, which hands over every frame it does not land):
        decoded as if this decoder had read them ahead itself. Between frames only."""
        if not self.between_frames or len(data) > READ_AHEAD_BYTES:
            raise ValueError(f"hold() of {len(data)} bytes while {self.what} is being decoded")
        if data:
            ahead = self._ahead
            if ahead is None:
                ahead = self._ahead = memoryview(bytearray(READ_AHEAD_BYTES))
            ahead[: len(data)] = data
            self._ahead_at, self._ahead_end = 0, len(data)

    @property
    def between_frames(self) -> bool:
        """No byte of the next frame has arrived."""
        return self._stage == _PREFIX and not self._got and not self._ahead_end

    @property
    def landing(self) -> int:
        """The size of the buffer a payload is landing in now (0 if none)."""
        return len(self._target) if self._stage == _LANDING else 0

    @property
    def landed(self) -> int:
        """Bytes of that buffer filled so far (0 if none)."""
        return self._got if self._stage == _LANDING else 0

    def release(self) -> None:
        """The connection is closed: let go of the receiver's buffer."""
        self._stage, self._target, self._got, self._header = _DEAD, memoryview(b""), 0, None
        self._ahead, self._ahead_at, self._ahead_end = None, 0, 0

    def _step(self) -> Event | None:
        while True:
            stage = self._stage
            if stage == _WANTED or stage == _LANDED:
                return self._event  # asked again until the receiver answers
            target = self._target
            missing = len(target) - self._got
            if missing:
                if not self._ahead_end:
                    return None
                self._place_read_ahead(target, missing)
                if self._got < len(target):
                    return None
            if stage == _PREFIX:
                frame_type, header_len, payload_len = self._parse_prefix(self._head[: PREFIX.size], self._max_payload)
                if self._accept is not None and frame_type not in self._accept:
                    raise RemoteProtocolError(f"unexpected {frame_type.name} frame")
                self._frame_type, self._payload_len = frame_type, payload_len
                self._stage, self._target, self._got = _HEADER, self._head[PREFIX.size : PREFIX.size + header_len], 0
                self.what = _HEADER_WHAT[frame_type]
            elif stage == _HEADER:
                header = self._header = self._parse_header(self._frame_type, target, self._payload_len)
                self._payload_left = header.payload_len
                if header.type in self._data_frames:
                    self._stage, self._target, self._got = _WANTED, _NO_ROOM, 0
                    self._event = PayloadWanted(header)
                    self._landed = PayloadLanded(header)
                    return self._event
                self._stage, self._target, self._got = _WHOLE, memoryview(bytearray(header.payload_len)), 0
                self.what = _PAYLOAD_WHAT[header.type]
            elif stage == _WHOLE:
                whole = self._header
                assert whole is not None
                self._next_frame()
                return parse_payload(whole, target)
            elif stage == _LANDING:
                self._payload_left -= len(target)
                self._stage, self._event = _LANDED, self._landed
            elif stage == _DISCARD:
                self._payload_left -= len(target)
                if not self._payload_left:
                    skipped = self._header
                    assert skipped is not None
                    self._next_frame()
                    return PayloadSkipped(skipped)
                self._target, self._got = _DISCARD_BUFFER[: min(self._payload_left, len(_DISCARD_BUFFER))], 0
            else:
                return None  # released

    def _place_read_ahead(self, target: memoryview, missing: int) -> None:
        """Move bytes read ahead into ``target``, as many as it misses."""
        ahead, at, got = self._ahead, self._ahead_at, self._got
        assert ahead is not None
        n = self._ahead_end - at
        if n > missing:
            n = missing
        target[got : got + n] = ahead[at : at + n]
        self._got = got + n
        at += n
        if at == self._ahead_end:
            self._ahead_at = self._ahead_end = 0
        else:
            self._ahead_at = at

    def _next_frame(self) -> None:
        self._stage, self._target, self._got, self._header, self.what = _PREFIX, self._head[: PREFIX.size], 0, None, "a frame"

    def _die(self, exc: RemoteProtocolError) -> None:
        self._error = exc
        self._pending.clear()
        self.release()

    # --- fed bytes -------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Append received bytes; ``b""`` means the peer closed its side."""
        if self._error is not None:
            raise self._error
        if not data:
            self._eof = True
        self._pending += data

    @property
    def buffered(self) -> int:
        """Bytes fed and held: of the frame being decoded, and any not yet looked at."""
        if self._stage in (_PREFIX, _WHOLE):
            held = self._got
        elif self._stage == _HEADER:
            held = PREFIX.size + self._got
        else:
            held = 0
        return held + len(self._pending)

    @property
    def bytes_needed(self) -> int:
        """How many more bytes complete the frame being decoded (at least 1). A caller that reads
        exactly this many never takes bytes beyond the frame from its socket, so the handshake can
        hand the connection to the data-path reader without losing what follows."""
        if self._error is not None:
            raise self._error
        if self._pump() is not None:
            return 1  # a frame is complete: next_frame() returns it
        missing = len(self._target) - self._got
        if self._stage == _HEADER:
            missing += self._payload_len
        return max(1, missing)

    def next_frame(self) -> Frame | None:
        """The next whole frame from the fed bytes, or ``None`` when more are needed."""
        if self._error is not None:
            raise self._error
        frame = self._pump()
        if frame is not None:
            self._ready = None
            return frame
        if self._eof and not self.between_frames:
            exc = RemoteProtocolError(f"connection closed in the middle of a frame ({self.buffered} bytes pending)")
            self._die(exc)
            raise exc
        return None

    def _pump(self) -> Frame | None:
        """Move fed bytes through the machine up to the next whole frame."""
        if self._ready is not None:
            return self._ready
        try:
            while True:
                room = self._target[self._got :]
                if room and self._pending:
                    n = min(len(room), len(self._pending))
                    room[:n] = self._pending[:n]
                    del self._pending[:n]
                    self._got += n
                event = self._step()
                if event is None:
                    if not self._pending or self._stage == _DEAD:
                        return None
                    continue
                if isinstance(event, (PayloadWanted, PayloadLanded, PayloadSkipped)):
                    raise TypeError("a decoder fed bytes decodes whole frames: give it no data_frames")
                self._ready = event
                return event
        except RemoteProtocolError as exc:
            self._die(exc)
            raise
def bitmap_from_ranks(ranks: int, world_size: int) -> bytes:
    """Pack an int whose bit r is rank r into a little-endian bitmap of world_size bits."""
    return ranks.to_bytes((world_size + 7) // 8, "little")


def ranks_from_bitmap(bitmap: bytes) -> list[int]:
    """The ranks whose bits are set, ascending."""
    value = int.from_bytes(bitmap, "little")
    return [r for r in range(len(bitmap) * 8) if value >> r & 1]
