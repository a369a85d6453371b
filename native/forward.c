/* redsrv.core._plane's forwarder: a cut-through chunk's sums combined and sent from C.
 *
 * docs/architecture.md, "The socket loops in C", step 2 (the reducer's forwarding). On the Python
 * plane, and on the native one before every rank's push of a chunk has arrived, the state machine
 * does this per progress report: ReducerCore.progress and _finish_part call _forward, which sums
 * in rank order into rank 0's buffer every byte range that every rank has (once a piece's worth is
 * there, or the chunk is whole) and sends it as one RESULT frame to every rank, counting the frame
 * on each connection (the count ACKs acknowledge). Once the last rank's push joins a chunk
 * (ReducerCore._engage), a Forwarder takes exactly that over: the push receivers of the chunk's
 * connections tell it each rank's landed bytes as they land (native/pushes.c, `feed`), and it
 * applies the same rule with the same kernels (native/plane.c) and writes the frames through the
 * connections' own writers (native/writer.c), so they share one queue per socket with the state
 * machine's SAFE and ERROR frames. The state machine keeps every decision around it: it reads
 * `forwarded` and the bytes sent back whenever it acts on the chunk, closes the chunk when its
 * last push ends, and cancels the forwarder at anything irregular (a connection leaving, a resend,
 * a failure), after which it goes on from `forwarded` itself.
 *
 * What it is handed, and nothing else, sizes what it touches: each rank's buffer (checked to hold
 * the chunk), the chunk's size and element size, the piece size. Landed ends from the receivers
 * are pointers into the buffers they were handed; one outside the rank's buffer is ignored.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "forward.h"
#include "plane.h"

typedef struct {
    PyObject *writer;    /* the rank's connection's FrameWriter; NULL once its write failed */
    PyObject *on_queued; /* on_queued(): a frame waits in the writer (the owner watches the socket) */
    PyObject *on_broken; /* on_broken(exc): a write failed (the owner ends the connection) */
    Py_buffer counter;   /* one int64: RESULT frames sent on the connection (ReducerCore's count) */
} target;

typedef struct {
    PyObject_HEAD
    Py_ssize_t world;
    Py_buffer *parts;   /* each rank's buffer; the sums accumulate in rank 0's */
    uint64_t *received; /* each rank's payload bytes landed */
    target *targets;
    PyObject *out;      /* a memoryview of rank 0's buffer, sliced for each frame */
    PyObject *header;   /* header(start, stop) -> the RESULT frame's prefix and header */
    PyObject *retain;   /* retain(k): k more references on rank 0's buffer, one per frame */
    PyObject *done;     /* done(ok): one frame is done with rank 0's buffer */
    uint64_t size, itemsize, piece, forwarded, bytes_out;
    combine_fn combine;
    int active;         /* cancelled: forwards nothing more */
    int running;        /* inside a send: cancel() waits for the end to let go of the buffers */
} Forwarder;

static PyObject *send_name, *out_name;
static PyObject *connection_broken; /* transport.ConnectionBroken, looked up at first use */

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock, as the writer's */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void drop_target(target *t) {
    Py_CLEAR(t->writer);
    Py_CLEAR(t->on_queued);
    Py_CLEAR(t->on_broken);
    if (t->counter.obj != NULL) PyBuffer_Release(&t->counter);
    t->counter.obj = NULL;
}

/* Let go of every buffer and callback: nothing is forwarded after. */
static void let_go(Forwarder *self) {
    self->active = 0;
    if (self->parts != NULL) {
        for (Py_ssize_t r = 0; r < self->world; r++)
            if (self->parts[r].obj != NULL) PyBuffer_Release(&self->parts[r]);
        PyMem_Free(self->parts);
        self->parts = NULL;
    }
    if (self->targets != NULL) {
        for (Py_ssize_t r = 0; r < self->world; r++) drop_target(&self->targets[r]);
        PyMem_Free(self->targets);
        self->targets = NULL;
    }
    PyMem_Free(self->received);
    self->received = NULL;
    Py_CLEAR(self->out);
    Py_CLEAR(self->header);
    Py_CLEAR(self->retain);
    Py_CLEAR(self->done);
}

/* transport.ConnectionBroken, imported at first use (transport imports this module): borrowed, or
 * NULL with an exception set. */
static PyObject *connection_broken_type(void) {
    if (connection_broken == NULL) {
        PyObject *transport = PyImport_ImportModule("redsrv.core.transport");
        if (transport == NULL) return NULL;
        connection_broken = PyObject_GetAttrString(transport, "ConnectionBroken");
        Py_DECREF(transport);
    }
    return connection_broken;
}

/* One RESULT frame, [header, data], to rank r's connection: 0, or -1 with an exception set (a
 * write that fails is handed to on_broken and the target dropped: 0). */
static int send_to(Forwarder *self, Py_ssize_t r, PyObject *header, PyObject *data, PyObject *now) {
    target *t = &self->targets[r];
    PyObject *writer = Py_NewRef(t->writer);
    PyObject *views = PyList_New(2), *finished = PyList_New(0), *got = NULL;
    int status = -1;
    if (views == NULL || finished == NULL) goto done;
    PyList_SET_ITEM(views, 0, Py_NewRef(header));
    PyList_SET_ITEM(views, 1, Py_NewRef(data));
    got = PyObject_CallMethodObjArgs(writer, send_name, views, self->done, now, finished, NULL);
    if (got == NULL) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *expected = connection_broken_type();
        if (expected == NULL || !PyErr_GivenExceptionMatches(type, expected)) {
            if (expected == NULL) { /* the import's failure is the one to report */
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(traceback);
            } else {
                PyErr_Restore(type, value, traceback);
            }
            goto done;
        }
        /* The connection's, not this chunk's: the frame is dropped, as ReducerDaemon._send drops it. */
        PyErr_NormalizeException(&type, &value, &traceback);
        PyObject *on_broken = Py_NewRef(t->on_broken);
        drop_target(t);
        PyObject *told = PyObject_CallFunctionObjArgs(self->done, Py_False, NULL);
        if (told != NULL) {
            Py_DECREF(told);
            told = PyObject_CallOneArg(on_broken, value != NULL ? value : Py_None);
        }
        Py_DECREF(on_broken);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        if (told == NULL) goto done;
        Py_DECREF(told);
        status = 0;
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(finished); i++) { /* frames the write finished, this one too */
        PyObject *ok = PyObject_CallOneArg(PyList_GET_ITEM(finished, i), Py_True);
        if (ok == NULL) goto done;
        Py_DECREF(ok);
    }
    PyObject *waiting = PyObject_GetAttr(writer, out_name);
    if (waiting == NULL) goto done;
    int queued = PyObject_IsTrue(waiting);
    Py_DECREF(waiting);
    if (queued < 0) goto done;
    if (queued && t->on_queued != NULL) {
        PyObject *told = PyObject_CallNoArgs(t->on_queued);
        if (told == NULL) goto done;
        Py_DECREF(told);
    }
    status = 0;
done:
    Py_XDECREF(got);
    Py_XDECREF(views);
    Py_XDECREF(finished);
    Py_DECREF(writer);
    return status;
}

/* Combine [start, stop) in rank order into rank 0's buffer and send it to every rank. */
static int send_piece(Forwarder *self, uint64_t start, uint64_t stop) {
    Py_ssize_t count = (Py_ssize_t)((stop - start) / self->itemsize);
    char *acc = (char *)self->parts[0].buf + start;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 1; r < self->world; r++) self->combine(acc, (const char *)self->parts[r].buf + start, count);
    Py_END_ALLOW_THREADS
    self->forwarded = stop;
    Py_ssize_t live = 0;
    for (Py_ssize_t r = 0; r < self->world; r++) live += self->targets[r].writer != NULL;
    self->bytes_out += (uint64_t)live * (stop - start);
    if (live == 0) return 0;
    PyObject *header = PyObject_CallFunction(self->header, "KK", (unsigned long long)start, (unsigned long long)stop);
    if (header == NULL) return -1;
    PyObject *from = PyLong_FromUnsignedLongLong(start), *to = PyLong_FromUnsignedLongLong(stop);
    PyObject *slice = from == NULL || to == NULL ? NULL : PySlice_New(from, to, NULL);
    Py_XDECREF(from);
    Py_XDECREF(to);
    PyObject *data = slice == NULL ? NULL : PyObject_GetItem(self->out, slice);
    PyObject *now = PyFloat_FromDouble(monotonic_now());
    PyObject *kept = data == NULL || now == NULL ? NULL : PyObject_CallFunction(self->retain, "n", live);
    int status = kept == NULL ? -1 : 0;
    Py_XDECREF(kept);
    for (Py_ssize_t r = 0; status == 0 && r < self->world; r++) {
        if (self->targets[r].writer == NULL) continue;
        int64_t *sent = self->targets[r].counter.buf;
        *sent += 1; /* counted before it is written, as _ResultRules._send_to counts */
        status = send_to(self, r, header, data, now);
    }
    Py_DECREF(header);
    Py_XDECREF(slice);
    Py_XDECREF(data);
    Py_XDECREF(now);
    return status;
}

/* _ResultRules._forward's rule: the bytes every rank has, in whole elements; send them once they
 * reach a piece beyond what was sent, or the chunk's end. */
static int forward_due(Forwarder *self) {
    if (self->running) return 0; /* the send in progress looks again when it returns */
    self->running = 1;
    int status = 0;
    while (self->active) {
        uint64_t ready = self->received[0];
        for (Py_ssize_t r = 1; r < self->world; r++)
            if (self->received[r] < ready) ready = self->received[r];
        ready -= ready % self->itemsize;
        uint64_t start = self->forwarded;
        if (!(ready > start && (ready == self->size || ready - start >= self->piece))) break;
        status = send_piece(self, start, ready);
        if (status < 0) {
            self->active = 0; /* the state machine goes on from `forwarded` */
            break;
        }
    }
    self->running = 0;
    if (!self->active && self->parts != NULL) let_go(self); /* cancelled meanwhile */
    return status;
}

static int landed(Forwarder *self, Py_ssize_t rank, uint64_t received) {
    if (!self->active || rank < 0 || rank >= self->world || received > self->size) return 0;
    if (received <= self->received[rank]) return 0;
    self->received[rank] = received;
    return forward_due(self);
}

int forward_landed_at(PyObject *obj, int rank, const char *end) {
    Forwarder *self = (Forwarder *)obj;
    if (!self->active || rank < 0 || rank >= self->world) return 0;
    const char *base = self->parts[rank].buf;
    if (end < base || (uint64_t)(end - base) > self->size) return 0; /* not this rank's buffer */
    Py_INCREF(obj); /* the callbacks it runs may drop the receiver's reference */
    int status = landed(self, rank, (uint64_t)(end - base));
    Py_DECREF(obj);
    return status;
}

/* --- the type -------------------------------------------------------------------------------- */

static int take_target(target *t, PyObject *spec) {
    PyObject *counter;
    if (spec == Py_None) return 0;
    if (!PyArg_ParseTuple(spec, "OOOO:target", &t->writer, &counter, &t->on_queued, &t->on_broken)) {
        t->writer = t->on_queued = t->on_broken = NULL;
        return -1;
    }
    Py_INCREF(t->writer);
    Py_INCREF(t->on_queued);
    Py_INCREF(t->on_broken);
    if (PyObject_GetBuffer(counter, &t->counter, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (t->counter.len != 8 || t->counter.format == NULL || strcmp(t->counter.format, "q") != 0) {
        PyErr_SetString(PyExc_ValueError, "Forwarder: a target's counter is one int64 (array('q', [n]))");
        return -1;
    }
    return 0;
}

static int fw_init(Forwarder *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"parts", "size", "itemsize", "kind", "op", "piece", "forwarded", "received", "header",
                            "retain", "done", "targets", NULL};
    PyObject *parts, *received, *header, *retain, *done, *targets;
    unsigned long long size, itemsize, piece, forwarded;
    int kind, op;
    if (self->parts != NULL || self->header != NULL) {
        PyErr_SetString(PyExc_TypeError, "Forwarder is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKKiiKKOOOOO:Forwarder", names, &parts, &size, &itemsize, &kind, &op,
                                     &piece, &forwarded, &received, &header, &retain, &done, &targets))
        return -1;
    parts = PySequence_Fast(parts, "Forwarder: parts is a sequence of buffers");
    if (parts == NULL) return -1;
    Py_ssize_t world = PySequence_Fast_GET_SIZE(parts);
    int status = -1;
    PyObject *received_seq = NULL, *target_seq = NULL;
    if (world < 1 || world > 65536) {
        PyErr_SetString(PyExc_ValueError, "Forwarder: 1 to 65536 ranks");
        goto done;
    }
    self->combine = plane_pick_combine(op, kind);
    if (self->combine == NULL || (uint64_t)plane_itemsize(kind) != itemsize || itemsize == 0 || size % itemsize
        || piece == 0 || forwarded > size || forwarded % itemsize) {
        PyErr_SetString(PyExc_ValueError, "Forwarder: no loop for this op and dtype, or sizes that do not fit them");
        goto done;
    }
    if (!PyCallable_Check(header) || !PyCallable_Check(retain) || !PyCallable_Check(done)) {
        PyErr_SetString(PyExc_TypeError, "Forwarder: header, retain and done must be callable");
        goto done;
    }
    received_seq = PySequence_Fast(received, "Forwarder: received is a sequence of ints");
    target_seq = PySequence_Fast(targets, "Forwarder: targets is a sequence");
    if (received_seq == NULL || target_seq == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(received_seq) != world || PySequence_Fast_GET_SIZE(target_seq) != world) {
        PyErr_SetString(PyExc_ValueError, "Forwarder: one received count and one target per rank");
        goto done;
    }
    self->world = world;
    self->parts = PyMem_Calloc((size_t)world, sizeof(Py_buffer));
    self->received = PyMem_Calloc((size_t)world, sizeof(uint64_t));
    self->targets = PyMem_Calloc((size_t)world, sizeof(target));
    if (self->parts == NULL || self->received == NULL || self->targets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < world; r++) {
        Py_buffer *b = &self->parts[r];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts, r), b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            b->obj = NULL;
            goto done;
        }
        if ((uint64_t)b->len < size) {
            PyErr_Format(PyExc_ValueError, "Forwarder: rank %zd's buffer holds %zd bytes of a %llu-byte chunk", r, b->len,
                         size);
            goto done;
        }
        unsigned long long got = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(received_seq, r));
        if (got == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        self->received[r] = got < size ? got : size;
        if (take_target(&self->targets[r], PySequence_Fast_GET_ITEM(target_seq, r)) < 0) goto done;
    }
    /* Sliced in bytes, whatever the exporter's element type. */
    PyObject *typed = PyMemoryView_FromObject(self->parts[0].obj);
    self->out = typed == NULL ? NULL : PyObject_CallMethod(typed, "cast", "s", "B");
    Py_XDECREF(typed);
    if (self->out == NULL) goto done;
    self->header = Py_NewRef(header);
    self->retain = Py_NewRef(retain);
    self->done = Py_NewRef(done);
    self->size = size;
    self->itemsize = itemsize;
    self->piece = piece;
    self->forwarded = forwarded;
    self->active = 1;
    status = 0;
done:
    Py_DECREF(parts);
    Py_XDECREF(received_seq);
    Py_XDECREF(target_seq);
    if (status < 0) let_go(self);
    return status;
}

static PyObject *fw_landed(Forwarder *self, PyObject *args) {
    Py_ssize_t rank;
    unsigned long long received;
    if (!PyArg_ParseTuple(args, "nK:landed", &rank, &received)) return NULL;
    if (landed(self, rank, received) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *fw_cancel(Forwarder *self, PyObject *Py_UNUSED(ignored)) {
    self->active = 0;
    if (!self->running) let_go(self); /* else forward_due lets go as it returns */
    Py_RETURN_NONE;
}

static PyObject *fw_take_bytes_out(Forwarder *self, PyObject *Py_UNUSED(ignored)) {
    uint64_t taken = self->bytes_out;
    self->bytes_out = 0;
    return PyLong_FromUnsignedLongLong(taken);
}

static PyObject *fw_get_forwarded(Forwarder *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->forwarded);
}

static PyObject *fw_get_active(Forwarder *self, void *Py_UNUSED(closure)) { return PyBool_FromLong(self->active); }

static PyObject *fw_get_received(Forwarder *self, void *Py_UNUSED(closure)) {
    if (self->received == NULL) return PyTuple_New(0);
    PyObject *out = PyTuple_New(self->world);
    for (Py_ssize_t r = 0; out != NULL && r < self->world; r++) {
        PyObject *n = PyLong_FromUnsignedLongLong(self->received[r]);
        if (n == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, r, n);
    }
    return out;
}

static int fw_traverse(Forwarder *self, visitproc visit, void *arg) {
    if (self->parts != NULL)
        for (Py_ssize_t r = 0; r < self->world; r++) Py_VISIT(self->parts[r].obj);
    if (self->targets != NULL)
        for (Py_ssize_t r = 0; r < self->world; r++) {
            Py_VISIT(self->targets[r].writer);
            Py_VISIT(self->targets[r].on_queued);
            Py_VISIT(self->targets[r].on_broken);
            Py_VISIT(self->targets[r].counter.obj);
        }
    Py_VISIT(self->out);
    Py_VISIT(self->header);
    Py_VISIT(self->retain);
    Py_VISIT(self->done);
    return 0;
}

static int fw_clear(Forwarder *self) {
    if (!self->running) let_go(self);
    return 0;
}

static void fw_dealloc(Forwarder *self) {
    PyObject_GC_UnTrack(self);
    self->running = 0;
    let_go(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef fw_methods[] = {
    {"landed", (PyCFunction)fw_landed, METH_VARARGS,
     "landed(rank, received): rank's payload is in up to `received` bytes; send what is due."},
    {"cancel", (PyCFunction)fw_cancel, METH_NOARGS, "Forward nothing more; let go of every buffer and callback."},
    {"take_bytes_out", (PyCFunction)fw_take_bytes_out, METH_NOARGS,
     "The payload bytes sent (summed over connections) since the last call."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef fw_getset[] = {
    {"forwarded", (getter)fw_get_forwarded, NULL, "payload bytes whose sums were sent", NULL},
    {"active", (getter)fw_get_active, NULL, "still forwarding (not cancelled, no failure)", NULL},
    {"received", (getter)fw_get_received, NULL, "each rank's payload bytes in, as told", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ForwarderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "redsrv.core._plane.Forwarder",
    .tp_basicsize = sizeof(Forwarder),
    .tp_dealloc = (destructor)fw_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)fw_traverse,
    .tp_clear = (inquiry)fw_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "Forwarder(parts, size, itemsize, kind, op, piece, forwarded, received, header, retain, done, targets):\n"
              "a cut-through chunk's sums combined in rank order and sent as its pushes land.",
    .tp_methods = fw_methods,
    .tp_getset = fw_getset,
    .tp_init = (initproc)fw_init,
    .tp_new = PyType_GenericNew,
};

int forward_check(PyObject *obj) { return PyObject_TypeCheck(obj, &ForwarderType); }

int forward_init_module(PyObject *module) {
    if ((send_name = PyUnicode_InternFromString("send")) == NULL) return -1;
    if ((out_name = PyUnicode_InternFromString("out")) == NULL) return -1;
    if (PyType_Ready(&ForwarderType) < 0) return -1;
    return PyModule_AddObjectRef(module, "Forwarder", (PyObject *)&ForwarderType);
}
