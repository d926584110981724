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
 * zero bytes". Elsewhere (another CPU, another architecture or compiler) a table-driven CRC reads
 * 8 bytes a step. Both give the same value; set_engine() picks one for tests and measurements.
 * The GIL is released for buffers of 64 KiB or more.
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

typedef uint32_t (*crc_fn)(uint32_t reg, const unsigned char *p, size_t n);
static crc_fn engine = crc_table;
static const char *engine_name = "table";

static int select_engine(const char *name) {
#ifdef KVF_X86
    __builtin_cpu_init();
    if ((name == NULL || !strcmp(name, "sse4.2")) && __builtin_cpu_supports("sse4.2")) {
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

PyDoc_STRVAR(engine_doc, "engine() -> str: the routine in use, sse4.2 (the crc32 instruction) or table.");

static PyObject *engine_of(PyObject *self, PyObject *unused) { return PyUnicode_FromString(engine_name); }

PyDoc_STRVAR(set_engine_doc,
"set_engine(name) -> bool: use sse4.2 or table if this CPU has it (for tests and measurements);\n"
"None picks the best again. False leaves it unchanged.");

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
