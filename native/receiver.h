/* The result receiver (native/receiver.c), part of the redsrv.core._plane module. */
#ifndef REDSRV_RECEIVER_H
#define REDSRV_RECEIVER_H

#include <Python.h>

/* Reads what it checks from core/wire.py and adds ResultSlot, ResultReceiver and the RECEIVE_*
 * outcomes to `module`; 0, or -1 with an ImportError set. */
int receiver_init_module(PyObject *module);

#endif
