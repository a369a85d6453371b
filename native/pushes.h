/* The push receiver (native/pushes.c), part of the redsrv.core._plane module. */
#ifndef REDSRV_PUSHES_H
#define REDSRV_PUSHES_H

#include <Python.h>

/* Reads what it checks from core/wire.py and adds PushReceiver to `module`; 0, or -1 with an
 * ImportError set. Runs after frames_init, whose tables it uses. */
int pushes_init_module(PyObject *module);

#endif
