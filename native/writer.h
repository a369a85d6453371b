/* The frame writer (native/writer.c), part of the redsrv.core._plane module. */
#ifndef REDSRV_WRITER_H
#define REDSRV_WRITER_H

#include <Python.h>

/* Adds FrameWriter to `module`: 0, or -1 with an exception set. */
int writer_init_module(PyObject *module);

#endif
