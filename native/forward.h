/* The forwarder (native/forward.c), part of the redsrv.core._plane module. */
#ifndef REDSRV_FORWARD_H
#define REDSRV_FORWARD_H

#include <Python.h>

/* Adds Forwarder to `module`: 0, or -1 with an exception set. */
int forward_init_module(PyObject *module);

/* `obj` is a Forwarder. */
int forward_check(PyObject *obj);

/* The push receiver landed rank `rank`'s payload up to `end` (a pointer into memory the receiver
 * was handed): if that is inside the rank's buffer, the forwarder takes the rank's bytes as in up
 * to there and sends every piece that is due. 0, or -1 with an exception set (a bug, not a peer's
 * doing: a write that fails is the target connection's, and is told to its owner). */
int forward_landed_at(PyObject *forwarder, int rank, const char *end);

#endif
