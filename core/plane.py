"""The data plane's element-wise work: combining contributions, widening and narrowing 16-bit
floats, dividing for a mean. Two implementations with one behaviour, chosen by
``REDSRV_DATA_PLANE`` (:attr:`Config.data_plane`, :attr:`DaemonSettings.data_plane`):

- :class:`PythonKernels`, NumPy ufuncs and casts: the readable reference and the test oracle;
- :class:`NativeKernels`, the C loops of ``redsrv.core._plane`` (``native/plane.c``), vectorised,
  with the GIL released, giving the same bytes (``tests/unit/test_plane.py`` compares both on
  random bit patterns). A combination the C code does not handle falls back to the reference.

Each plane also brings the frame parser its connections' decoders run on every frame
(:attr:`Kernels.frames`): ``wire.parse_prefix`` and ``wire.parse_header``, or their C twins in
``native/frames.c`` (``tests/unit/test_wire_fuzz.py`` feeds both the same byte streams). The
native plane adds the client's result receiver (:attr:`Kernels.result_receiver`,
``native/receiver.c``), which lands steady RESULT frames, and the reducer's push receiver
(:attr:`Kernels.push_receiver`, ``native/pushes.c``), which reads PUSH, ACK and heartbeat
frames; both hand every other frame to that decoder. Every data connection writes its frames
with the plane's :attr:`Kernels.frame_writer`: ``transport.FrameWriter`` or its C twin in
``native/writer.c`` (``tests/unit/test_frame_writer.py`` runs both on the same sockets). On the
native plane a reducer's cut-through chunks are summed and sent from C once every rank's push is
in them (:attr:`Kernels.forwarder`, ``native/forward.c``).

``auto`` (the default) takes the native plane where it was built and the reference otherwise;
``native`` insists on it. Which plane a process runs is in ``redsrv plan``'s and the
benchmarks' output.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import numpy as np

from .errors import ConfigError
from .transport import FrameWriter
from .wire import PYTHON_PARSER, DType, FrameParser, ReduceOp, numpy_dtype

__all__ = ["ACCUMULATION_DTYPES", "UFUNCS", "PLANES", "Kernels", "PythonKernels", "NativeKernels", "kernels_for",
           "native_unavailable"]

#: Accumulation dtype per wire dtype: 16-bit floats are combined in float32 (RELIABILITY R14).
ACCUMULATION_DTYPES = {DType.FLOAT16: np.dtype("<f4"), DType.BFLOAT16: np.dtype("<f4")}

#: The element-wise NumPy function of each combining op. Every op is applied in ascending rank
#: order, so even the non-associative ones (float sums and products) give the same bytes on
#: every rank and in every run.
UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

PLANES = ("auto", "native", "python")

_native: ModuleType | None
_native_error: str | None
try:
    _native = importlib.import_module(".core._plane", "redsrv")
    _native_error = None
except ImportError as exc:  # not built: a machine without a compiler at install (setup.py warned)
    _native, _native_error = None, str(exc)

log = logging.getLogger("redsrv.plane")

_CODES: dict[np.dtype, int] = {numpy_dtype(code): int(code) for code in DType}


def native_unavailable() -> str | None:
    """Why the native plane cannot run here (``None`` when it can)."""
    if _native is None:
        return f"redsrv.core._plane is not built ({_native_error}); reinstall redsrv with a C compiler"
    return None


class Kernels:
    """What both planes offer. Arrays are contiguous; ``dst`` and ``src`` are the same memory or
    apart."""

    name = ""
    #: The checks every received frame's prefix and header go through (``wire.FrameDecoder``'s parser).
    frames: FrameParser = PYTHON_PARSER
    #: ``ResultSlot`` and ``ResultReceiver`` of ``native/receiver.c``, which land a client's steady
    #: RESULT frames without the interpreter; ``None``: every frame goes through the decoder.
    result_slot: Any = None
    result_receiver: Any = None
    #: ``PushReceiver`` of ``native/pushes.c``, which reads a reducer connection's PUSH, ACK and
    #: heartbeat frames and asks the daemon's callbacks as ``transport.FrameReader`` does;
    #: ``None``: the decoder reads every frame.
    push_receiver: Any = None
    #: What writes a data connection's frames: ``transport.FrameWriter``, or ``FrameWriter`` of
    #: ``native/writer.c`` (the same methods and rules, the buffers and iovecs handled in C).
    frame_writer: Any = FrameWriter
    #: ``Forwarder`` of ``native/forward.c``, which sums and sends a cut-through chunk's pieces as
    #: the push receivers land them, once every rank's push joined (``ReducerCore._engage``);
    #: ``None``: the state machine forwards every piece.
    forwarder: Any = None

    def combine(self, op: ReduceOp, acc: np.ndarray, piece: np.ndarray) -> None:
        """``acc = op(acc, piece)`` element-wise; ``piece`` in ``acc``'s dtype or, for a float32
        ``acc``, a 16-bit float widened as it is combined."""
        raise NotImplementedError

    def cast(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst = src`` converted to ``dst``'s dtype (NumPy's ``copyto(..., casting="unsafe")``)."""
        raise NotImplementedError

    def divide(self, dst: np.ndarray, src: np.ndarray, divisor: int) -> None:
        """``dst = src / divisor`` (NumPy's ``divide(src, divisor, out=dst, casting="unsafe")``)."""
        raise NotImplementedError


class PythonKernels(Kernels):
    """The reference: NumPy's ufuncs and casts."""

    name = "python"

    def combine(self, op: ReduceOp, acc: np.ndarray, piece: np.ndarray) -> None:
        UFUNCS[op](acc, piece, out=acc, casting="unsafe")

    def cast(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src, casting="unsafe")

    def divide(self, dst: np.ndarray, src: np.ndarray, divisor: int) -> None:
        np.divide(src, divisor, out=dst, casting="unsafe")


class NativeKernels(PythonKernels):
    """The C loops where they apply (every op and wire dtype; 16-bit floats to and from float32;
    float32 and float64 means), the reference elsewhere; the C frame parser."""

    name = "native"

    def __init__(self) -> None:
        why = native_unavailable()
        if why is not None:
            raise ConfigError(f"REDSRV_DATA_PLANE=native: {why}")
        assert _native is not None
        self._plane = _native
        self.frames = FrameParser(_native.parse_prefix, _native.parse_header)
        self.result_slot, self.result_receiver = _native.ResultSlot, _native.ResultReceiver
        self.push_receiver = _native.PushReceiver
        self.frame_writer = _native.FrameWriter
        self.forwarder = _native.Forwarder

    def combine(self, op: ReduceOp, acc: np.ndarray, piece: np.ndarray) -> None:
        acc_code, piece_code = _CODES.get(acc.dtype), _CODES.get(piece.dtype)
        if (acc_code is None or piece_code is None or not _flat(acc, piece)
                or not self._plane.combine(op, _bytes(acc), acc_code, _bytes(piece), piece_code)):
            super().combine(op, acc, piece)

    def cast(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst_code, src_code = _CODES.get(dst.dtype), _CODES.get(src.dtype)
        if (dst_code is None or src_code is None or not _flat(dst, src)
                or not self._plane.cast(_bytes(dst), dst_code, _bytes(src), src_code)):
            super().cast(dst, src)

    def divide(self, dst: np.ndarray, src: np.ndarray, divisor: int) -> None:
        dst_code, src_code = _CODES.get(dst.dtype), _CODES.get(src.dtype)
        if (dst_code is None or src_code is None or not _flat(dst, src)
                or not self._plane.divide(_bytes(dst), dst_code, _bytes(src), src_code, divisor)):
            super().divide(dst, src, divisor)


def _flat(dst: np.ndarray, src: np.ndarray) -> bool:
    """Both contiguous and of one size: what the C loops take (NumPy broadcasts the rest)."""
    return dst.flags.c_contiguous and src.flags.c_contiguous and dst.size == src.size


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A byte view for the buffer protocol, which NumPy refuses for ml_dtypes' bfloat16."""
    return arr.view(np.uint8) if arr.dtype.itemsize == 2 else arr


def kernels_for(plane: str) -> Kernels:
    """The kernels for a ``REDSRV_DATA_PLANE`` value (checked by the config). ``auto`` without a
    built plane says so once per process: pip shows no build output on success, so this is where
    a user learns that the install went without a compiler."""
    global _missing_said
    if plane == "python":
        return PythonKernels()
    if plane == "auto" and _native is None:
        if not _missing_said:
            _missing_said = True
            log.warning("running the Python data plane: %s (REDSRV_DATA_PLANE=python silences this)",
                        native_unavailable())
        return PythonKernels()
    return NativeKernels()


_missing_said = False
