"""The native plane's kernels against the reference (core/plane.py): the same bytes for every op,
wire dtype and conversion, on random bit patterns (NaN payloads, infinities, subnormals and signed
zeros included), exhaustively for every 16-bit float. Skipped where the plane is not built; CI
builds it (tox -e native-asan runs these under the sanitizers)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import plane
from redsrv.core.errors import ConfigError
from redsrv.core.wire import DType, ReduceOp, numpy_dtype

# CI (tox) builds the plane everywhere and sets REDSRV_TEST_REQUIRE_NATIVE: a build that failed
# silently fails there instead of skipping.
_MISSING = plane.native_unavailable()
if _MISSING is not None and os.environ.get("REDSRV_TEST_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"REDSRV_TEST_REQUIRE_NATIVE=1 but {_MISSING}")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

REFERENCE = plane.PythonKernels()
NATIVE = plane.kernels_for("native") if plane.native_unavailable() is None else None

FLOATS = (DType.FLOAT32, DType.FLOAT64)
INTEGERS = (DType.INT32, DType.INT64, DType.INT8, DType.UINT8)
ARITHMETIC = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

# Values that decide edge cases, as bit patterns of each width.
SPECIAL_32 = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
              0x807FFFFF, 0x3F800000, 0x477FF000, 0x477FEFFF, 0x477FF001, 0x38800000, 0x387FFFFF, 0x33000000,
              0x33000001, 0x32FFFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0xC77FF000]


def random_bits(rng: np.random.Generator, dtype: np.dtype, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` with uniformly random bits, some replaced by special values."""
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8).view(dtype).copy()
    if dtype.itemsize == 4 and dtype.kind == "f":
        where = rng.integers(0, count, size=count // 4)
        raw.view(np.uint32)[where] = rng.choice(np.array(SPECIAL_32, dtype=np.uint32), size=where.size)
    if dtype.kind == "f":  # equal values, to test which operand min/max return for +0 and -0
        raw[: count // 8] = np.where(rng.random(count // 8) < 0.5, 0.0, -0.0).astype(dtype)
    return raw


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


def both(kernel: str, *arrays: np.ndarray, **kwargs: object) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run ``kernel`` through both planes on copies of ``arrays`` (the first is the output)."""
    assert NATIVE is not None
    ours, theirs = [a.copy() for a in arrays], [a.copy() for a in arrays]
    with np.errstate(all="ignore"):
        getattr(REFERENCE, kernel)(*kwargs.get("before", ()), *theirs, *kwargs.get("after", ()))
        getattr(NATIVE, kernel)(*kwargs.get("before", ()), *ours, *kwargs.get("after", ()))
    return ours, theirs


@pytest.mark.parametrize("dtype", FLOATS + INTEGERS + (DType.BOOL,))
@pytest.mark.parametrize("op", ARITHMETIC + BITWISE)
@pytest.mark.parametrize("count", [1, 7, 33, 4099])
def test_combining_gives_the_reference_bytes(dtype: DType, op: ReduceOp, count: int) -> None:
    if dtype in FLOATS and op in BITWISE:
        pytest.skip("NumPy refuses bitwise ops on floats; test_refusals checks the native plane says the same")
    rng = np.random.default_rng(count * 131 + int(op) * 17 + int(dtype))
    np_dtype = numpy_dtype(dtype)
    acc, piece = random_bits(rng, np_dtype, count), random_bits(rng, np_dtype, count)
    if dtype is DType.BOOL:  # bytes from the wire: any value, not just 0 and 1
        acc, piece = (rng.integers(0, 4, size=count, dtype=np.uint8).view(np.bool_) for _ in range(2))
    ours, theirs = both("combine", acc, piece, before=(op,))
    assert same_bytes(ours[0], theirs[0]), f"{op.name} on {dtype.name}: the planes differ"


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
@pytest.mark.parametrize("op", ARITHMETIC)
def test_16_bit_floats_combine_into_float32_as_the_reference_does(dtype: DType, op: ReduceOp) -> None:
    rng = np.random.default_rng(int(op) + 100 * int(dtype))
    every = np.arange(65536, dtype=np.uint16).view(numpy_dtype(dtype))  # every value, exhaustively
    acc = random_bits(rng, np.dtype("<f4"), every.size)
    ours, theirs = both("combine", acc, every, before=(op,))
    assert same_bytes(ours[0], theirs[0])


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_every_16_bit_float_widens_to_the_reference_float32(dtype: DType) -> None:
    every = np.arange(65536, dtype=np.uint16).view(numpy_dtype(dtype))
    ours, theirs = both("cast", np.zeros(every.size, dtype="<f4"), every)
    assert same_bytes(ours[0], theirs[0])


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_float32_narrows_to_the_reference_16_bit_float(dtype: DType) -> None:
    rng = np.random.default_rng(int(dtype))
    # Random patterns, every special value, and every float32 whose dropped bits sit at the
    # rounding boundary (ties to even) for a spread of exponents.
    ties = (np.arange(0, 256, dtype=np.uint32) << 23) | 0x1000 | ((np.arange(256, dtype=np.uint32) & 1) << 13)
    bf_ties = (np.arange(0, 256, dtype=np.uint32) << 23) | 0x8000 | ((np.arange(256, dtype=np.uint32) & 1) << 16)
    source = np.concatenate([random_bits(rng, np.dtype("<f4"), 200_000).view(np.uint32),
                             np.array(SPECIAL_32, dtype=np.uint32), ties, ties | 0x80000000, bf_ties, bf_ties - 1,
                             bf_ties + 1]).view("<f4")
    ours, theirs = both("cast", np.zeros(source.size, dtype=numpy_dtype(dtype)), source)
    mismatch = np.flatnonzero(ours[0].view(np.uint16) != theirs[0].view(np.uint16))
    assert mismatch.size == 0, (f"{mismatch.size} differ, first {source.view(np.uint32)[mismatch[0]]:#010x}: "
                                f"{ours[0].view(np.uint16)[mismatch[0]]:#06x} != {theirs[0].view(np.uint16)[mismatch[0]]:#06x}")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 1000, 1 << 24])
def test_means_divide_as_the_reference_does(dtype: DType, divisor: int) -> None:
    rng = np.random.default_rng(divisor)
    source = random_bits(rng, numpy_dtype(dtype), 5000)
    ours, theirs = both("divide", np.empty_like(source), source, after=(divisor,))
    assert same_bytes(ours[0], theirs[0])
    ours, theirs = both("divide", source, source, after=(divisor,))  # in place, as the client does
    assert same_bytes(ours[0], theirs[0])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ARITHMETIC + BITWISE), st.sampled_from(list(DType)), st.binary(max_size=256),
       st.binary(max_size=256))
def test_any_bytes_combine_alike(op: ReduceOp, dtype: DType, left: bytes, right: bytes) -> None:
    np_dtype = numpy_dtype(dtype)
    count = min(len(left), len(right)) // np_dtype.itemsize
    acc = np.frombuffer(left[: count * np_dtype.itemsize], dtype=np_dtype).copy()
    piece = np.frombuffer(right[: count * np_dtype.itemsize], dtype=np_dtype).copy()
    outcomes = []
    for kernels in (REFERENCE, NATIVE):
        assert kernels is not None
        target = acc.copy()
        try:
            with np.errstate(all="ignore"):
                kernels.combine(op, target, piece)
        except TypeError as exc:  # both refuse alike (bitwise ops on floats)
            outcomes.append(type(exc))
        else:
            outcomes.append(target.tobytes())
    assert outcomes[0] == outcomes[1]


def test_refusals_and_misuse() -> None:
    assert NATIVE is not None
    floats = np.ones(4, dtype=np.float32)
    with pytest.raises(TypeError):  # NumPy's own refusal, through the fallback
        NATIVE.combine(ReduceOp.BXOR, floats, floats.copy())
    with pytest.raises(ValueError):  # NumPy's broadcasting error, through the fallback
        NATIVE.combine(ReduceOp.SUM, floats, np.ones(3, dtype=np.float32))
    # The C functions check what they are given themselves, before any loop runs.
    native = plane._native
    assert native is not None
    with pytest.raises(ValueError, match="same number"):
        native.combine(ReduceOp.SUM, floats, DType.FLOAT32, np.ones(3, dtype=np.float32), DType.FLOAT32)
    with pytest.raises(ValueError, match="same number"):
        native.cast(np.zeros(6, dtype=np.uint8), DType.FLOAT16, floats, DType.FLOAT32)
    with pytest.raises(ValueError, match="same number"):  # a byte count that is no whole number of elements
        native.combine(ReduceOp.SUM, np.zeros(6, dtype=np.uint8), DType.FLOAT32, np.zeros(6, dtype=np.uint8),
                       DType.FLOAT32)
    # Codes it has no loop for are left to the reference.
    assert native.divide(floats, 99, floats, 99, 2) is False
    assert native.combine(ReduceOp.SUM, floats, 99, floats, 99) is False
    assert native.cast(floats, DType.FLOAT64, floats, DType.INT32) is False
    read_only = np.ones(4, dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        native.combine(ReduceOp.SUM, read_only, DType.FLOAT32, floats, DType.FLOAT32)
    strided = np.ones(8, dtype=np.float32)[::2]
    expected = strided + floats
    NATIVE.combine(ReduceOp.SUM, strided, floats)  # not contiguous: the reference does it
    assert same_bytes(strided, expected)


def test_partial_overlap_is_left_to_the_reference() -> None:
    base = np.arange(10, dtype=np.float32)
    expected = base.copy()
    REFERENCE.combine(ReduceOp.SUM, expected[1:9], expected[0:8])
    assert NATIVE is not None
    NATIVE.combine(ReduceOp.SUM, base[1:9], base[0:8])
    assert same_bytes(base, expected)


def test_the_config_chooses_the_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    from redsrv.core.config import Config, DaemonSettings

    assert Config(reducers=["127.0.0.1:1"]).data_plane == "auto"
    assert plane.kernels_for("auto").name == "native"
    assert plane.kernels_for("python").name == "python"
    monkeypatch.setenv("REDSRV_DATA_PLANE", "python")
    assert Config.from_env(reducers=["127.0.0.1:1"]).data_plane == "python"
    assert DaemonSettings.from_env().data_plane == "python"
    monkeypatch.setenv("REDSRV_DATA_PLANE", "fast")
    with pytest.raises(ConfigError, match="REDSRV_DATA_PLANE"):
        Config.from_env(reducers=["127.0.0.1:1"])
    monkeypatch.setattr(plane, "_native", None)
    monkeypatch.setattr(plane, "_native_error", "No module named 'redsrv.core._plane'")
    with pytest.raises(ConfigError, match="not built"):
        plane.kernels_for("native")
    assert plane.kernels_for("auto").name == "python"


@pytest.mark.parametrize("op", ARITHMETIC)
def test_every_pair_of_special_float32_values_combines_alike(op: ReduceOp) -> None:
    # Both operands NaN (quiet and signalling, different payloads) decide whose NaN comes out.
    specials = np.array(SPECIAL_32, dtype=np.uint32)
    acc = np.repeat(specials, specials.size).view("<f4")
    piece = np.tile(specials, specials.size).view("<f4")
    ours, theirs = both("combine", acc, piece, before=(op,))
    assert same_bytes(ours[0], theirs[0])
    for dtype in (DType.FLOAT16, DType.BFLOAT16):
        narrow = np.empty(piece.size, dtype=numpy_dtype(dtype))
        with np.errstate(all="ignore"):
            REFERENCE.cast(narrow, piece)
        ours, theirs = both("combine", acc, narrow, before=(op,))
        assert same_bytes(ours[0], theirs[0]), dtype.name


@pytest.mark.skipif(os.environ.get("REDSRV_TEST_SANITIZED") != "1", reason="runs in tox -e native-asan")
def test_the_sanitized_build_is_the_one_under_test() -> None:
    # tox -e native-asan must not pass by loading a plain build (for one, left in the source tree).
    with open("/proc/self/maps", encoding="utf-8") as maps:
        loaded = maps.read()
    assert "libasan" in loaded and "libubsan" in loaded
    assert plane._native is not None and "site-packages" in (plane._native.__file__ or "")


def test_a_process_without_the_plane_says_so_once(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(plane, "_native", None)
    monkeypatch.setattr(plane, "_native_error", "No module named 'redsrv.core._plane'")
    monkeypatch.setattr(plane, "_missing_said", False)
    with caplog.at_level("WARNING", logger="redsrv.plane"):
        plane.kernels_for("auto")
        plane.kernels_for("auto")
        plane.kernels_for("python")
    said = [r.getMessage() for r in caplog.records if "Python data plane" in r.getMessage()]
    assert len(said) == 1 and "not built" in said[0], said
