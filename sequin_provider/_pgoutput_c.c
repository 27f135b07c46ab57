/*
 * Compiled hot path of the pgoutput decoder (sequin_provider/pgoutput.py).
 *
 * Nine functions, each the exact counterpart of a pure-Python reference in pgoutput.py (or
 * messages.py, message_render.py), which stays the definition (tests/test_pgoutput_c.py and
 * tests/test_message_render.py hold both equal on the same inputs, hostile ones included):
 *
 *   parse_tuple(buf, pos)  ~ pgoutput.parse_tuple: TupleData -> ([str | None | TOAST marker], pos)
 *   render(values, kinds, prefixes, converters, columns, only, fill)
 *                          ~ pgoutput.render_record: a row's record JSON and its unchanged-TOAST columns
 *   change_row(specs, head, buf)
 *                          ~ pgoutput.change_row: an insert, an update without old values or with
 *                            the whole old row, or a full-row delete straight to its change row
 *                            (pgoutput.render_tuple's or render_update's record, changes, pks and
 *                            missing, and the row's tuple), with no Python frame
 *   read_rows(specs, head, conn, get_copy_data, free_memory, pending, max_rows, max_bytes)
 *                          ~ replication_protocol.ReplicationStream.read() and change_row() one message
 *                            at a time: libpq's copy data straight to change rows, until a message
 *                            change_row() does not take
 *   copy_out_into(conn, get_copy_data, free_memory, out)
 *                          ~ pq_copy.copy_out_text's loop of get_copy_data: the rows of a COPY TO that
 *                            libpq holds, appended to a bytearray
 *   render_copy(data, kinds, prefixes, converters, columns, pk_positions)
 *                          ~ pgoutput.render_copy: a backfill page's COPY text lines straight to the
 *                            rows' record JSON and record_pks JSON, as Arrow string buffers
 *   column_sizes(rows, kinds), fill_columns(rows, kinds, buffers)
 *                          ~ messages.rows_to_arrow's reference (Arrow reading the tuples): change rows
 *                            written into each column's Arrow buffers
 *   copy_binary_rows(n, fields)
 *                          ~ message_render.copy_binary_rows' Arrow path: rows of Arrow columns as
 *                            COPY binary tuples, in one pass
 *
 * render() converts the common types here (kinds, see pgoutput.CONVERTER_KINDS) and calls the
 * Python converter for every other value. It never sees a type OID: pgtypes.PG_TYPES maps OIDs to
 * rules, and the KIND_ codes below are pgtypes.NATIVE_KINDS (tests/test_pgtypes.py parses them). configure(toast_marker, decode_error) is called once
 * at import by pgoutput.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *toast_marker = NULL;   /* pgoutput.UNCHANGED_TOAST */
static PyObject *one = NULL;            /* 1, to move a transaction's idx on */
static PyObject *empty_changes = NULL;  /* "{}", an update's changes without old values */
static PyObject *decode_error = NULL;   /* pgoutput.DecodeError */

enum {
    KIND_CALL = 0,        /* call the Python converter */
    KIND_RAW = 1,         /* text is already JSON */
    KIND_STRING = 2,      /* JSON string */
    KIND_BOOL = 3,        /* t/f */
    KIND_NUMBER = 4,      /* numeric/float: raw, non-finite as strings */
    KIND_TIMESTAMPTZ = 5, /* fast path for +00, else the converter */
    KIND_TIMESTAMP = 6,   /* fast path for AD timestamps, else the converter */
};

/* ------------------------------------------------------------------------------------------ */
/* A growing byte buffer (UTF-8 output) */

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

static int buf_putc(Buf *b, char c) { return buf_put(b, &c, 1); }

/* As json.JSONEncoder(ensure_ascii=False).encode(str): escapes '"', '\\' and control characters. */
static int buf_json_string(Buf *b, const char *s, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    if (buf_reserve(b, n + 2) < 0 || buf_putc(b, '"') < 0)
        return -1;
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        if (buf_put(b, s + start, i - start) < 0)
            return -1;
        start = i + 1;
        char esc[6] = {'\\', 0, 0, 0, 0, 0};
        Py_ssize_t len = 2;
        switch (c) {
        case '"': esc[1] = '"'; break;
        case '\\': esc[1] = '\\'; break;
        case '\b': esc[1] = 'b'; break;
        case '\f': esc[1] = 'f'; break;
        case '\n': esc[1] = 'n'; break;
        case '\r': esc[1] = 'r'; break;
        case '\t': esc[1] = 't'; break;
        default:
            esc[1] = 'u'; esc[2] = '0'; esc[3] = '0'; esc[4] = hex[c >> 4]; esc[5] = hex[c & 15];
            len = 6;
        }
        if (buf_put(b, esc, len) < 0)
            return -1;
    }
    if (buf_put(b, s + start, n - start) < 0)
        return -1;
    return buf_putc(b, '"');
}

static int ends_with(const char *s, Py_ssize_t n, const char *suffix) {
    Py_ssize_t k = (Py_ssize_t)strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, (size_t)k) == 0;
}

static int buf_put_str(Buf *b, PyObject *str) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(str, &n);
    if (s == NULL)
        return -1;
    return buf_put(b, s, n);
}

/* Append the JSON of one non-null value; 1 = handled, 0 = not handled (call the converter), -1 = error. */
static int convert_native(Buf *b, int kind, const char *s, Py_ssize_t n) {
    switch (kind) {
    case KIND_RAW:
        return buf_put(b, s, n) < 0 ? -1 : 1;
    case KIND_STRING:
        return buf_json_string(b, s, n) < 0 ? -1 : 1;
    case KIND_BOOL:
        if (n == 1 && s[0] == 't')
            return buf_put(b, "true", 4) < 0 ? -1 : 1;
        return buf_put(b, "false", 5) < 0 ? -1 : 1;
    case KIND_NUMBER: {
        static const char *specials[][2] = {
            {"NaN", "\"NaN\""}, {"Infinity", "\"Infinity\""}, {"-Infinity", "\"-Infinity\""},
            {"inf", "\"Infinity\""}, {"-inf", "\"-Infinity\""}, {"nan", "\"NaN\""}};
        for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); i++) {
            if ((Py_ssize_t)strlen(specials[i][0]) == n && memcmp(s, specials[i][0], (size_t)n) == 0)
                return buf_put(b, specials[i][1], (Py_ssize_t)strlen(specials[i][1])) < 0 ? -1 : 1;
        }
        return buf_put(b, s, n) < 0 ? -1 : 1;
    }
    case KIND_TIMESTAMPTZ:
    case KIND_TIMESTAMP: {
        if (n == 0 || s[0] < '0' || s[0] > '9' || ends_with(s, n, " BC"))
            return 0;
        Py_ssize_t keep = n;
        if (kind == KIND_TIMESTAMPTZ) {
            if (!ends_with(s, n, "+00"))
                return 0;
            keep = n - 3;
        }
        if (buf_reserve(b, keep + 3) < 0)
            return -1;
        buf_putc(b, '"');
        const char *space = memchr(s, ' ', (size_t)n);
        Py_ssize_t at = space ? (Py_ssize_t)(space - s) : -1;
        Py_ssize_t start = b->len;
        buf_put(b, s, keep);
        if (at >= 0 && at < keep)
            b->data[start + at] = 'T';
        /* a first space among the stripped "+00" cannot occur: the suffix has none */
        if (kind == KIND_TIMESTAMPTZ)
            buf_putc(b, 'Z');
        buf_putc(b, '"');
        return 1;
    }
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------------------------------ */

static PyObject *truncated(const char *what) {
    PyErr_Format(decode_error, "truncated pgoutput tuple: %s", what);
    return NULL;
}

/* The next TupleData value at *pos: its kind ('t'/'b', 'n', 'u') and, for text/binary, its bytes. */
static int next_value(const unsigned char *buf, Py_ssize_t size, Py_ssize_t *pos, unsigned char *kind,
                      const char **s, Py_ssize_t *len) {
    *s = NULL;
    *len = -1;
    if (*pos >= size) {
        truncated("value kind");
        return -1;
    }
    *kind = buf[(*pos)++];
    if (*kind == 't' || *kind == 'b') {
        if (*pos + 4 > size) {
            truncated("value length");
            return -1;
        }
        int32_t length = (int32_t)(((uint32_t)buf[*pos] << 24) | ((uint32_t)buf[*pos + 1] << 16) |
                                   ((uint32_t)buf[*pos + 2] << 8) | (uint32_t)buf[*pos + 3]);
        *pos += 4;
        if (length < 0 || length > size - *pos) {
            truncated("value bytes");
            return -1;
        }
        *s = (const char *)buf + *pos;
        *len = length;
        *pos += length;
    } else if (*kind != 'n' && *kind != 'u') {
        PyErr_Format(decode_error, "unknown tuple value kind '%c'", *kind);
        return -1;
    }
    return 0;
}

/* The column count of the TupleData at *pos. */
static int column_count(const unsigned char *buf, Py_ssize_t size, Py_ssize_t *pos, int *n) {
    if (*pos < 0 || *pos + 2 > size) {
        truncated("column count");
        return -1;
    }
    *n = (int16_t)((buf[*pos] << 8) | buf[*pos + 1]);
    *pos += 2;
    return 0;
}

static PyObject *parse_tuple(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*n", &view, &pos))
        return NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t size = view.len;
    int n;
    PyObject *values = NULL;
    if (column_count(buf, size, &pos, &n) < 0 || (values = PyList_New(0)) == NULL)
        goto fail;
    for (int i = 0; i < n; i++) {
        unsigned char kind;
        const char *s;
        Py_ssize_t len;
        if (next_value(buf, size, &pos, &kind, &s, &len) < 0)
            goto fail;
        PyObject *value = s ? PyUnicode_DecodeUTF8(s, len, "strict")
                            : Py_NewRef(kind == 'n' ? Py_None : toast_marker);
        if (value == NULL)
            goto fail;
        int rc = PyList_Append(values, value);
        Py_DECREF(value);
        if (rc < 0)
            goto fail;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(Nn)", values, pos);
fail:
    Py_XDECREF(values);
    PyBuffer_Release(&view);
    return NULL;
}

/* Whether s[0:n] is UTF-8 as Python's strict decoder takes it (RFC 3629: no overlong forms, no
 * surrogates, nothing above U+10FFFF), without building the text: ASCII eight bytes at a time, then
 * each sequence by its lead byte. */
static int utf8_valid(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        if (n - i >= 8) {
            uint64_t word;
            memcpy(&word, s + i, 8);
            if ((word & UINT64_C(0x8080808080808080)) == 0) {
                i += 8;
                continue;
            }
        }
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (n - i < 2 || (s[i + 1] & 0xC0) != 0x80)
                return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (n - i < 3 || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xE0 && s[i + 1] < 0xA0) || (c == 0xED && s[i + 1] > 0x9F))
                return 0; /* overlong, or a surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (n - i < 4 || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xF0 && s[i + 1] < 0x90) || (c == 0xF4 && s[i + 1] > 0x8F))
                return 0; /* overlong, or above U+10FFFF */
            i += 4;
        } else {
            return 0; /* a continuation byte first, C0/C1 (overlong) or F5-FF */
        }
    }
    return 1;
}

/* Raise UnicodeDecodeError when bytes that are not copied into the output are not UTF-8: Python's
 * decoder raises it (its own message and position), asked only when utf8_valid found a fault. */
static int check_utf8(const char *s, Py_ssize_t n) {
    if (utf8_valid((const unsigned char *)s, n))
        return 0;
    PyObject *text = PyUnicode_DecodeUTF8(s, n, "strict");
    if (text == NULL)
        return -1;
    Py_DECREF(text);
    return 0;
}

/* What render() and change_row() need of a relation (pgoutput.Relation's lists). */
typedef struct {
    const char *kinds;
    Py_ssize_t nkinds;
    PyObject *prefixes, *converters, *columns;
} Columns;

static int index_error(void) {
    PyErr_SetString(PyExc_IndexError, "list index out of range");
    return -1;
}

/* An unchanged TOAST value: its column is reported, not rendered. */
static int append_missing(PyObject *missing, const Columns *rel, Py_ssize_t i) {
    if (i >= PyList_GET_SIZE(rel->columns))
        return index_error();
    return PyList_Append(missing, PyList_GET_ITEM(rel->columns, i));
}

/* Column i's `"name":value` into out. The value is `value` (a Python object: None, str, or anything
 * a converter takes) or, with value NULL, the UTF-8 bytes s[0:len] of the payload (s NULL: null). */
static int append_column(Buf *out, int *first, const Columns *rel, Py_ssize_t i, PyObject *value, const char *s,
                         Py_ssize_t len) {
    int is_null = value ? value == Py_None : s == NULL;
    if (i >= PyList_GET_SIZE(rel->prefixes) ||
        (!is_null && (i >= PyList_GET_SIZE(rel->converters) || i >= rel->nkinds)))
        return index_error();
    if ((!*first && buf_putc(out, ',') < 0) || buf_put_str(out, PyList_GET_ITEM(rel->prefixes, i)) < 0)
        return -1;
    *first = 0;
    if (is_null)
        return buf_put(out, "null", 4);
    if (value && PyUnicode_CheckExact(value)) {
        s = PyUnicode_AsUTF8AndSize(value, &len);
        if (s == NULL)
            return -1;
    } else if (value == NULL && rel->kinds[i] == KIND_BOOL && check_utf8(s, len) < 0) {
        return -1;  /* the payload's bytes: only what is copied to the output is validated with it */
    }
    int handled = s ? convert_native(out, rel->kinds[i], s, len) : 0;
    if (handled != 0)
        return handled < 0 ? -1 : 0;
    PyObject *arg = value ? Py_NewRef(value) : PyUnicode_DecodeUTF8(s, len, "strict");
    if (arg == NULL)
        return -1;
    PyObject *json = PyObject_CallOneArg(PyList_GET_ITEM(rel->converters, i), arg);
    Py_DECREF(arg);
    if (json == NULL)
        return -1;
    int rc = PyUnicode_Check(json) ? buf_put_str(out, json) : -1;
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "a converter must return str");
    Py_DECREF(json);
    return rc;
}

static PyObject *render(PyObject *self, PyObject *args) {
    PyObject *values, *kinds_obj, *prefixes, *converters, *columns, *only, *fill;
    if (!PyArg_ParseTuple(args, "O!SO!O!O!OO", &PyList_Type, &values, &kinds_obj, &PyList_Type, &prefixes,
                          &PyList_Type, &converters, &PyList_Type, &columns, &only, &fill))
        return NULL;
    Columns rel = {PyBytes_AS_STRING(kinds_obj), PyBytes_GET_SIZE(kinds_obj), prefixes, converters, columns};
    Py_ssize_t nvalues = PyList_GET_SIZE(values);
    Py_ssize_t nfill = fill == Py_None ? 0 : PyList_Size(fill);
    if (nfill < 0)
        return NULL;
    PyObject *missing = PyList_New(0);
    PyObject *order = NULL;
    Buf out = {NULL, 0, 0};
    if (missing == NULL)
        return NULL;
    if (only != Py_None) {
        order = PySequence_Fast(only, "only must be a sequence of column positions");
        if (order == NULL)
            goto fail;
    }
    Py_ssize_t count = order ? PySequence_Fast_GET_SIZE(order) : nvalues;
    if (buf_putc(&out, '{') < 0)
        goto fail;
    int first = 1;
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t i = k;
        if (order) {
            i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(order, k));
            if (i == -1 && PyErr_Occurred())
                goto fail;
        }
        if (i < 0 || i >= nvalues) {
            index_error();
            goto fail;
        }
        PyObject *v = PyList_GET_ITEM(values, i);
        if (v == toast_marker && fill != Py_None && i < nfill) {
            PyObject *f = PyList_GET_ITEM(fill, i);
            if (f != toast_marker)
                v = f;
        }
        if (v == toast_marker ? append_missing(missing, &rel, i) < 0
                              : append_column(&out, &first, &rel, i, v, NULL, 0) < 0)
            goto fail;
    }
    if (buf_putc(&out, '}') < 0)
        goto fail;
    PyObject *record = PyUnicode_DecodeUTF8(out.data, out.len, "strict");
    PyMem_Free(out.data);
    Py_XDECREF(order);
    if (record == NULL) {
        Py_DECREF(missing);
        return NULL;
    }
    return Py_BuildValue("(NN)", record, missing);
fail:
    PyMem_Free(out.data);
    Py_XDECREF(order);
    Py_DECREF(missing);
    return NULL;
}

/* A TupleData value in the payload: its kind ('t'/'b', 'n', 'u') and, for text/binary, its bytes
 * s[0:len] (s NULL for 'n' and 'u'). */
typedef struct {
    const char *s;
    Py_ssize_t len;
    unsigned char kind;
} Value;

#define SMALL_TUPLE 32 /* values a tuple holds on the stack; wider ones are allocated */

/* The values of the TupleData at *pos into *values (small, of SMALL_TUPLE, or allocated: the caller
 * frees it when it is not small) and their count into *n; *pos moves past it. 0, or -1 with an
 * exception set (pgoutput.parse_tuple's truncation errors). */
static int read_values(const unsigned char *buf, Py_ssize_t size, Py_ssize_t *pos, Value *small, Value **values,
                       int *n) {
    *values = small;
    if (column_count(buf, size, pos, n) < 0)
        return -1;
    if (*n > SMALL_TUPLE && (*values = PyMem_Malloc(sizeof(Value) * (size_t)*n)) == NULL) {
        *values = small;
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < *n; i++) {
        Value *v = &(*values)[i];
        if (next_value(buf, size, pos, &v->kind, &v->s, &v->len) < 0)
            return -1;
    }
    return 0;
}

static void free_values(Value *values, Value *small) {
    if (values != small)
        PyMem_Free(values);
}

/* The record JSON of values[0:n] into out, as pgoutput.render_record with fill: an unchanged TOAST
 * value is taken from fill[0:nfill] (fill NULL: none) when that holds one, else its column goes to
 * missing. 0, or -1 with an exception set. */
static int render_values(Buf *out, PyObject *missing, const Columns *rel, const Value *values, int n,
                         const Value *fill, int nfill) {
    int first = 1;
    if (buf_putc(out, '{') < 0)
        return -1;
    for (int i = 0; i < n; i++) {
        const Value *v = &values[i];
        if (v->kind == 'u' && i < nfill && fill[i].kind != 'u')
            v = &fill[i];
        if (v->kind == 'u' ? append_missing(missing, rel, i) < 0 : append_column(out, &first, rel, i, NULL, v->s, v->len) < 0)
            return -1;
    }
    return buf_putc(out, '}');
}

/* record_pks of values[0:n] (pgoutput.pk_texts): the text of each primary-key value present. */
static PyObject *pk_list(const Value *values, int n, PyObject *pk_positions) {
    PyObject *pks = PyList_New(0);
    if (pks == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(pk_positions); j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(pk_positions, j));
        if (i == -1 && PyErr_Occurred())
            goto fail;
        if (i < 0 || i >= n) {
            index_error();
            goto fail;
        }
        if (values[i].s == NULL)
            continue; /* null or unchanged TOAST */
        PyObject *text = PyUnicode_DecodeUTF8(values[i].s, values[i].len, "strict");
        if (text == NULL)
            goto fail;
        int rc = PyList_Append(pks, text);
        Py_DECREF(text);
        if (rc < 0)
            goto fail;
    }
    return pks;
fail:
    Py_DECREF(pks);
    return NULL;
}

/* out's bytes as a str (strict UTF-8: what was copied from the payload unchecked is checked here). */
static PyObject *buf_str(const Buf *out) { return PyUnicode_DecodeUTF8(out->data, out->len, "strict"); }

/* The TupleData at pos of buf rendered as pgoutput.render_tuple renders it into new references *record_out,
 * *pks_out and *missing_out: 0, or -1 with an exception set. Inserts, updates without old values and
 * deletes with the whole old row: the core of change_row(). */
static int render_tuple_at(const unsigned char *buf, Py_ssize_t size, Py_ssize_t pos, const Columns *rel,
                           PyObject *pk_positions, PyObject **record_out, PyObject **pks_out, PyObject **missing_out) {
    Value small[SMALL_TUPLE], *values = small;
    int n;
    PyObject *missing = NULL, *record = NULL, *pks = NULL;
    Buf out = {NULL, 0, 0};
    if (read_values(buf, size, &pos, small, &values, &n) < 0 || (missing = PyList_New(0)) == NULL ||
        render_values(&out, missing, rel, values, n, NULL, 0) < 0 || (record = buf_str(&out)) == NULL ||
        (pks = pk_list(values, n, pk_positions)) == NULL)
        goto fail;
    free_values(values, small);
    PyMem_Free(out.data);
    *record_out = record;
    *pks_out = pks;
    *missing_out = missing;
    return 0;
fail:
    free_values(values, small);
    PyMem_Free(out.data);
    Py_XDECREF(record);
    Py_XDECREF(missing);
    return -1;
}

/* Raise UnicodeDecodeError when a value's bytes are not UTF-8 (pgoutput.parse_tuple decodes every
 * value of the old row, also those that are not rendered). */
static int check_values_utf8(const Value *values, int n) {
    for (int i = 0; i < n; i++) {
        if (values[i].s != NULL && check_utf8(values[i].s, values[i].len) < 0)
            return -1;
    }
    return 0;
}

/* An update with the whole old row ('O' at 5 of buf, then 'N' and the new row) rendered as
 * pgoutput.change_row renders it (pgoutput.render_update without key flags): new references
 * *record_out, *changes_out (the old values of the columns it changed), *pks_out and *missing_out;
 * 0, or -1 with an exception set. */
static int render_update_at(const unsigned char *buf, Py_ssize_t size, const Columns *rel, PyObject *pk_positions,
                            PyObject **record_out, PyObject **changes_out, PyObject **pks_out,
                            PyObject **missing_out) {
    Value old_small[SMALL_TUPLE], new_small[SMALL_TUPLE], *old = old_small, *new = new_small;
    int nold = 0, nnew = 0;
    Py_ssize_t pos = 6;
    PyObject *missing = NULL, *record = NULL, *changes = NULL, *pks = NULL;
    Buf out = {NULL, 0, 0};
    if (read_values(buf, size, &pos, old_small, &old, &nold) < 0 || check_values_utf8(old, nold) < 0)
        goto fail;
    pos += 1; /* 'N' */
    if (read_values(buf, size, &pos, new_small, &new, &nnew) < 0 || (missing = PyList_New(0)) == NULL ||
        render_values(&out, missing, rel, new, nnew, old, nold) < 0 || (record = buf_str(&out)) == NULL)
        goto fail;
    out.len = 0;
    int first = 1, common = nold < nnew ? nold : nnew;
    if (buf_putc(&out, '{') < 0)
        goto fail;
    for (int i = 0; i < common; i++) {
        const Value *o = &old[i], *v = &new[i];
        if (o->kind == 'u' || v->kind == 'u')
            continue;
        int same = o->s == NULL ? v->s == NULL : v->s != NULL && o->len == v->len && memcmp(o->s, v->s, (size_t)o->len) == 0;
        if (!same && append_column(&out, &first, rel, i, NULL, o->s, o->len) < 0)
            goto fail;
    }
    if (buf_putc(&out, '}') < 0 || (changes = buf_str(&out)) == NULL || (pks = pk_list(new, nnew, pk_positions)) == NULL)
        goto fail;
    free_values(old, old_small);
    free_values(new, new_small);
    PyMem_Free(out.data);
    *record_out = record;
    *changes_out = changes;
    *pks_out = pks;
    *missing_out = missing;
    return 0;
fail:
    free_values(old, old_small);
    free_values(new, new_small);
    PyMem_Free(out.data);
    Py_XDECREF(record);
    Py_XDECREF(changes);
    Py_XDECREF(missing);
    return -1;
}

/* change_row(specs, head, buf): see pgoutput.change_row. specs maps a relation's OID to
 * (schema, name, kinds, prefixes, converters, columns, pk_positions); head is the list
 * [commit_lsn, idx, commit_ts_iso, xid] of the transaction, whose idx a row takes and moves on.
 * The row, its record_pks list and its unchanged-TOAST list hold only strings, ints and None, and
 * nothing adds to them after: they leave the cyclic GC's lists at once (as CPython does by itself
 * for such tuples and dicts, not for lists), so that a batch of 400,000 rows costs its collections
 * nothing to walk. */
static PyObject *change_row_at(PyObject *specs, PyObject *head, const unsigned char *buf, Py_ssize_t size);

static PyObject *change_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[0]) || !PyList_Check(args[1]) || PyList_GET_SIZE(args[1]) != 4) {
        PyErr_SetString(PyExc_TypeError, "change_row(specs: dict, head: list of 4, buf)");
        return NULL;
    }
    if (!PyBytes_Check(args[2]))
        Py_RETURN_NONE; /* another buffer: the decoder's own path */
    return change_row_at(args[0], args[1], (const unsigned char *)PyBytes_AS_STRING(args[2]), PyBytes_GET_SIZE(args[2]));
}

/* The core of change_row() (and of read_rows()): the change row of the pgoutput message buf[0:size],
 * None for a message it does not take, NULL with an exception set. */
static PyObject *change_row_at(PyObject *specs, PyObject *head, const unsigned char *buf, Py_ssize_t size) {
    const char *action;
    PyObject *changes;
    if (size < 6)
        Py_RETURN_NONE; /* the decoder's own path says what is wrong with it */
    switch (buf[0]) {
    case 'I':
        action = "insert";
        changes = Py_None;
        break;
    case 'U':
        if (buf[5] == 'K')
            Py_RETURN_NONE;
        action = "update";
        changes = NULL; /* "{}", or with the old row ('O') what render_update_at renders */
        break;
    case 'D':
        if (buf[5] == 'K')
            Py_RETURN_NONE;
        action = "delete";
        changes = Py_None;
        break;
    default:
        Py_RETURN_NONE;
    }
    uint32_t relid = ((uint32_t)buf[1] << 24) | ((uint32_t)buf[2] << 16) | ((uint32_t)buf[3] << 8) | (uint32_t)buf[4];
    PyObject *key = PyLong_FromUnsignedLong(relid);
    if (key == NULL)
        return NULL;
    PyObject *spec = PyDict_GetItemWithError(specs, key); /* borrowed */
    Py_DECREF(key);
    if (spec == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_INCREF(spec); /* a converter runs Python code while it is used */
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 7 || !PyBytes_Check(PyTuple_GET_ITEM(spec, 2)) ||
        !PyList_Check(PyTuple_GET_ITEM(spec, 3)) || !PyList_Check(PyTuple_GET_ITEM(spec, 4)) ||
        !PyList_Check(PyTuple_GET_ITEM(spec, 5)) || !PyList_Check(PyTuple_GET_ITEM(spec, 6))) {
        PyErr_SetString(PyExc_TypeError, "change_row: a spec is (schema, name, kinds, prefixes, converters, columns, pk_positions)");
        Py_DECREF(spec);
        return NULL;
    }
    PyObject *kinds_obj = PyTuple_GET_ITEM(spec, 2);
    Columns rel = {PyBytes_AS_STRING(kinds_obj), PyBytes_GET_SIZE(kinds_obj), PyTuple_GET_ITEM(spec, 3),
                   PyTuple_GET_ITEM(spec, 4), PyTuple_GET_ITEM(spec, 5)};
    PyObject *record, *pks, *missing, *old_changes = NULL;
    if (buf[0] == 'U' && buf[5] == 'O'
            ? render_update_at(buf, size, &rel, PyTuple_GET_ITEM(spec, 6), &record, &old_changes, &pks, &missing) < 0
            : render_tuple_at(buf, size, 6, &rel, PyTuple_GET_ITEM(spec, 6), &record, &pks, &missing) < 0) {
        Py_DECREF(spec);
        return NULL;
    }
    PyObject *idx = PyList_GET_ITEM(head, 1); /* borrowed until replaced below */
    PyObject *next = PyNumber_Add(idx, one);
    PyObject *row = next ? PyTuple_New(13) : NULL;
    PyObject *action_str = row ? PyUnicode_InternFromString(action) : NULL;
    if (action_str == NULL) {
        Py_DECREF(spec);
        Py_XDECREF(next);
        Py_XDECREF(row);
        Py_DECREF(record);
        Py_XDECREF(old_changes);
        Py_DECREF(pks);
        Py_DECREF(missing);
        return NULL;
    }
    PyTuple_SET_ITEM(row, 0, Py_NewRef(PyList_GET_ITEM(head, 0)));
    PyTuple_SET_ITEM(row, 1, Py_NewRef(idx));
    PyTuple_SET_ITEM(row, 2, Py_NewRef(PyList_GET_ITEM(head, 2)));
    PyTuple_SET_ITEM(row, 3, Py_NewRef(PyList_GET_ITEM(head, 3)));
    PyTuple_SET_ITEM(row, 4, Py_NewRef(PyTuple_GET_ITEM(spec, 0)));
    PyTuple_SET_ITEM(row, 5, Py_NewRef(PyTuple_GET_ITEM(spec, 1)));
    PyTuple_SET_ITEM(row, 6, action_str);
    PyTuple_SET_ITEM(row, 7, record);
    PyTuple_SET_ITEM(row, 8, old_changes ? old_changes : Py_NewRef(changes ? changes : empty_changes));
    PyTuple_SET_ITEM(row, 9, pks);
    PyTuple_SET_ITEM(row, 10, missing);
    PyTuple_SET_ITEM(row, 11, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(row, 12, Py_NewRef(Py_None));
    PyList_SetItem(head, 1, next); /* steals next; releases the old idx, which row holds */
    Py_DECREF(spec);
    PyObject_GC_UnTrack(pks);
    PyObject_GC_UnTrack(missing);
    PyObject_GC_UnTrack(row);
    return row;
}

/* read_rows(specs, head, conn, get_copy_data, free_memory, pending, max_rows, max_bytes): the reader's
 * loop over a replication connection in COPY BOTH mode (replication_protocol.ReplicationStream.read_rows,
 * whose reference is its read() and change_row() one message at a time). conn is libpq's PGconn *, and
 * get_copy_data and free_memory the addresses of PQgetCopyData and PQfreemem of the libpq that made
 * it, as integers. It appends to pending the change row of each XLogData message that change_row()
 * takes, in order, until one of:
 *   0: max_rows rows were appended, or their payloads reached max_bytes (checked before each read);
 *   1: no whole message is buffered (PQgetCopyData's 0: the caller consumes input and calls again);
 *   2: a message it does not take (a keepalive, or a data message change_row() does not take or
 *      fails on: the caller decodes it, and so raises what is wrong with it), returned whole as bytes;
 *   -1, -2: PQgetCopyData's end of the copy and error (the caller asks libpq why).
 * Returns (rows appended, their payloads' bytes, code, the message of code 2 or None). It never
 * blocks: the connection is nonblocking and PQgetCopyData is called with async = 1. */
typedef int (*get_copy_data_fn)(void *conn, char **buffer, int async);
typedef void (*free_memory_fn)(void *ptr);

#define XLOGDATA_HEAD 25 /* 'w', dataStart, walEnd, sendTime */

static PyObject *read_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !PyDict_Check(args[0]) || !PyList_Check(args[1]) || PyList_GET_SIZE(args[1]) != 4 ||
        !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "read_rows(specs: dict, head: list of 4, conn, get_copy_data, free_memory, "
                                         "pending: list, max_rows, max_bytes)");
        return NULL;
    }
    void *conn = PyLong_AsVoidPtr(args[2]);
    get_copy_data_fn get_copy_data = (get_copy_data_fn)PyLong_AsVoidPtr(args[3]);
    free_memory_fn free_memory = (free_memory_fn)PyLong_AsVoidPtr(args[4]);
    Py_ssize_t max_rows = PyLong_AsSsize_t(args[6]), max_bytes = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (conn == NULL || get_copy_data == NULL || free_memory == NULL) {
        PyErr_SetString(PyExc_ValueError, "read_rows: a null connection or libpq function");
        return NULL;
    }
    PyObject *specs = args[0], *head = args[1], *pending = args[5], *message = NULL;
    Py_ssize_t rows = 0, bytes = 0;
    int code;
    for (;;) {
        if (rows >= max_rows || bytes >= max_bytes) {
            code = 0;
            break;
        }
        char *data = NULL;
        int size = get_copy_data(conn, &data, 1);
        if (size <= 0) {
            code = size == 0 ? 1 : size;
            break;
        }
        if (size > XLOGDATA_HEAD && data[0] == 'w') {
            PyObject *row =
                change_row_at(specs, head, (const unsigned char *)data + XLOGDATA_HEAD, size - XLOGDATA_HEAD);
            if (row == NULL)
                PyErr_Clear(); /* the caller's decode raises it again, as the error that says what is wrong */
            else if (row == Py_None)
                Py_DECREF(row);
            else {
                int rc = PyList_Append(pending, row);
                Py_DECREF(row);
                if (rc < 0) {
                    free_memory(data);
                    return NULL;
                }
                rows++;
                bytes += size - XLOGDATA_HEAD;
                free_memory(data);
                continue;
            }
        }
        message = PyBytes_FromStringAndSize(data, size);
        free_memory(data);
        if (message == NULL)
            return NULL;
        code = 2;
        break;
    }
    return Py_BuildValue("nniN", rows, bytes, code, message ? message : Py_NewRef(Py_None));
}

/* copy_out_into(conn, get_copy_data, free_memory, out): the rows of a COPY ... TO STDOUT that libpq
 * already holds, appended to the bytearray out in order (pq_copy.copy_out_text, whose reference is its
 * loop of pgconn.get_copy_data). conn, get_copy_data and free_memory as for read_rows. Returns
 * PQgetCopyData's code that stopped it: 0 (no whole row is buffered: the caller waits, consumes input
 * and calls again), -1 (the rows' end) or -2 (an error: the caller asks libpq why). Never blocks. */
static PyObject *copy_out_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyByteArray_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "copy_out_into(conn, get_copy_data, free_memory, out: bytearray)");
        return NULL;
    }
    void *conn = PyLong_AsVoidPtr(args[0]);
    get_copy_data_fn get_copy_data = (get_copy_data_fn)PyLong_AsVoidPtr(args[1]);
    free_memory_fn free_memory = (free_memory_fn)PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (conn == NULL || get_copy_data == NULL || free_memory == NULL) {
        PyErr_SetString(PyExc_ValueError, "copy_out_into: a null connection or libpq function");
        return NULL;
    }
    PyObject *out = args[3];
    for (;;) {
        char *data = NULL;
        int size = get_copy_data(conn, &data, 1);
        if (size <= 0)
            return PyLong_FromLong(size);
        Py_ssize_t len = PyByteArray_GET_SIZE(out);
        /* PyByteArray_Resize over-allocates as it grows, as bytearray's += does */
        if (PyByteArray_Resize(out, len + size) < 0) {
            free_memory(data);
            return NULL;
        }
        memcpy(PyByteArray_AS_STRING(out) + len, data, (size_t)size);
        free_memory(data);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Backfill pages: COPY ... TO STDOUT text lines straight to record JSON (see render_copy) */

/* One field of a COPY text line, s[0:n], unescaped into scratch (as backfill_reader.parse_copy_line:
 * \b \f \n \r \t \v \\ are decoded, a backslash before any other character is dropped); *out points
 * at the value (s itself when it holds no backslash). */
static int copy_unescape(Buf *scratch, const char *s, Py_ssize_t n, const char **out) {
    if (memchr(s, '\\', (size_t)n) == NULL) {
        *out = s;
        return 0;
    }
    scratch->len = 0;
    if (buf_reserve(scratch, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '\\' && i + 1 < n) {
            c = s[++i];
            switch (c) {
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'v': c = '\v'; break;
            default: break;
            }
        }
        scratch->data[scratch->len++] = c;
    }
    *out = scratch->data;
    return 0;
}

static int put_offset(Buf *offsets, Py_ssize_t at) {
    if (at > INT32_MAX) {
        PyErr_SetString(decode_error, "a backfill page renders to more than 2 GiB");
        return -1;
    }
    int32_t v = (int32_t)at;
    return buf_put(offsets, (const char *)&v, sizeof v);
}

static PyObject *render_copy(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *kinds_obj, *prefixes, *converters, *columns, *pk_positions;
    if (!PyArg_ParseTuple(args, "y*SO!O!O!O!", &view, &kinds_obj, &PyList_Type, &prefixes, &PyList_Type,
                          &converters, &PyList_Type, &columns, &PyList_Type, &pk_positions))
        return NULL;
    Columns rel = {PyBytes_AS_STRING(kinds_obj), PyBytes_GET_SIZE(kinds_obj), prefixes, converters, columns};
    Py_ssize_t ncols = PyList_GET_SIZE(columns), npk = PyList_GET_SIZE(pk_positions);
    const char *data = view.buf, *end = data + view.len;
    Buf records = {NULL, 0, 0}, record_offsets = {NULL, 0, 0}, pks = {NULL, 0, 0}, pk_offsets = {NULL, 0, 0};
    Buf scratch = {NULL, 0, 0};
    Py_ssize_t rows = 0;
    PyObject *result = NULL;
    /* per column: the field's start and length in the line (start NULL: \N) */
    const char **starts = PyMem_Malloc(sizeof(char *) * (size_t)(ncols ? ncols : 1));
    Py_ssize_t *lens = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(ncols ? ncols : 1));
    Py_ssize_t *pk_col = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(npk ? npk : 1));
    if (starts == NULL || lens == NULL || pk_col == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < npk; j++) {
        pk_col[j] = PyLong_AsSsize_t(PyList_GET_ITEM(pk_positions, j));
        if (pk_col[j] == -1 && PyErr_Occurred())
            goto fail;
        if (pk_col[j] < 0 || pk_col[j] >= ncols) {
            index_error();
            goto fail;
        }
    }
    if (put_offset(&record_offsets, 0) < 0 || put_offset(&pk_offsets, 0) < 0)
        goto fail;
    const char *line = data;
    while (line < end) {
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        if (eol == NULL)
            eol = end;  /* a last line without its newline */
        Py_ssize_t n = 0;
        for (const char *f = line;; n++) {
            const char *tab = memchr(f, '\t', (size_t)(eol - f));
            const char *stop = tab ? tab : eol;
            if (n < ncols) {
                int is_null = stop - f == 2 && f[0] == '\\' && f[1] == 'N';
                starts[n] = is_null ? NULL : f;
                lens[n] = is_null ? 0 : stop - f;
            }
            if (tab == NULL)
                break;
            f = tab + 1;
        }
        if (n + 1 != ncols) {
            PyErr_Format(decode_error, "a COPY line of %zd fields for a table of %zd columns", n + 1, ncols);
            goto fail;
        }
        int first = 1;
        if (buf_putc(&records, '{') < 0)
            goto fail;
        for (Py_ssize_t i = 0; i < ncols; i++) {
            const char *s = starts[i];
            if (s != NULL && copy_unescape(&scratch, starts[i], lens[i], &s) < 0)
                goto fail;
            Py_ssize_t len = s == scratch.data && s != NULL ? scratch.len : lens[i];
            if (append_column(&records, &first, &rel, i, NULL, s, len) < 0)
                goto fail;
        }
        if (buf_putc(&records, '}') < 0 || put_offset(&record_offsets, records.len) < 0 || buf_putc(&pks, '[') < 0)
            goto fail;
        int any = 0;
        for (Py_ssize_t j = 0; j < npk; j++) {
            Py_ssize_t i = pk_col[j];
            if (starts[i] == NULL)
                continue;  /* as pgoutput.pk_texts: a null key part is left out */
            const char *s;
            if (copy_unescape(&scratch, starts[i], lens[i], &s) < 0)
                goto fail;
            if ((any && buf_putc(&pks, ',') < 0) ||
                buf_json_string(&pks, s, s == scratch.data ? scratch.len : lens[i]) < 0)
                goto fail;
            any = 1;
        }
        if (buf_putc(&pks, ']') < 0 || put_offset(&pk_offsets, pks.len) < 0)
            goto fail;
        rows++;
        line = eol + 1;
    }
    if (check_utf8(records.data, records.len) == 0 && check_utf8(pks.data, pks.len) == 0)
        result = Py_BuildValue("(y#y#y#y#n)", records.data ? records.data : "", records.len, record_offsets.data,
                               record_offsets.len, pks.data ? pks.data : "", pks.len, pk_offsets.data, pk_offsets.len,
                               rows);
fail:
    PyMem_Free(starts);
    PyMem_Free(lens);
    PyMem_Free(pk_col);
    PyMem_Free(records.data);
    PyMem_Free(record_offsets.data);
    PyMem_Free(pks.data);
    PyMem_Free(pk_offsets.data);
    PyMem_Free(scratch.data);
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* COPY binary tuples from Arrow columns (message_render.copy_binary_rows) */

enum { FIELD_CONST = 0, FIELD_INT64 = 1, FIELD_INT32 = 2, FIELD_STRING = 3 };

typedef struct {
    int kind;
    Py_buffer a;         /* CONST: the bytes; INT64/INT32: the values; STRING: the int32 offsets */
    Py_buffer b;         /* STRING: the data */
    Py_ssize_t offset;   /* the array's offset into its buffers */
} Field;

static char *put_be32(char *out, uint32_t v) {
    out[0] = (char)(v >> 24); out[1] = (char)(v >> 16); out[2] = (char)(v >> 8); out[3] = (char)v;
    return out + 4;
}

static char *put_be64(char *out, uint64_t v) {
    return put_be32(put_be32(out, (uint32_t)(v >> 32)), (uint32_t)v);
}

static PyObject *copy_binary_rows(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    PyObject *specs;
    if (!PyArg_ParseTuple(args, "nO!", &n, &PyList_Type, &specs))
        return NULL;
    Py_ssize_t nf = PyList_GET_SIZE(specs), ready = 0, total = 0;
    PyObject *result = NULL;
    Field *fields = PyMem_Calloc((size_t)(nf ? nf : 1), sizeof(Field));
    if (fields == NULL)
        return PyErr_NoMemory();
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative row count");
        goto done;
    }
    for (; ready < nf; ready++) {
        Field *f = &fields[ready];
        PyObject *spec = PyList_GET_ITEM(specs, ready);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2) {
            PyErr_SetString(PyExc_TypeError, "a field is a tuple (kind, buffer, ...)");
            goto done;
        }
        f->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
        if (f->kind == -1 && PyErr_Occurred())
            goto done;
        Py_ssize_t want = f->kind == FIELD_CONST ? 2 : f->kind == FIELD_STRING ? 4 : 3;
        if (f->kind < FIELD_CONST || f->kind > FIELD_STRING || PyTuple_GET_SIZE(spec) != want) {
            PyErr_SetString(PyExc_ValueError, "an unknown field kind or a field of the wrong size");
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(spec, 1), &f->a, PyBUF_SIMPLE) < 0)
            goto done;
        if (f->kind == FIELD_STRING && PyObject_GetBuffer(PyTuple_GET_ITEM(spec, 2), &f->b, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&f->a);
            goto done;
        }
        if (f->kind != FIELD_CONST) {
            f->offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, want - 1));
            if (f->offset == -1 && PyErr_Occurred()) {
                ready++;
                goto done;
            }
        }
        Py_ssize_t width = f->kind == FIELD_INT64 ? 8 : 4, size;
        if (f->kind != FIELD_CONST && (f->offset < 0 || f->a.len / width < f->offset + n + (f->kind == FIELD_STRING))) {
            PyErr_SetString(PyExc_ValueError, "a column's buffer is shorter than its rows");
            ready++;
            goto done;
        }
        if (f->kind == FIELD_STRING) {
            const int32_t *off = (const int32_t *)f->a.buf + f->offset;
            if (off[0] < 0 || off[n] < off[0] || off[n] > f->b.len) {
                PyErr_SetString(PyExc_ValueError, "a string column's offsets lie outside its data");
                ready++;
                goto done;
            }
            size = 4 * n + (off[n] - off[0]);
        } else {
            size = (f->kind == FIELD_CONST ? f->a.len : 4 + width) * n;
        }
        if (size > PY_SSIZE_T_MAX - total) {
            PyErr_NoMemory();
            ready++;
            goto done;
        }
        total += size;
    }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(result), *end = out + total;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t j = 0; j < nf; j++) {
            Field *f = &fields[j];
            Py_ssize_t at = f->offset + i;
            switch (f->kind) {
            case FIELD_CONST:
                memcpy(out, f->a.buf, (size_t)f->a.len);
                out += f->a.len;
                break;
            case FIELD_INT64:
                out = put_be64(put_be32(out, 8), (uint64_t)((const int64_t *)f->a.buf)[at]);
                break;
            case FIELD_INT32:
                out = put_be32(put_be32(out, 4), (uint32_t)((const int32_t *)f->a.buf)[at]);
                break;
            default: {
                const int32_t *off = (const int32_t *)f->a.buf;
                int32_t start = off[at], stop = off[at + 1];
                if (stop < start || end - out < 4 + (Py_ssize_t)(stop - start)) {
                    /* offsets that do not grow: not what the first pass measured */
                    PyErr_SetString(PyExc_ValueError, "a string column's offsets lie outside its data");
                    Py_CLEAR(result);
                    goto done;
                }
                out = put_be32(out, (uint32_t)(stop - start));
                memcpy(out, (const char *)f->b.buf + start, (size_t)(stop - start));
                out += stop - start;
            }
            }
        }
    }
    if (out != end) {
        PyErr_SetString(PyExc_ValueError, "a string column's offsets lie outside its data");
        Py_CLEAR(result);
    }
done:
    for (Py_ssize_t j = 0; j < ready; j++) {
        PyBuffer_Release(&fields[j].a);
        if (fields[j].kind == FIELD_STRING)
            PyBuffer_Release(&fields[j].b);
    }
    PyMem_Free(fields);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* Change rows (tuples) to Arrow buffers, column by column (see messages.rows_to_arrow): a first
 * pass sizes each column (column_sizes), Python allocates its buffers from Arrow's memory pool (which
 * keeps its pages: a batch's 60 MB of fresh malloc'd memory cost more in page faults than the copy),
 * a second pass fills them (fill_columns). Kinds: 'q' int64, 'i' int32, 's' string, 'l' list of
 * strings. A value of another type raises TypeError, a size past Arrow's int32 offsets
 * OverflowError: rows_to_arrow then leaves the rows to Arrow's own reading. */

static int utf8_of(PyObject *text, const char **s, Py_ssize_t *n) {
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "a string column holds a value that is not str");
        return -1;
    }
    *s = PyUnicode_AsUTF8AndSize(text, n);
    return *s == NULL ? -1 : 0;
}

static int check_rows(PyObject *rows, Py_ssize_t ncols) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != ncols) {
            PyErr_SetString(PyExc_TypeError, "a row is a tuple of one value per column");
            return -1;
        }
    }
    return 0;
}

static int check_kind(char kind) {
    if (kind == 'q' || kind == 'i' || kind == 's' || kind == 'l')
        return 0;
    PyErr_SetString(PyExc_ValueError, "a column kind is one of q i s l");
    return -1;
}

/* Sizes one value of a column of kind `kind` into *bytes and *items. */
static int size_value(char kind, PyObject *value, Py_ssize_t *bytes, Py_ssize_t *items) {
    const char *s;
    Py_ssize_t len;
    if (value == Py_None)
        return 0;
    switch (kind) {
    case 'q':
    case 'i':
        if (!PyLong_CheckExact(value)) {
            PyErr_SetString(PyExc_TypeError, "an integer column holds a value that is not int");
            return -1;
        }
        return 0;
    case 's':
        if (utf8_of(value, &s, &len) < 0)
            return -1;
        *bytes += len;
        break;
    default:
        if (!PyList_CheckExact(value)) {
            PyErr_SetString(PyExc_TypeError, "a list column holds a value that is not a list");
            return -1;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(value); j++) {
            if (utf8_of(PyList_GET_ITEM(value, j), &s, &len) < 0)
                return -1;
            *bytes += len;
        }
        *items += PyList_GET_SIZE(value);
    }
    if (*bytes > INT32_MAX || *items > INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "a column's strings exceed Arrow's int32 offsets");
        return -1;
    }
    return 0;
}

/* column_sizes(rows, kinds) -> [(utf8_bytes, strings)] per column (0s for integer columns). Row by
 * row, as fill_columns(): a batch's tuples are scattered over more memory than the caches hold. */
static PyObject *column_sizes(PyObject *self, PyObject *args) {
    PyObject *rows, *kinds_obj;
    if (!PyArg_ParseTuple(args, "O!S", &PyList_Type, &rows, &kinds_obj))
        return NULL;
    const char *kinds = PyBytes_AS_STRING(kinds_obj);
    Py_ssize_t ncols = PyBytes_GET_SIZE(kinds_obj), n = PyList_GET_SIZE(rows);
    for (Py_ssize_t k = 0; k < ncols; k++)
        if (check_kind(kinds[k]) < 0)
            return NULL;
    if (check_rows(rows, ncols) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t *sizes = PyMem_Calloc((size_t)(2 * ncols + 1), sizeof(Py_ssize_t));
    if (sizes == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        for (Py_ssize_t k = 0; k < ncols; k++)
            if (size_value(kinds[k], PyTuple_GET_ITEM(row, k), &sizes[2 * k], &sizes[2 * k + 1]) < 0)
                goto done;
    }
    if ((result = PyList_New(ncols)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < ncols; k++) {
        PyObject *size = Py_BuildValue("(nn)", sizes[2 * k], sizes[2 * k + 1]);
        if (size == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, size);
    }
done:
    PyMem_Free(sizes);
    return result;
}

/* One column being filled by fill_columns(): its writable buffers and where it is in them. */
typedef struct {
    char kind;
    Py_buffer b[4];
    int held;
    unsigned char *valid;
    char *values;      /* q/i values, or s/l offsets (int32, n + 1) */
    int32_t *items;    /* l: the strings' offsets */
    Py_ssize_t item_slots, item;
    char *data;        /* s/l: UTF-8 bytes */
    Py_ssize_t size, at, nulls;
} Filling;

static int wrong_size(void) {
    PyErr_SetString(PyExc_ValueError, "a buffer smaller than column_sizes() asked for");
    return -1;
}

/* Copy text's UTF-8 to f's data; its end offset to offsets[slot]. */
static int put_string(Filling *f, PyObject *text, int32_t *offsets, Py_ssize_t slot) {
    const char *s;
    Py_ssize_t len;
    if (utf8_of(text, &s, &len) < 0)
        return -1;
    if (len > f->size - f->at)
        return wrong_size();
    memcpy(f->data + f->at, s, (size_t)len);
    f->at += len;
    offsets[slot] = (int32_t)f->at;
    return 0;
}

static int fill_value(Filling *f, Py_ssize_t i, PyObject *value) {
    int32_t *offsets = (int32_t *)f->values;
    if (value == Py_None) {
        f->nulls++;
        if (f->kind == 'q')
            memset(f->values + 8 * i, 0, 8);
        else if (f->kind == 'i')
            memset(f->values + 4 * i, 0, 4);
        else
            offsets[i + 1] = offsets[i];
        return 0;
    }
    f->valid[i >> 3] |= (unsigned char)(1u << (i & 7));
    switch (f->kind) {
    case 'q':
    case 'i': {
        if (!PyLong_CheckExact(value)) {
            PyErr_SetString(PyExc_TypeError, "an integer column holds a value that is not int");
            return -1;
        }
        long long v = PyLong_AsLongLong(value);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (f->kind == 'q') {
            int64_t w = (int64_t)v;
            memcpy(f->values + 8 * i, &w, 8);
        } else {
            if (v < INT32_MIN || v > INT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "an int32 column's value is out of range");
                return -1;
            }
            int32_t w = (int32_t)v;
            memcpy(f->values + 4 * i, &w, 4);
        }
        return 0;
    }
    case 's':
        return put_string(f, value, offsets, i + 1);
    default:
        if (!PyList_CheckExact(value)) {
            PyErr_SetString(PyExc_TypeError, "a list column holds a value that is not a list");
            return -1;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(value); j++) {
            if (++f->item >= f->item_slots)
                return wrong_size();
            if (put_string(f, PyList_GET_ITEM(value, j), f->items, f->item) < 0)
                return -1;
        }
        offsets[i + 1] = (int32_t)f->item;
        return 0;
    }
}

/* Take column k's buffers (spec: a tuple of writable buffers) for n rows. */
static int start_filling(Filling *f, char kind, PyObject *spec, Py_ssize_t n) {
    int want = kind == 'l' ? 4 : kind == 's' ? 3 : 2;
    f->kind = kind;
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != want) {
        PyErr_SetString(PyExc_ValueError, "a column's buffers are a tuple of 2 (q, i), 3 (s) or 4 (l)");
        return -1;
    }
    for (; f->held < want; f->held++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(spec, f->held), &f->b[f->held], PyBUF_WRITABLE) < 0)
            return -1;
    Py_ssize_t count = kind == 'q' || kind == 'i' ? n : n + 1, width = kind == 'q' ? 8 : 4;
    if (f->b[0].len < (n + 7) / 8 || f->b[1].len < count * width)
        return wrong_size();
    f->valid = f->b[0].buf;
    memset(f->valid, 0, (size_t)((n + 7) / 8));
    f->values = f->b[1].buf;
    if (kind == 's' || kind == 'l')
        ((int32_t *)f->values)[0] = 0;
    if (kind == 'l') {
        f->items = f->b[2].buf;
        f->item_slots = f->b[2].len / 4;
        if (f->item_slots < 1)
            return wrong_size();
        f->items[0] = 0;
    }
    if (kind == 's' || kind == 'l') {
        f->data = f->b[want - 1].buf;
        f->size = f->b[want - 1].len;
    }
    return 0;
}

/* fill_columns(rows, kinds, buffers) -> null count per column. buffers: per column a tuple of
 * writable buffers sized by column_sizes(): (validity, values) for q/i; (validity, offsets, data)
 * for s; (validity, list offsets, string offsets, data) for l. */
static PyObject *fill_columns(PyObject *self, PyObject *args) {
    PyObject *rows, *kinds_obj, *buffers;
    if (!PyArg_ParseTuple(args, "O!SO!", &PyList_Type, &rows, &kinds_obj, &PyList_Type, &buffers))
        return NULL;
    const char *kinds = PyBytes_AS_STRING(kinds_obj);
    Py_ssize_t ncols = PyBytes_GET_SIZE(kinds_obj), n = PyList_GET_SIZE(rows);
    if (PyList_GET_SIZE(buffers) != ncols) {
        PyErr_SetString(PyExc_ValueError, "one tuple of buffers per column");
        return NULL;
    }
    if (check_rows(rows, ncols) < 0)
        return NULL;
    PyObject *result = NULL;
    Filling *cols = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof(Filling));
    if (cols == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < ncols; k++)
        if (check_kind(kinds[k]) < 0 || start_filling(&cols[k], kinds[k], PyList_GET_ITEM(buffers, k), n) < 0)
            goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        for (Py_ssize_t k = 0; k < ncols; k++)
            if (fill_value(&cols[k], i, PyTuple_GET_ITEM(row, k)) < 0)
                goto done;
    }
    if ((result = PyList_New(ncols)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < ncols; k++) {
        PyObject *nulls = PyLong_FromSsize_t(cols[k].nulls);
        if (nulls == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, nulls);
    }
done:
    for (Py_ssize_t k = 0; k < ncols; k++)
        for (int j = 0; j < cols[k].held; j++)
            PyBuffer_Release(&cols[k].b[j]);
    PyMem_Free(cols);
    return result;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *marker, *error;
    if (!PyArg_ParseTuple(args, "OO", &marker, &error))
        return NULL;
    Py_XSETREF(toast_marker, Py_NewRef(marker));
    Py_XSETREF(decode_error, Py_NewRef(error));
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL)
        return NULL;
    if (empty_changes == NULL && (empty_changes = PyUnicode_InternFromString("{}")) == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(toast_marker, decode_error): set once by pgoutput.py."},
    {"parse_tuple", parse_tuple, METH_VARARGS, "parse_tuple(buf, pos) -> (values, pos); see pgoutput.parse_tuple."},
    {"change_row", (PyCFunction)(void (*)(void))change_row, METH_FASTCALL,
     "change_row(specs, head, buf) -> the change row of an insert, an update without old values or with the "
     "whole old row, or a full-row delete, else None; see pgoutput.change_row."},
    {"read_rows", (PyCFunction)(void (*)(void))read_rows, METH_FASTCALL,
     "read_rows(specs, head, conn, get_copy_data, free_memory, pending, max_rows, max_bytes) -> (rows, bytes, code, "
     "message); see replication_protocol.ReplicationStream.read_rows."},
    {"copy_out_into", (PyCFunction)(void (*)(void))copy_out_into, METH_FASTCALL,
     "copy_out_into(conn, get_copy_data, free_memory, out) -> code: the buffered rows of a COPY TO appended to out; "
     "see pq_copy.copy_out_text."},
    {"render", render, METH_VARARGS,
     "render(values, kinds, prefixes, converters, columns, only, fill) -> (record, missing); see pgoutput.render_record."},
    {"render_copy", render_copy, METH_VARARGS,
     "render_copy(data, kinds, prefixes, converters, columns, pk_positions) -> (records, record_offsets, pks, "
     "pk_offsets, rows); see pgoutput.render_copy."},
    {"column_sizes", column_sizes, METH_VARARGS,
     "column_sizes(rows, kinds) -> [(utf8_bytes, strings)] per column; see messages.rows_to_arrow."},
    {"fill_columns", fill_columns, METH_VARARGS,
     "fill_columns(rows, kinds, buffers) -> [null count] per column, the buffers filled; see messages.rows_to_arrow."},
    {"copy_binary_rows", copy_binary_rows, METH_VARARGS,
     "copy_binary_rows(n, fields) -> bytes: n COPY binary tuples; see message_render.copy_binary_rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pgoutput_c", "Compiled hot path of sequin_provider.pgoutput.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pgoutput_c(void) { return PyModule_Create(&module); }
