/* The write side of a data connection in C: transport.FrameWriter's twin, with its methods,
 * attributes and rules. Frames go out in order, straight from the callers' buffers (sendmsg, no
 * concatenation); a frame sent `ahead` goes right behind the frame being written; `defer` queues
 * even when nothing is ahead; `done` callbacks are handed back in `finished`, never run here.
 * What it saves over the reference is the interpreter's work per frame: a frame's buffers are
 * taken once when it is queued, and the iovecs are built, written and advanced in C with the GIL
 * released around each sendmsg (docs/architecture.md, "The socket loops in C", step 3).
 *
 * Its owner serialises its calls, as for the reference (the daemon's loop; a client's loop lock).
 * A call that starts while another runs (another thread, or a `views` callable that calls back)
 * raises RuntimeError and touches nothing. Nothing from the network sizes anything here: the
 * lengths are those of the buffers the owner handed over. The socket's descriptor is asked of
 * the socket object before every write, so a closed socket fails as the reference's does
 * (EBADF) and a number the kernel gave to another socket since is never written to. */

#define _GNU_SOURCE
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "writer.h"

/* iovecs per sendmsg: a frame is a header and a payload or two, so one call takes a whole frame;
 * a frame of more views is written over several calls. */
#define MAX_IOV 64

typedef struct {
    PyObject *make;     /* a callable that makes the frame's views, not called yet; NULL once made */
    Py_buffer *views;   /* held until the frame is out or dropped */
    Py_ssize_t nviews;
    Py_ssize_t next;    /* the first view with bytes left */
    Py_ssize_t offset;  /* bytes of views[next] already written */
    PyObject *done;     /* NULL for none */
} frame;

typedef struct {
    PyObject_HEAD
    PyObject *sock, *peer;
    double last_send;     /* the last time anything was written (heartbeats are due after a pause) */
    double last_progress; /* the last time a queued frame moved (a peer that stopped reading) */
    frame *queue;         /* queue[0] is the frame being written */
    Py_ssize_t count, capacity;
    int busy;
} FrameWriter;

static PyObject *connection_broken; /* transport.ConnectionBroken, looked up by the first FrameWriter */
static PyObject *peer_name_of;      /* transport.peer_name */
static PyObject *fileno_name;

/* --- frames -------------------------------------------------------------------------------- */

static void skip_written(frame *f) {
    while (f->next < f->nviews && f->offset >= f->views[f->next].len) {
        f->next++;
        f->offset = 0;
    }
}

static void release_views(frame *f) {
    for (Py_ssize_t i = 0; i < f->nviews; i++) PyBuffer_Release(&f->views[i]);
    PyMem_Free(f->views);
    f->views = NULL;
    f->nviews = f->next = f->offset = 0;
}

/* Everything but `done`, which the caller hands on or drops. */
static void release_frame(frame *f) {
    release_views(f);
    Py_CLEAR(f->make);
}

/* Hold the buffers of `views`, a sequence of contiguous buffers: 0, or -1 with an exception. */
static int take_views(frame *f, PyObject *views) {
    PyObject *items = PySequence_Tuple(views); /* a tuple: nothing can shrink it while buffers are taken */
    if (items == NULL) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(items), i;
    Py_buffer *buffers = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    if (buffers == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(items, i), &buffers[i], PyBUF_SIMPLE) < 0) break;
    Py_DECREF(items);
    if (i < n) {
        while (i-- > 0) PyBuffer_Release(&buffers[i]);
        PyMem_Free(buffers);
        return -1;
    }
    f->views = buffers;
    f->nviews = n;
    f->next = f->offset = 0;
    skip_written(f);
    return 0;
}

/* A queued frame's views, made by its callable the first time it is written. */
static int make_views(frame *f) {
    if (f->make == NULL) return 0;
    PyObject *views = PyObject_CallNoArgs(f->make);
    if (views == NULL) return -1;
    int status = take_views(f, views);
    Py_DECREF(views);
    if (status == 0) Py_CLEAR(f->make);
    return status;
}

/* --- the queue ----------------------------------------------------------------------------- */

static int queue_insert(FrameWriter *self, Py_ssize_t at, frame *f) {
    if (self->count == self->capacity) {
        Py_ssize_t capacity = self->capacity ? self->capacity * 2 : 4;
        frame *grown = PyMem_Realloc(self->queue, (size_t)capacity * sizeof(frame));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->queue = grown;
        self->capacity = capacity;
    }
    memmove(&self->queue[at + 1], &self->queue[at], (size_t)(self->count - at) * sizeof(frame));
    self->queue[at] = *f;
    self->count++;
    memset(f, 0, sizeof(*f)); /* the queue owns it now */
    return 0;
}

/* Take queue[at] out into *f. */
static void queue_remove(FrameWriter *self, Py_ssize_t at, frame *f) {
    *f = self->queue[at];
    memmove(&self->queue[at], &self->queue[at + 1], (size_t)(self->count - at - 1) * sizeof(frame));
    self->count--;
}

/* --- writing ------------------------------------------------------------------------------- */

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The socket's descriptor as it is now (-1 once closed), or -2 with an exception. */
static int socket_fd(FrameWriter *self) {
    PyObject *value = PyObject_CallMethodNoArgs(self->sock, fileno_name);
    if (value == NULL) return -2;
    long fd = PyLong_AsLong(value);
    Py_DECREF(value);
    if (fd == -1 && PyErr_Occurred()) return -2;
    return fd < 0 || fd > INT_MAX ? -1 : (int)fd;
}

/* ConnectionBroken("reset", "sending to PEER failed: [Errno N] ...") as send_views raises it. */
static int broken(FrameWriter *self, int error) {
    PyObject *os_error = PyObject_CallFunction(PyExc_OSError, "is", error, strerror(error));
    if (os_error == NULL) return -1;
    PyObject *detail = PyUnicode_FromFormat("sending to %S failed: %S", self->peer, os_error);
    Py_DECREF(os_error);
    if (detail == NULL) return -1;
    PyObject *exc = PyObject_CallFunction(connection_broken, "sO", "reset", detail);
    Py_DECREF(detail);
    if (exc == NULL) return -1;
    PyErr_SetObject(connection_broken, exc);
    Py_DECREF(exc);
    return -1;
}

/* Write what the socket takes of `f` without blocking: 1 when the frame is out, 0 when the socket
 * is full (a short write, as send_views takes it, or EAGAIN), -1 with an exception. *moved is
 * set when a byte went out. */
static int write_frame(FrameWriter *self, frame *f, int *moved) {
    for (;;) {
        skip_written(f);
        if (f->next >= f->nviews) return 1;
        int fd = socket_fd(self);
        if (fd == -2) return -1;
        if (fd == -1) return broken(self, EBADF);
        struct iovec iov[MAX_IOV];
        int n = 0;
        size_t offered = 0;
        for (Py_ssize_t i = f->next; i < f->nviews && n < MAX_IOV; i++) {
            Py_ssize_t from = i == f->next ? f->offset : 0;
            if (f->views[i].len <= from) continue;
            iov[n].iov_base = (char *)f->views[i].buf + from;
            iov[n].iov_len = (size_t)(f->views[i].len - from);
            offered += iov[n].iov_len;
            n++;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n;
        ssize_t sent;
        int error;
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        error = errno;
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (error == EINTR) {
                if (PyErr_CheckSignals() < 0) return -1;
                continue;
            }
            if (error == EAGAIN || error == EWOULDBLOCK) return 0;
            return broken(self, error);
        }
        size_t left = (size_t)sent;
        if (left > 0) *moved = 1;
        while (left > 0) { /* advance past what went out */
            size_t rest = (size_t)(f->views[f->next].len - f->offset);
            if (left < rest) {
                f->offset += (Py_ssize_t)left;
                left = 0;
            } else {
                left -= rest;
                f->next++;
                f->offset = 0;
            }
        }
        if ((size_t)sent < offered) return 0; /* the socket buffer is full: the poll says when it drained */
    }
}

static int enter(FrameWriter *self) {
    if (self->sock == NULL) {
        PyErr_SetString(PyExc_ValueError, "FrameWriter was not initialised");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "FrameWriter: a call started while another runs (its owner serialises them)");
        return -1;
    }
    self->busy = 1;
    return 0;
}

/* Hand `f`'s done callback to `finished` (a list) and drop the frame: 0, or -1. */
static int finish(frame *f, PyObject *finished) {
    int status = 0;
    if (f->done != NULL) status = PyList_Append(finished, f->done);
    Py_CLEAR(f->done);
    release_frame(f);
    return status;
}

/* --- methods ------------------------------------------------------------------------------- */

static PyObject *fw_send(FrameWriter *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"views", "done", "now", "finished", "ahead", "defer", NULL};
    PyObject *views, *done, *finished;
    double now;
    int ahead = 0, defer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOdO!|$pp:send", names, &views, &done, &now, &PyList_Type, &finished,
                                     &ahead, &defer))
        return NULL;
    if (enter(self) < 0) return NULL;
    frame f;
    memset(&f, 0, sizeof(f));
    if (done != Py_None) f.done = Py_NewRef(done);
    int callable = PyCallable_Check(views);
    if (self->count > 0 || defer) { /* queued: last, right behind the frame being written, or for the loop */
        int was_empty = self->count == 0;
        if (callable)
            f.make = Py_NewRef(views);
        else if (take_views(&f, views) < 0)
            goto fail;
        if (queue_insert(self, ahead && self->count > 0 ? 1 : self->count, &f) < 0) goto fail;
        if (was_empty) self->last_progress = now; /* a deferred frame waits from now: the stall clock */
        self->busy = 0;
        Py_RETURN_NONE;
    }
    if (callable) {
        f.make = Py_NewRef(views);
        if (make_views(&f) < 0) goto fail;
    } else if (take_views(&f, views) < 0) {
        goto fail;
    }
    int moved = 0;
    int out = write_frame(self, &f, &moved);
    if (out < 0) goto fail;
    self->last_send = now;
    if (out == 1) {
        if (finish(&f, finished) < 0) goto fail;
    } else {
        if (queue_insert(self, self->count, &f) < 0) goto fail;
        self->last_progress = now;
    }
    self->busy = 0;
    Py_RETURN_NONE;
fail:
    Py_CLEAR(f.done);
    release_frame(&f);
    self->busy = 0;
    return NULL;
}

static PyObject *fw_flush(FrameWriter *self, PyObject *args) {
    double now;
    PyObject *finished;
    if (!PyArg_ParseTuple(args, "dO!:flush", &now, &PyList_Type, &finished)) return NULL;
    if (enter(self) < 0) return NULL;
    while (self->count > 0) {
        frame *head = &self->queue[0];
        if (make_views(head) < 0) goto fail;
        int moved = 0;
        int out = write_frame(self, head, &moved);
        if (out < 0) goto fail;
        if (out == 0) {
            if (moved) self->last_progress = self->last_send = now;
            break;
        }
        frame f;
        queue_remove(self, 0, &f);
        self->last_progress = self->last_send = now;
        if (finish(&f, finished) < 0) goto fail;
    }
    self->busy = 0;
    Py_RETURN_NONE;
fail:
    self->busy = 0;
    return NULL;
}

/* Append (done, ok) to `callbacks` and drop the frame. */
static int hand_back(frame *f, PyObject *callbacks, int ok) {
    int status = 0;
    if (f->done != NULL) {
        PyObject *pair = Py_BuildValue("(OO)", f->done, ok ? Py_True : Py_False);
        status = pair == NULL ? -1 : PyList_Append(callbacks, pair);
        Py_XDECREF(pair);
    }
    Py_CLEAR(f->done);
    release_frame(f);
    return status;
}

static PyObject *fw_finish_frame(FrameWriter *self, PyObject *args) {
    double deadline;
    if (!PyArg_ParseTuple(args, "d:finish_frame", &deadline)) return NULL;
    if (enter(self) < 0) return NULL;
    PyObject *callbacks = PyList_New(0);
    int between = 0;
    if (callbacks == NULL) goto fail;
    while (self->count > 1) { /* the frames behind the one on the wire are dropped */
        frame f;
        queue_remove(self, 1, &f);
        if (hand_back(&f, callbacks, 0) < 0) goto fail;
    }
    if (self->count == 0) {
        between = 1;
        goto done;
    }
    frame *head = &self->queue[0];
    if (deadline - monotonic_now() <= 0) goto done;
    if (make_views(head) < 0) goto fail;
    for (;;) {
        int moved = 0;
        int out = write_frame(self, head, &moved);
        if (out < 0) {
            if (!PyErr_ExceptionMatches(connection_broken) && !PyErr_ExceptionMatches(PyExc_OSError)) goto fail;
            PyErr_Clear();
            goto done;
        }
        if (out == 1) {
            frame f;
            queue_remove(self, 0, &f);
            between = 1;
            if (hand_back(&f, callbacks, 1) < 0) goto fail;
            goto done;
        }
        double remaining = deadline - monotonic_now();
        if (remaining <= 0) goto done;
        int fd = socket_fd(self);
        if (fd == -2) goto fail;
        if (fd == -1) goto done;
        struct pollfd ready = {.fd = fd, .events = POLLOUT};
        int timeout_ms = remaining >= 3600.0 ? 3600 * 1000 : (int)(remaining * 1000.0) + 1;
        int polled, error;
        Py_BEGIN_ALLOW_THREADS
        polled = poll(&ready, 1, timeout_ms);
        error = errno;
        Py_END_ALLOW_THREADS
        if (polled < 0 && error == EINTR && PyErr_CheckSignals() < 0) goto fail;
    }
done:
    self->busy = 0;
    {
        PyObject *result = Py_BuildValue("(ON)", between ? Py_True : Py_False, callbacks);
        return result;
    }
fail:
    Py_XDECREF(callbacks);
    self->busy = 0;
    return NULL;
}

static PyObject *fw_abandon(FrameWriter *self, PyObject *Py_UNUSED(ignored)) {
    if (enter(self) < 0) return NULL;
    PyObject *leftovers = PyList_New(0);
    if (leftovers == NULL) {
        self->busy = 0;
        return NULL;
    }
    int status = 0;
    while (self->count > 0) {
        frame f;
        queue_remove(self, 0, &f);
        if (status == 0 && f.done != NULL) status = PyList_Append(leftovers, f.done);
        Py_CLEAR(f.done);
        release_frame(&f);
    }
    self->busy = 0;
    if (status < 0) Py_CLEAR(leftovers);
    return leftovers;
}

/* --- the type ------------------------------------------------------------------------------ */

static int fw_init(FrameWriter *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"sock", "now", NULL};
    PyObject *sock;
    double now;
    if (self->sock != NULL) {
        PyErr_SetString(PyExc_TypeError, "FrameWriter is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Od:FrameWriter", names, &sock, &now)) return -1;
    if (connection_broken == NULL) { /* transport imports nothing of the plane's, so it loads here */
        PyObject *transport = PyImport_ImportModule("redsrv.core.transport");
        if (transport == NULL) return -1;
        connection_broken = PyObject_GetAttrString(transport, "ConnectionBroken");
        peer_name_of = connection_broken ? PyObject_GetAttrString(transport, "peer_name") : NULL;
        Py_DECREF(transport);
        if (peer_name_of == NULL) {
            Py_CLEAR(connection_broken);
            return -1;
        }
    }
    PyObject *peer = PyObject_CallOneArg(peer_name_of, sock);
    if (peer == NULL) return -1;
    self->sock = Py_NewRef(sock);
    self->peer = peer;
    self->last_send = self->last_progress = now;
    return 0;
}

static void drop_queue(FrameWriter *self) {
    while (self->count > 0) {
        frame f;
        queue_remove(self, self->count - 1, &f);
        Py_CLEAR(f.done);
        release_frame(&f);
    }
}

static int fw_traverse(FrameWriter *self, visitproc visit, void *arg) {
    Py_VISIT(self->sock);
    Py_VISIT(self->peer);
    for (Py_ssize_t i = 0; i < self->count; i++) {
        frame *f = &self->queue[i];
        Py_VISIT(f->make);
        Py_VISIT(f->done);
        for (Py_ssize_t j = 0; j < f->nviews; j++) Py_VISIT(f->views[j].obj);
    }
    return 0;
}

static int fw_clear(FrameWriter *self) {
    drop_queue(self);
    Py_CLEAR(self->sock);
    Py_CLEAR(self->peer);
    return 0;
}

static void fw_dealloc(FrameWriter *self) {
    PyObject_GC_UnTrack(self);
    fw_clear(self);
    PyMem_Free(self->queue);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fw_get_out(FrameWriter *self, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(self->count); }

static PyMethodDef fw_methods[] = {
    {"send", (PyCFunction)(void (*)(void))fw_send, METH_VARARGS | METH_KEYWORDS,
     "send(views, done, now, finished, *, ahead=False, defer=False)\n\n"
     "Write a frame now if nothing is queued ahead of it, else queue it (transport.FrameWriter.send)."},
    {"flush", (PyCFunction)fw_flush, METH_VARARGS,
     "flush(now, finished)\n\nWrite queued frames until the socket is full or nothing is left."},
    {"finish_frame", (PyCFunction)fw_finish_frame, METH_VARARGS,
     "finish_frame(deadline) -> (between, [(done, ok), ...])\n\n"
     "Write the rest of the frame being written until deadline at most and drop the frames behind it."},
    {"abandon", (PyCFunction)fw_abandon, METH_NOARGS,
     "abandon() -> [done, ...]\n\nThe connection is gone: the done callbacks of everything still queued."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef fw_members[] = {
    {"sock", T_OBJECT, offsetof(FrameWriter, sock), READONLY, "the connection's socket"},
    {"peer", T_OBJECT, offsetof(FrameWriter, peer), READONLY, "the peer's address, for messages"},
    {"last_send", T_DOUBLE, offsetof(FrameWriter, last_send), 0, "the last time anything was written"},
    {"last_progress", T_DOUBLE, offsetof(FrameWriter, last_progress), 0, "the last time a queued frame moved"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef fw_getset[] = {
    {"out", (getter)fw_get_out, NULL, "how many frames wait: true while any does, as the reference's deque", NULL},
    {"queued", (getter)fw_get_out, NULL, "how many frames wait (the frame being written first)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FrameWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "redsrv.core._plane.FrameWriter",
    .tp_basicsize = sizeof(FrameWriter),
    .tp_dealloc = (destructor)fw_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)fw_traverse,
    .tp_clear = (inquiry)fw_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "FrameWriter(sock, now): the write side of a non-blocking connection in C (transport.FrameWriter's twin).",
    .tp_methods = fw_methods,
    .tp_members = fw_members,
    .tp_getset = fw_getset,
    .tp_init = (initproc)fw_init,
    .tp_new = PyType_GenericNew,
};

int writer_init_module(PyObject *module) {
    fileno_name = PyUnicode_InternFromString("fileno");
    if (fileno_name == NULL || PyType_Ready(&FrameWriterType) < 0) return -1;
    return PyModule_AddObjectRef(module, "FrameWriter", (PyObject *)&FrameWriterType);
}
