/* kvferry.adapters._crc32c: CRC-32C (Castagnoli) of a buffer, with the CPU's crc32 instruction.
 *
 * crc32c(data, value=0) is CRC-32C as iSCSI, ext4 and Google's crc32c define it (reflected
 * polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; crc32c(b"123456789") ==
 * 0xE3069283). Like zlib.crc32, `value` is the result for the bytes before: crc32c(b, crc32c(a))
 * == crc32c(a + b).
 *
 * Where the CPU has SSE4.2 (checked at run time with cpuid, so a CPU without it never runs the
 * instruction), three independent streams of crc32 instructions run side by side over three
 * consecutive stretches of the buffer (the instruction takes 3 cycles and can start every cycle),
 * and the three registers are joined with precomputed tables for "this register followed by n
 * zero bytes". Where it also has AVX-512F with VPCLMULQDQ (carry-less multiplication of 512-bit
 * registers), buffers of 512 bytes or more are folded instead: sixteen 16-byte lanes of the
 * buffer are kept as polynomials, and each is carried forward over the next 256 bytes by two
 * carry-less multiplications with the constants x^(D+31) and x^(D-33) mod P (bit-reflected;
 * D = 2048, the stretch in bits), so that the lanes' CRC stays the buffer's; at the end the
 * lanes are folded into one (D = 128) and the crc32 instruction finishes it and the tail. That
 * reads 256 bytes a step instead of 24 (measured on a 4 MiB buffer: 58 GB/s from cache against
 * 28, and as fast as memory when cold). The 128-bit PCLMULQDQ alone, latency-bound, measured
 * slower than the crc32 instruction and is not used. Elsewhere (another CPU, another
 * architecture or compiler) a table-driven CRC reads 8 bytes a step. All give the same value;
 * set_engine() picks one for tests and measurements.
 * The GIL is released for buffers of 64 KiB or more.
 *
 * copy_crc32c(dst, src, chunk, spans, value) copies src chunk by chunk to places in dst and returns
 * src's CRC-32C, reading src once (the vLLM connector's page write with its check).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) \
    && !defined(KVF_GENERIC)
#define KVF_X86 1
#include <immintrin.h>
#endif

#define POLY 0x82F63B78u
#define LONG_SPAN 8192 /* bytes per stream in a long round (3 streams: 24 KiB a round) */
#define SHORT_SPAN 256 /* bytes per stream in a short round */
#define RELEASE_GIL_BYTES 65536

static uint32_t table[8][256];      /* table[k][b]: register after byte b then k zero bytes */
static uint32_t long_shift[4][256]; /* byte k of a register, followed by LONG_SPAN zero bytes */
static uint32_t short_shift[4][256];

/* The register after `n` zero bytes follow `reg` (no initial value or final xor). */
static uint32_t zeros_after(uint32_t reg, size_t n) {
    while (n--)
        reg = (reg >> 8) ^ table[0][reg & 0xff];
    return reg;
}

/* shift[k][b] = zeros_after(b << 8k, n): a register followed by n zero bytes is the xor of four
 * lookups (the map is linear over GF(2), so it is built from its 32 single-bit images). */
static void build_shift(uint32_t shift[4][256], size_t n) {
    uint32_t bit[32];
    for (int i = 0; i < 32; i++)
        bit[i] = zeros_after((uint32_t)1 << i, n);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int i = 0; i < 8; i++)
                if (b & (1 << i))
                    v ^= bit[8 * k + i];
            shift[k][b] = v;
        }
}

static inline uint32_t apply_shift(uint32_t shift[4][256], uint32_t reg) {
    return shift[0][reg & 0xff] ^ shift[1][(reg >> 8) & 0xff] ^ shift[2][(reg >> 16) & 0xff]
           ^ shift[3][reg >> 24];
}

static void build_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t reg = b;
        for (int i = 0; i < 8; i++)
            reg = reg & 1 ? (reg >> 1) ^ POLY : reg >> 1;
        table[0][b] = reg;
    }
    for (int b = 0; b < 256; b++)
        for (int k = 1; k < 8; k++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xff];
    build_shift(long_shift, LONG_SPAN);
    build_shift(short_shift, SHORT_SPAN);
}

static uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* x86 and every little-endian target: one unaligned load */
    return v;
}

/* Table-driven: 8 bytes a step ("slicing by 8"); little-endian byte order assumed for the word
 * path, so big-endian targets take the byte loop. */
static uint32_t crc_table(uint32_t reg, const unsigned char *p, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w = load64(p) ^ reg;
        reg = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff]
              ^ table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff]
              ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
    }
#endif
    while (n--)
        reg = (reg >> 8) ^ table[0][(reg ^ *p++) & 0xff];
    return reg;
}

#ifdef KVF_X86
/* Three streams over consecutive stretches of `span` bytes each, joined: the register after
 * a||b||c is shift(shift(A) ^ B) ^ C, where B and C started from 0. */
#define KVF_ROUNDS(span, shift)                                                                    \
    while (n >= 3 * (span)) {                                                                      \
        uint64_t a = reg, b = 0, c = 0;                                                            \
        for (size_t at = 0; at < (span); at += 8) {                                                \
            a = _mm_crc32_u64(a, load64(p + at));                                                  \
            b = _mm_crc32_u64(b, load64(p + (span) + at));                                         \
            c = _mm_crc32_u64(c, load64(p + 2 * (span) + at));                                     \
        }                                                                                          \
        reg = apply_shift(shift, apply_shift(shift, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;     \
        p += 3 * (span), n -= 3 * (span);                                                          \
    }

__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t reg, const unsigned char *p,
                                                            size_t n) {
    for (; n && ((uintptr_t)p & 7); n--)
        reg = _mm_crc32_u8(reg, *p++);
    KVF_ROUNDS(LONG_SPAN, long_shift)
    KVF_ROUNDS(SHORT_SPAN, short_shift)
    uint64_t r = reg;
    for (; n >= 8; p += 8, n -= 8)
        r = _mm_crc32_u64(r, load64(p));
    reg = (uint32_t)r;
    for (; n; n--)
        reg = _mm_crc32_u8(reg, *p++);
    return reg;
}
#endif

/* The folding engine needs a compiler that knows VPCLMULQDQ (GCC 8, Clang 6 and later). */
#if defined(KVF_X86) && ((defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && __GNUC__ >= 8))
#define KVF_FOLD 1
#endif

#ifdef KVF_FOLD
/* Fold constants (bit-reflected x^e mod P, e = D + 31 and D - 33 for a fold over D bits; found and
 * checked against the bitwise CRC by tests/adapters/test_checksums.py's model). */
#define K128_LOW 0xf20c0dfeu   /* x^159: multiplies a lane's low 64 bits to carry them 128 bits on */
#define K128_HIGH 0x493c7d27u  /* x^95: its high 64 bits */
#define K2048_LOW 0xdcb17aa4u  /* x^2079 */
#define K2048_HIGH 0xb9e02b86u /* x^2015 */
#define FOLD_MIN 512          /* shorter buffers go to the crc32 instruction alone */

/* One lane x (its two 64-bit halves) carried over `k`'s distance, xor `next`. */
__attribute__((target("sse4.2,pclmul"))) static inline __m128i fold16(__m128i x, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00); /* x.lo * k.lo */
    __m128i hi = _mm_clmulepi64_si128(x, k, 0x11); /* x.hi * k.hi */
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The register after the 16 bytes of `x` (the folded lanes' CRC), then the rest with crc32. */
__attribute__((target("sse4.2,pclmul"))) static uint32_t finish_lane(__m128i x, const unsigned char *p, size_t n) {
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(x, 1));
    return crc_sse42((uint32_t)r, p, n);
}

/* Four 512-bit registers of four lanes each, 256 bytes a step. */
__attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq"))) static inline __m512i fold64(__m512i x, __m512i k,
                                                                                         __m512i next) {
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
    __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

/* The sixteen lanes of a, b, c, d in buffer order (a's four, then b's, ...) folded into one, then
 * the register after them and the `n` bytes at `p` (the tail, fewer than 256). */
__attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq"))) static uint32_t finish_lanes(
    __m512i a, __m512i b, __m512i c, __m512i d, const unsigned char *p, size_t n) {
    const __m128i k128 = _mm_set_epi64x(K128_HIGH, K128_LOW);
    __m512i regs[4] = {a, b, c, d};
    __m128i x = _mm512_castsi512_si128(a);
    for (int r = 0; r < 4; r++)
        for (int lane = r == 0 ? 1 : 0; lane < 4; lane++) {
            __m128i next;
            switch (lane) { /* the lane index must be a constant */
            case 0: next = _mm512_extracti32x4_epi32(regs[r], 0); break;
            case 1: next = _mm512_extracti32x4_epi32(regs[r], 1); break;
            case 2: next = _mm512_extracti32x4_epi32(regs[r], 2); break;
            default: next = _mm512_extracti32x4_epi32(regs[r], 3); break;
            }
            x = fold16(x, k128, next);
        }
    return finish_lane(x, p, n);
}

__attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq"))) static uint32_t crc_vpclmul(uint32_t reg,
                                                                                        const unsigned char *p,
                                                                                        size_t n) {
    if (n < FOLD_MIN)
        return crc_sse42(reg, p, n);
    const __m512i k2048 = _mm512_set4_epi64(K2048_HIGH, K2048_LOW, K2048_HIGH, K2048_LOW);
    __m512i a = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg)));
    __m512i b = _mm512_loadu_si512(p + 64);
    __m512i c = _mm512_loadu_si512(p + 128);
    __m512i d = _mm512_loadu_si512(p + 192);
    p += 256, n -= 256;
    for (; n >= 256; p += 256, n -= 256) {
        a = fold64(a, k2048, _mm512_loadu_si512(p));
        b = fold64(b, k2048, _mm512_loadu_si512(p + 64));
        c = fold64(c, k2048, _mm512_loadu_si512(p + 128));
        d = fold64(d, k2048, _mm512_loadu_si512(p + 192));
    }
    return finish_lanes(a, b, c, d, p, n);
}
#endif

typedef uint32_t (*crc_fn)(uint32_t reg, const unsigned char *p, size_t n);
static crc_fn engine = crc_table;
static const char *engine_name = "table";

static int select_engine(const char *name) {
#ifdef KVF_X86
    __builtin_cpu_init();
    int sse42 = __builtin_cpu_supports("sse4.2");
#ifdef KVF_FOLD
    if ((name == NULL || !strcmp(name, "vpclmulqdq")) && sse42 && __builtin_cpu_supports("pclmul")
        && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq")) {
        engine = crc_vpclmul, engine_name = "vpclmulqdq";
        return 1;
    }
#endif
    if ((name == NULL || !strcmp(name, "sse4.2")) && sse42) {
        engine = crc_sse42, engine_name = "sse4.2";
        return 1;
    }
#endif
    if (name == NULL || !strcmp(name, "table")) {
        engine = crc_table, engine_name = "table";
        return 1;
    }
    return 0;
}

PyDoc_STRVAR(crc32c_doc,
"crc32c(data, value=0, /) -> int\n"
"\n"
"CRC-32C of a C-contiguous buffer, continuing from `value` (the CRC-32C of the bytes before)\n"
"like zlib.crc32. Unsigned 32 bit.");

static PyObject *crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32c", &view, &value))
        return NULL;
    uint32_t reg = ~(uint32_t)value;
    const unsigned char *p = (const unsigned char *)view.buf;
    size_t n = (size_t)view.len;
    if (n >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        reg = engine(reg, p, n);
        Py_END_ALLOW_THREADS
    } else {
        reg = engine(reg, p, n);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong((unsigned long)~reg);
}

/* copy_crc32c: the page copy and the check in one read of the source. The source is walked in
 * windows of COPY_WINDOW bytes: the window's chunks are copied to their destinations, then the
 * window, still in the first-level cache, goes through the CRC routine. */
#define COPY_WINDOW 49152 /* two long rounds of the three streams */

typedef struct {
    Py_ssize_t offset, stride, count;
} span_t;

static int parse_spans(PyObject *spans, Py_ssize_t chunk, Py_ssize_t dst_len, span_t **out,
                       Py_ssize_t *nspans, Py_ssize_t *nchunks) {
    PyObject *seq = PySequence_Fast(spans, "spans must be a sequence of (offset, stride, count)");
    if (seq == NULL)
        return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0;
    span_t *sp = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(span_t));
    if (sp == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "nnn", &sp[i].offset, &sp[i].stride, &sp[i].count)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "each span must be a tuple (offset, stride, count)");
            goto fail;
        }
        span_t s = sp[i];
        if (s.offset < 0 || s.stride < 0 || s.count < 0) {
            PyErr_Format(PyExc_ValueError, "span %zd: offset, stride and count must be >= 0", i);
            goto fail;
        }
        /* the last chunk of the span ends at offset + (count - 1) * stride + chunk <= dst_len */
        if (s.count && (s.offset > dst_len - chunk
                        || (s.count > 1 && s.stride && (s.count - 1) > (dst_len - chunk - s.offset) / s.stride))) {
            PyErr_Format(PyExc_ValueError, "span %zd reaches past the destination (%zd bytes)", i, dst_len);
            goto fail;
        }
        if (s.count > PY_SSIZE_T_MAX / chunk - total) {
            PyErr_Format(PyExc_ValueError, "span %zd: too many chunks", i);
            goto fail;
        }
        total += s.count;
    }
    Py_DECREF(seq);
    *out = sp, *nspans = n, *nchunks = total;
    return 1;
fail:
    PyMem_Free(sp);
    Py_DECREF(seq);
    return 0;
}

#ifdef KVF_X86
/* The copy and the CRC in one pass with the crc32 instruction: three streams over consecutive
 * stretches as in crc_sse42, each word stored to its chunk's destination (to[c]: where chunk c
 * of the source goes) as it is read. `chunk` is a multiple of 8, `n` of `chunk`. */
#define KVF_DST(off) (to[(off) / chunk] + (off) % chunk)
#define KVF_LEFT(off) (chunk - (off) % chunk)
#define KVF_COPY_ROUNDS(span, shift)                                                               \
    while (n - o >= 3 * (size_t)(span)) {                                                          \
        uint64_t a = reg, b = 0, c = 0;                                                            \
        for (size_t at = 0; at < (span);) {                                                        \
            size_t oa = o + at, ob = oa + (span), oc = ob + (span);                                \
            size_t step = KVF_LEFT(oa);                                                            \
            if (KVF_LEFT(ob) < step)                                                               \
                step = KVF_LEFT(ob);                                                               \
            if (KVF_LEFT(oc) < step)                                                               \
                step = KVF_LEFT(oc);                                                               \
            if ((span) - at < step)                                                                \
                step = (span) - at;                                                                \
            unsigned char *da = KVF_DST(oa), *db = KVF_DST(ob), *dc = KVF_DST(oc);                 \
            const unsigned char *pa = src + oa, *pb = src + ob, *pc = src + oc;                    \
            for (size_t j = 0; j < step; j += 8) {                                                 \
                uint64_t wa = load64(pa + j), wb = load64(pb + j), wc = load64(pc + j);            \
                a = _mm_crc32_u64(a, wa);                                                          \
                b = _mm_crc32_u64(b, wb);                                                          \
                c = _mm_crc32_u64(c, wc);                                                          \
                memcpy(da + j, &wa, 8);                                                            \
                memcpy(db + j, &wb, 8);                                                            \
                memcpy(dc + j, &wc, 8);                                                            \
            }                                                                                      \
            at += step;                                                                            \
        }                                                                                          \
        reg = apply_shift(shift, apply_shift(shift, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;     \
        o += 3 * (size_t)(span);                                                                   \
    }

__attribute__((target("sse4.2"))) static uint32_t copy_crc_sse42(uint32_t reg, unsigned char *const *to,
                                                                 size_t chunk, const unsigned char *src,
                                                                 size_t n) {
    size_t o = 0;
    KVF_COPY_ROUNDS(LONG_SPAN, long_shift)
    KVF_COPY_ROUNDS(SHORT_SPAN, short_shift)
    uint64_t r = reg;
    while (n - o >= 8) {
        size_t step = KVF_LEFT(o);
        if (step > n - o)
            step = (n - o) & ~(size_t)7;
        unsigned char *d = KVF_DST(o);
        for (size_t j = 0; j < step; j += 8) {
            uint64_t w = load64(src + o + j);
            r = _mm_crc32_u64(r, w);
            memcpy(d + j, &w, 8);
        }
        o += step;
    }
    reg = (uint32_t)r;
    for (; o < n; o++) {
        *KVF_DST(o) = src[o];
        reg = _mm_crc32_u8(reg, src[o]);
    }
    return reg;
}
#endif

#ifdef KVF_FOLD
/* The copy and the folding CRC in one pass, 256 bytes a step: each 64-byte vector is loaded once,
 * stored to its chunk's destination and folded (as crc_vpclmul). `chunk` is a multiple of 64 (a
 * vector never straddles two chunks), `n` of `chunk`. */
__attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq"))) static uint32_t copy_fold_vpclmul(
    uint32_t reg, unsigned char *const *to, size_t chunk, const unsigned char *src, size_t n) {
    if (n < FOLD_MIN)
        return copy_crc_sse42(reg, to, chunk, src, n);
    size_t ci = 0, off = 0; /* where the next vector goes: chunk ci, byte off */
#define KVF_PUT(v)                                                                                 \
    do {                                                                                           \
        _mm512_storeu_si512(to[ci] + off, (v));                                                    \
        if ((off += 64) == chunk)                                                                  \
            off = 0, ci++;                                                                         \
    } while (0)
    const __m512i k2048 = _mm512_set4_epi64(K2048_HIGH, K2048_LOW, K2048_HIGH, K2048_LOW);
    __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 64);
    __m512i c = _mm512_loadu_si512(src + 128), d = _mm512_loadu_si512(src + 192);
    KVF_PUT(a);
    KVF_PUT(b);
    KVF_PUT(c);
    KVF_PUT(d);
    a = _mm512_xor_si512(a, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg)));
    size_t o = 256;
    for (; n - o >= 256; o += 256) {
        __m512i w = _mm512_loadu_si512(src + o), x = _mm512_loadu_si512(src + o + 64);
        __m512i y = _mm512_loadu_si512(src + o + 128), z = _mm512_loadu_si512(src + o + 192);
        KVF_PUT(w);
        KVF_PUT(x);
        KVF_PUT(y);
        KVF_PUT(z);
        a = fold64(a, k2048, w), b = fold64(b, k2048, x), c = fold64(c, k2048, y), d = fold64(d, k2048, z);
    }
    for (size_t t = o; t < n; t += 64) /* the tail's vectors (n - o < 256), folded below by crc32 */
        KVF_PUT(_mm512_loadu_si512(src + t));
#undef KVF_PUT
    return finish_lanes(a, b, c, d, src + o, n - o);
}
#endif

/* The general way: each window's chunks copied, then the window checked while it is hot. */
static uint32_t scatter(uint32_t reg, unsigned char *dst, const unsigned char *src, size_t chunk,
                        const span_t *sp, Py_ssize_t nspans) {
    size_t copied = 0, checked = 0;
    for (Py_ssize_t i = 0; i < nspans; i++) {
        unsigned char *d = dst + sp[i].offset;
        for (Py_ssize_t j = 0; j < sp[i].count; j++, d += sp[i].stride) {
            memcpy(d, src + copied, chunk);
            copied += chunk;
            if (copied - checked >= COPY_WINDOW) {
                reg = engine(reg, src + checked, copied - checked);
                checked = copied;
            }
        }
    }
    return engine(reg, src + checked, copied - checked);
}

PyDoc_STRVAR(copy_crc32c_doc,
"copy_crc32c(dst, src, chunk, spans, value=0, /) -> int\n"
"\n"
"Copy `src` chunk by chunk into the writable buffer `dst` and return the CRC-32C of `src`\n"
"(continuing from `value`), reading `src` once. `spans` is a sequence of (offset, stride, count):\n"
"the chunks of `chunk` bytes, taken from `src` in order, go to dst[offset + k * stride] for k in\n"
"range(count), span after span. The chunks must cover `src` exactly and every destination must\n"
"lie inside `dst` (ValueError otherwise, before anything is written).");

static PyObject *copy_crc32c(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t chunk, nspans, nchunks;
    PyObject *spans;
    unsigned int value = 0;
    span_t *sp = NULL;
    if (!PyArg_ParseTuple(args, "w*y*nO|I:copy_crc32c", &dst, &src, &chunk, &spans, &value))
        return NULL;
    PyObject *result = NULL;
    if (chunk <= 0 || chunk > dst.len) {
        PyErr_Format(PyExc_ValueError, "chunk must be between 1 and the destination's %zd bytes", dst.len);
        goto done;
    }
    if (!parse_spans(spans, chunk, dst.len, &sp, &nspans, &nchunks))
        goto done;
    if (nchunks * chunk != src.len) {
        PyErr_Format(PyExc_ValueError, "the spans hold %zd bytes, the source has %zd", nchunks * chunk, src.len);
        goto done;
    }
    uint32_t reg = ~(uint32_t)value;
    unsigned char **to = NULL;
#ifdef KVF_X86
    int fused = engine == crc_sse42;
#ifdef KVF_FOLD
    fused = fused || engine == crc_vpclmul;
#endif
    if (fused && chunk % 8 == 0 && nchunks) {
        to = PyMem_Malloc((size_t)nchunks * sizeof(unsigned char *));
        if (to == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t c = 0;
        for (Py_ssize_t i = 0; i < nspans; i++)
            for (Py_ssize_t k = 0; k < sp[i].count; k++)
                to[c++] = (unsigned char *)dst.buf + sp[i].offset + k * sp[i].stride;
    }
#endif
    int release = src.len >= RELEASE_GIL_BYTES;
    PyThreadState *state = release ? PyEval_SaveThread() : NULL;
#ifdef KVF_X86
#ifdef KVF_FOLD
    if (to != NULL && engine == crc_vpclmul && chunk % 64 == 0)
        reg = copy_fold_vpclmul(reg, to, (size_t)chunk, (const unsigned char *)src.buf, (size_t)src.len);
    else
#endif
    if (to != NULL)
        reg = copy_crc_sse42(reg, to, (size_t)chunk, (const unsigned char *)src.buf, (size_t)src.len);
    else
#endif
        reg = scatter(reg, (unsigned char *)dst.buf, (const unsigned char *)src.buf, (size_t)chunk, sp, nspans);
    if (release)
        PyEval_RestoreThread(state);
    PyMem_Free(to);
    result = PyLong_FromUnsignedLong((unsigned long)~reg);
done:
    PyMem_Free(sp);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(engine_doc,
"engine() -> str: the routine in use: vpclmulqdq (carry-less folding, then the crc32\n"
"instruction), sse4.2 (the crc32 instruction alone) or table.");

static PyObject *engine_of(PyObject *self, PyObject *unused) { return PyUnicode_FromString(engine_name); }

PyDoc_STRVAR(set_engine_doc,
"set_engine(name) -> bool: use vpclmulqdq, sse4.2 or table if this CPU has it (for tests and\n"
"measurements); None picks the best again. False leaves it unchanged.");

static PyObject *set_engine(PyObject *self, PyObject *arg) {
    const char *name = NULL;
    if (arg != Py_None) {
        name = PyUnicode_AsUTF8(arg);
        if (name == NULL)
            return NULL;
    }
    return PyBool_FromLong(select_engine(name));
}

static PyMethodDef methods[] = {
    {"crc32c", crc32c, METH_VARARGS, crc32c_doc},
    {"copy_crc32c", copy_crc32c, METH_VARARGS, copy_crc32c_doc},
    {"engine", engine_of, METH_NOARGS, engine_doc},
    {"set_engine", set_engine, METH_O, set_engine_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_crc32c", "Optional native CRC-32C (see crc32c).", -1, methods,
};

PyMODINIT_FUNC PyInit__crc32c(void) {
    build_tables();
    select_engine(NULL);
    return PyModule_Create(&module);
}
