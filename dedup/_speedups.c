/* Optional C core of the containment and repeated-passage searches of promptsplice.dedup.
 *
 * The pure-Python passes (dedup/_passes.py) stay the reference: these two functions
 * return exactly what their Python counterparts find (the first occurrence of each
 * needle in the earliest chunk searched; tests/dedup/test_speedups.py compares the
 * two on random requests), only without a Python object per sentence piece.
 *
 * Filter: a needle (a whole chunk, or a paragraph) that occurs inside an earlier chunk H
 * has each *interior* piece (bytes between two of its dots) as an interior piece of H,
 * since a one-byte delimiter cannot be misaligned.  The 64-bit hashes of the interior
 * pieces of the chunks searched so far are kept in one open-addressing set; a needle
 * with an interior piece missing from it is not searched.  A hash collision only makes
 * the filter search more, never less, so results are exact by construction (every
 * match comes from memmem).
 *
 * Built by setup.py as an optional extension: without a C compiler the package installs
 * and runs the Python passes (promptsplice.dedup.ACCELERATED says which).
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- hashing and a set of 64-bit hashes ---------------------------------------- */

static inline uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* A hash of a piece from its length and at most 24 of its bytes (head, middle, tail):
 * equal pieces hash equal, which is all the filter needs (a collision only makes it
 * search more); O(1) per piece whatever its length. */
static uint64_t hash_piece(const unsigned char *p, Py_ssize_t n) {
    uint64_t a = 0, b = 0, c = 0;
    if (n >= 8) {
        a = rd64(p);
        b = rd64(p + (n - 8) / 2);
        c = rd64(p + n - 8);
    } else {
        memcpy(&a, p, (size_t)n);
    }
    uint64_t h = (0x9E3779B97F4A7C15ULL ^ (uint64_t)n) * 0xff51afd7ed558ccdULL;
    h = (h ^ a) * 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 31;
    h = (h ^ b) * 0x94d049bb133111ebULL;
    h ^= h >> 29;
    h = (h ^ c) * 0xff51afd7ed558ccdULL;
    h ^= h >> 32;
    return h ? h : 1; /* 0 marks an empty slot */
}

typedef struct {
    uint64_t *slots;
    size_t mask;
    size_t used;
} HashSet;

static int hs_init(HashSet *s) {
    s->mask = 255;
    s->used = 0;
    s->slots = PyMem_Calloc(s->mask + 1, sizeof(uint64_t));
    if (!s->slots) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void hs_free(HashSet *s) { PyMem_Free(s->slots); }

static int hs_grow(HashSet *s) {
    size_t cap = (s->mask + 1) * 2;
    uint64_t *slots = PyMem_Calloc(cap, sizeof(uint64_t));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= s->mask; i++) {
        uint64_t h = s->slots[i];
        if (h) {
            size_t j = h & (cap - 1);
            while (slots[j]) j = (j + 1) & (cap - 1);
            slots[j] = h;
        }
    }
    PyMem_Free(s->slots);
    s->slots = slots;
    s->mask = cap - 1;
    return 0;
}

static int hs_add(HashSet *s, uint64_t h) {
    size_t i = h & s->mask;
    while (s->slots[i]) {
        if (s->slots[i] == h) return 0;
        i = (i + 1) & s->mask;
    }
    s->slots[i] = h;
    if (++s->used * 2 > s->mask + 1) return hs_grow(s);
    return 0;
}

static int hs_has(const HashSet *s, uint64_t h) {
    size_t i = h & s->mask;
    while (s->slots[i]) {
        if (s->slots[i] == h) return 1;
        i = (i + 1) & s->mask;
    }
    return 0;
}

/* Add the hashes of the interior pieces of p[0:n] (between two dots). */
static int add_pieces(HashSet *s, const unsigned char *p, Py_ssize_t n) {
    const unsigned char *end = p + n;
    const unsigned char *dot = memchr(p, '.', (size_t)n);
    while (dot) {
        const unsigned char *start = dot + 1;
        dot = start < end ? memchr(start, '.', (size_t)(end - start)) : NULL;
        if (dot && hs_add(s, hash_piece(start, dot - start)) < 0) return -1;
    }
    return 0;
}

/* 0 when an interior piece of p[0:n] is missing from the set: p occurs in none of the
 * chunks the set was built from.  1 otherwise (also when p has no interior piece). */
static int may_occur(const HashSet *s, const unsigned char *p, Py_ssize_t n) {
    const unsigned char *end = p + n;
    const unsigned char *dot = memchr(p, '.', (size_t)n);
    while (dot) {
        const unsigned char *start = dot + 1;
        dot = start < end ? memchr(start, '.', (size_t)(end - start)) : NULL;
        if (dot && !hs_has(s, hash_piece(start, dot - start))) return 0;
    }
    return 1;
}

/* The next paragraph break (b"\n\n") in p[0:n], or NULL: memchr for the first byte,
 * which the libc scans with SIMD (memmem's short-needle path is bytewise). */
static const unsigned char *next_break(const unsigned char *p, const unsigned char *end) {
    while (p < end) {
        const unsigned char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl || nl + 1 >= end) return NULL;
        if (nl[1] == '\n') return nl;
        p = nl + 2 <= end ? nl + 1 : end;
    }
    return NULL;
}

/* ---- the searches ------------------------------------------------------------------ */

typedef struct {
    const unsigned char *p;
    Py_ssize_t n;
} Span;

static Span *spans_of(PyObject *list, Py_ssize_t *count) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "expected a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    Span *spans = PyMem_Malloc(sizeof(Span) * (size_t)(n ? n : 1));
    if (!spans) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyBytes_Check(item)) {
            PyMem_Free(spans);
            PyErr_SetString(PyExc_TypeError, "expected a list of bytes");
            return NULL;
        }
        spans[i].p = (const unsigned char *)PyBytes_AS_STRING(item);
        spans[i].n = PyBytes_GET_SIZE(item);
    }
    *count = n;
    return spans;
}

/* The first occurrence of needle in hay, or -1.  A needle holding a dot (at offset i,
 * its first) can only start at d - i for a dot d of hay, so the search walks hay's dots
 * with memchr and compares there: in prose dots are ~1 byte in 100, which beats a
 * full scan.  Text dense in dots falls back to memmem (two-way, linear) after a budget
 * of comparisons, so the worst case stays linear. */
static Py_ssize_t find_in(const unsigned char *hay, Py_ssize_t hn, const unsigned char *needle,
                          Py_ssize_t nn, Py_ssize_t dot) {
    if (hn < nn) return -1;
    Py_ssize_t from = 0;
    if (dot >= 0) {
        Py_ssize_t last = hn - nn + dot; /* the last dot position a match can have */
        Py_ssize_t budget = hn / 16 + 16;
        const unsigned char *d = hay + dot;
        const unsigned char *stop = hay + last + 1;
        while (d < stop && (d = memchr(d, '.', (size_t)(stop - d))) != NULL) {
            if (memcmp(d - dot, needle, (size_t)nn) == 0) return (d - dot) - hay;
            d++;
            if (--budget == 0) {
                from = (d - dot) - hay; /* no match starts before this */
                goto plain;
            }
        }
        return -1;
    }
plain:;
    const unsigned char *q = memmem(hay + from, (size_t)(hn - from), needle, (size_t)nn);
    return q ? q - hay : -1;
}

/* The first occurrence of needle in spans[0:limit]: its item (or -1) and offset. */
static Py_ssize_t first_in(const Span *spans, Py_ssize_t limit, const unsigned char *needle,
                           Py_ssize_t len, Py_ssize_t *at) {
    const unsigned char *dp = memchr(needle, '.', (size_t)len);
    Py_ssize_t dot = dp ? dp - needle : -1;
    for (Py_ssize_t h = 0; h < limit; h++) {
        Py_ssize_t pos = find_in(spans[h].p, spans[h].n, needle, len, dot);
        if (pos >= 0) {
            *at = pos;
            return h;
        }
    }
    return -1;
}

PyDoc_STRVAR(contained_doc,
"contained(datas) -> list of (r, h, offset)\n\n"
"For each r >= 1, the first occurrence of datas[r] in datas[:r] (earliest item h, first\n"
"offset), for the r that occur; ascending r.");

static PyObject *contained(PyObject *self, PyObject *arg) {
    Py_ssize_t n;
    Span *spans = spans_of(arg, &n);
    if (!spans) return NULL;
    HashSet set;
    PyObject *out = PyList_New(0);
    if (!out || hs_init(&set) < 0) {
        Py_XDECREF(out);
        PyMem_Free(spans);
        return NULL;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        if (r > 0 && may_occur(&set, spans[r].p, spans[r].n)) {
            Py_ssize_t at = 0;
            Py_ssize_t h = first_in(spans, r, spans[r].p, spans[r].n, &at);
            if (h >= 0) {
                PyObject *t = Py_BuildValue("(nnn)", r, h, at);
                if (!t || PyList_Append(out, t) < 0) {
                    Py_XDECREF(t);
                    goto fail;
                }
                Py_DECREF(t);
            }
        }
        if (add_pieces(&set, spans[r].p, spans[r].n) < 0) goto fail;
    }
    hs_free(&set);
    PyMem_Free(spans);
    return out;
fail:
    hs_free(&set);
    PyMem_Free(spans);
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(passage_scan_doc,
"passage_scan(datas, start, min_passage, whole_chunks) -> (j, hits) or None\n\n"
"The first chunk j >= start (j >= 1) with a paragraph (datas[j].split(b'\\n\\n')) of at\n"
"least min_passage bytes that occurs in datas[:j]; hits lists (paragraph index, its\n"
"offset in datas[j], its length, h, offset in datas[h]) for each such paragraph, h the\n"
"earliest item holding it.  A chunk of one paragraph is skipped unless whole_chunks.");

static PyObject *passage_scan(PyObject *self, PyObject *args) {
    PyObject *list;
    Py_ssize_t start, mp;
    int whole;
    if (!PyArg_ParseTuple(args, "Onnp", &list, &start, &mp, &whole)) return NULL;
    Py_ssize_t n;
    Span *spans = spans_of(list, &n);
    if (!spans) return NULL;
    if (start < 0) start = 0;
    HashSet set;
    PyObject *hits = NULL;
    if (hs_init(&set) < 0) {
        PyMem_Free(spans);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n && j < start; j++)
        if (add_pieces(&set, spans[j].p, spans[j].n) < 0) goto fail;
    for (Py_ssize_t j = start; j < n; j++) {
        const unsigned char *d = spans[j].p;
        Py_ssize_t len = spans[j].n;
        if (j > 0 && len >= mp) {
            const unsigned char *end = d + len;
            const unsigned char *brk = next_break(d, end);
            if (brk || whole) {
                const unsigned char *p = d;
                Py_ssize_t i = 0;
                for (;;) {
                    const unsigned char *stop = brk ? brk : end;
                    Py_ssize_t plen = stop - p;
                    if (plen >= mp && may_occur(&set, p, plen)) {
                        Py_ssize_t at = 0;
                        Py_ssize_t h = first_in(spans, j, p, plen, &at);
                        if (h >= 0) {
                            if (!hits && !(hits = PyList_New(0))) goto fail;
                            PyObject *t = Py_BuildValue("(nnnnn)", i, (Py_ssize_t)(p - d), plen, h, at);
                            if (!t || PyList_Append(hits, t) < 0) {
                                Py_XDECREF(t);
                                goto fail;
                            }
                            Py_DECREF(t);
                        }
                    }
                    if (!brk) break;
                    p = brk + 2;
                    i++;
                    brk = next_break(p, end);
                }
                if (hits) {
                    hs_free(&set);
                    PyMem_Free(spans);
                    PyObject *res = Py_BuildValue("(nN)", j, hits);
                    return res;
                }
            }
        }
        if (add_pieces(&set, d, len) < 0) goto fail;
    }
    hs_free(&set);
    PyMem_Free(spans);
    Py_RETURN_NONE;
fail:
    hs_free(&set);
    PyMem_Free(spans);
    Py_XDECREF(hits);
    return NULL;
}

static PyMethodDef methods[] = {
    {"contained", contained, METH_O, contained_doc},
    {"passage_scan", passage_scan, METH_VARARGS, passage_scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups",
    "C core of promptsplice.dedup's containment and passage searches (optional).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
