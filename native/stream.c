/* The socket side of redsrv.core._plane's receivers (native/stream.h). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "frames.h"
#include "stream.h"

unsigned char stream_magic[4];
unsigned stream_version;
Py_ssize_t stream_read_ahead;

int stream_init_module(PyObject *module) {
    PyObject *wire = PyImport_ImportModule("redsrv.core.wire");
    PyObject *constants = PyImport_ImportModule("redsrv.core.constants");
    PyObject *magic = constants ? PyObject_GetAttrString(constants, "MAGIC") : NULL;
    PyObject *version = constants ? PyObject_GetAttrString(constants, "PROTOCOL_VERSION") : NULL;
    PyObject *ahead = wire ? PyObject_GetAttrString(wire, "READ_AHEAD_BYTES") : NULL;
    int status = -1;
    if (magic == NULL || version == NULL || ahead == NULL) goto done;
    long v = PyLong_AsLong(version);
    stream_read_ahead = PyLong_AsSsize_t(ahead);
    if (PyErr_Occurred()) goto done;
    /* The read-ahead holds any prefix and header a receiver takes (the largest, a PUSH's, is under 64 bytes). */
    if (!PyBytes_Check(magic) || PyBytes_GET_SIZE(magic) != 4 || v < 0 || v > 255 || stream_read_ahead < 256
        || stream_read_ahead > (1 << 20)) {
        PyErr_SetString(PyExc_ImportError,
                        "wire's magic, protocol version or read-ahead changed: update native/stream.c");
        goto done;
    }
    memcpy(stream_magic, PyBytes_AS_STRING(magic), 4);
    stream_version = (unsigned)v;
    if (PyModule_AddIntConstant(module, "RECEIVE_DRAINED", DRAINED) < 0
        || PyModule_AddIntConstant(module, "RECEIVE_LIMIT", LIMIT) < 0
        || PyModule_AddIntConstant(module, "RECEIVE_HANDOFF", HANDOFF) < 0
        || PyModule_AddIntConstant(module, "RECEIVE_CLOSED", CLOSED) < 0
        || PyModule_AddIntConstant(module, "RECEIVE_FAILED", FAILED) < 0)
        goto done;
    status = 0;
done:
    if (status < 0) frames_as_import_error("the receivers' reading");
    Py_XDECREF(wire);
    Py_XDECREF(constants);
    Py_XDECREF(magic);
    Py_XDECREF(version);
    Py_XDECREF(ahead);
    return status;
}

int stream_prefix_is_ours(const unsigned char *p) {
    return memcmp(p, stream_magic, 4) == 0 && p[4] == stream_version;
}

uint64_t read_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

int stream_open(stream_in *in, int fd, Py_ssize_t capacity, uint64_t max_lowat) {
    in->ahead = PyMem_Malloc((size_t)capacity);
    if (in->ahead == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    in->fd = fd;
    in->capacity = capacity;
    in->at = in->end = 0;
    in->max_lowat = max_lowat;
    in->lowat = 1;
    return 0;
}

void stream_close(stream_in *in) {
    PyMem_Free(in->ahead);
    in->ahead = NULL;
    in->at = in->end = 0;
}

Py_ssize_t stream_recv(stream_in *in, void *into, size_t want) {
    ssize_t got;
    int err = 0;
    do {
        Py_BEGIN_ALLOW_THREADS
        got = recv(in->fd, into, want, MSG_DONTWAIT);
        err = errno;
        Py_END_ALLOW_THREADS
    } while (got < 0 && err == EINTR);
    if (got < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK) return -1;
        in->error = err;
        return -2;
    }
    if (got > 0) in->received = 1;
    return (Py_ssize_t)got;
}

int stream_set_lowat(stream_in *in, uint64_t nbytes) {
    int value = nbytes > in->max_lowat ? (int)in->max_lowat : (int)nbytes;
    if (value < 1) value = 1;
    if (value != in->lowat) {
        if (setsockopt(in->fd, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof value) < 0) {
            in->error = errno;
            return -1;
        }
        in->lowat = value;
    }
    return 0;
}

int stream_hold(stream_in *in, Py_ssize_t need) {
    while (in->end - in->at < need) {
        if (in->at) { /* keep the frame's start at the front: the buffer's room is for what follows */
            memmove(in->ahead, in->ahead + in->at, (size_t)(in->end - in->at));
            in->end -= in->at;
            in->at = 0;
        }
        Py_ssize_t room = in->capacity - in->end;
        Py_ssize_t got = stream_recv(in, in->ahead + in->end, (size_t)room);
        if (got == -1) return 0;
        if (got == -2) return FAILED;
        if (got == 0) return CLOSED;
        in->end += got;
        /* A short read drained the socket: the poll wakes the loop for the rest, so another recv
         * now would only return EAGAIN. */
        if (got < room && in->end - in->at < need) return 0;
    }
    return 1;
}

void stream_consume(stream_in *in, Py_ssize_t n) {
    in->at += n;
    if (in->at == in->end) in->at = in->end = 0;
}

int stream_hold_frame(stream_in *in, Py_ssize_t (*size_of)(const unsigned char *prefix, const void *receiver),
                      const void *receiver, Py_ssize_t *header_size) {
    int held = stream_hold(in, STREAM_PREFIX_SIZE);
    if (held != 1) return held;
    Py_ssize_t size = size_of(in->ahead + in->at, receiver);
    if (size < 0) return HANDOFF;
    held = stream_hold(in, STREAM_PREFIX_SIZE + size);
    if (held != 1) return held;
    *header_size = size;
    return 1;
}

int stream_take(stream_in *in, unsigned char *into, uint64_t want, uint64_t *moved) {
    uint64_t done = 0;
    Py_ssize_t have = in->end - in->at;
    if (have > 0 && want) {
        done = (uint64_t)have < want ? (uint64_t)have : want;
        memcpy(into, in->ahead + in->at, (size_t)done);
        stream_consume(in, (Py_ssize_t)done);
    }
    *moved = done;
    if (done == want) return 1;
    Py_ssize_t got = stream_recv(in, into + done, (size_t)(want - done));
    if (got == -1) return DRAINED;
    if (got == -2) return FAILED;
    if (got == 0) return CLOSED;
    *moved = done + (uint64_t)got;
    return *moved == want ? 1 : DRAINED;
}

static PyObject *frame_type(PyObject *wire, const char *name) {
    PyObject *types = PyObject_GetAttrString(wire, "FrameType");
    PyObject *member = types ? PyObject_GetAttrString(types, name) : NULL;
    Py_XDECREF(types);
    return member;
}

int stream_frame_code(PyObject *wire, const char *name, unsigned *out) {
    PyObject *member = frame_type(wire, name);
    PyObject *value = member ? PyObject_GetAttrString(member, "value") : NULL;
    long v = value ? PyLong_AsLong(value) : -1;
    Py_XDECREF(member);
    Py_XDECREF(value);
    if (v < 0 || v > 255) return -1;
    *out = (unsigned)v;
    return 0;
}

int stream_header_format_is(PyObject *wire, const char *name, const char *format) {
    PyObject *structs = PyObject_GetAttrString(wire, "_HEADER_STRUCTS");
    PyObject *member = frame_type(wire, name);
    PyObject *packer = structs && member && PyDict_Check(structs) ? PyDict_GetItemWithError(structs, member) : NULL;
    PyObject *got = packer ? PyObject_GetAttrString(packer, "format") : NULL;
    int same = got != NULL && PyUnicode_Check(got) && PyUnicode_CompareWithASCIIString(got, format) == 0;
    Py_XDECREF(structs);
    Py_XDECREF(member);
    Py_XDECREF(got);
    return same;
}
