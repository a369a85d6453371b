/* redsrv.core._plane's frame parser: core/wire.py's parse_prefix and parse_header in C.
 *
 * The Python functions are the reference and the test oracle: for the same bytes these return
 * equal values (the same FrameType members, FrameHeader objects and field tuples) and raise the
 * same RemoteProtocolError with the same message (tests/unit/test_wire_fuzz.py feeds both
 * decoders the same streams under Hypothesis). The decoder's state machine stays in Python
 * (wire.FrameDecoder); it calls these where the native plane is selected.
 *
 * Little is declared twice: the header layouts are read from wire's struct formats, the enums,
 * dtype names and sizes from wire's tables, the bounds from core/constants.py, all once, at
 * import; only the positions of the fields the rules read are written here, as in parse_header,
 * and the import refuses headers whose sizes differ from the ones they assume. Every number from
 * the wire is checked against a bound before the caller sizes anything with it, in integer types
 * that cannot overflow: the widest sum (a push's offset plus its count) is compared as a
 * difference instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "frames.h"

#define PREFIX_SIZE 12
#define MAX_FIELDS 16
#define MAX_LAYOUT 32

/* A frame type's header: wire._HEADER_STRUCTS' format without its "<" (x, B, H, I, Q, Ns). */
typedef struct {
    PyObject *member; /* the FrameType member; NULL: no such type */
    PyObject *name;   /* its name, for messages */
    char layout[MAX_LAYOUT];
    Py_ssize_t size;
} frame_kind;

static frame_kind kinds[256];
static PyObject *op_names[256];     /* ReduceOp names; NULL: unknown op */
static int op_bitwise[256];         /* in wire.BITWISE_OPS */
static PyObject *dtype_names[256];  /* str(numpy dtype); NULL: unknown dtype */
static uint64_t dtype_sizes[256];
static int dtype_integer[256];      /* in wire.INTEGER_DTYPES */
static int mode_known[256];         /* StragglerMode values */
static int error_known[256];        /* ErrorCode values */
static int k_hello, k_push, k_result, k_error, op_broadcast;

/* A code from the wire indexes a table only through this (every such field is a byte today). */
#define IN(table, code) ((code) < 256 && (table)[code])

static PyObject *header_type;    /* wire.FrameHeader */
static PyObject *protocol_error; /* errors.RemoteProtocolError */
static PyObject *struct_error;   /* struct.error: what the reference raises for a buffer of the wrong size */
static PyObject *magic;          /* constants.MAGIC */
static long protocol_version;
static uint64_t max_world_size, max_job_id_bytes, max_error_message_bytes;
static PyObject *default_max_payload;
static PyObject *str_type, *str_payload_len, *str_fields;

static uint64_t read_le(const unsigned char *p, int n) {
    uint64_t value = 0;
    for (int i = n - 1; i >= 0; i--) value = value << 8 | p[i];
    return value;
}

static PyObject *fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (message != NULL) {
        PyErr_SetObject(protocol_error, message);
        Py_DECREF(message);
    }
    return NULL;
}

/* The buffer of `obj`, which must be `size` bytes long (struct.unpack's rule and message). */
static int take(PyObject *obj, Py_buffer *view, Py_ssize_t size) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len != size) {
        PyErr_Format(struct_error, "unpack requires a buffer of %zd bytes", size);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* parse_prefix(data, max_payload=DEFAULT_MAX_FRAME_PAYLOAD) -> (FrameType, header_len, payload_len) */
static PyObject *frames_parse_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "parse_prefix() takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *max_payload = nargs == 2 ? args[1] : default_max_payload;
    int above = 0; /* max_payload beyond a long long: -1 below every length, +1 above */
    long long cap = PyLong_AsLongLongAndOverflow(max_payload, &above);
    if (cap == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (take(args[0], &view, PREFIX_SIZE) < 0) return NULL;
    const unsigned char *p = view.buf;
    PyObject *result = NULL;
    if (memcmp(p, PyBytes_AS_STRING(magic), 4) != 0) {
        PyObject *got = PyBytes_FromStringAndSize((const char *)p, 4);
        if (got != NULL) {
            fail("bad magic %R (expected %R): not a redsrv peer", got, magic);
            Py_DECREF(got);
        }
        goto done;
    }
    unsigned version = p[4], code = p[5];
    uint64_t header_len = read_le(p + 6, 2), payload_len = read_le(p + 8, 4);
    const frame_kind *kind = &kinds[code];
    if (version != (unsigned long)protocol_version)
        fail("unsupported protocol version %u (this build speaks %ld)", version, protocol_version);
    else if (kind->member == NULL)
        fail("unknown frame type %u", code);
    else if (header_len != (uint64_t)kind->size)
        fail("%U header is %llu bytes, expected %zd", kind->name, (unsigned long long)header_len, kind->size);
    else if (above < 0 || (above == 0 && (long long)payload_len > cap))
        fail("%U payload of %llu bytes exceeds the cap of %S", kind->name, (unsigned long long)payload_len, max_payload);
    else
        result = Py_BuildValue("(OKK)", kind->member, (unsigned long long)header_len, (unsigned long long)payload_len);
done:
    PyBuffer_Release(&view);
    return result;
}

/* The fields of `kind`'s header at `p`: integers into `ints`, the start of each byte string into
 * `strings`; returns how many. The layouts were checked at import. */
static int read_fields(const frame_kind *kind, const unsigned char *p, uint64_t *ints, const unsigned char **strings,
                       int *lengths) {
    int n = 0;
    for (const char *c = kind->layout; *c; c++) {
        int count = 0;
        while (*c >= '0' && *c <= '9') count = count * 10 + (*c++ - '0');
        if (!count) count = 1;
        switch (*c) {
        case 'x': p += count; break;
        case 's': strings[n] = p; lengths[n] = count; ints[n++] = 0; p += count; break;
        default: {
            int width = *c == 'B' ? 1 : *c == 'H' ? 2 : *c == 'I' ? 4 : 8;
            for (int i = 0; i < count; i++, p += width) {
                strings[n] = NULL;
                ints[n++] = read_le(p, width);
            }
        }
        }
    }
    return n;
}

/* The type's own rules, the reference's checks in its order; 0, or -1 with the error set. */
static int check_header(int code, const uint64_t *f, uint64_t payload_len) {
    if (code == k_push) {
        /* key, incarnation, total, offset, count, chunk, dtype, op, root */
        uint64_t total = f[2], offset = f[3], count = f[4], dtype = f[6], op = f[7];
        if (!IN(dtype_names, dtype)) return fail("unknown dtype %llu", (unsigned long long)dtype), -1;
        if (!IN(op_names, op)) return fail("unknown op %llu", (unsigned long long)op), -1;
        if (op_bitwise[op] && !dtype_integer[dtype])
            return fail("push asks for %U of %U: bitwise ops need integer or bool data", op_names[op], dtype_names[dtype]), -1;
        if (count > total || offset > total - count) {
            /* offset + count may not fit in 64 bits: the message adds them as Python does. */
            PyObject *a = PyLong_FromUnsignedLongLong(offset), *b = PyLong_FromUnsignedLongLong(count);
            PyObject *end = a != NULL && b != NULL ? PyNumber_Add(a, b) : NULL;
            if (end != NULL)
                fail("push covers [%llu, %S) beyond the total of %llu elements", (unsigned long long)offset, end,
                     (unsigned long long)total);
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_XDECREF(end);
            return -1;
        }
        uint64_t expected = count * dtype_sizes[dtype]; /* count < 2^32, itemsize <= 8 */
        if (payload_len != expected && !(op == (uint64_t)op_broadcast && payload_len == 0))
            return fail("push payload is %llu bytes but %llu x %U needs %llu", (unsigned long long)payload_len,
                        (unsigned long long)count, dtype_names[dtype], (unsigned long long)expected), -1;
    } else if (code == k_result) {
        /* key, offset, count, chunk, dtype, contributors, bitmap_len */
        uint64_t count = f[2], dtype = f[4], bitmap_len = f[6];
        if (!IN(dtype_names, dtype)) return fail("unknown dtype %llu", (unsigned long long)dtype), -1;
        if (bitmap_len > (max_world_size + 7) / 8)
            return fail("result bitmap of %llu bytes is larger than any job", (unsigned long long)bitmap_len), -1;
        uint64_t expected = bitmap_len + count * dtype_sizes[dtype];
        if (payload_len != expected)
            return fail("result payload is %llu bytes, expected %llu", (unsigned long long)payload_len,
                        (unsigned long long)expected), -1;
    } else if (code == k_hello) {
        /* rank, world_size, mode, ... */
        uint64_t rank = f[0], world_size = f[1], mode = f[2];
        if (!IN(mode_known, mode)) return fail("unknown straggler mode %llu", (unsigned long long)mode), -1;
        if (world_size == 0 || world_size > max_world_size || rank >= world_size)
            return fail("rank %llu / world_size %llu out of range", (unsigned long long)rank,
                        (unsigned long long)world_size), -1;
        if (payload_len == 0 || payload_len > max_job_id_bytes)
            return fail("job id of %llu bytes (allowed 1..%llu)", (unsigned long long)payload_len,
                        (unsigned long long)max_job_id_bytes), -1;
    } else if (code == k_error) {
        /* code, fatal, key, chunk */
        if (!IN(error_known, f[0])) return fail("unknown error code %llu", (unsigned long long)f[0]), -1;
        if (payload_len > max_error_message_bytes)
            return fail("error message of %llu bytes exceeds %llu", (unsigned long long)payload_len,
                        (unsigned long long)max_error_message_bytes), -1;
    } else if (payload_len != 0) {
        return fail("%U frames carry no payload, got %llu bytes", kinds[code].name, (unsigned long long)payload_len), -1;
    }
    return 0;
}

/* The FrameHeader of a frame of type `code` whose header (of that type's size) is at `p`, or NULL
 * with the rules' RemoteProtocolError (or an allocation failure) set. */
static PyObject *build_header(int code, const unsigned char *p, uint64_t payload_len) {
    const frame_kind *kind = &kinds[code];
    uint64_t ints[MAX_FIELDS];
    const unsigned char *strings[MAX_FIELDS];
    int lengths[MAX_FIELDS];
    int n = read_fields(kind, p, ints, strings, lengths);
    PyObject *fields = NULL, *header = NULL;
    if (check_header(code, ints, payload_len) < 0) return NULL;
    if ((fields = PyTuple_New(n)) == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *item = strings[i] != NULL ? PyBytes_FromStringAndSize((const char *)strings[i], lengths[i])
                                            : PyLong_FromUnsignedLongLong(ints[i]);
        if (item == NULL) goto done;
        PyTuple_SET_ITEM(fields, i, item);
    }
    /* FrameHeader is a frozen dataclass: its own __init__ sets each field with object.__setattr__,
     * which is what PyObject_GenericSetAttr is. Running that __init__ would cost more than the
     * whole parse. */
    PyTypeObject *type = (PyTypeObject *)header_type;
    PyObject *no_args = PyTuple_New(0);
    if (no_args == NULL) goto done;
    header = type->tp_new(type, no_args, NULL);
    Py_DECREF(no_args);
    if (header == NULL) goto done;
    PyObject *length = PyLong_FromUnsignedLongLong(payload_len);
    int failed = length == NULL || PyObject_GenericSetAttr(header, str_type, kind->member) < 0
                 || PyObject_GenericSetAttr(header, str_payload_len, length) < 0
                 || PyObject_GenericSetAttr(header, str_fields, fields) < 0;
    Py_XDECREF(length);
    if (failed) Py_CLEAR(header);
done:
    Py_XDECREF(fields);
    return header;
}

PyObject *frames_header(int code, const unsigned char *header, uint64_t payload_len) {
    if (code < 0 || code > 255 || kinds[code].member == NULL) {
        PyErr_Format(PyExc_ValueError, "frames_header() of frame type %d, which does not exist", code);
        return NULL;
    }
    return build_header(code, header, payload_len);
}

Py_ssize_t frames_header_size(int code) {
    return code < 0 || code > 255 || kinds[code].member == NULL ? -1 : kinds[code].size;
}

int frames_is_protocol_error(void) { return PyErr_ExceptionMatches(protocol_error); }

/* parse_header(frame_type, header, payload_len) -> FrameHeader */
static PyObject *frames_parse_header(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "parse_header() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    /* The type and length come from parse_prefix; anything else is the caller's mistake. */
    long code = PyLong_AsLong(args[0]);
    if (code == -1 && PyErr_Occurred()) return NULL;
    if (code < 0 || code > 255 || kinds[code].member == NULL) {
        PyErr_Format(PyExc_ValueError, "parse_header() of frame type %ld, which does not exist", code);
        return NULL;
    }
    unsigned long long payload_len = PyLong_AsUnsignedLongLong(args[2]);
    if (payload_len == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (take(args[1], &view, kinds[code].size) < 0) return NULL;
    PyObject *header = build_header((int)code, view.buf, payload_len);
    PyBuffer_Release(&view);
    return header;
}

static PyMethodDef frames_methods[] = {
    {"parse_prefix", (PyCFunction)(void (*)(void))frames_parse_prefix, METH_FASTCALL,
     "parse_prefix(data, max_payload=DEFAULT_MAX_FRAME_PAYLOAD) -> (FrameType, header_len, payload_len)\n\n"
     "wire.parse_prefix in C: the same values and the same RemoteProtocolError."},
    {"parse_header", (PyCFunction)(void (*)(void))frames_parse_header, METH_FASTCALL,
     "parse_header(frame_type, header, payload_len) -> FrameHeader\n\n"
     "wire.parse_header in C: the same values and the same RemoteProtocolError."},
    {NULL, NULL, 0, NULL},
};

/* --- the tables, read from core/wire.py and core/constants.py once ------------------------- */

static PyObject *attr(PyObject *obj, const char *name) { return PyObject_GetAttrString(obj, name); }

static int get_u64(PyObject *module, const char *name, uint64_t *out) {
    PyObject *value = attr(module, name);
    if (value == NULL) return -1;
    *out = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    return PyErr_Occurred() ? -1 : 0;
}

/* For each member of the enum wire.`name`: its value, checked to fit a byte, and the member. */
typedef int (*member_fn)(long value, PyObject *member);

static int each_member(PyObject *wire, const char *name, member_fn fn) {
    PyObject *cls = attr(wire, name), *members = cls ? PySequence_List(cls) : NULL;
    Py_XDECREF(cls);
    if (members == NULL) return -1;
    int status = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(members) && status == 0; i++) {
        PyObject *member = PyList_GET_ITEM(members, i);
        long value = PyLong_AsLong(member);
        if (value == -1 && PyErr_Occurred()) status = -1;
        else if (value < 0 || value > 255) {
            PyErr_Format(PyExc_ImportError, "wire.%s.%S = %ld does not fit the parser's tables", name, member, value);
            status = -1;
        } else status = fn(value, member);
    }
    Py_DECREF(members);
    return status;
}

static PyObject *header_structs; /* wire._HEADER_STRUCTS while the tables are read */

static int add_frame_type(long value, PyObject *member) {
    frame_kind *kind = &kinds[value];
    PyObject *st = PyDict_GetItemWithError(header_structs, member); /* borrowed */
    PyObject *format = st ? attr(st, "format") : NULL, *size = st ? attr(st, "size") : NULL;
    int status = -1;
    const char *text = format ? PyUnicode_AsUTF8(format) : NULL;
    if (text != NULL && size != NULL) {
        /* Little-endian, no alignment, only the codes read_fields knows, at most MAX_FIELDS. */
        Py_ssize_t computed = 0, fields = 0, count = 0;
        int ok = text[0] == '<' && strlen(text) < MAX_LAYOUT;
        for (const char *c = text + 1; ok && *c; c++) {
            if (*c >= '0' && *c <= '9') { count = count * 10 + (*c - '0'); continue; }
            Py_ssize_t times = count ? count : 1, width = *c == 'B' || *c == 'x' || *c == 's' ? 1 : *c == 'H' ? 2
                                                          : *c == 'I' ? 4 : *c == 'Q' ? 8 : 0;
            ok = width != 0;
            computed += times * width;
            fields += *c == 'x' ? 0 : *c == 's' ? 1 : times;
            count = 0;
        }
        if (ok && count == 0 && fields <= MAX_FIELDS && computed == PyLong_AsSsize_t(size)) {
            strcpy(kind->layout, text + 1);
            kind->size = computed;
            kind->name = attr(member, "name");
            Py_INCREF(member);
            kind->member = member;
            status = kind->name ? 0 : -1;
        } else if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ImportError, "the parser cannot read %S's header format %R", member, format);
        }
    } else if (!PyErr_Occurred()) {
        PyErr_Format(PyExc_ImportError, "no header format for %S", member);
    }
    Py_XDECREF(format);
    Py_XDECREF(size);
    return status;
}

static int add_op(long value, PyObject *member) { return (op_names[value] = attr(member, "name")) ? 0 : -1; }
static int add_mode(long value, PyObject *member) { return mode_known[value] = 1, 0; }
static int add_error(long value, PyObject *member) { return error_known[value] = 1, 0; }

/* Sets `flags[value]` for every member of the set wire.`name`. */
static int mark(PyObject *wire, const char *name, int *flags) {
    PyObject *set = attr(wire, name), *list = set ? PySequence_List(set) : NULL;
    Py_XDECREF(set);
    if (list == NULL) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        long value = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (value >= 0 && value <= 255) flags[value] = 1;
    }
    Py_DECREF(list);
    return PyErr_Occurred() ? -1 : 0;
}

static long member_value(PyObject *wire, const char *cls_name, const char *name) {
    PyObject *cls = attr(wire, cls_name), *member = cls ? attr(cls, name) : NULL;
    long value = member ? PyLong_AsLong(member) : -1;
    Py_XDECREF(cls);
    Py_XDECREF(member);
    return value;
}

static int load_dtypes(PyObject *wire) {
    PyObject *table = attr(wire, "NUMPY_DTYPE_BY_CODE");
    if (table == NULL) return -1;
    PyObject *key, *dtype;
    Py_ssize_t pos = 0;
    int status = 0;
    while (status == 0 && PyDict_Next(table, &pos, &key, &dtype)) {
        long code = PyLong_AsLong(key);
        PyObject *size = attr(dtype, "itemsize");
        if (size == NULL || code < 0 || code > 255) status = -1;
        else {
            dtype_sizes[code] = PyLong_AsUnsignedLongLong(size);
            dtype_names[code] = PyObject_Str(dtype);
            if (dtype_names[code] == NULL || PyErr_Occurred()) status = -1;
        }
        Py_XDECREF(size);
    }
    Py_DECREF(table);
    if (status < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "wire.NUMPY_DTYPE_BY_CODE: a bad code");
    return status;
}

void frames_as_import_error(const char *who) {
    /* An ImportError, whatever went wrong: core/plane.py then runs the Python plane under `auto`. */
    if (PyErr_ExceptionMatches(PyExc_ImportError)) return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyErr_Format(PyExc_ImportError, "%s cannot read core/wire.py's tables: %R", who, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

int frames_init(PyObject *module) {
    PyObject *wire = PyImport_ImportModule("redsrv.core.wire");
    PyObject *errors = PyImport_ImportModule("redsrv.core.errors");
    PyObject *constants = PyImport_ImportModule("redsrv.core.constants");
    PyObject *structmod = PyImport_ImportModule("struct");
    int status = -1;
    if (wire == NULL || errors == NULL || constants == NULL || structmod == NULL) goto done;
    header_structs = attr(wire, "_HEADER_STRUCTS");
    if (header_structs == NULL || !PyDict_Check(header_structs)) goto done;
    if (each_member(wire, "FrameType", add_frame_type) < 0 || each_member(wire, "ReduceOp", add_op) < 0
        || each_member(wire, "StragglerMode", add_mode) < 0 || each_member(wire, "ErrorCode", add_error) < 0
        || load_dtypes(wire) < 0 || mark(wire, "BITWISE_OPS", op_bitwise) < 0
        || mark(wire, "INTEGER_DTYPES", dtype_integer) < 0)
        goto done;
    k_hello = (int)member_value(wire, "FrameType", "HELLO");
    k_push = (int)member_value(wire, "FrameType", "PUSH");
    k_result = (int)member_value(wire, "FrameType", "RESULT");
    k_error = (int)member_value(wire, "FrameType", "ERROR");
    op_broadcast = (int)member_value(wire, "ReduceOp", "BROADCAST");
    if (PyErr_Occurred()) goto done;
    /* check_header reads these fields by position, as the reference does. */
    if (kinds[k_push].size != 44 || kinds[k_result].size != 32 || kinds[k_hello].size != 68 || kinds[k_error].size != 16) {
        PyErr_SetString(PyExc_ImportError, "wire's PUSH, RESULT, HELLO or ERROR header changed: update native/frames.c");
        goto done;
    }
    header_type = attr(wire, "FrameHeader");
    protocol_error = attr(errors, "RemoteProtocolError");
    struct_error = attr(structmod, "error");
    magic = attr(constants, "MAGIC");
    default_max_payload = attr(constants, "DEFAULT_MAX_FRAME_PAYLOAD");
    if (header_type == NULL || protocol_error == NULL || struct_error == NULL || magic == NULL
        || default_max_payload == NULL)
        goto done;
    if (!PyType_Check(header_type) || !PyBytes_Check(magic) || PyBytes_GET_SIZE(magic) != 4) {
        PyErr_SetString(PyExc_ImportError, "wire.FrameHeader is not a class, or MAGIC is not 4 bytes");
        goto done;
    }
    PyObject *version = attr(constants, "PROTOCOL_VERSION");
    protocol_version = version ? PyLong_AsLong(version) : -1;
    Py_XDECREF(version);
    if (PyErr_Occurred() || get_u64(constants, "MAX_WORLD_SIZE", &max_world_size) < 0
        || get_u64(constants, "MAX_JOB_ID_BYTES", &max_job_id_bytes) < 0
        || get_u64(constants, "MAX_ERROR_MESSAGE_BYTES", &max_error_message_bytes) < 0)
        goto done;
    str_type = PyUnicode_InternFromString("type");
    str_payload_len = PyUnicode_InternFromString("payload_len");
    str_fields = PyUnicode_InternFromString("fields");
    if (str_type == NULL || str_payload_len == NULL || str_fields == NULL) goto done;
    status = PyModule_AddFunctions(module, frames_methods);
done:
    if (status < 0) frames_as_import_error("the frame parser");
    Py_CLEAR(header_structs);
    Py_XDECREF(wire);
    Py_XDECREF(errors);
    Py_XDECREF(constants);
    Py_XDECREF(structmod);
    return status;
}
