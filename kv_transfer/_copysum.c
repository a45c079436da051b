/* Copy KV bytes and checksum them in the same pass (kv_transfer.native wraps this module).
 *
 * The checksum is the one of kv_transfer/checksum.py: the byte stream is cut into sub-rows of
 * `subrow_bytes`; sub-row j (counted over the whole request, from `first_subrow`) contributes the wrapping
 * sum of its 64-bit words times (2j + 1). This module returns that weighted sum and the number of
 * sub-rows; the Python side applies the mixing constant and the byte count, as it does for the torch path.
 *
 * One call moves a list of segments (dst_offset, src_offset, nbytes) in stream order, with the GIL
 * released. Stores to the destination can bypass the CPU cache (non-temporal, `stream=True`), which is
 * what a large memcpy does and what a KV cache wants: nobody reads those bytes again soon. With `dst`
 * None the segments are only read (a checksum of what already sits there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

typedef struct {
    int64_t dst, src, nbytes;
} segment_t;

/* Sum of the 64-bit words of one sub-row (a multiple of 8 bytes), copying it to `dst` when not NULL. */
static uint64_t subrow_sum(uint8_t *dst, const uint8_t *src, Py_ssize_t nbytes, int stream)
{
    Py_ssize_t i = 0;
    uint64_t sum = 0;
#if defined(__SSE2__)
    Py_ssize_t vector_bytes = nbytes & ~(Py_ssize_t)63;
    int aligned = ((uintptr_t)dst & 15) == 0;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (; i < vector_bytes; i += 64) {
        _mm_prefetch((const char *)(src + i + PREFETCH_BYTES), _MM_HINT_T0);
        __m128i w0 = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i w1 = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i w2 = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i w3 = _mm_loadu_si128((const __m128i *)(src + i + 48));
        a0 = _mm_add_epi64(a0, w0);
        a1 = _mm_add_epi64(a1, w1);
        a2 = _mm_add_epi64(a2, w2);
        a3 = _mm_add_epi64(a3, w3);
        if (!dst)
            continue;
        __m128i *out = (__m128i *)(dst + i);
        if (aligned && stream) {
            _mm_stream_si128(out, w0);
            _mm_stream_si128(out + 1, w1);
            _mm_stream_si128(out + 2, w2);
            _mm_stream_si128(out + 3, w3);
        } else {
            _mm_storeu_si128(out, w0);
            _mm_storeu_si128(out + 1, w1);
            _mm_storeu_si128(out + 2, w2);
            _mm_storeu_si128(out + 3, w3);
        }
    }
    __m128i a = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, a);
    sum = lanes[0] + lanes[1];
#endif
    for (; i < nbytes; i += 8) {
        uint64_t word;
        memcpy(&word, src + i, 8);
        sum += word;
        if (dst)
            memcpy(dst + i, &word, 8);
    }
    return sum;
}

static PyObject *copy_checksum(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dst", "src", "segments", "subrow_bytes", "first_subrow", "stream", NULL};
    PyObject *dst_obj, *src_obj, *segments_obj;
    Py_ssize_t subrow_bytes;
    unsigned long long first_subrow;
    int stream = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOnK|p", keywords, &dst_obj, &src_obj, &segments_obj,
                                     &subrow_bytes, &first_subrow, &stream))
        return NULL;
    if (subrow_bytes <= 0 || subrow_bytes % 8) {
        PyErr_Format(PyExc_ValueError, "subrow_bytes must be a positive multiple of 8 (got %zd)", subrow_bytes);
        return NULL;
    }
    Py_buffer dst = {0}, src = {0}, seg = {0};
    int have_dst = dst_obj != Py_None;
    PyObject *result = NULL;
    if (have_dst && PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(segments_obj, &seg, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    const char *format = seg.format ? seg.format : "B";
    int int64_items = seg.itemsize == 8 && (!strcmp(format, "q") || !strcmp(format, "l") || !strcmp(format, "<q") ||
                                            !strcmp(format, "<l") || !strcmp(format, "=q"));
    if (!int64_items || seg.len % (Py_ssize_t)sizeof(segment_t)) {
        PyErr_SetString(PyExc_ValueError, "segments must hold (dst, src, nbytes) int64 triples");
        goto done;
    }
    const segment_t *segments = (const segment_t *)seg.buf;
    Py_ssize_t num_segments = seg.len / (Py_ssize_t)sizeof(segment_t);
    for (Py_ssize_t k = 0; k < num_segments; k++) {
        const segment_t *s = &segments[k];
        if (s->nbytes < 0 || s->nbytes % subrow_bytes) {
            PyErr_Format(PyExc_ValueError, "segment %zd: %lld bytes is not a whole number of %zd-byte sub-rows", k,
                         (long long)s->nbytes, subrow_bytes);
            goto done;
        }
        if (s->src < 0 || s->src > src.len - s->nbytes || (have_dst && (s->dst < 0 || s->dst > dst.len - s->nbytes))) {
            PyErr_Format(PyExc_ValueError, "segment %zd (dst %lld, src %lld, %lld bytes) is outside its buffers", k,
                         (long long)s->dst, (long long)s->src, (long long)s->nbytes);
            goto done;
        }
    }
    uint64_t weighted = 0, index = (uint64_t)first_subrow;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < num_segments; k++) {
        const segment_t *s = &segments[k];
        const uint8_t *from = (const uint8_t *)src.buf + s->src;
        uint8_t *to = have_dst ? (uint8_t *)dst.buf + s->dst : NULL;
        for (int64_t off = 0; off < s->nbytes; off += subrow_bytes, index++)
            weighted += subrow_sum(to ? to + off : NULL, from + off, subrow_bytes, stream) * (2 * index + 1);
    }
#if defined(__SSE2__)
    if (have_dst && stream)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("KK", (unsigned long long)weighted, (unsigned long long)(index - first_subrow));
done:
    if (have_dst && dst.obj)
        PyBuffer_Release(&dst);
    if (src.obj)
        PyBuffer_Release(&src);
    if (seg.obj)
        PyBuffer_Release(&seg);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_checksum", (PyCFunction)(void (*)(void))copy_checksum, METH_VARARGS | METH_KEYWORDS,
     "copy_checksum(dst, src, segments, subrow_bytes, first_subrow, stream=True) -> (weighted, num_subrows)\n\n"
     "Copy each (dst_offset, src_offset, nbytes) int64 segment of `segments` from `src` to `dst` (None: read\n"
     "only) and return the checksum's weighted sub-row sum mod 2**64 and the number of sub-rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copysum", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copysum(void) { return PyModule_Create(&module); }
