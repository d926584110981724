/* kvferry.adapters._gather: an optional native gather with streaming stores.
 *
 * One function, gather(), copies n blocks of a paged cache into a contiguous destination.
 * A block is read as up to three nested strided dimensions of contiguous pieces:
 *
 *   for i in [0, n):                      block = src + index[i] * block_stride
 *     for a in [0, d0): for b in [0, d1): for c in [0, d2):
 *       copy `piece` bytes from block + a*s0 + b*s1 + c*s2 to dst; dst += piece
 *
 * (all sizes and strides in bytes; index == 0 means index[i] = i). Whole contiguous blocks are
 * one piece each; a head slice is one piece per token; the packed layout one per token and head.
 *
 * With stream != 0, every piece of at least STREAM_MIN_PIECE bytes is written with
 * non-temporal (streaming) stores where the CPU has them (AVX-512F, AVX2 or SSE2, picked at run
 * time), plain stores for the unaligned head and tail of a piece, and one sfence at the end; the
 * bytes written are the same either way. Elsewhere (another architecture, another compiler)
 * every piece is a memcpy. The GIL is released during the copy. Every index is checked against
 * nblocks before the first byte moves (IndexError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* -DKVF_GENERIC builds the memcpy-only version that other architectures get. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) \
    && !defined(KVF_GENERIC)
#define KVF_X86 1
#include <immintrin.h>
#endif

#define STREAM_MIN_PIECE 256

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void copy_plain(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

#ifdef KVF_X86
/* Plain stores up to the next `align`-byte boundary of dst; returns the bytes copied. */
static inline size_t align_head(char *dst, const char *src, size_t n, size_t align) {
    size_t head = (size_t)(-(uintptr_t)dst) & (align - 1);
    if (head > n)
        head = n;
    if (head)
        memcpy(dst, src, head);
    return head;
}

__attribute__((target("avx512f"))) static void copy_nt_avx512(char *dst, const char *src,
                                                               size_t n) {
    size_t head = align_head(dst, src, n, 64);
    dst += head, src += head, n -= head;
    for (; n >= 256; dst += 256, src += 256, n -= 256) {
        __m512i a = _mm512_loadu_si512((const void *)src);
        __m512i b = _mm512_loadu_si512((const void *)(src + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + 192));
        _mm512_stream_si512((void *)dst, a);
        _mm512_stream_si512((void *)(dst + 64), b);
        _mm512_stream_si512((void *)(dst + 128), c);
        _mm512_stream_si512((void *)(dst + 192), d);
    }
    for (; n >= 64; dst += 64, src += 64, n -= 64)
        _mm512_stream_si512((void *)dst, _mm512_loadu_si512((const void *)src));
    if (n)
        memcpy(dst, src, n);
}

__attribute__((target("avx2"))) static void copy_nt_avx2(char *dst, const char *src, size_t n) {
    size_t head = align_head(dst, src, n, 32);
    dst += head, src += head, n -= head;
    for (; n >= 128; dst += 128, src += 128, n -= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    for (; n >= 32; dst += 32, src += 32, n -= 32)
        _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
    if (n)
        memcpy(dst, src, n);
}

__attribute__((target("sse2"))) static void copy_nt_sse2(char *dst, const char *src, size_t n) {
    size_t head = align_head(dst, src, n, 16);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    for (; n >= 16; dst += 16, src += 16, n -= 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    if (n)
        memcpy(dst, src, n);
}

__attribute__((target("sse2"))) static void store_fence(void) { _mm_sfence(); }
#endif

/* The streaming copy in use and its name; "memcpy" when there is none. */
static copy_fn stream_copy = copy_plain;
static const char *stream_isa = "memcpy";

static int select_isa(const char *name) {
#ifdef KVF_X86
    __builtin_cpu_init();
    int any = name == NULL;
    if ((any || !strcmp(name, "avx512f")) && __builtin_cpu_supports("avx512f")) {
        stream_copy = copy_nt_avx512, stream_isa = "avx512f";
        return 1;
    }
    if ((any || !strcmp(name, "avx2")) && __builtin_cpu_supports("avx2")) {
        stream_copy = copy_nt_avx2, stream_isa = "avx2";
        return 1;
    }
    if ((any || !strcmp(name, "sse2")) && __builtin_cpu_supports("sse2")) {
        stream_copy = copy_nt_sse2, stream_isa = "sse2";
        return 1;
    }
#endif
    if (name == NULL || !strcmp(name, "memcpy")) {
        stream_copy = copy_plain, stream_isa = "memcpy";
        return 1;
    }
    return 0;
}

static void run_gather(char *dst, const char *src, const int64_t *index, Py_ssize_t n,
                       Py_ssize_t block_stride, Py_ssize_t d0, Py_ssize_t s0, Py_ssize_t d1,
                       Py_ssize_t s1, Py_ssize_t d2, Py_ssize_t s2, size_t piece, copy_fn copy) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *block = src + (index ? index[i] : i) * block_stride;
        for (Py_ssize_t a = 0; a < d0; a++)
            for (Py_ssize_t b = 0; b < d1; b++)
                for (Py_ssize_t c = 0; c < d2; c++) {
                    copy(dst, block + a * s0 + b * s1 + c * s2, piece);
                    dst += piece;
                }
    }
}

PyDoc_STRVAR(gather_doc,
"gather(dst, src, index, n, nblocks, block_stride, d0, s0, d1, s1, d2, s2, piece, stream)\n"
"\n"
"Copy n blocks (ids from the int64 array at address index, or 0..n-1 when index is 0) of the\n"
"paged view at address src into the contiguous destination at address dst: per block, d0 x d1 x\n"
"d2 pieces of `piece` bytes at byte offsets a*s0 + b*s1 + c*s2 from src + id*block_stride.\n"
"stream: non-temporal stores for pieces of 256 bytes or more. IndexError if an id is outside\n"
"[0, nblocks). The caller guarantees every address range is valid.");

static PyObject *gather(PyObject *self, PyObject *args) {
    unsigned long long dst, src, index;
    Py_ssize_t n, nblocks, block_stride, d0, s0, d1, s1, d2, s2, piece;
    int stream;
    if (!PyArg_ParseTuple(args, "KKKnnnnnnnnnnp:gather", &dst, &src, &index, &n, &nblocks,
                          &block_stride, &d0, &s0, &d1, &s1, &d2, &s2, &piece, &stream))
        return NULL;
    if (n < 0 || d0 < 0 || d1 < 0 || d2 < 0 || piece < 0) {
        PyErr_SetString(PyExc_ValueError, "gather: negative count or size");
        return NULL;
    }
    const int64_t *ids = (const int64_t *)(uintptr_t)index;
    if (ids) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= nblocks) {
                PyErr_Format(PyExc_IndexError, "gather: block id %lld outside [0, %zd)",
                             (long long)ids[i], nblocks);
                return NULL;
            }
    } else if (n > nblocks) {
        PyErr_Format(PyExc_IndexError, "gather: %zd blocks from a view of %zd", n, nblocks);
        return NULL;
    }
    int streaming = stream && piece >= STREAM_MIN_PIECE && stream_copy != copy_plain;
    Py_BEGIN_ALLOW_THREADS
    run_gather((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, ids, n, block_stride, d0, s0,
               d1, s1, d2, s2, (size_t)piece, streaming ? stream_copy : copy_plain);
#ifdef KVF_X86
    if (streaming)
        store_fence();
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(isa_doc, "isa() -> str: the streaming stores in use (avx512f, avx2, sse2 or memcpy).");

static PyObject *isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(stream_isa); }

PyDoc_STRVAR(set_isa_doc,
"set_isa(name) -> bool: use avx512f, avx2, sse2 or memcpy for streaming copies if this CPU has\n"
"it (for tests and measurements); None picks the best again. False leaves it unchanged.");

static PyObject *set_isa(PyObject *self, PyObject *arg) {
    const char *name = NULL;
    if (arg != Py_None) {
        name = PyUnicode_AsUTF8(arg);
        if (name == NULL)
            return NULL;
    }
    copy_fn before = stream_copy;
    const char *before_name = stream_isa;
    if (!select_isa(name)) {
        stream_copy = before, stream_isa = before_name;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"isa", isa, METH_NOARGS, isa_doc},
    {"set_isa", set_isa, METH_O, set_isa_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gather",
    "Optional native gather of paged-cache blocks with streaming stores (see gather).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__gather(void) {
    select_isa(NULL);
    return PyModule_Create(&module);
}
