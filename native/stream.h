/* What both native receivers (receiver.c, pushes.c) do with a data connection's socket: read
 * ahead into a fixed buffer, receive with the GIL released, keep FrameReader's low-water mark.
 * Part of the redsrv.core._plane module. */
#ifndef REDSRV_STREAM_H
#define REDSRV_STREAM_H

#include <Python.h>
#include <stdint.h>

#define STREAM_PREFIX_SIZE 12      /* wire.PREFIX: magic, version, type, header_len, payload_len */
#define STREAM_LOWAT_FROM (64 * 1024) /* transport._LOWAT_FROM: payloads from this size wake once */

/* receive() outcomes, the module's RECEIVE_* constants (transport.ReceiverOutcome) */
enum { DRAINED = 0, LIMIT = 1, HANDOFF = 2, CLOSED = 3, FAILED = 4 };

typedef struct {
    int fd;
    unsigned char *ahead;   /* bytes read ahead: [at, end) not yet consumed; `capacity` bytes */
    Py_ssize_t at, end, capacity;
    uint64_t max_lowat;     /* FrameReader.max_lowat */
    int lowat;              /* SO_RCVLOWAT as last set */
    int received;           /* a byte arrived since the owner cleared it */
    int error;              /* errno of the last failure */
} stream_in;

/* What every receiver checks a prefix against and how much it reads ahead: constants.MAGIC,
 * constants.PROTOCOL_VERSION and wire.READ_AHEAD_BYTES, read by stream_init_module. */
extern unsigned char stream_magic[4];
extern unsigned stream_version;
extern Py_ssize_t stream_read_ahead;

/* Reads those and adds the RECEIVE_* outcomes to `module`: 0, or -1 with an ImportError set.
 * Runs before the receivers' inits. */
int stream_init_module(PyObject *module);

/* The prefix at `p` carries redsrv's magic and protocol version. */
int stream_prefix_is_ours(const unsigned char *p);

/* A little-endian unsigned integer of n bytes. */
uint64_t read_le(const unsigned char *p, int n);

/* Set up `in` for `fd` with a read-ahead buffer of `capacity` bytes: 0, or -1 with MemoryError. */
int stream_open(stream_in *in, int fd, Py_ssize_t capacity, uint64_t max_lowat);

/* Free the read-ahead buffer (receive then refuses to run: ahead is NULL). */
void stream_close(stream_in *in);

/* recv() without the GIL: > 0 bytes, 0 end of stream, -1 nothing there, -2 an error (in->error). */
Py_ssize_t stream_recv(stream_in *in, void *into, size_t want);

/* SO_RCVLOWAT to `nbytes`, within 1..max_lowat, if it changes: 0, or -1 (in->error). */
int stream_set_lowat(stream_in *in, uint64_t nbytes);

/* Read ahead until `need` bytes of the frame's start are held: 1, 0 (the socket is drained: a
 * short read counts, as FrameReader.read takes it), CLOSED or FAILED. */
int stream_hold(stream_in *in, Py_ssize_t need);

/* `n` held bytes are used. */
void stream_consume(stream_in *in, Py_ssize_t n);

/* The next frame's prefix and header are held: 1 with *header_size set. Else DRAINED, CLOSED,
 * FAILED, or HANDOFF where `size_of` (from the held prefix: the header size of a frame the
 * receiver takes, -1 for one it does not) refuses the frame. */
int stream_hold_frame(stream_in *in, Py_ssize_t (*size_of)(const unsigned char *prefix, const void *receiver),
                      const void *receiver, Py_ssize_t *header_size);

/* Move up to `want` bytes into `into`, what was read ahead first, then with one recv; *moved says
 * how many. 1 when all `want` came, DRAINED when the socket holds no more for now (a short read,
 * or EAGAIN), CLOSED or FAILED. */
int stream_take(stream_in *in, unsigned char *into, uint64_t want, uint64_t *moved);

/* At init: the value of wire.FrameType.<name> in *out (0), or -1. */
int stream_frame_code(PyObject *wire, const char *name, unsigned *out);

/* At init: wire._HEADER_STRUCTS[FrameType.<name>].format is `format` (the positions a receiver
 * reads): 1 or 0. */
int stream_header_format_is(PyObject *wire, const char *name, const char *format);

#endif
