/* redsrv.core._plane's push receiver: a reducer connection's steady frames read in C.
 *
 * docs/architecture.md, "The socket loops in C", step 2 (the reducer's half, its receiving). A
 * reducer connection carries PUSH frames, ACK frames and heartbeats from one worker. On the
 * Python plane transport.FrameReader drives wire.FrameDecoder over it and asks the daemon, through
 * its callbacks, where each push's payload goes. A PushReceiver is that loop in C for those three
 * frame types: it reads ahead, checks each prefix and header with the plane's own frame parser
 * (native/frames.c, the rules of wire.parse_prefix and wire.parse_header), and asks the same
 * callbacks the same questions in the same order:
 *
 *   on_header(FrameHeader) -> (view, what) | SKIP | WAIT     at each PUSH header
 *   on_payload()           -> (view, what) | WAIT | None     each time a view is full
 *   on_count(FrameType.ACK, n)                              before either of those, and before
 *                                                           receive() returns, once for the ACKs
 *                                                           read since the last call (their
 *                                                           largest count: an ACK acknowledges
 *                                                           every RESULT frame up to its count,
 *                                                           so one call with the largest leaves
 *                                                           the core as the sequence would)
 *
 * A view is landed with recv straight into its memory, the GIL released, and a low-water mark for
 * the rest of a large one as FrameReader sets it. WAIT stops receive(); the next call asks again.
 * SKIP reads the payload and drops it.
 *
 * Everything else goes back to the reference whole, before any of its bytes is consumed: another
 * frame type (an ERROR, a frame a worker must not send), a prefix or header the rules refuse, an
 * ACK or heartbeat with a payload. receive() then returns HANDOFF and take_held() gives the bytes
 * read ahead to the decoder (FrameDecoder.hold), which decodes that frame exactly as on the
 * Python plane, its refusal's message included. So this file decides nothing the protocol
 * defines: the rules are frames.c's, the decisions the daemon's. Nothing from the wire sizes a
 * copy: payload bytes land only in views the owner handed out, each no larger than what the
 * payload has left, and the read-ahead buffer is fixed.
 *
 * The callbacks may close the connection: the owner then calls stop() (or release(), which frees
 * nothing while receive() runs), and receive() returns at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>

#include "forward.h"
#include "frames.h"
#include "pushes.h"
#include "stream.h"

#define PREFIX_SIZE STREAM_PREFIX_SIZE
#define LOWAT_FROM STREAM_LOWAT_FROM
#define DISCARD_BYTES (64 * 1024)
/* where the receiver is in the stream */
enum { AT_FRAME = 0, ASK_HEADER = 1, IN_VIEW = 2, ASK_PAYLOAD = 3, DISCARDING = 4 };

static unsigned k_push, k_ack, k_heartbeat;
static Py_ssize_t push_header_size, ack_header_size;
static PyObject *ack_member; /* wire.FrameType.ACK, what on_count is told */
static unsigned char discard_scratch[DISCARD_BYTES];

typedef struct {
    PyObject_HEAD
    stream_in in;            /* the socket, what was read ahead, the low-water mark (max_lowat: the
                              * owner lowers it to its cut-through piece) */
    uint64_t max_payload;
    PyObject *on_header, *on_payload, *on_count;
    PyObject *wait, *skip;   /* the owner's WAIT and SKIP answers (transport.WAIT, transport.SKIP) */
    int stage;
    PyObject *header;        /* the current push's FrameHeader */
    uint64_t payload_left;   /* of the current push: bytes not yet landed in a view or dropped */
    Py_buffer view;          /* the view being landed in (IN_VIEW) */
    uint64_t view_got;
    PyObject *what;          /* what the owner calls that view */
    uint64_t ack;            /* the largest ACK count read and not yet told */
    int has_ack;
    PyObject *feed;          /* a Forwarder told what lands (native/forward.c), or NULL */
    int feed_rank;
    int stopped;             /* the owner closed the connection */
    int running;             /* inside receive(): release() frees nothing */
    int released;
} PushReceiver;

static int pr_init(PushReceiver *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"fd", "max_payload", "max_lowat", "on_header", "on_payload", "on_count", "wait", "skip",
                            NULL};
    int fd;
    unsigned long long max_payload, max_lowat;
    PyObject *on_header, *on_payload, *on_count, *wait, *skip;
    if (self->on_header != NULL) {
        PyErr_SetString(PyExc_TypeError, "PushReceiver is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iKKOOOOO:PushReceiver", names, &fd, &max_payload, &max_lowat,
                                     &on_header, &on_payload, &on_count, &wait, &skip))
        return -1;
    if (fd < 0 || max_lowat < 1 || max_lowat > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "PushReceiver: a file descriptor and 1 <= max_lowat < 2**31");
        return -1;
    }
    if (!PyCallable_Check(on_header) || !PyCallable_Check(on_payload) || !PyCallable_Check(on_count)) {
        PyErr_SetString(PyExc_TypeError, "PushReceiver: on_header, on_payload and on_count must be callable");
        return -1;
    }
    if (stream_open(&self->in, fd, stream_read_ahead, max_lowat) < 0) return -1;
    self->max_payload = max_payload;
    self->on_header = Py_NewRef(on_header);
    self->on_payload = Py_NewRef(on_payload);
    self->on_count = Py_NewRef(on_count);
    self->wait = Py_NewRef(wait);
    self->skip = Py_NewRef(skip);
    return 0;
}

/* The callbacks are the owner's bound methods, and the owner holds this receiver. */
static int pr_traverse(PushReceiver *self, visitproc visit, void *arg) {
    Py_VISIT(self->on_header);
    Py_VISIT(self->on_payload);
    Py_VISIT(self->on_count);
    Py_VISIT(self->wait);
    Py_VISIT(self->skip);
    Py_VISIT(self->header);
    Py_VISIT(self->what);
    Py_VISIT(self->view.obj);
    Py_VISIT(self->feed);
    return 0;
}

static void drop_view(PushReceiver *self) {
    if (self->view.obj != NULL) PyBuffer_Release(&self->view);
    self->view.obj = NULL;
    self->view_got = 0;
}

static int pr_clear(PushReceiver *self) {
    drop_view(self);
    Py_CLEAR(self->on_header);
    Py_CLEAR(self->on_payload);
    Py_CLEAR(self->on_count);
    Py_CLEAR(self->wait);
    Py_CLEAR(self->skip);
    Py_CLEAR(self->header);
    Py_CLEAR(self->what);
    Py_CLEAR(self->feed);
    return 0;
}

static void pr_dealloc(PushReceiver *self) {
    PyObject_GC_UnTrack(self);
    pr_clear(self);
    stream_close(&self->in);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The header size of the frame whose prefix is `p` when it may be one of ours (PUSH, ACK,
 * HEARTBEAT as the rules allow them), else -1: the reference decides. */
static Py_ssize_t our_header_size(const unsigned char *p, const void *receiver) {
    const PushReceiver *self = receiver;
    if (!stream_prefix_is_ours(p)) return -1;
    unsigned code = p[5];
    uint64_t header_len = read_le(p + 6, 2), payload_len = read_le(p + 8, 4);
    if (payload_len > self->max_payload) return -1;
    if (code == k_push) return header_len == (uint64_t)push_header_size ? push_header_size : -1;
    if (code == k_ack) return header_len == (uint64_t)ack_header_size && payload_len == 0 ? ack_header_size : -1;
    if (code == k_heartbeat) return header_len == 0 && payload_len == 0 ? 0 : -1;
    return -1;
}

/* Tell the owner the ACKs read so far: 0, or -1 with its exception set. */
static int tell_acks(PushReceiver *self) {
    if (!self->has_ack) return 0;
    self->has_ack = 0;
    PyObject *count = PyLong_FromUnsignedLongLong(self->ack);
    if (count == NULL) return -1;
    PyObject *callback = Py_NewRef(self->on_count); /* the owner may let go of it meanwhile */
    PyObject *got = PyObject_CallFunctionObjArgs(callback, ack_member, count, NULL);
    Py_DECREF(callback);
    Py_DECREF(count);
    if (got == NULL) return -1;
    Py_DECREF(got);
    return 0;
}

/* The owner's answer to on_header or on_payload, other than WAIT (and SKIP, None): take the
 * view it names. 0, or -1 with an exception set (an answer FrameDecoder.land_payload refuses). */
static int take_view(PushReceiver *self, PyObject *step) {
    if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != 2) {
        PyErr_Format(PyExc_TypeError, "PushReceiver: the owner answered %R, not (view, what)", step);
        return -1;
    }
    Py_buffer view;
    /* Writable unless empty: an empty payload lands in memoryview(b"") (ReducerDaemon._begin_push). */
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(step, 0), &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view.readonly && view.len > 0) {
        PyErr_SetString(PyExc_BufferError, "PushReceiver: the owner's view is read-only");
        PyBuffer_Release(&view);
        return -1;
    }
    if ((uint64_t)view.len > self->payload_left) {
        PyErr_Format(PyExc_ValueError, "a buffer of %zd bytes for the %llu left of the payload", view.len,
                     (unsigned long long)self->payload_left);
        PyBuffer_Release(&view);
        return -1;
    }
    drop_view(self);
    self->view = view;
    self->view_got = 0;
    Py_XSETREF(self->what, Py_NewRef(PyTuple_GET_ITEM(step, 1)));
    self->stage = IN_VIEW;
    return 0;
}

/* The push is over (its last view full, or its payload dropped): the next frame. */
static int end_push(PushReceiver *self) {
    Py_CLEAR(self->header);
    Py_CLEAR(self->what);
    self->stage = AT_FRAME;
    /* A small header must wake the loop again (FrameReader._frame_over). */
    return stream_set_lowat(&self->in, 1);
}

static PyObject *pr_receive(PushReceiver *self, PyObject *arg) {
    long max_frames = PyLong_AsLong(arg);
    if (max_frames == -1 && PyErr_Occurred()) return NULL;
    if (self->released || self->in.ahead == NULL) {
        PyErr_SetString(PyExc_ValueError, "receive() on a released PushReceiver");
        return NULL;
    }
    if (self->running) {
        PyErr_SetString(PyExc_RuntimeError, "PushReceiver.receive() called from one of its callbacks");
        return NULL;
    }
    Py_INCREF(self); /* a callback may drop the owner's last reference */
    self->running = 1;
    self->in.received = 0;
    long frames = 0;
    int outcome = DRAINED, failed = 0;
    while (!self->stopped) {
        if (self->stage == AT_FRAME) {
            if (frames >= max_frames && self->in.at == self->in.end) {
                outcome = LIMIT;
                break;
            }
            Py_ssize_t header_size;
            int held = stream_hold_frame(&self->in, our_header_size, self, &header_size);
            if (held != 1) {
                outcome = held;
                break;
            }
            const unsigned char *p = self->in.ahead + self->in.at;
            unsigned code = p[5];
            if (code == k_ack) {
                uint64_t count = read_le(p + PREFIX_SIZE, 8);
                if (!self->has_ack || count > self->ack) self->ack = count;
                self->has_ack = 1;
            }
            if (code != k_push) { /* an ACK or a heartbeat, whole */
                stream_consume(&self->in, PREFIX_SIZE + header_size);
                frames++;
                if (stream_set_lowat(&self->in, 1) < 0) {
                    outcome = FAILED;
                    break;
                }
                continue;
            }
            uint64_t payload_len = read_le(p + 8, 4);
            PyObject *header = frames_header((int)code, p + PREFIX_SIZE, payload_len);
            if (header == NULL) {
                if (!frames_is_protocol_error()) {
                    failed = 1;
                    break;
                }
                PyErr_Clear(); /* the reference refuses it, with its own message */
                outcome = HANDOFF;
                break;
            }
            Py_XSETREF(self->header, header);
            self->payload_left = payload_len;
            stream_consume(&self->in, PREFIX_SIZE + header_size);
            self->stage = ASK_HEADER;
        }
        if (self->stage == ASK_HEADER) {
            if (tell_acks(self) < 0) {
                failed = 1;
                break;
            }
            if (self->stopped) break;
            PyObject *callback = Py_NewRef(self->on_header);
            PyObject *step = PyObject_CallOneArg(callback, self->header);
            Py_DECREF(callback);
            if (step == NULL) {
                failed = 1;
                break;
            }
            int taken = 0;
            if (self->stopped || step == self->wait) {
                Py_DECREF(step);
                break; /* asked again by the next receive() */
            }
            if (step == self->skip) {
                self->stage = DISCARDING;
            } else {
                taken = take_view(self, step);
            }
            Py_DECREF(step);
            if (taken < 0) {
                failed = 1;
                break;
            }
        }
        if (self->stage == IN_VIEW) {
            uint64_t moved, want = (uint64_t)self->view.len - self->view_got;
            int status = stream_take(&self->in, (unsigned char *)self->view.buf + self->view_got, want, &moved);
            self->view_got += moved;
            if (moved && self->feed != NULL
                && forward_landed_at(self->feed, self->feed_rank, (const char *)self->view.buf + self->view_got) < 0) {
                failed = 1;
                break;
            }
            if (status != 1) {
                /* One wake-up for the rest of a large view (FrameReader.read's low-water mark). */
                if (status == DRAINED && (uint64_t)self->view.len >= LOWAT_FROM
                    && stream_set_lowat(&self->in, want - moved) < 0)
                    status = FAILED;
                outcome = status;
                break;
            }
            self->payload_left -= (uint64_t)self->view.len;
            drop_view(self);
            self->stage = ASK_PAYLOAD;
        }
        if (self->stage == ASK_PAYLOAD) {
            if (tell_acks(self) < 0) {
                failed = 1;
                break;
            }
            if (self->stopped) break;
            PyObject *callback = Py_NewRef(self->on_payload);
            PyObject *more = PyObject_CallNoArgs(callback);
            Py_DECREF(callback);
            if (more == NULL) {
                failed = 1;
                break;
            }
            if (self->stopped || more == self->wait) {
                Py_DECREF(more);
                break;
            }
            int status;
            if (more == Py_None) {
                if (self->payload_left) {
                    PyErr_Format(PyExc_ValueError, "end_payload() with %llu bytes of the payload still to land",
                                 (unsigned long long)self->payload_left);
                    status = -1;
                } else {
                    frames++;
                    status = end_push(self);
                    if (status < 0) outcome = FAILED;
                }
            } else {
                status = take_view(self, more);
            }
            Py_DECREF(more);
            if (status < 0) {
                if (outcome != FAILED) failed = 1;
                break;
            }
            continue;
        }
        if (self->stage == DISCARDING) {
            if (self->payload_left) {
                uint64_t moved, want = self->payload_left < DISCARD_BYTES ? self->payload_left : DISCARD_BYTES;
                int status = stream_take(&self->in, discard_scratch, want, &moved);
                self->payload_left -= moved;
                if (status != 1) {
                    outcome = status;
                    break;
                }
                continue;
            }
            frames++;
            if (end_push(self) < 0) {
                outcome = FAILED;
                break;
            }
        }
    }
    /* The ACKs read last are told before the owner acts on the outcome. */
    if (!failed && !self->stopped && tell_acks(self) < 0) failed = 1;
    self->running = 0;
    if (self->released) {
        drop_view(self);
        stream_close(&self->in);
    }
    if (self->stopped && outcome != CLOSED && outcome != FAILED) outcome = DRAINED;
    Py_DECREF(self); /* last: a callback may have dropped every other reference */
    return failed ? NULL : PyLong_FromLong(outcome);
}

static PyObject *pr_take_held(PushReceiver *self, PyObject *unused) {
    if (self->stage != AT_FRAME || self->running) {
        PyErr_SetString(PyExc_ValueError, "take_held() in the middle of a frame");
        return NULL;
    }
    PyObject *held = PyBytes_FromStringAndSize((const char *)self->in.ahead + self->in.at, self->in.end - self->in.at);
    if (held != NULL) self->in.at = self->in.end = 0;
    return held;
}

static PyObject *pr_stop(PushReceiver *self, PyObject *unused) {
    self->stopped = 1;
    Py_RETURN_NONE;
}

static PyObject *pr_release(PushReceiver *self, PyObject *unused) {
    self->stopped = 1;
    self->released = 1;
    Py_CLEAR(self->header);
    Py_CLEAR(self->what);
    /* The callbacks are the owner's bound methods: let go of them so the pair is freed without
     * waiting for the cyclic collector (FrameReader.release). */
    Py_CLEAR(self->on_header);
    Py_CLEAR(self->on_payload);
    Py_CLEAR(self->on_count);
    Py_CLEAR(self->feed);
    if (!self->running) { /* else receive() frees them as it returns */
        drop_view(self);
        stream_close(&self->in);
    }
    self->stage = AT_FRAME;
    Py_RETURN_NONE;
}

static PyObject *pr_get_busy(PushReceiver *self, void *closure) {
    return PyBool_FromLong(self->stage != AT_FRAME || self->in.end > self->in.at);
}

static PyObject *pr_get_landed(PushReceiver *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->stage == IN_VIEW ? self->view_got : 0);
}

/* What FrameDecoder.what says at the same point of the stream. */
static PyObject *pr_get_what(PushReceiver *self, void *closure) {
    if ((self->stage == IN_VIEW || self->stage == ASK_PAYLOAD) && self->what != NULL) return Py_NewRef(self->what);
    if (self->stage == DISCARDING) return PyUnicode_FromString("a discarded payload");
    if (self->stage == ASK_HEADER) return PyUnicode_FromString("a PUSH header");
    if (self->in.end - self->in.at >= PREFIX_SIZE) {
        unsigned code = self->in.ahead[self->in.at + 5];
        if (code == k_push) return PyUnicode_FromString("a PUSH header");
        if (code == k_ack) return PyUnicode_FromString("a ACK header");
    }
    return PyUnicode_FromString("a frame");
}

static PyObject *pr_get_feed(PushReceiver *self, void *closure) {
    if (self->feed == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(Oi)", self->feed, self->feed_rank);
}

static int pr_set_feed(PushReceiver *self, PyObject *value, void *closure) {
    PyObject *forwarder = NULL;
    int rank = 0;
    if (value != NULL && value != Py_None
        && (!PyArg_ParseTuple(value, "Oi:feed", &forwarder, &rank) || !forward_check(forwarder))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "feed: None or (Forwarder, rank)");
        return -1;
    }
    Py_XSETREF(self->feed, Py_XNewRef(forwarder));
    self->feed_rank = rank;
    return 0;
}

static PyObject *pr_get_max_lowat(PushReceiver *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->in.max_lowat);
}

static int pr_set_max_lowat(PushReceiver *self, PyObject *value, void *closure) {
    unsigned long long v = value != NULL ? PyLong_AsUnsignedLongLong(value) : 0;
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v < 1 || v > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "max_lowat: 1 <= max_lowat < 2**31");
        return -1;
    }
    self->in.max_lowat = v;
    return 0;
}

static PyMethodDef pr_methods[] = {
    {"receive", (PyCFunction)pr_receive, METH_O,
     "receive(max_frames) -> outcome: read pushes, ACKs and heartbeats while they are ours, asking the\n"
     "owner's callbacks; one of RECEIVE_DRAINED (also: the owner said WAIT or stopped it),\n"
     "RECEIVE_LIMIT, RECEIVE_HANDOFF (take_held() for the reference decoder), RECEIVE_CLOSED,\n"
     "RECEIVE_FAILED (errno in .error)."},
    {"take_held", (PyCFunction)pr_take_held, METH_NOARGS, "The bytes read ahead of the next frame, given away."},
    {"stop", (PyCFunction)pr_stop, METH_NOARGS, "The owner closed the connection: receive() returns at once."},
    {"release", (PyCFunction)pr_release, METH_NOARGS,
     "The connection is closed: let go of every buffer and callback (once receive() returns, if it runs)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef pr_members[] = {
    {"lowat", T_INT, offsetof(PushReceiver, in.lowat), READONLY, "SO_RCVLOWAT as last set"},
    {"received", T_INT, offsetof(PushReceiver, in.received), READONLY, "a byte arrived in the last receive()"},
    {"error", T_INT, offsetof(PushReceiver, in.error), READONLY, "errno of the last RECEIVE_FAILED"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef pr_getset[] = {
    {"busy", (getter)pr_get_busy, NULL, "holds bytes of a frame, or is inside one", NULL},
    {"landed", (getter)pr_get_landed, NULL, "bytes of the current view landed (FrameDecoder.landed)", NULL},
    {"what", (getter)pr_get_what, NULL, "what it waits for, for timeout messages", NULL},
    {"max_lowat", (getter)pr_get_max_lowat, (setter)pr_set_max_lowat, "the largest low-water mark it sets", NULL},
    {"feed", (getter)pr_get_feed, (setter)pr_set_feed,
     "None, or (forwarder, rank): every byte landed is told to that Forwarder as rank's (native/forward.c)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PushReceiverType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "redsrv.core._plane.PushReceiver",
    .tp_basicsize = sizeof(PushReceiver),
    .tp_dealloc = (destructor)pr_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)pr_traverse,
    .tp_clear = (inquiry)pr_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "PushReceiver(fd, max_payload, max_lowat, on_header, on_payload, on_count, wait, skip): a reducer\n"
              "connection's PUSH, ACK and heartbeat frames read in C.",
    .tp_methods = pr_methods,
    .tp_members = pr_members,
    .tp_getset = pr_getset,
    .tp_init = (initproc)pr_init,
    .tp_new = PyType_GenericNew,
};

/* --- module ---------------------------------------------------------------------------------- */

int pushes_init_module(PyObject *module) {
    PyObject *wire = PyImport_ImportModule("redsrv.core.wire");
    PyObject *types = wire ? PyObject_GetAttrString(wire, "FrameType") : NULL;
    int status = -1;
    if (types == NULL) goto done;
    if (stream_frame_code(wire, "PUSH", &k_push) < 0 || stream_frame_code(wire, "ACK", &k_ack) < 0
        || stream_frame_code(wire, "HEARTBEAT", &k_heartbeat) < 0)
        goto changed;
    /* The sizes come from frames.c's tables (wire's struct formats); the ACK's count is read here. */
    push_header_size = frames_header_size((int)k_push);
    ack_header_size = frames_header_size((int)k_ack);
    if (push_header_size <= 0 || PREFIX_SIZE + push_header_size > stream_read_ahead || ack_header_size != 8
        || frames_header_size((int)k_heartbeat) != 0 || !stream_header_format_is(wire, "ACK", "<Q"))
        goto changed;
    if ((ack_member = PyObject_GetAttrString(types, "ACK")) == NULL) goto done;
    if (PyType_Ready(&PushReceiverType) < 0) goto done;
    if (PyModule_AddObjectRef(module, "PushReceiver", (PyObject *)&PushReceiverType) < 0) goto done;
    status = 0;
    goto done;
changed:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ImportError, "wire's PUSH, ACK or HEARTBEAT frames changed: update native/pushes.c");
done:
    if (status < 0) frames_as_import_error("the push receiver");
    Py_XDECREF(wire);
    Py_XDECREF(types);
    return status;
}
