/* Optional C core of the overlap, containment and repeated-passage searches of
 * promptsplice.dedup.
 *
 * The pure-Python passes (dedup/_passes.py, dedup/_overlap.py) stay the reference:
 * these functions return exactly what their Python counterparts find (the first
 * occurrence of each needle in the earliest chunk searched; tests/dedup/test_speedups.py
 * compares them with the Python passes and with brute-force searches on random input),
 * only without a Python object per sentence piece.  The records are made in Python.
 *
 * Filter: wherever a needle (a whole chunk, or a paragraph) occurs, each of its dots
 * with 8 bytes on both sides inside the needle sits in the same 17 bytes there.  The
 * keys (hashes of those 16 bytes, seeded per process so that crafted text cannot pile
 * them into one probe chain) of the dots of the chunks searched so far are kept in one
 * open-addressing set; a needle with a dot key missing from it is not searched.  A hash
 * collision only makes the filter search more, never less, so results are exact by
 * construction (every match is confirmed by comparing bytes).  This is the Python
 * passes' sentence-piece filter in another form: a key per dot instead of a Python
 * object per piece, and it also prunes needles with a single dot.
 *
 * Text without ASCII dots (CJK full stops, Thai, tables, code) gives the filter nothing
 * to key on.  A needle without a dot key asks a grid-gram index of the chunks searched
 * so far instead (the Python passes' grid index in C, built the first time a call has
 * a second such needle): its candidate places come from hash look-ups, so it is not
 * searched in every earlier chunk, which made such a call quadratic in its chunks.
 *
 * The inputs' bytes objects are held (a new reference each) for the whole call: a
 * callback, or a garbage collection run while a result is built, cannot free them.
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

/* ---- portability: memrchr is GNU's, memmem is missing on MSVC ---------------------- */

#if !defined(__GLIBC__)
static void *ps_memrchr(const void *s, int c, size_t n) {
    const unsigned char *p = (const unsigned char *)s + n;
    while (p > (const unsigned char *)s)
        if (*--p == (unsigned char)c) return (void *)p;
    return NULL;
}
#define memrchr ps_memrchr
#endif

#if defined(_MSC_VER)
static void *ps_memmem(const void *h, size_t hn, const void *n, size_t nn) {
    const unsigned char *p = h, *end = (const unsigned char *)h + hn;
    if (nn == 0) return (void *)h;
    while (hn >= nn && (p = memchr(p, *(const unsigned char *)n, (size_t)(end - p - nn + 1)))) {
        if (memcmp(p, n, nn) == 0) return (void *)p;
        p++;
        if ((size_t)(end - p) < nn) break;
    }
    return NULL;
}
#define memmem ps_memmem
#endif

/* ---- hashing and a set of 64-bit hashes ---------------------------------------- */

static uint64_t seed = 0x9E3779B97F4A7C15ULL; /* replaced from os.urandom at import */

static inline uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

typedef struct {
    uint64_t *slots;
    size_t mask;
    size_t used;
} HashSet;

static int hs_init(HashSet *s) {
    s->mask = 1023; /* a 20-chunk request holds ~200 keys: no growth */
    s->used = 0;
    s->slots = PyMem_Calloc(s->mask + 1, sizeof(uint64_t));
    if (!s->slots) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void hs_free(HashSet *s) {
    PyMem_Free(s->slots);
    s->slots = NULL;
}

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

/* The key of the dot at p[i]: a seeded hash of the 8 bytes before it and the 8 after. */
static inline uint64_t dot_key(const unsigned char *p, Py_ssize_t i) {
    uint64_t h = (rd64(p + i - 8) ^ seed) * 0xff51afd7ed558ccdULL;
    h ^= h >> 31;
    h = (h ^ rd64(p + i + 1)) * 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 29;
    h = (h ^ seed) * 0x94d049bb133111ebULL;
    h ^= h >> 32;
    return h ? h : 1; /* 0 marks an empty slot */
}

/* The dot keys of one chunk, with the dots' offsets (ascending), computed once a chunk. */
typedef struct {
    uint64_t *key;
    Py_ssize_t *pos;
    Py_ssize_t n, cap;
} Keys;

static void keys_free(Keys *ks) {
    PyMem_Free(ks->key);
    PyMem_Free(ks->pos);
}

static int keys_of(Keys *ks, const unsigned char *p, Py_ssize_t n) {
    ks->n = 0;
    if (n < 17) return 0;
    const unsigned char *stop = p + n - 8; /* a dot needs 8 bytes after it */
    const unsigned char *d = p + 8;
    while (d < stop && (d = memchr(d, '.', (size_t)(stop - d))) != NULL) {
        if (ks->n == ks->cap) {
            Py_ssize_t cap = ks->cap ? ks->cap * 2 : 64;
            uint64_t *key = PyMem_Realloc(ks->key, sizeof(uint64_t) * (size_t)cap);
            if (key) ks->key = key;
            Py_ssize_t *pos = key ? PyMem_Realloc(ks->pos, sizeof(Py_ssize_t) * (size_t)cap) : NULL;
            if (!key || !pos) {
                PyErr_NoMemory();
                return -1;
            }
            ks->pos = pos;
            ks->cap = cap;
        }
        ks->key[ks->n] = dot_key(p, d - p);
        ks->pos[ks->n++] = d - p;
        d++;
    }
    return 0;
}

/* 0 when p[lo:hi] of the chunk whose keys ks holds cannot occur in the chunks the set
 * was built from: one of its dots with 8 bytes on each side inside [lo, hi) (the
 * chunk's dots at offsets in [lo + 8, hi - 8)) has a key missing from the set.  1
 * when it has such dots and all their keys are there; NO_KEYS when it has none (text
 * without ASCII dots: the filter cannot tell, the gram index below can).  *cursor (the
 * first key not before lo + 8) only moves forward, so the ranges of one chunk, asked in
 * ascending order, cost O(dots + ranges). */
#define NO_KEYS 2
static int keys_may_occur(const HashSet *s, const Keys *ks, Py_ssize_t lo, Py_ssize_t hi,
                          Py_ssize_t *cursor) {
    Py_ssize_t i = *cursor;
    while (i < ks->n && ks->pos[i] < lo + 8) i++;
    *cursor = i;
    if (i >= ks->n || ks->pos[i] >= hi - 8) return NO_KEYS;
    for (; i < ks->n && ks->pos[i] < hi - 8; i++)
        if (!hs_has(s, ks->key[i])) return 0;
    return 1;
}

static int keys_add(HashSet *s, const Keys *ks) {
    for (Py_ssize_t i = 0; i < ks->n; i++)
        if (hs_add(s, ks->key[i]) < 0) return -1;
    return 0;
}

/* The next paragraph break (b"\n\n") in [p, end), or NULL: memchr for the first byte,
 * which the libc scans with SIMD (memmem's short-needle path is bytewise). */
static const unsigned char *next_break(const unsigned char *p, const unsigned char *end) {
    while (p < end) {
        const unsigned char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl || nl + 1 >= end) return NULL;
        if (nl[1] == '\n') return nl;
        p = nl + 1;
    }
    return NULL;
}

/* ---- the inputs --------------------------------------------------------------------- */

typedef struct {
    PyObject *obj; /* a new reference, held for the call */
    const unsigned char *p;
    Py_ssize_t n;
} Span;

static void spans_free(Span *spans, Py_ssize_t n) {
    if (!spans) return;
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(spans[i].obj);
    PyMem_Free(spans);
}

static Span *spans_of(PyObject *list, Py_ssize_t *count) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "expected a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    Span *spans = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Span));
    if (!spans) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyBytes_Check(item)) {
            spans_free(spans, i);
            PyErr_SetString(PyExc_TypeError, "expected a list of bytes");
            return NULL;
        }
        Py_INCREF(item);
        spans[i].obj = item;
        spans[i].p = (const unsigned char *)PyBytes_AS_STRING(item);
        spans[i].n = PyBytes_GET_SIZE(item);
    }
    *count = n;
    return spans;
}

/* ---- the gram index: where the dot filter has no say -------------------------------- */

/* A needle without a dot key (text without ASCII dots: CJK full stops, Thai, tables,
 * code) passes the dot filter, and a plain search of every earlier chunk is quadratic
 * in the chunks.  Such needles look up the chunks' grid grams instead (the Python
 * passes' grid index, dedup/_anchors.py, in C): every GRAM_K-byte gram of a chunk at
 * offsets 0, GRAM_S, 2 GRAM_S, ... is filed under its seeded hash, with its chunk and
 * offset, in the order added (chunks in ascending index, offsets ascending).  A needle
 * of at least GRAM_MIN bytes that occurs at offset o of a chunk covers the grid point
 * o + j, j = (-o) mod GRAM_S, and every grid point o + j + t GRAM_S whose gram lies
 * inside it; each of those grams is the needle's gram at offset j + t GRAM_S.  So for
 * each phase j the occurrences are among the places of the needle's first gram of that
 * phase, and among those of its last one: the rarer of the two is walked, each place
 * confirmed by comparing bytes.  The answer is the first occurrence in the earliest
 * chunk, as a plain search gives.  The index is built when a call has a second needle
 * without dot keys (the first one is searched plainly): text with dots rarely has two,
 * so it does not pay for the index.  Periodic text piles places under one gram: a
 * needle whose places would cost more than the bytes a plain search reads is searched
 * plainly, and so is one whose walk runs past that budget (at most twice a plain
 * search in all).  Hash collisions only add places to confirm. */

#define GRAM_K 16
#define GRAM_S 16
#define GRAM_MIN (GRAM_K + GRAM_S - 1)

/* A slot of the index: a gram's hash (32 bits: a collision only adds candidates) and its
 * places, a list in the order added (head, tail: indices into places), count long. */
typedef struct {
    uint32_t key; /* 0: empty */
    int32_t head, tail, count;
} GSlot;

typedef struct {
    int32_t chunk, pos, next; /* next: -1 at the tail */
} GPlace;

typedef struct {
    GSlot *slots;
    size_t mask, used;
    GPlace *places;
    Py_ssize_t n, cap;
    Py_ssize_t chunks;  /* spans[0:chunks] are indexed; -1: no index (yet); GRAMS_OFF */
    Py_ssize_t bytes;   /* their total length */
    int searched;       /* a needle without dot keys was searched plainly */
    Py_ssize_t total;   /* the bytes of the call's chunks (sizes the table) */
} Grams;

/* g->chunks of a call whose chunks hold over GRAMS_MAX bytes (offsets are 32-bit): no
 * index, plain searches only. */
#define GRAMS_OFF (-2)
#define GRAMS_MAX ((Py_ssize_t)1 << 30)

/* What the searches did since import (the tests count them): plain searches of one
 * chunk, needles answered by the gram index, and walks that ran out of budget. */
static Py_ssize_t n_scans = 0, n_indexed = 0, n_over_budget = 0;

static inline uint32_t gram_key(const unsigned char *p) {
    uint64_t h = (rd64(p) ^ seed) * 0xff51afd7ed558ccdULL;
    h ^= h >> 31;
    h = (h ^ rd64(p + 8)) * 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 29;
    uint32_t k = (uint32_t)(h >> 32);
    return k ? k : 1;
}

static void grams_free(Grams *g) {
    PyMem_Free(g->slots);
    PyMem_Free(g->places);
    g->slots = NULL;
    g->places = NULL;
}

static int grams_grow(Grams *g) {
    size_t cap = (g->mask + 1) * 2;
    GSlot *slots = PyMem_Calloc(cap, sizeof(GSlot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= g->mask; i++) {
        if (g->slots[i].key) {
            size_t j = g->slots[i].key & (cap - 1);
            while (slots[j].key) j = (j + 1) & (cap - 1);
            slots[j] = g->slots[i];
        }
    }
    PyMem_Free(g->slots);
    g->slots = slots;
    g->mask = cap - 1;
    return 0;
}

static const GSlot *grams_get(const Grams *g, uint32_t key) {
    size_t i = key & g->mask;
    while (g->slots[i].key) {
        if (g->slots[i].key == key) return &g->slots[i];
        i = (i + 1) & g->mask;
    }
    return NULL;
}

/* Index spans[index] (the next chunk: index == g->chunks). */
static int grams_add(Grams *g, const Span *span, Py_ssize_t index) {
    const unsigned char *p = span->p;
    Py_ssize_t n = span->n;
    if (n > GRAMS_MAX - g->bytes) {
        grams_free(g);
        g->chunks = GRAMS_OFF;
        return 0;
    }
    Py_ssize_t more = n >= GRAM_K ? (n - GRAM_K) / GRAM_S + 1 : 0;
    if (g->n + more > g->cap) {
        Py_ssize_t cap = g->cap ? g->cap : 256;
        while (cap < g->n + more) cap *= 2;
        GPlace *places = cap <= INT32_MAX ? PyMem_Realloc(g->places, sizeof(GPlace) * (size_t)cap) : NULL;
        if (!places) {
            PyErr_NoMemory();
            return -1;
        }
        g->places = places;
        g->cap = cap;
    }
    for (Py_ssize_t pos = 0; pos + GRAM_K <= n; pos += GRAM_S) {
        uint32_t key = gram_key(p + pos);
        int32_t at = (int32_t)g->n++;
        GPlace *pl = &g->places[at];
        pl->chunk = (int32_t)index;
        pl->pos = (int32_t)pos;
        pl->next = -1;
        size_t i = key & g->mask;
        while (g->slots[i].key && g->slots[i].key != key) i = (i + 1) & g->mask;
        GSlot *slot = &g->slots[i];
        if (slot->key) {
            g->places[slot->tail].next = at;
            slot->tail = at;
            slot->count++;
        } else {
            slot->key = key;
            slot->head = slot->tail = at;
            slot->count = 1;
            if (++g->used * 2 > g->mask + 1 && grams_grow(g) < 0) return -1;
        }
    }
    g->chunks = index + 1;
    g->bytes += n;
    return 0;
}

/* Start the index with spans[0:limit] (a needle needs it now), the table sized for all
 * of the call's bytes (g->total) at most half full. */
static int grams_start(Grams *g, const Span *spans, Py_ssize_t limit) {
    g->mask = 255;
    Py_ssize_t total = g->total < GRAMS_MAX ? g->total : GRAMS_MAX;
    while ((Py_ssize_t)(g->mask + 1) < 2 * (total / GRAM_S)) g->mask = g->mask * 2 + 1;
    g->used = 0;
    g->n = g->cap = 0;
    g->places = NULL;
    g->chunks = 0;
    g->bytes = 0;
    g->slots = PyMem_Calloc(g->mask + 1, sizeof(GSlot));
    if (!g->slots) {
        g->chunks = -1;
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t h = 0; h < limit && g->chunks >= 0; h++)
        if (grams_add(g, &spans[h], h) < 0) return -1;
    return 0;
}

/* The first occurrence of needle (len >= GRAM_MIN) in the indexed chunks spans[0:limit]
 * (limit == g->chunks): its item, or -1 when there is none, or -2 when the places to
 * walk would cost more than a plain search (periodic text: one gram at every grid
 * point), or the walk ran out of that budget; the caller then searches plainly. */
static Py_ssize_t grams_first(const Grams *g, const Span *spans, const unsigned char *needle,
                              Py_ssize_t nn, Py_ssize_t *at) {
    const GSlot *walk[GRAM_S];
    Py_ssize_t off[GRAM_S]; /* the offset in the needle of the gram walked */
    Py_ssize_t phases = 0, places = 0;
    Py_ssize_t budget = g->bytes + 256;
    n_indexed++;
    for (Py_ssize_t j = 0; j < GRAM_S; j++) {
        const GSlot *first = grams_get(g, gram_key(needle + j));
        if (!first) continue;
        Py_ssize_t last = j + (nn - GRAM_K - j) / GRAM_S * GRAM_S;
        walk[phases] = first;
        off[phases] = j;
        if (last != j) {
            const GSlot *other = grams_get(g, gram_key(needle + last));
            if (!other) continue; /* no occurrence of this phase */
            if (other->count < first->count) {
                walk[phases] = other;
                off[phases] = last;
            }
        }
        places += walk[phases++]->count;
    }
    if (places * 16 > budget) {
        n_over_budget++;
        return -2;
    }
    Py_ssize_t best_h = PY_SSIZE_T_MAX, best_at = 0;
    Py_ssize_t head = nn < 16 ? nn : 16;
    for (Py_ssize_t f = 0; f < phases; f++) {
        for (int32_t e = walk[f]->head; e >= 0; e = g->places[e].next) {
            const GPlace *pl = &g->places[e];
            Py_ssize_t h = pl->chunk, o = pl->pos - off[f];
            if (h > best_h || (h == best_h && o >= best_at)) break; /* ascending places */
            if (o < 0 || o + nn > spans[h].n) continue;
            const unsigned char *c = spans[h].p + o;
            budget -= 16;
            if (memcmp(c, needle, (size_t)head) == 0) {
                if (memcmp(c, needle, (size_t)nn) == 0) {
                    best_h = h;
                    best_at = o;
                    break;
                }
                budget -= nn;
            }
            if (budget <= 0) {
                n_over_budget++;
                return -2;
            }
        }
    }
    if (best_h == PY_SSIZE_T_MAX) return -1;
    *at = best_at;
    return best_h;
}

/* ---- the searches ------------------------------------------------------------------ */

/* The first occurrence of needle in hay, or -1.  A needle holding a dot (at offset
 * dot, its first) can only start at d - dot for a dot d of hay, so the search walks
 * hay's dots with memchr and compares there: in prose dots are ~1 byte in 100, which
 * beats a full scan.  Each candidate is charged the bytes it may compare (16 for the
 * first comparison, the needle's length when that one matches) against a budget of
 * about hn bytes; once spent, memmem (two-way, linear) takes over from where the walk
 * stopped, so the whole search is O(hn + nn). */
static Py_ssize_t find_in(const unsigned char *hay, Py_ssize_t hn, const unsigned char *needle,
                          Py_ssize_t nn, Py_ssize_t dot) {
    if (hn < nn) return -1;
    Py_ssize_t from = 0;
    if (dot >= 0) {
        Py_ssize_t last = hn - nn + dot; /* the last dot position a match can have */
        Py_ssize_t budget = hn + 256;
        size_t head = (size_t)(nn < 16 ? nn : 16);
        const unsigned char *d = hay + dot;
        const unsigned char *stop = hay + last + 1;
        while (d < stop && (d = memchr(d, '.', (size_t)(stop - d))) != NULL) {
            const unsigned char *at = d - dot;
            budget -= 16;
            if (memcmp(at, needle, head) == 0) {
                if (memcmp(at, needle, (size_t)nn) == 0) return at - hay;
                budget -= nn;
            }
            d++;
            if (budget <= 0) {
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
        n_scans++;
        Py_ssize_t pos = find_in(spans[h].p, spans[h].n, needle, len, dot);
        if (pos >= 0) {
            *at = pos;
            return h;
        }
    }
    return -1;
}

/* The first occurrence of needle in spans[0:limit], as first_in, for a needle that
 * passed the dot filter with answer say (keys_may_occur): a needle without dot keys
 * asks the gram index, started here when none is (g->chunks < 0), which the caller
 * keeps at spans[0:limit].  -1 when there is none, -3 on an error (memory). */
static Py_ssize_t search(Grams *g, const Span *spans, Py_ssize_t limit, const unsigned char *needle,
                         Py_ssize_t len, int say, Py_ssize_t *at) {
    if (say == NO_KEYS && len >= GRAM_MIN && limit > 0 && g->chunks != GRAMS_OFF) {
        if (g->chunks < 0) {
            /* The first such needle of a call is searched plainly, the index starts at
             * the second: text with dots has rarely more than one (a fragment of a
             * sentence at a chunk's edge), so it never pays for the index. */
            if (!g->searched) {
                g->searched = 1;
                return first_in(spans, limit, needle, len, at);
            }
            if (grams_start(g, spans, limit) < 0) return -3;
        }
        if (g->chunks >= 0) {
            Py_ssize_t h = grams_first(g, spans, needle, len, at);
            if (h != -2) return h;
        }
    }
    return first_in(spans, limit, needle, len, at);
}

/* Whether needle occurs in hay (the same search as first_in, on one item). */
static int holds(const Span *hay, const Span *needle) {
    const unsigned char *dp = memchr(needle->p, '.', (size_t)needle->n);
    return find_in(hay->p, hay->n, needle->p, needle->n, dp ? dp - needle->p : -1) >= 0;
}

static int append_tuple(PyObject *list, PyObject *t) {
    if (!t) return -1;
    int rc = PyList_Append(list, t);
    Py_DECREF(t);
    return rc;
}

/* ---- containment --------------------------------------------------------------------- */

PyDoc_STRVAR(contained_doc,
"contained(datas) -> list of (z, h, offset)\n\n"
"Containment over chunks ordered longest first (stable): each chunk is searched in the\n"
"chunks before it in that order (earliest first, first offset).  One tuple per chunk z\n"
"found, in that order; h is the host it ends up in (a host that was itself found in\n"
"another is followed to that one, offsets added), indices into datas.");

typedef struct {
    Py_ssize_t len, index;
} ByLen;

static int by_len_desc(const void *x, const void *y) {
    const ByLen *a = x, *b = y;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->index < b->index ? -1 : (a->index > b->index);
}

static PyObject *contained(PyObject *self, PyObject *arg) {
    Py_ssize_t n;
    Span *given = spans_of(arg, &n);
    if (!given) return NULL;
    size_t cells = (size_t)(n ? n : 1);
    Span *spans = PyMem_Malloc(sizeof(Span) * cells); /* borrowed from given */
    ByLen *order = PyMem_Malloc(sizeof(ByLen) * cells);
    Py_ssize_t *host = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * cells);
    HashSet set = {NULL, 0, 0};
    Keys ks = {NULL, NULL, 0, 0};
    Grams g = {NULL, 0, 0, NULL, 0, 0, -1, 0, 0, 0};
    PyObject *out = NULL;
    if (!spans || !order || !host) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        order[i].len = given[i].n;
        order[i].index = i;
        g.total += given[i].n;
    }
    qsort(order, (size_t)n, sizeof(ByLen), by_len_desc);
    for (Py_ssize_t r = 0; r < n; r++) {
        spans[r] = given[order[r].index];
        host[2 * r] = -1;
    }
    if (!(out = PyList_New(0)) || hs_init(&set) < 0) goto fail;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (keys_of(&ks, spans[r].p, spans[r].n) < 0) goto fail;
        Py_ssize_t cursor = 0;
        int say = r > 0 ? keys_may_occur(&set, &ks, 0, spans[r].n, &cursor) : 0;
        if (say) {
            Py_ssize_t at = 0;
            Py_ssize_t h = search(&g, spans, r, spans[r].p, spans[r].n, say, &at);
            if (h == -3) goto fail;
            if (h >= 0) {
                if (host[2 * h] >= 0) { /* found inside an absorbed chunk: its host */
                    at += host[2 * h + 1];
                    h = host[2 * h];
                }
                host[2 * r] = h;
                host[2 * r + 1] = at;
                if (append_tuple(out, Py_BuildValue("(nnn)", order[r].index, order[h].index, at)) < 0)
                    goto fail;
            }
        }
        if (keys_add(&set, &ks) < 0) goto fail;
        if (g.chunks >= 0 && grams_add(&g, &spans[r], r) < 0) goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    hs_free(&set);
    keys_free(&ks);
    grams_free(&g);
    PyMem_Free(host);
    PyMem_Free(order);
    PyMem_Free(spans);
    spans_free(given, n);
    return out;
}

/* ---- repeated passages ----------------------------------------------------------------- */

PyDoc_STRVAR(passage_scan_doc,
"passage_scan(datas, min_passage, whole_chunks, cut) -> None\n\n"
"The passage pass over datas in order.  For each chunk j >= 1 with paragraphs\n"
"(datas[j].split(b'\\n\\n')) of at least min_passage bytes that occur in the chunks\n"
"before it, calls cut(j, hits) with hits = [(paragraph index, its offset in the chunk,\n"
"its length, h, offset in chunk h)] (h the earliest chunk holding it); cut returns the\n"
"chunk's new bytes, or None when the chunk is gone (the chunks after it then move down\n"
"one index, as in the caller's list).  A chunk of one paragraph is skipped unless\n"
"whole_chunks.");

static PyObject *passage_scan(PyObject *self, PyObject *args) {
    PyObject *list, *cut;
    Py_ssize_t mp;
    int whole;
    if (!PyArg_ParseTuple(args, "OnpO", &list, &mp, &whole, &cut)) return NULL;
    if (!PyCallable_Check(cut)) {
        PyErr_SetString(PyExc_TypeError, "cut must be callable");
        return NULL;
    }
    Py_ssize_t n;
    Span *spans = spans_of(list, &n);
    if (!spans) return NULL;
    HashSet set = {NULL, 0, 0};
    Keys ks = {NULL, NULL, 0, 0};
    Grams g = {NULL, 0, 0, NULL, 0, 0, -1, 0, 0, 0};
    PyObject *hits = NULL;
    for (Py_ssize_t i = 0; i < n; i++) g.total += spans[i].n;
    if (hs_init(&set) < 0) goto fail;
    Py_ssize_t j = 0;
    while (j < n) {
        const unsigned char *d = spans[j].p;
        Py_ssize_t len = spans[j].n;
        if (keys_of(&ks, d, len) < 0) goto fail;
        if (j > 0 && len >= mp) {
            const unsigned char *end = d + len;
            const unsigned char *brk = next_break(d, end);
            if (brk || whole) {
                const unsigned char *p = d;
                Py_ssize_t i = 0, cursor = 0;
                for (;;) {
                    const unsigned char *stop = brk ? brk : end;
                    Py_ssize_t plen = stop - p;
                    int say = plen >= mp ? keys_may_occur(&set, &ks, p - d, stop - d, &cursor) : 0;
                    if (say) {
                        Py_ssize_t at = 0;
                        Py_ssize_t h = search(&g, spans, j, p, plen, say, &at);
                        if (h == -3) goto fail;
                        if (h >= 0) {
                            if (!hits && !(hits = PyList_New(0))) goto fail;
                            if (append_tuple(hits, Py_BuildValue("(nnnnn)", i, (Py_ssize_t)(p - d), plen, h, at)) < 0)
                                goto fail;
                        }
                    }
                    if (!brk) break;
                    p = brk + 2;
                    i++;
                    brk = next_break(p, end);
                }
            }
        }
        if (hits) {
            PyObject *res = PyObject_CallFunction(cut, "nO", j, hits);
            Py_CLEAR(hits);
            if (!res) goto fail;
            if (res == Py_None) { /* the chunk is gone: the later ones move down */
                Py_DECREF(res);
                Py_DECREF(spans[j].obj);
                memmove(spans + j, spans + j + 1, sizeof(Span) * (size_t)(n - j - 1));
                n--;
                continue;
            }
            if (!PyBytes_Check(res)) {
                Py_DECREF(res);
                PyErr_SetString(PyExc_TypeError, "cut must return bytes or None");
                goto fail;
            }
            Py_DECREF(spans[j].obj);
            spans[j].obj = res;
            spans[j].p = (const unsigned char *)PyBytes_AS_STRING(res);
            spans[j].n = PyBytes_GET_SIZE(res);
            if (keys_of(&ks, spans[j].p, spans[j].n) < 0) goto fail;
        }
        if (keys_add(&set, &ks) < 0) goto fail;
        if (g.chunks >= 0 && grams_add(&g, &spans[j], j) < 0) goto fail;
        j++;
    }
    hs_free(&set);
    keys_free(&ks);
    grams_free(&g);
    spans_free(spans, n);
    Py_RETURN_NONE;
fail:
    hs_free(&set);
    keys_free(&ks);
    grams_free(&g);
    spans_free(spans, n);
    Py_XDECREF(hits);
    return NULL;
}

/* ---- overlap ---------------------------------------------------------------------------- */

/* The largest L <= top with B[:L] == A[la - L:] (0 if none), in O(top): the
 * Knuth-Morris-Pratt automaton of B[:top] (its failure table in pi, top entries) run over
 * A's last top bytes; its final state is the longest prefix of B that A ends with. */
static Py_ssize_t longest_border(const unsigned char *A, Py_ssize_t la, const unsigned char *B,
                                 Py_ssize_t top, Py_ssize_t *pi) {
    if (top <= 0) return 0;
    Py_ssize_t k = 0;
    pi[0] = 0;
    for (Py_ssize_t i = 1; i < top; i++) {
        unsigned char c = B[i];
        while (k && B[k] != c) k = pi[k - 1];
        if (B[k] == c) k++;
        pi[i] = k;
    }
    const unsigned char *T = A + la - top;
    Py_ssize_t q = 0;
    for (Py_ssize_t i = 0; i < top; i++) {
        unsigned char c = T[i];
        while (q && (q == top || B[q] != c)) q = pi[q - 1];
        if (B[q] == c) q++;
    }
    return q;
}

/* The KMP table, grown on demand across the pairs of one call. */
typedef struct {
    Py_ssize_t *pi;
    Py_ssize_t cap;
} Table;

/* The largest L in [m, min(la, lb) - 1] with B[:L] == A[la - L:], 0 if none, -1 on a
 * memory error (la, lb > m >= 1).  Longest L first: candidates L - 1 with B[L - 1] == A's
 * last byte, each checked by comparing.  Periodic text has one at nearly every offset,
 * each costing O(L): once the comparisons have cost more than per_byte * top + least
 * bytes, longest_border answers instead, in O(top): the same L (it was quadratic:
 * 1 s for a 1 MB pair of a-runs). */
static Py_ssize_t pair_overlap(const unsigned char *A, Py_ssize_t la, const unsigned char *B,
                               Py_ssize_t lb, Py_ssize_t m, Py_ssize_t per_byte,
                               Py_ssize_t least, Table *t) {
    const unsigned char *tail = A + la - m;
    unsigned char last = A[la - 1];
    Py_ssize_t top = (la < lb ? la : lb) - 1; /* the largest L allowed */
    Py_ssize_t lo = m - 1;
    Py_ssize_t hi = top - 1;
    Py_ssize_t budget = per_byte * top + least;
    while (hi >= lo) {
        const unsigned char *e = memrchr(B + lo, last, (size_t)(hi - lo + 1));
        if (!e) break;
        Py_ssize_t L = (e - B) + 1;
        budget -= m;
        if (memcmp(B + L - m, tail, (size_t)m) == 0) {
            if (memcmp(A + la - L, B, (size_t)(L - m)) == 0) return L;
            budget -= L - m;
        }
        if (budget < 0) {
            if (top > t->cap) {
                Py_ssize_t *grown = PyMem_Realloc(t->pi, sizeof(Py_ssize_t) * (size_t)top);
                if (!grown) {
                    PyErr_NoMemory();
                    return -1;
                }
                t->pi = grown;
                t->cap = top;
            }
            L = longest_border(A, la, B, top, t->pi);
            return L >= m ? L : 0;
        }
        hi = (e - B) - 1;
    }
    return 0;
}

/* per_byte, least: the budget of pair_overlap's comparisons (tests pass 0, 0). */
static int budget_args(Py_ssize_t m, Py_ssize_t per_byte, Py_ssize_t *least) {
    if (m < 1) {
        PyErr_SetString(PyExc_ValueError, "m must be >= 1");
        return -1;
    }
    if (per_byte < 0 || per_byte > 1024 || *least < 0) {
        PyErr_SetString(PyExc_ValueError, "per_byte must be in [0, 1024] and least >= 0");
        return -1;
    }
    if (*least > PY_SSIZE_T_MAX / 4) *least = PY_SSIZE_T_MAX / 4; /* no overflow */
    return 0;
}

#define BUDGET_DOC \
"Candidates are compared until that costs more than per_byte * (min(len a, len b) - 1)\n" \
"+ least bytes, then a linear (KMP) search answers: the same L (0, 0: every failed\n" \
"candidate switches, for tests)."

PyDoc_STRVAR(overlap_edges_doc,
"overlap_edges(datas, m, per_byte=32, least=4096) -> list of (L, a, b)\n\n"
"For each ordered pair a != b with len > m: the largest L in [m, min(len a, len b) - 1]\n"
"with datas[a].endswith(datas[b][:L]), unless one of the two occurs in the other.\n"
BUDGET_DOC);

static PyObject *overlap_edges(PyObject *self, PyObject *args) {
    PyObject *list;
    Py_ssize_t m, per_byte = 32, least = 4096;
    if (!PyArg_ParseTuple(args, "On|nn", &list, &m, &per_byte, &least)) return NULL;
    if (budget_args(m, per_byte, &least) < 0) return NULL;
    Py_ssize_t n;
    Span *spans = spans_of(list, &n);
    if (!spans) return NULL;
    Table t = {NULL, 0};
    PyObject *out = PyList_New(0);
    if (!out) goto done;
    for (Py_ssize_t a = 0; a < n; a++) {
        Py_ssize_t la = spans[a].n;
        if (la <= m) continue;
        for (Py_ssize_t b = 0; b < n; b++) {
            Py_ssize_t lb = spans[b].n;
            if (b == a || lb <= m) continue;
            Py_ssize_t L = pair_overlap(spans[a].p, la, spans[b].p, lb, m, per_byte, least, &t);
            if (L < 0) {
                Py_CLEAR(out);
                goto done;
            }
            if (L) {
                /* A chunk inside the other one is containment, not overlap. */
                int inside = (lb <= la && holds(&spans[a], &spans[b])) ||
                             (la <= lb && holds(&spans[b], &spans[a]));
                if (!inside && append_tuple(out, Py_BuildValue("(nnn)", L, a, b)) < 0) {
                    Py_CLEAR(out);
                    goto done;
                }
            }
        }
    }
done:
    PyMem_Free(t.pi);
    spans_free(spans, n);
    return out;
}

PyDoc_STRVAR(overlap_len_doc,
"overlap_len(a, b, m, per_byte=32, least=4096) -> int\n\n"
"The largest L in [m, min(len a, len b) - 1] with a.endswith(b[:L]), 0 if none (no\n"
"containment check): one pair of overlap_edges, for the Python pass's large groups.\n"
BUDGET_DOC);

static PyObject *overlap_len(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t m, per_byte = 32, least = 4096;
    if (!PyArg_ParseTuple(args, "y*y*n|nn", &a, &b, &m, &per_byte, &least)) return NULL;
    Py_ssize_t L = 0;
    if (budget_args(m, per_byte, &least) < 0) {
        L = -1;
    } else if (a.len > m && b.len > m) {
        Table t = {NULL, 0};
        L = pair_overlap(a.buf, a.len, b.buf, b.len, m, per_byte, least, &t);
        PyMem_Free(t.pi);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return L < 0 ? NULL : PyLong_FromSsize_t(L);
}

/* ---- the module ---------------------------------------------------------------------- */

PyDoc_STRVAR(counters_doc,
"counters() -> (scans, indexed, over_budget)\n\n"
"What the containment and passage searches did since import: plain searches of one\n"
"chunk (memmem or the dot walk), needles without dot keys answered by the gram index,\n"
"and gram walks that ran out of budget (a plain search answered).  For tests.");

static PyObject *counters(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(nnn)", n_scans, n_indexed, n_over_budget);
}

static PyMethodDef methods[] = {
    {"counters", counters, METH_NOARGS, counters_doc},
    {"contained", contained, METH_O, contained_doc},
    {"passage_scan", passage_scan, METH_VARARGS, passage_scan_doc},
    {"overlap_edges", overlap_edges, METH_VARARGS, overlap_edges_doc},
    {"overlap_len", overlap_len, METH_VARARGS, overlap_len_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups",
    "C core of promptsplice.dedup's overlap, containment and passage searches (optional).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    /* The dot keys' seed: 8 bytes of os.urandom, so that no text can be crafted to put
     * its keys into one probe chain.  Results never depend on it (the filter is exact). */
    PyObject *os = PyImport_ImportModule("os");
    PyObject *raw = os ? PyObject_CallMethod(os, "urandom", "n", (Py_ssize_t)8) : NULL;
    Py_XDECREF(os);
    if (!raw) return NULL;
    if (PyBytes_Check(raw) && PyBytes_GET_SIZE(raw) == 8) memcpy(&seed, PyBytes_AS_STRING(raw), 8);
    Py_DECREF(raw);
    seed |= 1;
    return PyModule_Create(&module);
}
