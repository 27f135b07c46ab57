/*
 * Compiled ack ids of the pull API (sequin_provider/ack_ids.py).
 *
 * Two functions, each the exact counterpart of a pure-Python reference in ack_ids.py, which stays
 * the definition (tests/unit/test_ack_ids.py holds both equal on the same inputs, hostile ones
 * included):
 *
 *   ack_ids(claimed)          ~ [ack_ids.format_ack_id(lsn, idx, nonce) for lsn, idx, nonce, *_ in claimed]
 *   positions(ids, uuid_type) ~ ack_ids.parse_positions(ids): the positions and nonces of ack ids, each
 *                               once, in first-seen order, ids not ours left out; None where an id is
 *                               neither a uuid_type nor a UUID's canonical 36-character text (the
 *                               caller then runs the reference, which knows every form uuid.UUID takes)
 *
 * A receive of 100 made its ack ids in Python for 1.2 us each and an ack parsed them for 0.7 us
 * each, in the API's event loop or its threads (docs/performance.md, "The API's ack ids").
 *
 * The layout (format_ack_id's docstring): value = lsn << 59 | idx << 28 | nonce (122 bits), spread
 * over an RFC 9562 version-8 UUID around its version (4 bits) and variant (2 bits). Here value is
 * (vhi, vlo), its high 58 and low 64 bits, and the UUID (uhi, ulo), its high and low 64 bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define IDX_BITS 31
#define NONCE_BITS 28
#define LOW62 ((UINT64_C(1) << 62) - 1)

static PyObject *sixty_four = NULL; /* 64, to shift a UUID's int */
static PyObject *int_name = NULL;   /* "int", a uuid.UUID's attribute */

static const char HEX[] = "0123456789abcdef";

/* An int in [0, limit), or -1 with no error set when it is out of range (or -1 with an error). */
static int bounded(PyObject *o, uint64_t limit, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "an ack id's position and nonce are ints, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < 0 || (uint64_t)v >= limit)
        return 1;
    *out = (uint64_t)v;
    return 0;
}

static PyObject *format_one(PyObject *lsn_o, PyObject *idx_o, PyObject *nonce_o) {
    uint64_t lsn = 0, idx = 0, nonce = 0;
    int bad;
    if ((bad = bounded(lsn_o, UINT64_C(1) << 63, &lsn)) == 0 && (bad = bounded(idx_o, UINT64_C(1) << IDX_BITS, &idx)) == 0)
        bad = bounded(nonce_o, UINT64_C(1) << NONCE_BITS, &nonce);
    if (bad < 0)
        return NULL;
    if (bad > 0)
        return PyErr_Format(PyExc_ValueError, "position (%S, %S) or nonce %S out of range", lsn_o, idx_o, nonce_o);
    uint64_t vlo = (lsn << (IDX_BITS + NONCE_BITS)) | (idx << NONCE_BITS) | nonce;
    uint64_t vhi = lsn >> (64 - IDX_BITS - NONCE_BITS);
    uint64_t uhi = ((vhi >> 10) << 16) | (UINT64_C(0x8) << 12) | (((vhi << 2) | (vlo >> 62)) & 0xFFF);
    uint64_t ulo = (UINT64_C(0x2) << 62) | (vlo & LOW62);
    PyObject *text = PyUnicode_New(36, 127);
    if (text == NULL)
        return NULL;
    char *out = (char *)PyUnicode_1BYTE_DATA(text);
    int pos = 0;
    for (int nibble = 15; nibble >= 0; nibble--) {
        if (pos == 8 || pos == 13)
            out[pos++] = '-';
        out[pos++] = HEX[(uhi >> (4 * nibble)) & 0xF];
    }
    for (int nibble = 15; nibble >= 0; nibble--) {
        if (pos == 18 || pos == 23)
            out[pos++] = '-';
        out[pos++] = HEX[(ulo >> (4 * nibble)) & 0xF];
    }
    return text;
}

static PyObject *ack_ids(PyObject *self, PyObject *claimed) {
    /* a tuple of its own: an error message's str() runs Python code, which must not change it under us */
    PyObject *rows = PySequence_Tuple(claimed);
    if (rows == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(rows);
    PyObject *result = PyList_New(n);
    if (result == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GET_ITEM(rows, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 3) {
            PyErr_SetString(PyExc_TypeError, "a claimed row is a tuple (lsn, idx, nonce, ...)");
            goto fail;
        }
        PyObject *text = format_one(PyTuple_GET_ITEM(row, 0), PyTuple_GET_ITEM(row, 1), PyTuple_GET_ITEM(row, 2));
        if (text == NULL)
            goto fail;
        PyList_SET_ITEM(result, i, text);
    }
    Py_DECREF(rows);
    return result;
fail:
    Py_DECREF(rows);
    Py_XDECREF(result);
    return NULL;
}

static int hex_value(Py_UCS4 c) {
    if (c >= '0' && c <= '9')
        return (int)(c - '0');
    if (c >= 'a' && c <= 'f')
        return (int)(c - 'a' + 10);
    if (c >= 'A' && c <= 'F')
        return (int)(c - 'A' + 10);
    return -1;
}

/* A UUID's canonical text (8-4-4-4-12 hex digits, either case) as (uhi, ulo): 0, or 1 otherwise. */
static int parse_text(PyObject *s, uint64_t *uhi, uint64_t *ulo) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) { /* a legacy string: leave it to the reference */
        PyErr_Clear();
        return 1;
    }
#endif
    if (PyUnicode_GET_LENGTH(s) != 36)
        return 1;
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    uint64_t halves[2] = {0, 0};
    int digits = 0;
    for (Py_ssize_t i = 0; i < 36; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (c != '-')
                return 1;
            continue;
        }
        int v = hex_value(c);
        if (v < 0)
            return 1;
        halves[digits / 16] = (halves[digits / 16] << 4) | (uint64_t)v;
        digits++;
    }
    *uhi = halves[0];
    *ulo = halves[1];
    return 0;
}

/* A uuid.UUID's int as (uhi, ulo): 0, -1 with an error set. */
static int parse_uuid(PyObject *u, uint64_t *uhi, uint64_t *ulo) {
    PyObject *value = PyObject_GetAttr(u, int_name);
    if (value == NULL)
        return -1;
    PyObject *high = PyLong_Check(value) ? PyNumber_Rshift(value, sixty_four) : NULL;
    if (high == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a UUID's int is an int");
        Py_DECREF(value);
        return -1;
    }
    *ulo = PyLong_AsUnsignedLongLongMask(value);
    *uhi = PyLong_AsUnsignedLongLongMask(high);
    Py_DECREF(value);
    Py_DECREF(high);
    return PyErr_Occurred() ? -1 : 0;
}

/* A 64-bit hash of a 122-bit value (splitmix64's finisher over both halves). */
static uint64_t mix(uint64_t hi, uint64_t lo) {
    uint64_t x = lo ^ (hi * UINT64_C(0x9E3779B97F4A7C15));
    x ^= x >> 30;
    x *= UINT64_C(0xBF58476D1CE4E5B9);
    x ^= x >> 27;
    x *= UINT64_C(0x94D049BB133111EB);
    x ^= x >> 31;
    return x;
}

typedef struct {
    uint64_t hi, lo; /* the value (position and nonce); slot empty when used == 0 */
    int used;
} Seen;

static PyObject *positions(PyObject *self, PyObject *args) {
    PyObject *ids, *uuid_type;
    if (!PyArg_ParseTuple(args, "OO", &ids, &uuid_type))
        return NULL;
    /* a tuple of its own: isinstance() and a UUID's int run Python code, which must not change it under us */
    PyObject *items = PySequence_Tuple(ids);
    if (items == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    int bits = 4;
    while (((size_t)1 << bits) < (size_t)n * 2)
        bits++;
    size_t slots = (size_t)1 << bits;
    Seen *seen = calloc(slots, sizeof(Seen));
    PyObject *lsns = PyList_New(0), *idxs = PyList_New(0), *nonces = PyList_New(0), *result = NULL;
    if (seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (lsns == NULL || idxs == NULL || nonces == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        uint64_t uhi, ulo;
        if (PyUnicode_CheckExact(item)) {
            if (parse_text(item, &uhi, &ulo) != 0) { /* another form: the reference's */
                result = Py_NewRef(Py_None);
                goto done;
            }
        } else {
            int is_uuid = PyObject_IsInstance(item, uuid_type);
            if (is_uuid < 0)
                goto done;
            if (!is_uuid) {
                result = Py_NewRef(Py_None);
                goto done;
            }
            if (parse_uuid(item, &uhi, &ulo) < 0)
                goto done;
        }
        if (((uhi >> 12) & 0xF) != 0x8 || (ulo >> 62) != 0x2)
            continue; /* not ours */
        uint64_t vhi = ((uhi >> 16) << 10) | ((uhi & 0xFFF) >> 2);
        uint64_t vlo = ((uhi & 0x3) << 62) | (ulo & LOW62);
        size_t h = (size_t)(mix(vhi, vlo) >> (64 - bits)); /* the high bits: every input bit moves them */
        while (seen[h].used && !(seen[h].hi == vhi && seen[h].lo == vlo))
            h = (h + 1) & (slots - 1);
        if (seen[h].used)
            continue; /* repeated: counted once */
        seen[h].used = 1;
        seen[h].hi = vhi;
        seen[h].lo = vlo;
        uint64_t lsn = (vhi << 5) | (vlo >> (IDX_BITS + NONCE_BITS));
        uint64_t idx = (vlo >> NONCE_BITS) & ((UINT64_C(1) << IDX_BITS) - 1);
        uint64_t nonce = vlo & ((UINT64_C(1) << NONCE_BITS) - 1);
        PyObject *a = PyLong_FromUnsignedLongLong(lsn), *b = PyLong_FromUnsignedLongLong(idx),
                 *c = PyLong_FromUnsignedLongLong(nonce);
        int failed = a == NULL || b == NULL || c == NULL || PyList_Append(lsns, a) < 0 || PyList_Append(idxs, b) < 0 ||
                     PyList_Append(nonces, c) < 0;
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(c);
        if (failed)
            goto done;
    }
    result = PyTuple_Pack(3, lsns, idxs, nonces);
done:
    free(seen);
    Py_DECREF(items);
    Py_XDECREF(lsns);
    Py_XDECREF(idxs);
    Py_XDECREF(nonces);
    return result;
}

static PyMethodDef methods[] = {
    {"ack_ids", ack_ids, METH_O,
     "ack_ids(claimed) -> [str]: the ack id of each (lsn, idx, nonce, ...) row; see ack_ids.format_ack_id."},
    {"positions", positions, METH_VARARGS,
     "positions(ids, uuid_type) -> (lsns, idxs, nonces), or None for an id in another form; see "
     "ack_ids.parse_positions."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ack_ids_c", "Compiled ack ids of sequin_provider.ack_ids.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ack_ids_c(void) {
    if (sixty_four == NULL && (sixty_four = PyLong_FromLong(64)) == NULL)
        return NULL;
    if (int_name == NULL && (int_name = PyUnicode_InternFromString("int")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
