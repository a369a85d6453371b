/* The frame parser (native/frames.c), part of the redsrv.core._plane module. */
#ifndef REDSRV_FRAMES_H
#define REDSRV_FRAMES_H

#include <Python.h>
#include <stdint.h>

/* Reads the parser's tables from core/wire.py and adds parse_prefix and parse_header to
 * `module`; 0, or -1 with an exception set. */
int frames_init(PyObject *module);

/* With an exception set by a failed init of `who`: turn it into an ImportError that names it. */
void frames_as_import_error(const char *who);

/* parse_header's FrameHeader for a frame of type `code` whose header, of frames_header_size(code)
 * bytes, is at `header`; NULL with the rules' RemoteProtocolError (or another error) set. */
PyObject *frames_header(int code, const unsigned char *header, uint64_t payload_len);

/* The header size of frame type `code`, -1 for no such type. */
Py_ssize_t frames_header_size(int code);

/* The error set is the rules' RemoteProtocolError. */
int frames_is_protocol_error(void);

#endif
