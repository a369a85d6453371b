/* redsrv.core._plane's result receiver: a client connection's steady RESULT frames landed in C.
 *
 * docs/architecture.md, "The socket loops in C", step 2 (the client's half). The client core
 * registers, before a chunk's push leaves, a ResultSlot: the bytes its result lands in (the
 * operation's output, or a buffer of the chunk's own that Python widens or divides from), its
 * element range and wire dtype (ClientCore._register_slot). A ResultReceiver
 * then moves the connection's bytes while they are the happy path: RESULT pieces that continue a
 * registered slot in order, SAFE frames and heartbeats. It lands each piece's data straight into
 * the slot (recv into the slot's memory, the GIL released), folds its contributor count and
 * bitmap into the slot, and moves a slot whose last piece is in to the list of landed slots,
 * which Python takes once per receive() call: Python is woken per call and per chunk, not per
 * frame.
 *
 * Everything else goes back to the reference whole: at a frame's start, before any of its bytes
 * is consumed, anything this code does not recognise as the happy path (another frame type, a
 * header the rules refuse, a piece for no slot, out of order or of another dtype) stops the
 * receiver, which hands the bytes it read ahead to wire.FrameDecoder (FrameDecoder.hold). The
 * Python decoder then decodes that frame, refuses it with the reference's message or hands it to
 * the core, exactly as on the Python plane. So this file decides nothing the protocol defines; it
 * only recognises frames that need no decision, and writes only into memory Python registered:
 * a piece lands only where its offset continues its slot and its length fits what the slot has
 * left, both checked before any byte is received (nothing from the wire sizes a copy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>

#include "frames.h"
#include "receiver.h"
#include "stream.h"

#define PREFIX_SIZE STREAM_PREFIX_SIZE
#define RESULT_HEADER_SIZE 32
#define COUNT_HEADER_SIZE 8
#define LOWAT_FROM STREAM_LOWAT_FROM

/* where the receiver is in the stream */
enum { AT_FRAME = 0, IN_BITMAP = 1, IN_DATA = 2 };

static unsigned k_result, k_safe, k_heartbeat;
static uint64_t max_bitmap_bytes;

/* --- ResultSlot ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Py_buffer dest;          /* the output's bytes for the chunk: element `start` at dest.buf */
    uint64_t start, count;   /* the chunk's elements */
    uint64_t itemsize;
    unsigned dtype;          /* wire dtype code */
    uint64_t done;           /* elements landed, in order from `start` */
    unsigned long min_contributors, max_contributors;
    unsigned char *bitmap;   /* the AND of the pieces' bitmaps, as int.from_bytes folds them */
    Py_ssize_t bitmap_len;
    int pieces;              /* pieces landed */
    unsigned long long frame; /* the receiver's RESULT frame count when the last piece ended */
    int cancelled;
    int one_count;           /* every piece must have the first one's contributor count (a mean) */
    PyObject *tag;           /* the core's, opaque here */
} ResultSlot;

static int slot_init(ResultSlot *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"dest", "start", "count", "itemsize", "dtype", "tag", "one_count", NULL};
    PyObject *dest, *tag;
    unsigned long long start, count, itemsize;
    unsigned int dtype;
    int one_count = 0;
    if (self->tag != NULL) {
        PyErr_SetString(PyExc_TypeError, "ResultSlot is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKKKIO|$p:ResultSlot", names, &dest, &start, &count, &itemsize,
                                     &dtype, &tag, &one_count))
        return -1;
    if (itemsize == 0 || itemsize > 8 || dtype > 255 || count == 0 || count > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "ResultSlot: itemsize 1..8, dtype < 256 and 0 < count < 2**32");
        return -1;
    }
    if (PyObject_GetBuffer(dest, &self->dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if ((uint64_t)self->dest.len != count * itemsize) {
        PyBuffer_Release(&self->dest);
        self->dest.obj = NULL;
        PyErr_Format(PyExc_ValueError, "ResultSlot: %zd bytes for %llu elements of %llu bytes", self->dest.len, count,
                     itemsize);
        return -1;
    }
    self->start = start;
    self->count = count;
    self->itemsize = itemsize;
    self->dtype = dtype;
    self->min_contributors = ULONG_MAX;
    self->one_count = one_count;
    Py_INCREF(tag);
    self->tag = tag;
    return 0;
}

/* The tag refers back to the operation that refers to its slots: the collector must see it. */
static int slot_traverse(ResultSlot *self, visitproc visit, void *arg) {
    Py_VISIT(self->tag);
    return 0;
}

static int slot_clear(ResultSlot *self) {
    Py_CLEAR(self->tag);
    return 0;
}

static void slot_dealloc(ResultSlot *self) {
    PyObject_GC_UnTrack(self);
    if (self->dest.obj != NULL) PyBuffer_Release(&self->dest);
    PyMem_Free(self->bitmap);
    slot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *slot_cancel(ResultSlot *self, PyObject *unused) {
    self->cancelled = 1;
    Py_RETURN_NONE;
}

static PyObject *slot_get_bitmap(ResultSlot *self, void *closure) {
    return PyBytes_FromStringAndSize((const char *)self->bitmap, self->bitmap_len);
}

static PyObject *slot_get_min(ResultSlot *self, void *closure) {
    return self->pieces ? PyLong_FromUnsignedLong(self->min_contributors) : Py_NewRef(Py_None);
}

/* Fold a landed piece's contributors and bitmap (ClientCore.payload_landed's folds, per slot). */
static int slot_fold(ResultSlot *self, unsigned long contributors, const unsigned char *bitmap, Py_ssize_t len) {
    if (contributors < self->min_contributors) self->min_contributors = contributors;
    if (contributors > self->max_contributors) self->max_contributors = contributors;
    if (self->pieces == 0) {
        if (len) {
            self->bitmap = PyMem_Malloc((size_t)len);
            if (self->bitmap == NULL) return PyErr_NoMemory(), -1;
            memcpy(self->bitmap, bitmap, (size_t)len);
        }
        self->bitmap_len = len;
    } else {
        /* x & int.from_bytes(b): bits beyond b's bytes are zero. */
        if (len < self->bitmap_len) self->bitmap_len = len;
        for (Py_ssize_t i = 0; i < self->bitmap_len; i++) self->bitmap[i] &= bitmap[i];
    }
    self->pieces++;
    return 0;
}

static PyMethodDef slot_methods[] = {
    {"cancel", (PyCFunction)slot_cancel, METH_NOARGS,
     "No piece lands here any more (the operation failed, or its connection is gone)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef slot_members[] = {
    {"start", T_ULONGLONG, offsetof(ResultSlot, start), READONLY, "first element of the chunk"},
    {"count", T_ULONGLONG, offsetof(ResultSlot, count), READONLY, "elements of the chunk"},
    {"dtype", T_UINT, offsetof(ResultSlot, dtype), READONLY, "wire dtype code"},
    {"done", T_ULONGLONG, offsetof(ResultSlot, done), READONLY, "elements landed so far"},
    {"max_contributors", T_ULONG, offsetof(ResultSlot, max_contributors), READONLY, "over the landed pieces"},
    {"pieces", T_INT, offsetof(ResultSlot, pieces), READONLY, "pieces landed"},
    {"frame", T_ULONGLONG, offsetof(ResultSlot, frame), READONLY,
     "the receiver's count of RESULT frames (within its receive() call) at the last piece"},
    {"cancelled", T_INT, offsetof(ResultSlot, cancelled), READONLY, "cancel() was called"},
    {"one_count", T_INT, offsetof(ResultSlot, one_count), READONLY, "pieces with another count than the first's go to the reference"},
    {"tag", T_OBJECT, offsetof(ResultSlot, tag), READONLY, "the registrant's"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef slot_getset[] = {
    {"bitmap", (getter)slot_get_bitmap, NULL, "the AND of the landed pieces' contributor bitmaps", NULL},
    {"min_contributors", (getter)slot_get_min, NULL, "over the landed pieces (None before the first)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ResultSlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "redsrv.core._plane.ResultSlot",
    .tp_basicsize = sizeof(ResultSlot),
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)slot_traverse,
    .tp_clear = (inquiry)slot_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "ResultSlot(dest, start, count, itemsize, dtype, tag, *, one_count=False): where one chunk's result lands.",
    .tp_methods = slot_methods,
    .tp_members = slot_members,
    .tp_getset = slot_getset,
    .tp_init = (initproc)slot_init,
    .tp_new = PyType_GenericNew,
};

/* --- ResultReceiver -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    stream_in in;            /* the socket, what was read ahead, the low-water mark */
    uint64_t max_payload;
    PyObject *slots;         /* dict: (key, chunk index) -> ResultSlot, the core's */
    PyObject *landed;        /* list of slots whose last piece landed, taken by take_landed() */
    int stage;
    ResultSlot *slot;        /* the piece being landed (a strong reference) */
    uint64_t piece_at, piece_left;   /* bytes: where in the slot's dest, and how many to go */
    uint64_t piece_count;
    unsigned long contributors;
    unsigned char *bitmap;   /* the piece's bitmap, max_bitmap_bytes */
    uint64_t bitmap_len, bitmap_got;
    unsigned long long results;      /* RESULT frames consumed since take_counts() */
    unsigned long long landed_bytes; /* result data bytes landed since take_counts() */
    unsigned long long safe;         /* the last SAFE's count */
    int has_safe;
} ResultReceiver;

static int receiver_init(ResultReceiver *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"fd", "max_payload", "slots", "max_lowat", NULL};
    int fd;
    unsigned long long max_payload, max_lowat;
    PyObject *slots;
    if (self->slots != NULL) {
        PyErr_SetString(PyExc_TypeError, "ResultReceiver is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iKO!K:ResultReceiver", names, &fd, &max_payload, &PyDict_Type,
                                     &slots, &max_lowat))
        return -1;
    if (fd < 0 || max_lowat < 1 || max_lowat > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "ResultReceiver: a file descriptor and 1 <= max_lowat < 2**31");
        return -1;
    }
    if (stream_open(&self->in, fd, stream_read_ahead, max_lowat) < 0) return -1;
    self->bitmap = PyMem_Malloc(max_bitmap_bytes ? (size_t)max_bitmap_bytes : 1);
    self->landed = PyList_New(0);
    if (self->bitmap == NULL || self->landed == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->max_payload = max_payload;
    Py_INCREF(slots);
    self->slots = slots;
    return 0;
}

static int receiver_traverse(ResultReceiver *self, visitproc visit, void *arg) {
    Py_VISIT(self->slots);
    Py_VISIT(self->landed);
    Py_VISIT(self->slot);
    return 0;
}

static int receiver_clear(ResultReceiver *self) {
    Py_CLEAR(self->slots);
    Py_CLEAR(self->landed);
    Py_CLEAR(self->slot);
    return 0;
}

static void receiver_dealloc(ResultReceiver *self) {
    PyObject_GC_UnTrack(self);
    receiver_clear(self);
    stream_close(&self->in);
    PyMem_Free(self->bitmap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The size of the header of the frame whose prefix is held when that frame may be the happy
 * path (RESULT, SAFE, HEARTBEAT as wire's rules allow them), else -1: the reference decides. */
static Py_ssize_t happy_header_size(const unsigned char *p, const void *receiver) {
    const ResultReceiver *self = receiver;
    if (!stream_prefix_is_ours(p)) return -1;
    unsigned code = p[5];
    uint64_t header_len = read_le(p + 6, 2), payload_len = read_le(p + 8, 4);
    if (payload_len > self->max_payload) return -1;
    if (code == k_result) return header_len == RESULT_HEADER_SIZE ? RESULT_HEADER_SIZE : -1;
    if (code == k_safe) return header_len == COUNT_HEADER_SIZE && payload_len == 0 ? COUNT_HEADER_SIZE : -1;
    if (code == k_heartbeat) return header_len == 0 && payload_len == 0 ? 0 : -1;
    return -1;
}

/* The result header is held: 1 when its piece continues a registered slot (the receiver then
 * lands it), 0 when the reference decides, -1 with an exception set. */
static int land_result_header(ResultReceiver *self) {
    const unsigned char *h = self->in.ahead + self->in.at + PREFIX_SIZE;
    /* key, offset, count, chunk, dtype, pad, contributors, bitmap_len (wire's "<QQIIBxHI") */
    uint64_t payload_len = read_le(self->in.ahead + self->in.at + 8, 4);
    uint64_t key = read_le(h, 8), offset = read_le(h + 8, 8), count = read_le(h + 16, 4), chunk = read_le(h + 20, 4);
    unsigned dtype = h[24];
    unsigned long contributors = (unsigned long)read_le(h + 26, 2);
    uint64_t bitmap_len = read_le(h + 28, 4);
    if (bitmap_len > max_bitmap_bytes) return 0;
    PyObject *place = Py_BuildValue("(KK)", (unsigned long long)key, (unsigned long long)chunk);
    if (place == NULL) return -1;
    PyObject *found = PyDict_GetItemWithError(self->slots, place); /* borrowed */
    Py_DECREF(place);
    if (found == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyObject_TypeCheck(found, &ResultSlotType)) return 0;
    ResultSlot *slot = (ResultSlot *)found;
    /* The slot's next piece, whole or a prefix of what it lacks, in its dtype: wire's rules
     * (payload = bitmap + count x itemsize) then the core's (ClientCore.frame_header), each
     * compared without a sum that could wrap. */
    if (slot->cancelled || dtype != slot->dtype || count == 0 || count > slot->count - slot->done
        || offset != slot->start + slot->done || payload_len < bitmap_len
        || payload_len - bitmap_len != count * slot->itemsize
        || (slot->one_count && slot->pieces && contributors != slot->min_contributors))
        return 0;
    Py_INCREF(slot);
    Py_XSETREF(self->slot, slot);
    self->piece_at = slot->done * slot->itemsize;
    self->piece_left = count * slot->itemsize;
    self->piece_count = count;
    self->contributors = contributors;
    self->bitmap_len = bitmap_len;
    self->bitmap_got = 0;
    stream_consume(&self->in, PREFIX_SIZE + RESULT_HEADER_SIZE);
    self->stage = bitmap_len ? IN_BITMAP : IN_DATA;
    return 1;
}

/* The piece is in: fold it into its slot, and move a complete slot to `landed`. 0, or -1 with
 * an exception set. */
static int end_piece(ResultReceiver *self) {
    ResultSlot *slot = self->slot;
    self->results++;
    self->stage = AT_FRAME;
    uint64_t left_after = 0;
    if (!slot->cancelled) {
        if (slot_fold(slot, self->contributors, self->bitmap, (Py_ssize_t)self->bitmap_len) < 0) return -1;
        slot->done += self->piece_count;
        self->landed_bytes += self->piece_count * slot->itemsize;
        left_after = (slot->count - slot->done) * slot->itemsize;
        if (slot->done == slot->count) {
            slot->frame = self->results;
            /* The core takes it out of `slots` when it takes `landed`. */
            if (PyList_Append(self->landed, (PyObject *)slot) < 0) return -1;
        }
    }
    Py_CLEAR(self->slot);
    /* One wake-up for the rest of the chunk (FrameReader.expect_at_least), else the next header. */
    return stream_set_lowat(&self->in, left_after >= LOWAT_FROM ? left_after : 1) < 0 ? -2 : 0;
}

static PyObject *receiver_receive(ResultReceiver *self, PyObject *arg) {
    long max_frames = PyLong_AsLong(arg);
    if (max_frames == -1 && PyErr_Occurred()) return NULL;
    if (self->in.ahead == NULL || self->slots == NULL || self->landed == NULL) {
        PyErr_SetString(PyExc_ValueError, "receive() on a released ResultReceiver");
        return NULL;
    }
    long frames = 0;
    int outcome = DRAINED;
    self->in.received = 0;
    for (;;) {
        if (self->stage == AT_FRAME) {
            if (frames >= max_frames && self->in.at == self->in.end) {
                outcome = LIMIT;
                break;
            }
            Py_ssize_t header_size;
            int held = stream_hold_frame(&self->in, happy_header_size, self, &header_size);
            if (held != 1) {
                outcome = held;
                break;
            }
            unsigned code = self->in.ahead[self->in.at + 5];
            if (code != k_result) { /* SAFE or a heartbeat: whole */
                if (code == k_safe) {
                    self->safe = read_le(self->in.ahead + self->in.at + PREFIX_SIZE, 8);
                    self->has_safe = 1;
                }
                stream_consume(&self->in, PREFIX_SIZE + header_size);
                frames++;
                if (stream_set_lowat(&self->in, 1) < 0) {
                    outcome = FAILED;
                    break;
                }
                continue;
            }
            int taken = land_result_header(self);
            if (taken < 0) return NULL;
            if (taken == 0) {
                outcome = HANDOFF;
                break;
            }
        }
        if (self->stage == IN_BITMAP) {
            uint64_t moved;
            int status =
                stream_take(&self->in, self->bitmap + self->bitmap_got, self->bitmap_len - self->bitmap_got, &moved);
            self->bitmap_got += moved;
            if (status != 1) {
                outcome = status;
                break;
            }
            self->stage = IN_DATA;
        }
        if (self->stage == IN_DATA) {
            uint64_t moved;
            unsigned char *into = (unsigned char *)self->slot->dest.buf + self->piece_at;
            int status = stream_take(&self->in, into, self->piece_left, &moved);
            self->piece_at += moved;
            self->piece_left -= moved;
            if (status != 1) {
                /* One wake-up for the rest of a large payload (FrameReader.read's low-water mark). */
                if (status == DRAINED && self->piece_count * self->slot->itemsize >= LOWAT_FROM
                    && stream_set_lowat(&self->in, self->piece_left) < 0)
                    status = FAILED;
                outcome = status;
                break;
            }
            int ended = end_piece(self);
            if (ended == -1) return NULL;
            frames++;
            if (ended == -2) {
                outcome = FAILED;
                break;
            }
        }
    }
    return PyLong_FromLong(outcome);
}

static PyObject *receiver_take_held(ResultReceiver *self, PyObject *unused) {
    if (self->stage != AT_FRAME) {
        PyErr_SetString(PyExc_ValueError, "take_held() in the middle of a frame");
        return NULL;
    }
    PyObject *held = PyBytes_FromStringAndSize((const char *)self->in.ahead + self->in.at, self->in.end - self->in.at);
    if (held != NULL) self->in.at = self->in.end = 0;
    return held;
}

static PyObject *receiver_take_landed(ResultReceiver *self, PyObject *unused) {
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    PyObject *landed = self->landed;
    self->landed = fresh;
    return landed != NULL ? landed : PyList_New(0);
}

static PyObject *receiver_take_counts(ResultReceiver *self, PyObject *unused) {
    PyObject *safe = self->has_safe ? PyLong_FromUnsignedLongLong(self->safe) : Py_NewRef(Py_None);
    if (safe == NULL) return NULL;
    PyObject *counts = Py_BuildValue("(KKN)", self->results, self->landed_bytes, safe);
    if (counts != NULL) {
        self->results = self->landed_bytes = 0;
        self->has_safe = 0;
    }
    return counts;
}

static PyObject *receiver_release(ResultReceiver *self, PyObject *unused) {
    Py_CLEAR(self->slot);
    stream_close(&self->in);
    self->stage = AT_FRAME;
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    Py_SETREF(self->landed, fresh);
    Py_RETURN_NONE;
}

static PyObject *receiver_get_busy(ResultReceiver *self, void *closure) {
    return PyBool_FromLong(self->stage != AT_FRAME || self->in.end > self->in.at);
}

static PyObject *receiver_get_what(ResultReceiver *self, void *closure) {
    if (self->stage == IN_BITMAP) return PyUnicode_FromString("a result bitmap");
    if (self->stage == IN_DATA) return PyUnicode_FromString("a RESULT payload");
    return PyUnicode_FromString(self->in.end > self->in.at ? "a frame header" : "a frame");
}

static PyMethodDef receiver_methods[] = {
    {"receive", (PyCFunction)receiver_receive, METH_O,
     "receive(max_frames) -> outcome: land what the socket holds while it is the happy path; one of\n"
     "RECEIVE_DRAINED, RECEIVE_LIMIT, RECEIVE_HANDOFF (take_held() for the reference decoder),\n"
     "RECEIVE_CLOSED, RECEIVE_FAILED (errno in .error)."},
    {"take_held", (PyCFunction)receiver_take_held, METH_NOARGS, "The bytes read ahead of the next frame, given away."},
    {"take_landed", (PyCFunction)receiver_take_landed, METH_NOARGS, "The slots completed since the last call."},
    {"take_counts", (PyCFunction)receiver_take_counts, METH_NOARGS,
     "(RESULT frames, result data bytes, last SAFE count or None) since the last call."},
    {"release", (PyCFunction)receiver_release, METH_NOARGS, "The connection is closed: let go of every buffer."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef receiver_members[] = {
    {"lowat", T_INT, offsetof(ResultReceiver, in.lowat), READONLY, "SO_RCVLOWAT as last set"},
    {"received", T_INT, offsetof(ResultReceiver, in.received), READONLY, "a byte arrived in the last receive()"},
    {"error", T_INT, offsetof(ResultReceiver, in.error), READONLY, "errno of the last RECEIVE_FAILED"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef receiver_getset[] = {
    {"busy", (getter)receiver_get_busy, NULL, "holds bytes of a frame it has not finished", NULL},
    {"what", (getter)receiver_get_what, NULL, "what it waits for, for timeout messages", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ResultReceiverType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "redsrv.core._plane.ResultReceiver",
    .tp_basicsize = sizeof(ResultReceiver),
    .tp_dealloc = (destructor)receiver_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)receiver_traverse,
    .tp_clear = (inquiry)receiver_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "ResultReceiver(fd, max_payload, slots, max_lowat): a client connection's RESULT frames landed in C.",
    .tp_methods = receiver_methods,
    .tp_members = receiver_members,
    .tp_getset = receiver_getset,
    .tp_init = (initproc)receiver_init,
    .tp_new = PyType_GenericNew,
};

/* --- module ---------------------------------------------------------------------------------- */

int receiver_init_module(PyObject *module) {
    PyObject *wire = PyImport_ImportModule("redsrv.core.wire");
    PyObject *constants = PyImport_ImportModule("redsrv.core.constants");
    PyObject *world = constants ? PyObject_GetAttrString(constants, "MAX_WORLD_SIZE") : NULL;
    int status = -1;
    if (world == NULL) goto done;
    unsigned long long w = PyLong_AsUnsignedLongLong(world);
    if (PyErr_Occurred()) goto done;
    if (w == 0 || w > (1ULL << 32) || stream_read_ahead < PREFIX_SIZE + RESULT_HEADER_SIZE) goto changed;
    max_bitmap_bytes = (w + 7) / 8;
    if (stream_frame_code(wire, "RESULT", &k_result) < 0 || stream_frame_code(wire, "SAFE", &k_safe) < 0
        || stream_frame_code(wire, "HEARTBEAT", &k_heartbeat) < 0)
        goto changed;
    /* The positions land_result_header and receive() read. */
    if (!stream_header_format_is(wire, "RESULT", "<QQIIBxHI") || !stream_header_format_is(wire, "SAFE", "<Q")
        || !stream_header_format_is(wire, "HEARTBEAT", "<"))
        goto changed;
    if (PyType_Ready(&ResultSlotType) < 0 || PyType_Ready(&ResultReceiverType) < 0) goto done;
    if (PyModule_AddObjectRef(module, "ResultSlot", (PyObject *)&ResultSlotType) < 0
        || PyModule_AddObjectRef(module, "ResultReceiver", (PyObject *)&ResultReceiverType) < 0)
        goto done;
    status = 0;
    goto done;
changed:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ImportError, "wire's RESULT, SAFE or HEARTBEAT frames changed: update native/receiver.c");
done:
    if (status < 0) frames_as_import_error("the result receiver");
    Py_XDECREF(wire);
    Py_XDECREF(constants);
    Py_XDECREF(world);
    return status;
}
