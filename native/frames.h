/* The frame parser (native/frames.c), part of the redsrv.core._plane module. */
#ifndef REDSRV_FRAMES_H
#define REDSRV_FRAMES_H

#include <Python.h>

/* Reads the parser's tables from core/wire.py and adds parse_prefix and parse_header to
 * `module`; 0, or -1 with an exception set. */
int frames_init(PyObject *module);

/* With an exception set by a failed init of `who`: turn it into an ImportError that names it. */
void frames_as_import_error(const char *who);

#endif
