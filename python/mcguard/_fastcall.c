/* mcguard._fastcall: mc_guard_transfer and mc_guard_sync_transfers called
 * without ctypes.
 *
 * A 1 x 4 KiB transfer on one host takes about 5 µs inside the library;
 * through ctypes and the wrapper that builds its arguments it took 9-10
 * (measured on a 2-core VM). A receiver's sync of one transfer takes about 1.5 µs
 * inside; through ctypes 5-6. This module takes Python lists of ints as they are,
 * converts them on the stack where they are short, and calls the library
 * with the GIL released, as ctypes does.
 *
 * It only ever takes the plain case: anything it cannot convert exactly
 * (not a list, not an exact int, out of range, a session with a NUL) makes
 * it return None, and guard.py takes its ctypes path, which checks and
 * says what is wrong. So no value is ever wrapped or truncated here.
 *
 * The library's entry point comes with each call (its address in the
 * library ctypes loaded): this module links against nothing. Built by
 * `make build` beside the sources and by setup.py into the wheel; where
 * it is missing, guard.py uses ctypes alone. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mcguard.h"

typedef mc_status (*transfer_fn)(mc_guard_t, const char *, const uint64_t *, const uint64_t *,
                                 const uint64_t *, size_t, mc_transfer_opts *);
typedef mc_status (*sync_transfers_fn)(mc_guard_t, const uint64_t *, size_t, const mc_sync_opts *);

/* Descriptors converted on the stack; longer batches take one malloc. */
enum { STACK_DESCS = 16 };

/* into[i] = list[i] for n exact ints in [0, 2**64); 0 where one is not. */
static int convert(PyObject *list, Py_ssize_t n, uint64_t *into) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(v)) return 0; /* bool, float, numpy scalar...: the checked path */
        unsigned long long x = PyLong_AsUnsignedLongLong(v);
        if (x == (unsigned long long)-1 && PyErr_Occurred()) { /* negative or too large */
            PyErr_Clear();
            return 0;
        }
        into[i] = x;
    }
    return 1;
}

/* transfer(entry, handle, session, src, dst, lengths, verify, flags) ->
 *   (status, transfer_id, retries, resends, abort_state), or None where
 *   an argument is not the plain case (the caller then takes ctypes). */
static PyObject *transfer(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long entry, handle;
    PyObject *session, *src, *dst, *len;
    int verify;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "KKUOOOiI", &entry, &handle, &session, &src, &dst, &len, &verify, &flags)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    transfer_fn transfer_entry = (transfer_fn)(uintptr_t)entry;
    if (transfer_entry == NULL || !PyList_CheckExact(src) || !PyList_CheckExact(dst) || !PyList_CheckExact(len))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(src);
    if (n == 0 || PyList_GET_SIZE(dst) != n || PyList_GET_SIZE(len) != n) Py_RETURN_NONE;
    Py_ssize_t slen;
    const char *name = PyUnicode_AsUTF8AndSize(session, &slen);
    if (name == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if ((size_t)slen != strlen(name)) Py_RETURN_NONE; /* a NUL inside: the checked path says so */

    uint64_t stack[3 * STACK_DESCS];
    uint64_t *buf = stack;
    if (n > STACK_DESCS) {
        if ((size_t)n > SIZE_MAX / (3 * sizeof(uint64_t))) Py_RETURN_NONE;
        buf = malloc(3 * (size_t)n * sizeof(uint64_t));
        if (buf == NULL) return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    if (!convert(src, n, buf) || !convert(dst, n, buf + n) || !convert(len, n, buf + 2 * n)) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    mc_transfer_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.struct_size = sizeof opts;
    opts.verify = verify;
    opts.flags = flags;
    mc_status st;
    /* The session's UTF-8 stays valid: the tuple of arguments holds the str. */
    Py_BEGIN_ALLOW_THREADS
    st = transfer_entry((mc_guard_t)handle, name, buf, buf + n, buf + 2 * n, (size_t)n, &opts);
    Py_END_ALLOW_THREADS
    out = Py_BuildValue("(iKKKi)", (int)st, (unsigned long long)opts.transfer_id,
                        (unsigned long long)opts.retries, (unsigned long long)opts.resends,
                        (int)opts.abort_state);
done:
    if (buf != stack) free(buf);
    return out;
}

/* sync_transfers(entry, handle, ids, stream) -> status, or None where an
 * argument is not the plain case (ids a non-empty list of exact ints,
 * stream an exact int, both in [0, 2**64)). */
static PyObject *sync_transfers(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long entry, handle;
    PyObject *ids, *stream;
    if (!PyArg_ParseTuple(args, "KKOO", &entry, &handle, &ids, &stream)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    sync_transfers_fn sync_entry = (sync_transfers_fn)(uintptr_t)entry;
    if (sync_entry == NULL || !PyList_CheckExact(ids) || !PyLong_CheckExact(stream)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (n == 0) Py_RETURN_NONE;
    mc_sync_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.struct_size = sizeof opts;
    opts.stream = PyLong_AsUnsignedLongLong(stream);
    if (opts.stream == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    uint64_t stack[STACK_DESCS];
    uint64_t *buf = stack;
    if (n > STACK_DESCS) {
        if ((size_t)n > SIZE_MAX / sizeof(uint64_t)) Py_RETURN_NONE;
        buf = malloc((size_t)n * sizeof(uint64_t));
        if (buf == NULL) return PyErr_NoMemory();
    }
    PyObject *out;
    if (!convert(ids, n, buf)) {
        out = Py_None;
        Py_INCREF(out);
    } else {
        mc_status st;
        Py_BEGIN_ALLOW_THREADS
        st = sync_entry((mc_guard_t)handle, buf, (size_t)n, &opts);
        Py_END_ALLOW_THREADS
        out = PyLong_FromLong((long)st);
    }
    if (buf != stack) free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"transfer", transfer, METH_VARARGS,
     "transfer(entry, handle, session, src, dst, lengths, verify, flags) -> "
     "(status, transfer_id, retries, resends, abort_state) or None (not the plain case)"},
    {"sync_transfers", sync_transfers, METH_VARARGS,
     "sync_transfers(entry, handle, ids, stream) -> status or None (not the plain case)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mcguard._fastcall",
    .m_doc = "mc_guard_transfer and mc_guard_sync_transfers without ctypes, for the plain case",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fastcall(void) { return PyModule_Create(&module); }
