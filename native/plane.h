/* The element-wise loops of native/plane.c, for the module's other files. */
#ifndef REDSRV_PLANE_H
#define REDSRV_PLANE_H

#include <Python.h>

typedef void (*combine_fn)(void *, const void *, Py_ssize_t);

/* The loop for acc = op(acc, piece) on one wire dtype (core/wire.py's codes), or NULL where the
 * reference must answer; and that dtype's size in bytes (0: unknown). */
combine_fn plane_pick_combine(int op, int kind);
Py_ssize_t plane_itemsize(int kind);

#endif
