/* Native window hashes and winnowing for the data-flow ledger (proxy/envelope/dataflow/fingerprint.py).
 *
 * Computes, bit for bit, what fingerprint.py's numpy functions compute: the polynomial hash of
 * every k-character window mod 2**64 (hash(i) = sum c[i+j] * B**j over the str's code points,
 * surrogates included), the minimum of every `window` consecutive hashes, and the results
 * fingerprint.py returns from them. On the ~200-character outputs of a typical call the numpy
 * version is almost all per-call overhead on tiny arrays; this is one pass over the text.
 *
 * Work is bounded whatever the text and window: one rolling pass for the hashes, a monotonic queue
 * (linear) or log2(window) + 1 branch-free passes for the window minima, and a bucket sort that
 * falls back to a radix sort (linear) for crowded buckets. The heavy loop runs without the GIL on
 * large inputs (outputs past 6,144 characters are fingerprinted in worker threads), and an
 * allocation failure raises MemoryError (never a partial answer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

#define B 0x100000001B3ULL /* fingerprint._B: odd, so invertible mod 2**64 */
#define NOGIL_CHARS 4096   /* below this, dropping and retaking the GIL costs more than it frees */

/* B**-1 mod 2**64 by Newton's iteration (each step doubles the correct low bits). */
static uint64_t b_inverse(void) {
    uint64_t x = B; /* correct to 3 bits: B * B == 1 mod 8 for odd B */
    for (int i = 0; i < 5; i++) {
        x *= 2 - B * x;
    }
    return x;
}

static uint64_t B_INV;

/* (a + b) % size for a, b < size, without a division */
ALWAYS_INLINE Py_ssize_t ring(Py_ssize_t a, Py_ssize_t b, Py_ssize_t size) {
    Py_ssize_t sum = a + b;
    return sum >= size ? sum - size : sum;
}

ALWAYS_INLINE uint64_t code_at(int kind, const void *data, Py_ssize_t i) {
    switch (kind) {
    case PyUnicode_1BYTE_KIND:
        return ((const Py_UCS1 *)data)[i];
    case PyUnicode_2BYTE_KIND:
        return ((const Py_UCS2 *)data)[i];
    default:
        return ((const Py_UCS4 *)data)[i];
    }
}

/* The window hashes of a text, in order, each passed to `emit` (a rolling hash: removing the first
 * code point and dividing by B is exact mod 2**64 because B is odd). `kind` is a constant at every
 * call site, so the compiler specialises each loop for its code point width. */
#define ROLL(kind, data, length, k, EMIT)                                                  \
    do {                                                                                   \
        uint64_t h_ = 0, top_ = 1;                                                         \
        for (Py_ssize_t j_ = (k) - 1; j_ >= 0; j_--) {                                     \
            h_ = h_ * B + code_at(kind, data, j_);                                         \
        }                                                                                  \
        for (Py_ssize_t j_ = 1; j_ < (k); j_++) {                                          \
            top_ *= B;                                                                     \
        }                                                                                  \
        Py_ssize_t count_ = (length) - (k) + 1;                                            \
        for (Py_ssize_t i_ = 0;; i_++) {                                                   \
            uint64_t hash = h_;                                                            \
            Py_ssize_t at = i_;                                                            \
            EMIT;                                                                          \
            if (i_ + 1 >= count_) {                                                        \
                break;                                                                     \
            }                                                                              \
            h_ = (h_ - code_at(kind, data, i_)) * B_INV + code_at(kind, data, i_ + (k)) * top_; \
        }                                                                                  \
    } while (0)

/* -- the three computations, over plain buffers (no Python object: run without the GIL) ------- */

ALWAYS_INLINE void hashes_kind(int kind, const void *data, Py_ssize_t length, Py_ssize_t k,
                               uint64_t *out) {
    ROLL(kind, data, length, k, out[at] = hash);
}

static void window_hashes_into(int kind, const void *data, Py_ssize_t length, Py_ssize_t k,
                               uint64_t *out) {
    switch (kind) {
    case PyUnicode_1BYTE_KIND:
        hashes_kind(PyUnicode_1BYTE_KIND, data, length, k, out);
        break;
    case PyUnicode_2BYTE_KIND:
        hashes_kind(PyUnicode_2BYTE_KIND, data, length, k, out);
        break;
    default:
        hashes_kind(PyUnicode_4BYTE_KIND, data, length, k, out);
    }
}

/* Winnowing while hashing, for windows of 2..STREAM_WINDOW hashes (at least one whole window):
 * the last `window` hashes in a ring, each run's minimum found by a branch-free scan of it (the
 * rightmost on ties: `<=` from oldest to newest). The same result as `winnow_in_place` and
 * `window_minima` over stored hashes, without storing them or passing over them again, and
 * without the queue's unpredictable branches; the scan does not wait on the rolling hash, so
 * the two run alongside. With `positions`, a run's minimum is written unless it is the same
 * position as the previous run's (`winnow_in_place`); without, unless it is the same value
 * (`window_minima`: what a packed set keeps). */
#define STREAM_WINDOW 16 /* the policy bounds `winnow` to 16 */

typedef struct {
    uint64_t recent[2 * STREAM_WINDOW]; /* each hash twice: recent[slot + 1 .. slot + window] */
    Py_ssize_t window, slot, written, last_at;
    uint64_t last;
    uint64_t *out;
} stream;

ALWAYS_INLINE void stream_push(stream *st, uint64_t hash, Py_ssize_t at, int positions) {
    Py_ssize_t window = st->window;
    Py_ssize_t slot = st->slot + 1 == window ? 0 : st->slot + 1;
    st->slot = slot;
    st->recent[slot] = hash;
    st->recent[slot + window] = hash; /* oldest to newest: recent[slot + 1 .. slot + window] */
    if (at + 1 < window) {
        return;
    }
    const uint64_t *run = st->recent + slot + 1;
    uint64_t least = run[0];
    Py_ssize_t offset = 0;
    for (Py_ssize_t j = 1; j < window; j++) {
        int better = run[j] <= least;
        least = better ? run[j] : least;
        offset = better ? j : offset;
    }
    st->out[st->written] = least;
    if (positions) {
        Py_ssize_t where = at - window + 1 + offset;
        st->written += where != st->last_at;
        st->last_at = where;
    } else {
        st->written += (st->written == 0) | (least != st->last);
        st->last = least;
    }
}

ALWAYS_INLINE void stream_kind(int kind, const void *data, Py_ssize_t length, Py_ssize_t k,
                               stream *st, int positions) {
    ROLL(kind, data, length, k, stream_push(st, hash, at, positions));
}

/* Returns how many were written to `out` (at most length - k + 1). */
static Py_ssize_t stream_winnow(int kind, const void *data, Py_ssize_t length, Py_ssize_t k,
                                Py_ssize_t window, uint64_t *out, int positions) {
    stream st = {.window = window, .slot = window - 1, .last_at = -1, .out = out};
    switch (kind * 2 + (positions != 0)) {
    case PyUnicode_1BYTE_KIND * 2:
        stream_kind(PyUnicode_1BYTE_KIND, data, length, k, &st, 0);
        break;
    case PyUnicode_1BYTE_KIND * 2 + 1:
        stream_kind(PyUnicode_1BYTE_KIND, data, length, k, &st, 1);
        break;
    case PyUnicode_2BYTE_KIND * 2:
        stream_kind(PyUnicode_2BYTE_KIND, data, length, k, &st, 0);
        break;
    case PyUnicode_2BYTE_KIND * 2 + 1:
        stream_kind(PyUnicode_2BYTE_KIND, data, length, k, &st, 1);
        break;
    case PyUnicode_4BYTE_KIND * 2:
        stream_kind(PyUnicode_4BYTE_KIND, data, length, k, &st, 0);
        break;
    default:
        stream_kind(PyUnicode_4BYTE_KIND, data, length, k, &st, 1);
    }
    return st.written;
}

/* Winnowing over `count` hashes, in place: for every run of `window` consecutive hashes, its
 * minimum, the rightmost on ties; a position kept by consecutive runs is written once (what
 * fingerprint._numpy_winnowed_hashes keeps, in its order). `queue` and `queued` hold `window`
 * slots. Returns how many were written to the front of `hashes` (each write is at or before the
 * run being read). */
static Py_ssize_t winnow_in_place(uint64_t *hashes, Py_ssize_t count, Py_ssize_t window,
                                  Py_ssize_t *queue, uint64_t *queued) {
    /* A monotonic queue of positions (a ring of `window` slots), values strictly increasing from
     * head to tail: a new hash drops every queued one not smaller (so the rightmost of equal
     * values stays), and the head is the current run's minimum. Each position enters and leaves
     * once: linear whatever the window. */
    Py_ssize_t head = 0, size = 0, written = 0, last_at = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t value = hashes[i];
        Py_ssize_t start = i - window + 1; /* the run ending at i */
        if (size && queue[head] < start) { /* left the run (before the push: the ring is full) */
            head = ring(head, 1, window);
            size--;
        }
        while (size && queued[ring(head, size - 1, window)] >= value) {
            size--;
        }
        Py_ssize_t slot = ring(head, size, window);
        queue[slot] = i;
        queued[slot] = value;
        size++;
        if (start < 0) {
            continue;
        }
        Py_ssize_t at = queue[head];
        uint64_t least = queued[head];
        if (at == last_at) {
            continue;
        }
        hashes[written++] = least; /* written <= start <= i: nothing unread is overwritten */
        last_at = at;
    }
    return written;
}

/* Each run of equal consecutive values kept once, in place (count >= 1); returns how many remain.
 * Branch-free, and the previous value stays in a register: reading it back from the array would
 * chain every step to the last store. */
static Py_ssize_t distinct_runs(uint64_t *values, Py_ssize_t count) {
    Py_ssize_t kept = 1;
    uint64_t last = values[0];
    for (Py_ssize_t i = 1; i < count; i++) {
        uint64_t v = values[i];
        values[kept] = v;
        kept += v != last;
        last = v;
    }
    return kept;
}

/* The distinct consecutive window minima of `count` hashes (window > 1, count >= window), in place,
 * as fingerprint._numpy_winnowed_packed finds them: minima of doubling spans, then two
 * overlapping spans per window; branch-free passes, log2(window) + 1 of them. Returns how many
 * were written to the front of `hashes`. */
static Py_ssize_t window_minima(uint64_t *hashes, Py_ssize_t count, Py_ssize_t window) {
    Py_ssize_t length = count, span = 1; /* hashes[i]: the least of the original [i, i + span) */
    while (span <= window / 2) {
        length -= span;
        for (Py_ssize_t i = 0; i < length; i++) { /* reads i + span before it is rewritten */
            uint64_t a = hashes[i], b = hashes[i + span];
            hashes[i] = b < a ? b : a;
        }
        span *= 2;
    }
    Py_ssize_t runs = count - window + 1;
    if (span < window) {
        Py_ssize_t shift = window - span;
        for (Py_ssize_t i = 0; i < runs; i++) {
            uint64_t a = hashes[i], b = hashes[i + shift];
            hashes[i] = b < a ? b : a;
        }
    }
    return distinct_runs(hashes, runs);
}

static void insertion_sort(uint64_t *values, Py_ssize_t count) {
    for (Py_ssize_t i = 1; i < count; i++) {
        uint64_t v = values[i];
        Py_ssize_t j = i;
        for (; j > 0 && values[j - 1] > v; j--) {
            values[j] = values[j - 1];
        }
        values[j] = v;
    }
}

/* LSD radix sort by bytes, `spare` as large as `values`: linear, no worst case. */
static void radix_sort(uint64_t *values, uint64_t *spare, Py_ssize_t count) {
    Py_ssize_t counts[8][256];
    memset(counts, 0, sizeof(counts));
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t v = values[i];
        for (int b = 0; b < 8; b++) {
            counts[b][(v >> (8 * b)) & 0xff]++;
        }
    }
    uint64_t *from = values, *to = spare;
    for (int b = 0; b < 8; b++) {
        Py_ssize_t *c = counts[b];
        if (c[(from[0] >> (8 * b)) & 0xff] == count) {
            continue; /* every value has this byte: the pass would change nothing */
        }
        Py_ssize_t at = 0;
        for (int d = 0; d < 256; d++) {
            Py_ssize_t here = c[d];
            c[d] = at;
            at += here;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t v = from[i];
            to[c[(v >> (8 * b)) & 0xff]++] = v;
        }
        uint64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != values) {
        memcpy(values, from, (size_t)count * sizeof(uint64_t));
    }
}

#define SMALL 32 /* a bucket of at most this many values is insertion-sorted */

/* Sorted in place. Hashes are spread evenly, so one pass distributes them into about twice as
 * many buckets as values by their top bits, after which the array is sorted but for the few
 * values that share a bucket: one insertion pass finishes it, its compare almost always false
 * (well predicted; qsort's compare calls, or an 8-pass radix sort, cost more than the hashing).
 * A text made to crowd its hashes into one bucket cannot make this quadratic: when a bucket holds
 * more than SMALL values, each bucket is sorted alone, a crowded one by a radix sort.
 * Returns 0, or -1 when its buffers cannot be allocated. */
static int sort_u64(uint64_t *values, Py_ssize_t count) {
    if (count <= SMALL) {
        insertion_sort(values, count);
        return 0;
    }
    int bits = 4;
    while (bits < 14 && ((Py_ssize_t)1 << bits) < 2 * count) {
        bits++;
    }
    Py_ssize_t buckets = (Py_ssize_t)1 << bits;
    int shift = 64 - bits;
    uint64_t *spare = PyMem_RawMalloc((size_t)count * sizeof(uint64_t));
    Py_ssize_t *ends = PyMem_RawCalloc((size_t)buckets + 1, sizeof(Py_ssize_t));
    if (!spare || !ends) {
        PyMem_RawFree(spare);
        PyMem_RawFree(ends);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        ends[(values[i] >> shift) + 1]++;
    }
    Py_ssize_t crowded = 0;
    for (Py_ssize_t b = 0; b < buckets; b++) {
        crowded |= ends[b + 1] > SMALL;
        ends[b + 1] += ends[b];
    }
    /* ends[b] is bucket b's start; filling it moves it to the bucket's end */
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t v = values[i];
        spare[ends[v >> shift]++] = v;
    }
    memcpy(values, spare, (size_t)count * sizeof(uint64_t));
    if (!crowded) {
        insertion_sort(values, count); /* moves each value at most SMALL places */
    } else {
        Py_ssize_t begin = 0;
        for (Py_ssize_t b = 0; b < buckets; b++) {
            Py_ssize_t size = ends[b] - begin;
            if (size > SMALL) {
                radix_sort(values + begin, spare + begin, size);
            } else if (size > 1) {
                insertion_sort(values + begin, size);
            }
            begin = ends[b];
        }
    }
    PyMem_RawFree(ends);
    PyMem_RawFree(spare);
    return 0;
}

/* Sorted and distinct, in place; returns how many remain, or -1 when out of memory. */
static Py_ssize_t sort_distinct(uint64_t *values, Py_ssize_t count) {
    if (count < 2) {
        return count;
    }
    if (sort_u64(values, count) < 0) {
        return -1;
    }
    return distinct_runs(values, count);
}

static uint64_t least_of(const uint64_t *values, Py_ssize_t count) {
    uint64_t least = values[0];
    for (Py_ssize_t i = 1; i < count; i++) {
        if (values[i] < least) {
            least = values[i];
        }
    }
    return least;
}

/* -- the Python entry points ------------------------------------------------------------------ */

enum mode { WINDOW_HASHES, WINNOWED_HASHES, WINNOWED_PACKED };

/* The one path behind the three functions: parse, hash (without the GIL on large inputs),
 * winnow, build the result. */
static PyObject *run(PyObject *args, enum mode mode) {
    PyObject *text;
    Py_ssize_t k, window = 1;
    if (mode == WINDOW_HASHES) {
        if (!PyArg_ParseTuple(args, "Un", &text, &k)) {
            return NULL;
        }
    } else if (!PyArg_ParseTuple(args, "Unn", &text, &k, &window)) {
        return NULL;
    }
    if (k < 1) {
        PyErr_SetString(PyExc_ValueError, "gram length must be at least 1");
        return NULL;
    }
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (length < k) {
        return mode == WINNOWED_PACKED ? PyBytes_FromStringAndSize(NULL, 0)
                                       : PyByteArray_FromStringAndSize(NULL, 0);
    }
    Py_ssize_t count = length - k + 1;
    int winnowing = mode != WINDOW_HASHES && window > 1 && count >= window;
    int queueing = winnowing && mode == WINNOWED_HASHES && window > STREAM_WINDOW;
    if ((size_t)count > PY_SSIZE_T_MAX / sizeof(uint64_t)) {
        return PyErr_NoMemory();
    }
    /* Raw allocations: usable without the GIL. */
    uint64_t *hashes = PyMem_RawMalloc((size_t)count * sizeof(uint64_t));
    Py_ssize_t *queue = NULL;
    uint64_t *queued = NULL;
    if (queueing) {
        queue = PyMem_RawMalloc((size_t)window * sizeof(Py_ssize_t));
        queued = PyMem_RawMalloc((size_t)window * sizeof(uint64_t));
    }
    if (!hashes || (queueing && (!queue || !queued))) {
        PyMem_RawFree(hashes);
        PyMem_RawFree(queue);
        PyMem_RawFree(queued);
        return PyErr_NoMemory();
    }
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text); /* immutable, and the caller holds a reference */
    Py_ssize_t kept = count;
    PyThreadState *saved = length >= NOGIL_CHARS ? PyEval_SaveThread() : NULL;
    int streaming = winnowing && window <= STREAM_WINDOW;
    if (streaming) {
        kept = stream_winnow(kind, data, length, k, window, hashes, mode == WINNOWED_HASHES);
        if (mode == WINNOWED_PACKED) {
            kept = sort_distinct(hashes, kept);
        }
    } else {
        window_hashes_into(kind, data, length, k, hashes);
    }
    if (mode != WINDOW_HASHES && !streaming) {
        if (winnowing) {
            kept = mode == WINNOWED_PACKED ? window_minima(hashes, count, window)
                                           : winnow_in_place(hashes, count, window, queue, queued);
        } else if (window > 1) {
            /* fewer hashes than one window: their minimum alone */
            hashes[0] = least_of(hashes, count);
            kept = 1;
        }
        if (mode == WINNOWED_PACKED || (!winnowing && window <= 1)) {
            /* a packed set, and numpy's np.unique for window 1, are sorted and distinct */
            kept = sort_distinct(hashes, kept);
        }
    }
#if !PY_LITTLE_ENDIAN
    if (mode == WINNOWED_PACKED) { /* 8-byte little-endian values, whatever the machine */
        for (Py_ssize_t i = 0; i < kept; i++) {
            uint64_t v = hashes[i], le = 0;
            for (int b = 0; b < 8; b++) {
                le = (le << 8) | ((v >> (8 * b)) & 0xff);
            }
            hashes[i] = le;
        }
    }
#endif
    if (saved) {
        PyEval_RestoreThread(saved);
    }
    PyMem_RawFree(queue);
    PyMem_RawFree(queued);
    if (kept < 0) {
        PyMem_RawFree(hashes);
        return PyErr_NoMemory();
    }
    PyObject *result = mode == WINNOWED_PACKED
                           ? PyBytes_FromStringAndSize((const char *)hashes, kept * 8)
                           : PyByteArray_FromStringAndSize((const char *)hashes, kept * 8);
    PyMem_RawFree(hashes);
    return result;
}

static PyObject *window_hashes(PyObject *self, PyObject *args) {
    return run(args, WINDOW_HASHES);
}

static PyObject *winnowed_hashes(PyObject *self, PyObject *args) {
    return run(args, WINNOWED_HASHES);
}

static PyObject *winnowed_packed(PyObject *self, PyObject *args) {
    return run(args, WINNOWED_PACKED);
}

static PyMethodDef methods[] = {
    {"window_hashes", window_hashes, METH_VARARGS,
     "window_hashes(text, k) -> bytearray: the hash of every k-character window, in order, as "
     "native-endian uint64 values (fingerprint._window_hashes)."},
    {"winnowed_hashes", winnowed_hashes, METH_VARARGS,
     "winnowed_hashes(text, k, window) -> bytearray: the hashes winnowing keeps, as native-endian "
     "uint64 values in fingerprint.winnowed_hashes' order."},
    {"winnowed_packed", winnowed_packed, METH_VARARGS,
     "winnowed_packed(text, k, window) -> bytes: the distinct window minima, sorted, as 8-byte "
     "little-endian values (fingerprint.winnowed_packed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_winnow",
    "Native window hashes and winnowing (fingerprint.py's numpy functions, bit for bit).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__winnow(void) {
    B_INV = b_inverse();
    return PyModule_Create(&module);
}
