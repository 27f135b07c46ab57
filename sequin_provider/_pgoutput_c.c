/*
 * Compiled hot path of the pgoutput decoder (sequin_provider/pgoutput.py).
 *
 * Three functions, each the exact counterpart of a pure-Python reference in pgoutput.py, which
 * stays the definition (tests/test_pgoutput.py holds both equal on the same payloads, hostile
 * ones included):
 *
 *   parse_tuple(buf, pos)  ~ pgoutput.parse_tuple: TupleData -> ([str | None | TOAST marker], pos)
 *   render(values, kinds, prefixes, converters, columns, only, fill)
 *                          ~ pgoutput.render_record: a row's record JSON and its unchanged-TOAST columns
 *   render_tuple(buf, pos, kinds, prefixes, converters, columns, pk_positions)
 *                          ~ pgoutput.render_tuple: a whole tuple straight to (record, pks, missing),
 *                            the path of inserts, most updates and full-row deletes
 *
 * render() converts the common types here (kinds, see pgoutput.CONVERTER_KINDS) and calls the
 * Python converter for every other value. configure(toast_marker, decode_error) is called once
 * at import by pgoutput.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *toast_marker = NULL;   /* pgoutput.UNCHANGED_TOAST */
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

static PyObject *parse_tuple(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*n", &view, &pos))
        return NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t size = view.len;
    PyObject *values = NULL;
    if (pos < 0 || pos + 2 > size) {
        truncated("column count");
        goto fail;
    }
    int n = (int16_t)((buf[pos] << 8) | buf[pos + 1]);
    pos += 2;
    values = PyList_New(0);
    if (values == NULL)
        goto fail;
    for (int i = 0; i < n; i++) {
        if (pos >= size) {
            truncated("value kind");
            goto fail;
        }
        unsigned char kind = buf[pos++];
        PyObject *value;
        if (kind == 't' || kind == 'b') {
            if (pos + 4 > size) {
                truncated("value length");
                goto fail;
            }
            int32_t length = (int32_t)(((uint32_t)buf[pos] << 24) | ((uint32_t)buf[pos + 1] << 16) |
                                       ((uint32_t)buf[pos + 2] << 8) | (uint32_t)buf[pos + 3]);
            pos += 4;
            if (length < 0 || length > size - pos) {
                truncated("value bytes");
                goto fail;
            }
            value = PyUnicode_DecodeUTF8((const char *)buf + pos, length, "strict");
            if (value == NULL)
                goto fail;
            pos += length;
        } else if (kind == 'n') {
            value = Py_NewRef(Py_None);
        } else if (kind == 'u') {
            value = Py_NewRef(toast_marker);
        } else {
            PyErr_Format(decode_error, "unknown tuple value kind '%c'", kind);
            goto fail;
        }
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

static PyObject *render(PyObject *self, PyObject *args) {
    PyObject *values, *kinds_obj, *prefixes, *converters, *columns, *only, *fill;
    if (!PyArg_ParseTuple(args, "O!SO!O!O!OO", &PyList_Type, &values, &kinds_obj, &PyList_Type, &prefixes,
                          &PyList_Type, &converters, &PyList_Type, &columns, &only, &fill))
        return NULL;
    const char *kinds = PyBytes_AS_STRING(kinds_obj);
    Py_ssize_t nkinds = PyBytes_GET_SIZE(kinds_obj);
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
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail;
        }
        PyObject *v = PyList_GET_ITEM(values, i);
        if (v == toast_marker && fill != Py_None && i < nfill) {
            PyObject *f = PyList_GET_ITEM(fill, i);
            if (f != toast_marker)
                v = f;
        }
        if (v == toast_marker) {
            if (i >= PyList_GET_SIZE(columns)) {
                PyErr_SetString(PyExc_IndexError, "list index out of range");
                goto fail;
            }
            if (PyList_Append(missing, PyList_GET_ITEM(columns, i)) < 0)
                goto fail;
            continue;
        }
        if (i >= PyList_GET_SIZE(prefixes) || (v != Py_None && (i >= PyList_GET_SIZE(converters) || i >= nkinds))) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail;
        }
        if (!first && buf_putc(&out, ',') < 0)
            goto fail;
        first = 0;
        if (buf_put_str(&out, PyList_GET_ITEM(prefixes, i)) < 0)
            goto fail;
        if (v == Py_None) {
            if (buf_put(&out, "null", 4) < 0)
                goto fail;
            continue;
        }
        int handled = 0;
        if (PyUnicode_CheckExact(v)) {
            Py_ssize_t n;
            const char *s = PyUnicode_AsUTF8AndSize(v, &n);
            if (s == NULL)
                goto fail;
            handled = convert_native(&out, kinds[i], s, n);
            if (handled < 0)
                goto fail;
        }
        if (!handled) {
            PyObject *json = PyObject_CallOneArg(PyList_GET_ITEM(converters, i), v);
            if (json == NULL)
                goto fail;
            int rc = PyUnicode_Check(json) ? buf_put_str(&out, json) : -1;
            if (rc < 0 && !PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a converter must return str");
            Py_DECREF(json);
            if (rc < 0)
                goto fail;
        }
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

/* Raise UnicodeDecodeError when bytes that are not copied into the output are not UTF-8. */
static int check_utf8(const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((unsigned char)s[i] >= 0x80) {
            PyObject *text = PyUnicode_DecodeUTF8(s, n, "strict");
            if (text == NULL)
                return -1;
            Py_DECREF(text);
            return 0;
        }
    }
    return 0;
}

static PyObject *render_tuple(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos;
    PyObject *kinds_obj, *prefixes, *converters, *columns, *pk_positions;
    if (!PyArg_ParseTuple(args, "y*nSO!O!O!O!", &view, &pos, &kinds_obj, &PyList_Type, &prefixes, &PyList_Type,
                          &converters, &PyList_Type, &columns, &PyList_Type, &pk_positions))
        return NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t size = view.len;
    const char *kinds = PyBytes_AS_STRING(kinds_obj);
    Py_ssize_t nkinds = PyBytes_GET_SIZE(kinds_obj);
    Py_ssize_t npk = PyList_GET_SIZE(pk_positions);
    PyObject *missing = NULL, *pks = NULL, *pk_values = NULL, *record = NULL;
    Buf out = {NULL, 0, 0};
    /* per pk position: the value's offset and length in buf (-1: null or unchanged TOAST) */
    Py_ssize_t pk_off[16], pk_len[16];
    Py_ssize_t *pk_at = NULL;
    if (npk > 16) {
        pk_at = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)npk);
        if (pk_at == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    Py_ssize_t *offs = pk_at ? pk_at : pk_off, *lens = pk_at ? pk_at + npk : pk_len;
    Py_ssize_t *pk_col = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(npk ? npk : 1));
    if (pk_col == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < npk; j++) {
        pk_col[j] = PyLong_AsSsize_t(PyList_GET_ITEM(pk_positions, j));
        if (pk_col[j] == -1 && PyErr_Occurred())
            goto fail_cols;
        offs[j] = -2; /* not seen: the tuple is shorter than the position */
        lens[j] = 0;
    }
    missing = PyList_New(0);
    if (missing == NULL)
        goto fail_cols;
    if (pos < 0 || pos + 2 > size) {
        truncated("column count");
        goto fail_cols;
    }
    int n = (int16_t)((buf[pos] << 8) | buf[pos + 1]);
    pos += 2;
    if (buf_putc(&out, '{') < 0)
        goto fail_cols;
    int first = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos >= size) {
            truncated("value kind");
            goto fail_cols;
        }
        unsigned char kind = buf[pos++];
        const char *s = NULL;
        Py_ssize_t len = -1;
        if (kind == 't' || kind == 'b') {
            if (pos + 4 > size) {
                truncated("value length");
                goto fail_cols;
            }
            int32_t length = (int32_t)(((uint32_t)buf[pos] << 24) | ((uint32_t)buf[pos + 1] << 16) |
                                       ((uint32_t)buf[pos + 2] << 8) | (uint32_t)buf[pos + 3]);
            pos += 4;
            if (length < 0 || length > size - pos) {
                truncated("value bytes");
                goto fail_cols;
            }
            s = (const char *)buf + pos;
            len = length;
            pos += length;
        } else if (kind != 'n' && kind != 'u') {
            PyErr_Format(decode_error, "unknown tuple value kind '%c'", kind);
            goto fail_cols;
        }
        for (Py_ssize_t j = 0; j < npk; j++) {
            if (pk_col[j] == i) {
                offs[j] = s ? (Py_ssize_t)(s - (const char *)buf) : -1;
                lens[j] = len;
            }
        }
        if (kind == 'u') {
            if (i >= PyList_GET_SIZE(columns)) {
                PyErr_SetString(PyExc_IndexError, "list index out of range");
                goto fail_cols;
            }
            if (PyList_Append(missing, PyList_GET_ITEM(columns, i)) < 0)
                goto fail_cols;
            continue;
        }
        if (i >= PyList_GET_SIZE(prefixes) || (s && (i >= PyList_GET_SIZE(converters) || i >= nkinds))) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail_cols;
        }
        if (!first && buf_putc(&out, ',') < 0)
            goto fail_cols;
        first = 0;
        if (buf_put_str(&out, PyList_GET_ITEM(prefixes, i)) < 0)
            goto fail_cols;
        if (s == NULL) {
            if (buf_put(&out, "null", 4) < 0)
                goto fail_cols;
            continue;
        }
        if (kinds[i] == KIND_BOOL && check_utf8(s, len) < 0)
            goto fail_cols;
        int handled = convert_native(&out, kinds[i], s, len);
        if (handled < 0)
            goto fail_cols;
        if (!handled) {
            PyObject *text = PyUnicode_DecodeUTF8(s, len, "strict");
            if (text == NULL)
                goto fail_cols;
            PyObject *json = PyObject_CallOneArg(PyList_GET_ITEM(converters, i), text);
            Py_DECREF(text);
            if (json == NULL)
                goto fail_cols;
            int rc = PyUnicode_Check(json) ? buf_put_str(&out, json) : -1;
            if (rc < 0 && !PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a converter must return str");
            Py_DECREF(json);
            if (rc < 0)
                goto fail_cols;
        }
    }
    if (buf_putc(&out, '}') < 0)
        goto fail_cols;
    record = PyUnicode_DecodeUTF8(out.data, out.len, "strict");
    if (record == NULL)
        goto fail_cols;
    pks = PyList_New(0);
    if (pks == NULL)
        goto fail_cols;
    for (Py_ssize_t j = 0; j < npk; j++) {
        if (offs[j] == -2) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail_cols;
        }
        if (offs[j] < 0)
            continue;
        PyObject *text = PyUnicode_DecodeUTF8((const char *)buf + offs[j], lens[j], "strict");
        if (text == NULL)
            goto fail_cols;
        int rc = PyList_Append(pks, text);
        Py_DECREF(text);
        if (rc < 0)
            goto fail_cols;
    }
    PyMem_Free(pk_col);
    PyMem_Free(pk_at);
    PyMem_Free(out.data);
    PyBuffer_Release(&view);
    return Py_BuildValue("(NNN)", record, pks, missing);
fail_cols:
    PyMem_Free(pk_col);
fail:
    PyMem_Free(pk_at);
    PyMem_Free(out.data);
    Py_XDECREF(record);
    Py_XDECREF(pks);
    Py_XDECREF(pk_values);
    Py_XDECREF(missing);
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *marker, *error;
    if (!PyArg_ParseTuple(args, "OO", &marker, &error))
        return NULL;
    Py_XSETREF(toast_marker, Py_NewRef(marker));
    Py_XSETREF(decode_error, Py_NewRef(error));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(toast_marker, decode_error): set once by pgoutput.py."},
    {"parse_tuple", parse_tuple, METH_VARARGS, "parse_tuple(buf, pos) -> (values, pos); see pgoutput.parse_tuple."},
    {"render_tuple", render_tuple, METH_VARARGS,
     "render_tuple(buf, pos, kinds, prefixes, converters, columns, pk_positions) -> (record, pks, missing); "
     "see pgoutput.render_tuple."},
    {"render", render, METH_VARARGS,
     "render(values, kinds, prefixes, converters, columns, only, fill) -> (record, missing); see pgoutput.render_record."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pgoutput_c", "Compiled hot path of sequin_provider.pgoutput.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pgoutput_c(void) { return PyModule_Create(&module); }
