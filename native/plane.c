/* redsrv.core._plane: the data plane's element-wise kernels in C.
 *
 * The Python reference is core/plane.py's PythonKernels (NumPy ufuncs and casts); every function
 * here must give the same bytes for the same inputs, NaN payloads and signed zeros included
 * (tests/unit/test_plane.py compares both on random bit patterns). A function returns False for
 * a combination it does not handle and the caller falls back to the reference, so the set of
 * supported combinations can grow without a second definition of any result.
 *
 * Codes are the wire's (core/wire.py DType and ReduceOp), so no table translates between them.
 * Loops run with the GIL released: buffers are pinned by the buffer protocol for the call.
 * Integer arithmetic runs in unsigned types: NumPy wraps on overflow, and signed overflow is
 * undefined in C. Floating point follows IEEE 754 with the default rounding: the build sets
 * -ffp-contract=off so that no a*b+c is fused (setup.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "forward.h"
#include "frames.h"
#include "plane.h"
#include "pushes.h"
#include "receiver.h"
#include "stream.h"
#include "writer.h"

/* core/wire.py DType */
enum { K_F32 = 1, K_F64 = 2, K_F16 = 3, K_BF16 = 4, K_I32 = 5, K_I64 = 6, K_I8 = 7, K_U8 = 8, K_BOOL = 9 };
/* core/wire.py ReduceOp (BROADCAST and SETTLED combine nothing) */
enum { OP_SUM = 0, OP_MIN = 2, OP_MAX = 3, OP_PRODUCT = 4, OP_BAND = 5, OP_BOR = 6, OP_BXOR = 7 };

/* Each kernel is compiled for AVX2 and for the baseline, chosen once at load (an ifunc), so one
 * wheel runs everywhere and vectorises where it can. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(REDSRV_NO_CLONES)
#define KERNEL __attribute__((target_clones("avx2", "default"))) static
#else
#define KERNEL static
#endif

static inline float bits_to_f32(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t f32_to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* IEEE half -> float, exact; a NaN keeps its payload and is not quieted (NumPy's rule). */
static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = h & 0x7c00u;
    uint32_t mantissa = h & 0x03ffu;
    uint32_t normal = ((exponent + 0x1c000u) | mantissa) << 13; /* rebias 15 -> 127 */
    uint32_t special = 0x7f800000u | (mantissa << 13);
    /* A subnormal half is mantissa * 2^-24, exact in float. */
    uint32_t subnormal = f32_to_bits((float)mantissa * 5.9604644775390625e-08f);
    uint32_t magnitude = exponent == 0x7c00u ? special : (exponent == 0 ? subnormal : normal);
    return bits_to_f32(magnitude | sign);
}

/* float -> IEEE half, round to nearest even; a NaN keeps the top of its payload, never becoming
 * an infinity (NumPy's rule). */
static inline uint16_t f32_to_half(float value) {
    uint32_t bits = f32_to_bits(value);
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t magnitude = bits & 0x7fffffffu;
    uint32_t nan = 0x7c00u | ((magnitude & 0x007fffffu) >> 13);
    nan |= (nan == 0x7c00u);
    /* Normal halves: drop 13 mantissa bits with round to nearest even; a carry moves into the
     * exponent, which is the right result up to the largest finite half. */
    uint32_t normal = (magnitude - 0x38000000u + 0x0fffu + ((magnitude >> 13) & 1u)) >> 13;
    /* Below 2^-14: adding 0.5 makes the FPU round to a multiple of 2^-24, the subnormal step. */
    uint32_t subnormal = f32_to_bits(bits_to_f32(magnitude) + 0.5f) - 0x3f000000u;
    uint32_t result = magnitude > 0x7f800000u ? nan
                    : magnitude >= 0x477ff000u ? 0x7c00u
                    : magnitude >= 0x38800000u ? normal
                    : subnormal;
    return (uint16_t)(result | sign);
}

static inline float bf16_to_f32(uint16_t b) { return bits_to_f32((uint32_t)b << 16); }

/* float -> bfloat16, round to nearest even; every NaN becomes the quiet NaN of its sign
 * (ml_dtypes' rule). */
static inline uint16_t f32_bits_to_bf16(uint32_t bits) {
    uint32_t nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* NumPy's minimum/maximum for floats: NaN wins (the first operand's if both are NaN); among
 * equal values (+0 and -0) the second operand. */
/* NumPy's sum and product return the first operand's NaN (quieted) when both are NaN; the
 * compiler may swap the operands of a commutative operation, so the rule is written out. */
#define FADD(a, b) ((a) != (a) ? (a) + (a) : (a) + (b))
#define FMUL(a, b) ((a) != (a) ? (a) * (a) : (a) * (b))
#define FMIN(a, b) ((a) != (a) ? (a) : ((a) < (b) ? (a) : (b)))
#define FMAX(a, b) ((a) != (a) ? (a) : ((a) > (b) ? (a) : (b)))
#define IMIN(a, b) ((a) < (b) ? (a) : (b))
#define IMAX(a, b) ((a) > (b) ? (a) : (b))

/* acc = EXPR(a, b) element-wise, with a = acc[i] and b = WIDEN(piece[i]): a float32 accumulator
 * takes 16-bit pieces widened as they are combined; SAME leaves a piece as it is. */
#define SAME(x) (x)
#define LOOP(NAME, ACC_T, PIECE_T, WIDEN, EXPR)                                 \
    KERNEL void NAME(ACC_T *acc, const PIECE_T *piece, Py_ssize_t n) {          \
        for (Py_ssize_t i = 0; i < n; i++) {                                    \
            ACC_T a = acc[i], b = WIDEN(piece[i]);                              \
            acc[i] = (EXPR);                                                    \
        }                                                                       \
    }

#define FLOAT_LOOPS(SUFFIX, ACC_T, PIECE_T, WIDEN)                    \
    LOOP(sum_##SUFFIX, ACC_T, PIECE_T, WIDEN, FADD(a, b))             \
    LOOP(product_##SUFFIX, ACC_T, PIECE_T, WIDEN, FMUL(a, b))         \
    LOOP(min_##SUFFIX, ACC_T, PIECE_T, WIDEN, FMIN(a, b))             \
    LOOP(max_##SUFFIX, ACC_T, PIECE_T, WIDEN, FMAX(a, b))
FLOAT_LOOPS(f32, float, float, SAME)
FLOAT_LOOPS(f64, double, double, SAME)
FLOAT_LOOPS(f32_f16, float, uint16_t, half_to_f32)
FLOAT_LOOPS(f32_bf16, float, uint16_t, bf16_to_f32)

/* Signed values combine through their unsigned twins for sums and products (wrap-around). */
#define INT_LOOPS(SUFFIX, T, U)                                  \
    LOOP(sum_##SUFFIX, T, T, SAME, (T)((U)a + (U)b))             \
    LOOP(product_##SUFFIX, T, T, SAME, (T)((U)a * (U)b))         \
    LOOP(min_##SUFFIX, T, T, SAME, IMIN(a, b))                   \
    LOOP(max_##SUFFIX, T, T, SAME, IMAX(a, b))                   \
    LOOP(band_##SUFFIX, T, T, SAME, (T)(a & b))                  \
    LOOP(bor_##SUFFIX, T, T, SAME, (T)(a | b))                   \
    LOOP(bxor_##SUFFIX, T, T, SAME, (T)(a ^ b))
INT_LOOPS(i32, int32_t, uint32_t)
INT_LOOPS(i64, int64_t, uint64_t)
INT_LOOPS(i8, int8_t, uint8_t)
INT_LOOPS(u8, uint8_t, uint32_t)

/* NumPy's bool: any non-zero byte is true, and every result is 0 or 1. Sum and maximum are
 * "or", product and minimum "and", xor "not equal". */
LOOP(or_bool, uint8_t, uint8_t, SAME, (uint8_t)((a != 0) | (b != 0)))
LOOP(and_bool, uint8_t, uint8_t, SAME, (uint8_t)((a != 0) & (b != 0)))
LOOP(xor_bool, uint8_t, uint8_t, SAME, (uint8_t)((a != 0) != (b != 0)))

KERNEL void widen_f16(float *dst, const uint16_t *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = half_to_f32(src[i]);
}
KERNEL void widen_bf16(float *dst, const uint16_t *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}
KERNEL void narrow_f16(uint16_t *dst, const float *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = f32_to_half(src[i]);
}
/* Reads the float32 source as its bits: Python's buffers have no declared C type. */
KERNEL void narrow_bf16(uint16_t *dst, const uint32_t *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = f32_bits_to_bf16(src[i]);
}
KERNEL void divide_f32(float *dst, const float *src, float divisor, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = src[i] / divisor;
}
KERNEL void divide_f64(double *dst, const double *src, double divisor, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = src[i] / divisor;
}

static Py_ssize_t itemsize_of(int kind) {
    switch (kind) {
    case K_F64: case K_I64: return 8;
    case K_F32: case K_I32: return 4;
    case K_F16: case K_BF16: return 2;
    case K_I8: case K_U8: case K_BOOL: return 1;
    default: return 0;
    }
}

#define PICK(SUFFIX)                                       \
    switch (op) {                                          \
    case OP_SUM: return (combine_fn)sum_##SUFFIX;          \
    case OP_PRODUCT: return (combine_fn)product_##SUFFIX;  \
    case OP_MIN: return (combine_fn)min_##SUFFIX;          \
    case OP_MAX: return (combine_fn)max_##SUFFIX;          \
    default: return NULL;                                  \
    }
#define PICK_INT(SUFFIX)                                   \
    switch (op) {                                          \
    case OP_BAND: return (combine_fn)band_##SUFFIX;        \
    case OP_BOR: return (combine_fn)bor_##SUFFIX;          \
    case OP_BXOR: return (combine_fn)bxor_##SUFFIX;        \
    default: PICK(SUFFIX)                                  \
    }

/* The loop for acc = op(acc, piece), or NULL where the reference must answer (NumPy refuses
 * bitwise ops on floats, for one, and its error is the one to raise). */
static combine_fn pick_combine(int op, int acc_kind, int piece_kind) {
    if (acc_kind == K_F32 && piece_kind == K_F16) { PICK(f32_f16) }
    if (acc_kind == K_F32 && piece_kind == K_BF16) { PICK(f32_bf16) }
    if (acc_kind != piece_kind) return NULL;
    switch (acc_kind) {
    case K_F32: PICK(f32)
    case K_F64: PICK(f64)
    case K_I32: PICK_INT(i32)
    case K_I64: PICK_INT(i64)
    case K_I8: PICK_INT(i8)
    case K_U8: PICK_INT(u8)
    case K_BOOL:
        switch (op) {
        case OP_SUM: case OP_MAX: case OP_BOR: return (combine_fn)or_bool;
        case OP_PRODUCT: case OP_MIN: case OP_BAND: return (combine_fn)and_bool;
        case OP_BXOR: return (combine_fn)xor_bool;
        default: return NULL;
        }
    default: return NULL;
    }
}

combine_fn plane_pick_combine(int op, int kind) { return pick_combine(op, kind, kind); }

Py_ssize_t plane_itemsize(int kind) { return itemsize_of(kind); }

/* Two buffers, the first writable, of equal element counts. Returns the count, or -1 with an
 * exception set. ``same_or_apart``: the buffers are either the same memory or disjoint (a
 * partial overlap is left to the reference, which copies). */
static Py_ssize_t take_buffers(PyObject *dst_obj, int dst_kind, PyObject *src_obj, int src_kind, Py_buffer *dst,
                               Py_buffer *src, int *same_or_apart) {
    Py_ssize_t dst_size = itemsize_of(dst_kind), src_size = itemsize_of(src_kind);
    if (dst_size == 0 || src_size == 0) {
        PyErr_Format(PyExc_ValueError, "unknown dtype code %d or %d", dst_kind, src_kind);
        return -1;
    }
    if (PyObject_GetBuffer(dst_obj, dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(src_obj, src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    Py_ssize_t count = dst->len / dst_size;
    if (dst->len % dst_size || src->len % src_size || src->len / src_size != count) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes do not hold the same number of %zd- and "
                     "%zd-byte elements", dst->len, src->len, dst_size, src_size);
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    const char *d = dst->buf, *s = src->buf;
    *same_or_apart = d == s || d + dst->len <= s || s + src->len <= d;
    return count;
}

/* Runs ``loop`` over two buffers (with no loop: ``dst = src / divisor``) with the GIL released.
 * Returns False, doing nothing, where the reference must answer: the buffers partly overlap, or
 * they are the same memory and ``in_place`` is not allowed. */
static PyObject *run_pair(combine_fn loop, PyObject *dst_obj, int dst_kind, PyObject *src_obj, int src_kind,
                          int in_place, long long divisor) {
    Py_buffer dst, src;
    int same_or_apart;
    Py_ssize_t count = take_buffers(dst_obj, dst_kind, src_obj, src_kind, &dst, &src, &same_or_apart);
    if (count < 0) return NULL;
    int run = same_or_apart && (in_place || dst.buf != src.buf);
    if (run) {
        Py_BEGIN_ALLOW_THREADS
        if (loop != NULL) loop(dst.buf, src.buf, count);
        else if (dst_kind == K_F32) divide_f32(dst.buf, src.buf, (float)divisor, count);
        else divide_f64(dst.buf, src.buf, (double)divisor, count);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyBool_FromLong(run);
}

static PyObject *plane_combine(PyObject *self, PyObject *args) {
    (void)self;
    int op, acc_kind, piece_kind;
    PyObject *acc_obj, *piece_obj;
    if (!PyArg_ParseTuple(args, "iOiOi:combine", &op, &acc_obj, &acc_kind, &piece_obj, &piece_kind)) return NULL;
    combine_fn loop = pick_combine(op, acc_kind, piece_kind);
    if (loop == NULL) Py_RETURN_FALSE;
    return run_pair(loop, acc_obj, acc_kind, piece_obj, piece_kind, 1, 0);
}

static PyObject *plane_cast(PyObject *self, PyObject *args) {
    (void)self;
    int dst_kind, src_kind;
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OiOi:cast", &dst_obj, &dst_kind, &src_obj, &src_kind)) return NULL;
    combine_fn loop;
    if (dst_kind == K_F32 && src_kind == K_F16) loop = (combine_fn)widen_f16;
    else if (dst_kind == K_F32 && src_kind == K_BF16) loop = (combine_fn)widen_bf16;
    else if (dst_kind == K_F16 && src_kind == K_F32) loop = (combine_fn)narrow_f16;
    else if (dst_kind == K_BF16 && src_kind == K_F32) loop = (combine_fn)narrow_bf16;
    else Py_RETURN_FALSE;
    /* Elements of different widths cannot be converted in place. */
    return run_pair(loop, dst_obj, dst_kind, src_obj, src_kind, 0, 0);
}

static PyObject *plane_divide(PyObject *self, PyObject *args) {
    (void)self;
    int dst_kind, src_kind;
    long long divisor;
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OiOiL:divide", &dst_obj, &dst_kind, &src_obj, &src_kind, &divisor)) return NULL;
    /* NumPy converts a Python int divisor to the array's float type first: exact up to 2^24
     * for float32; beyond that the reference decides. */
    if (dst_kind != src_kind || (dst_kind != K_F32 && dst_kind != K_F64) || divisor <= 0 || divisor > (1 << 24))
        Py_RETURN_FALSE;
    return run_pair(NULL, dst_obj, dst_kind, src_obj, src_kind, 1, divisor);
}

static PyMethodDef plane_methods[] = {
    {"combine", plane_combine, METH_VARARGS,
     "combine(op, acc, acc_dtype, piece, piece_dtype) -> bool\n\n"
     "acc = op(acc, piece) element-wise (wire codes); False where the reference must do it."},
    {"cast", plane_cast, METH_VARARGS,
     "cast(dst, dst_dtype, src, src_dtype) -> bool\n\n"
     "dst = src converted (16-bit floats to and from float32); False where the reference must do it."},
    {"divide", plane_divide, METH_VARARGS,
     "divide(dst, dst_dtype, src, src_dtype, divisor) -> bool\n\n"
     "dst = src / divisor for float32 and float64; False where the reference must do it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef plane_module = {
    PyModuleDef_HEAD_INIT, "_plane",
    "redsrv's compiled data plane (core/plane.py is the interface), frame parser (native/frames.c), result "
    "receiver (native/receiver.c), push receiver (native/pushes.c), frame writer (native/writer.c) and "
    "forwarder (native/forward.c).", -1,
    plane_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__plane(void) {
    PyObject *module = PyModule_Create(&plane_module);
    if (module != NULL
        && (frames_init(module) < 0 || stream_init_module(module) < 0 || receiver_init_module(module) < 0
            || pushes_init_module(module) < 0 || writer_init_module(module) < 0 || forward_init_module(module) < 0))
        Py_CLEAR(module);
    return module;
}
