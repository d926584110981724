/* kvferry.adapters._gather: an optional native gather with streaming stores.
 *
 * gather() copies n blocks of a paged cache into a contiguous destination; gather_split() does
 * the same for several equal slices of every block (head slices for several receivers) in one
 * pass over the source, each slice into its own destination, or into `replicas` destinations
 * each (a head that several receivers hold: every copy written from the one read).
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
 * bytes written are the same either way; while a block is copied, the first line of each page
 * of the next block is prefetched; eight memory streams are kept in flight: 4-page stretches are
 * copied two at a time (two of a block, or a block of one stretch with the next block; for whole
 * blocks each step reads 128 bytes of all 4 pages of a stretch before writing any, in an order
 * picked from where the destination lies in a page: kvf_ahead), blocks of 1, 2 or 4 pages 8, 4
 * or 2 at a time (KVF_GROUP_PAGES). Elsewhere (another
 * architecture, another compiler) every piece is a memcpy. The GIL is released during a copy of
 * RELEASE_GIL_BYTES or more. Every index is checked against nblocks before the first byte moves
 * (IndexError).
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

/* The step kernels (copy128, copy4s) are inlined wherever they are used: see copy4s_avx512. */
#define KVF_INLINE __attribute__((always_inline)) inline

/* A copy this small keeps the GIL: releasing it lets another Python thread (a connector's
 * serving loop) take it, and getting it back costs more than the copy (a small request's send
 * call, interleaved A/B: 4 % faster holding it). Larger copies release it, so other threads run
 * meanwhile. (_crc32c.c decides the same for checksums at 64 KiB, a pass several times faster.) */
#define RELEASE_GIL_BYTES (256 * 1024)

/* Run `run` over `w`, releasing the GIL for copies of at least RELEASE_GIL_BYTES bytes. */
#define KVF_RUN(run, dst, src, w, bytes)                                                           \
    do {                                                                                           \
        if ((bytes) >= RELEASE_GIL_BYTES) {                                                        \
            Py_BEGIN_ALLOW_THREADS                                                                 \
            run((dst), (src), (w));                                                                \
            Py_END_ALLOW_THREADS                                                                   \
        } else {                                                                                   \
            run((dst), (src), (w));                                                                \
        }                                                                                          \
    } while (0)

/* Where the pieces are: see gather() below. Sizes and strides in bytes. */
struct walk {
    const int64_t *index; /* NULL: blocks 0..n-1 */
    Py_ssize_t n, block_stride, d0, s0, d1, s1, d2, s2;
    size_t piece;
    /* gather_split(): nsplit slices, each into `replicas` destinations (dsts[j*replicas + r]:
     * copy r of slice j); slice j reads its pieces split_stride*j further on */
    Py_ssize_t nsplit, split_stride;
    char **dsts;
    Py_ssize_t replicas;
    /* gather_split() when the splits tile each block (see tiled_ok): log2 of a piece's and of
     * a row's bytes, else 0 */
    int piece_shift, row_shift;
};

/* Block i's id (blocks 0..n-1 without an index). */
static inline Py_ssize_t kvf_block(const struct walk *w, Py_ssize_t i) {
    return w->index ? (Py_ssize_t)w->index[i] : i;
}

/* The loop over blocks and pieces, with `copy` inlined into it (an indirect call per piece
 * measured 30 % slower for 512-byte pieces). */
#define KVF_WALK(w, dst, src, copy)                                                                \
    for (Py_ssize_t i = 0; i < (w)->n; i++) {                                                      \
        const char *block = (src) + kvf_block((w), i) * (w)->block_stride;                         \
        for (Py_ssize_t a = 0; a < (w)->d0; a++)                                                   \
            for (Py_ssize_t b = 0; b < (w)->d1; b++)                                               \
                for (Py_ssize_t c = 0; c < (w)->d2; c++) {                                         \
                    copy((dst), block + a * (w)->s0 + b * (w)->s1 + c * (w)->s2, (w)->piece);      \
                    (dst) += (w)->piece;                                                           \
                }                                                                                  \
    }

/* The same walk over several destinations at once (gather_split): every block is read for each
 * destination in turn while it is still in the core's cache, so memory is read once; each
 * destination's pieces of a block land one after another in it (measured faster than
 * alternating destinations piece by piece). Destination j reads slice j / replicas. */
#define KVF_WALK_SPLIT(w, src, copy)                                                               \
    for (Py_ssize_t i = 0; i < (w)->n; i++) {                                                      \
        const char *block = (src) + kvf_block((w), i) * (w)->block_stride;                         \
        for (Py_ssize_t j = 0; j < (w)->nsplit * (w)->replicas; j++) {                             \
            const char *slice = block + (j / (w)->replicas) * (w)->split_stride;                   \
            char *out = (w)->dsts[j];                                                              \
            for (Py_ssize_t a = 0; a < (w)->d0; a++)                                               \
                for (Py_ssize_t b = 0; b < (w)->d1; b++)                                           \
                    for (Py_ssize_t c = 0; c < (w)->d2; c++) {                                     \
                        copy(out, slice + a * (w)->s0 + b * (w)->s1 + c * (w)->s2, (w)->piece);    \
                        out += (w)->piece;                                                         \
                    }                                                                              \
            (w)->dsts[j] = out;                                                                    \
        }                                                                                          \
    }

typedef void (*gather_fn)(char *dst, const char *src, const struct walk *w);

static void gather_plain(char *dst, const char *src, const struct walk *w) {
    if (w->nsplit) {
        KVF_WALK_SPLIT(w, src, memcpy)
        return;
    }
    KVF_WALK(w, dst, src, memcpy)
}

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

/* One streaming kernel per instruction set. 128 bytes per step; a piece of 2 or 4 pages or more
 * is copied 4 (or 2) pages at a time, 128 bytes from each in turn, which keeps several memory
 * streams in flight (measured 10-20 % faster than a linear pass over scattered 16 KiB blocks).
 * An aligned piece of whole 128-byte steps under 2 pages takes a short path first (measured
 * 15-25 % faster for 512-byte head-slice pieces than going through the general one). */
#define KVF_PAGE 4096

/* For each whole 4-page stretch of [x, n): `step` for every 128-byte step y of it, 128 bytes
 * from each of the 4 pages in turn (x advances past the stretches). The page loop's bounds are
 * constants, so the compiler unrolls it: measured 3-5 % faster than the same loop over a
 * variable number of pages. */
#define KVF_FOUR_PAGES(x, n, y, step)                                                              \
    for (; (n) - (x) >= 4 * KVF_PAGE; (x) += 4 * KVF_PAGE)                                         \
        for (size_t at_ = 0; at_ < KVF_PAGE; at_ += 128)                                           \
            for (size_t page_ = 0; page_ < 4 * KVF_PAGE; page_ += KVF_PAGE) {                      \
                size_t y = (x) + page_ + at_;                                                      \
                step;                                                                              \
            }

/* Two 4-page stretches (of one block, or of two blocks) copied together: for every 128-byte step
 * offset y of a stretch, `step_a` for each of the first stretch's 4 pages in turn, then `step_b`
 * for the second's: eight memory streams in flight instead of four. Measured on the bench's two
 * sender ranks (56 tensors each of 256 scattered 16 KiB blocks, into the shm pool), one stretch
 * at a time against two, alternated in one process, medians of 40: whole blocks 30.4 -> 28.8 ms,
 * two head slices 34.1 -> 31.0 ms; three stretches at a time (12 streams) gave 30.0 / 32.0 ms,
 * four 31.9 / 33.9. Within a block of 32 KiB (64 KiB), one process, medians of 60: 0.237 ->
 * 0.225 ms (0.347 -> 0.334) a tensor. */
#define KVF_EIGHT_PAGES(y, step_a, step_b)                                                         \
    for (size_t at_ = 0; at_ < KVF_PAGE; at_ += 128) {                                             \
        for (size_t page_ = 0; page_ < 4 * KVF_PAGE; page_ += KVF_PAGE) {                          \
            size_t y = page_ + at_;                                                                \
            step_a;                                                                                \
        }                                                                                          \
        for (size_t page_ = 0; page_ < 4 * KVF_PAGE; page_ += KVF_PAGE) {                          \
            size_t y = page_ + at_;                                                                \
            step_b;                                                                                \
        }                                                                                          \
    }

/* One 128-byte step of a tiled block (see name##_tiled below) into its destinations: the step
 * at offset x + y of the block, read at src + y, stored `shift` bytes further on in each of its
 * slice's `reps` copies (KVF_TILED_STORE), or, for two slices of one copy, in d0 or d1
 * (KVF_TWO_SLICE_STORE: the destinations held in registers). */
#define KVF_TILED_STORE(copy128, dsts, src, x, shift, y, pshift, rshift, nsplit, reps)            \
    {                                                                                              \
        size_t at_ = (x) + (y);                                                                    \
        size_t off_ = (shift) + ((at_ >> (rshift)) << (pshift)) + (at_ & (((size_t)1 << (pshift)) - 1)); \
        char **to_ = (dsts) + ((at_ >> (pshift)) & ((nsplit) - 1)) * (reps);                      \
        for (size_t r_ = 0; r_ < (reps); r_++)                                                     \
            copy128(to_[r_] + off_, (src) + (y));                                                  \
    }
#define KVF_TWO_SLICE_STORE(copy128, d0, d1, src, x, shift, y, pshift, rshift)                    \
    {                                                                                              \
        size_t at_ = (x) + (y);                                                                    \
        copy128((((at_ >> (pshift)) & 1) ? (d1) : (d0)) + (shift) + ((at_ >> (rshift)) << (pshift)) \
                    + (at_ & (((size_t)1 << (pshift)) - 1)),                                       \
                (src) + (y));                                                                      \
    }

/* G blocks of P pages each (G * P = 8: eight memory streams, as KVF_EIGHT_PAGES) read together:
 * for every 128-byte step offset of a page, `step` for each block k in turn and each of its pages
 * (y: the step's offset in block k). G and P are constants where it is expanded, so the compiler
 * unrolls the two inner loops. */
#define KVF_GROUP_PAGES(G, P, k, y, step)                                                          \
    for (size_t at_ = 0; at_ < KVF_PAGE; at_ += 128)                                               \
        for (size_t k = 0; k < (G); k++)                                                           \
            for (size_t page_ = 0; page_ < (P) * KVF_PAGE; page_ += KVF_PAGE) {                    \
                size_t y = page_ + at_;                                                            \
                step;                                                                              \
            }

/* Tiled blocks b[0..G) of P pages each (see name##_tiled below), read together
 * (KVF_GROUP_PAGES), block k's slices `part` * k bytes further on in every destination than
 * block 0's. */
#define KVF_TILED_GROUP(copy128, G, P, dsts, b, part, pshift, rshift, nsplit, reps)              \
    do {                                                                                           \
        if ((reps) == 1 && (nsplit) == 2) {                                                        \
            char *const d0_ = (dsts)[0], *const d1_ = (dsts)[1];                                   \
            KVF_GROUP_PAGES(G, P, k, y,                                                            \
                            KVF_TWO_SLICE_STORE(copy128, d0_, d1_, (b)[k], 0, k * (part), y,      \
                                                pshift, rshift))                                   \
        } else {                                                                                   \
            KVF_GROUP_PAGES(G, P, k, y,                                                            \
                            KVF_TILED_STORE(copy128, dsts, (b)[k], 0, k * (part), y, pshift,       \
                                            rshift, nsplit, reps))                                 \
        }                                                                                          \
    } while (0)

/* Ask for the first line of each page of the next block (up to PREFETCH_PAGES pages) while
 * the current one is copied. A block's pages are separate streams to the CPU's own prefetchers,
 * which neither cross a page nor guess where a scattered next block lies; started early, its
 * pages' first reads overlap the copy. Measured on the bench's 56 tensors (16 KiB blocks
 * scattered over a 1.9 GB cache): whole blocks 1.21x as fast (16.6 -> 13.8 ms); every line of
 * the next block instead, 0.76x; two lines a block or eight, 1.14x; two blocks ahead, 1.14x. */
#define PREFETCH_PAGES 16
static inline void prefetch_pages(const char *block, size_t nbytes) {
    size_t pages = (nbytes + KVF_PAGE - 1) / KVF_PAGE;
    if (pages > PREFETCH_PAGES)
        pages = PREFETCH_PAGES;
    for (size_t p = 0; p < pages; p++)
        __builtin_prefetch(block + p * KVF_PAGE, 0, 3);
}

/* Where a store and a later load share their address's low 12 bits (its offset in a 4 KiB
 * page), the CPU may take the load for one that reads the stored bytes and hold it until the
 * store is done ("4K aliasing"). A copy whose destination lies a few lines past its source
 * within a page then waits on almost every load: measured here (AMD EPYC, AVX2; 235 MB of
 * scattered 16 KiB blocks, two blocks a step, each 128-byte step written right after it was
 * read) 3.4-4.2 GB/s with the destination 0-64 bytes past the source in a page, against 10-12
 * GB/s at 1024-2048 bytes; glibc's own memcpy of one 235 MB run lost as much at 64-256 bytes.
 * So a step reads 128 bytes of each of 4 pages before writing any (copy4s), and the order of
 * the steps follows from kvf_ahead (name##_stretch, name##_two_stretches, kvf_order):
 * measured at 64-byte offsets, one stretch walked forward ran 0.85-1.14x memcpy but for
 * 32-448 bytes ahead (0.20-0.57x), walked backward 0.81-0.99x but for 3712 and more (0.29-0.72x)
 * and 32 (0.51x); two stretches stepped together 0.93-1.29x at 256-3904 bytes. Those figures
 * came from a build that kept copy4s's vectors on the stack (see copy4s_avx512). With them in
 * registers (AMD EPYC Zen 3, AVX2, medians of 7 paired with memcpy): forward 1.01-1.07x at 0
 * and 3584-4032, 0.16-0.92x at 32-640; backward 0.76-0.88x at 32-448, 0.22-0.46x at 3712 and
 * more; stepped together 0.92-1.06x at 384-3968 but 0.37-0.44x at 256-320, hence the pair band
 * from 384 (docs/extraction.md, "Where the destination lies in a page"). */
#define KVF_BACKWARD_BELOW 512
#define KVF_PAIR_LOW 384
#define KVF_PAIR_HIGH (KVF_PAGE - 192)

/* How far dst lies past src within a page: (dst - src) mod 4096. */
static inline size_t kvf_ahead(const char *dst, const char *src) {
    return (size_t)((uintptr_t)dst - (uintptr_t)src) & (KVF_PAGE - 1);
}

/* The two bands: a destination this far ahead of a source lets two groups of 4 pages be
 * stepped together (kvf_pairable), or has one group walked backward (kvf_backward). */
static inline int kvf_pairable(size_t ahead) { return ahead >= KVF_PAIR_LOW && ahead < KVF_PAIR_HIGH; }
static inline int kvf_backward(size_t ahead) { return ahead && ahead < KVF_BACKWARD_BELOW; }

/* Two stretches a -> da and b -> db may be stepped together: every destination lies
 * KVF_PAIR_LOW to KVF_PAIR_HIGH bytes past both sources within a page. */
static inline int kvf_pair_ok(const char *da, const char *sa, const char *db, const char *sb) {
    return kvf_pairable(kvf_ahead(da, sa)) && kvf_pairable(kvf_ahead(da, sb))
           && kvf_pairable(kvf_ahead(db, sa)) && kvf_pairable(kvf_ahead(db, sb));
}

/* The order of copy4s steps for 8 sources into 8 consecutive destination pages (which share
 * their offset in a page): KVF_PAIRED (two groups of 4 stepped together) where every source
 * passes kvf_pair_ok's test, else KVF_BACKWARD where some destination lies 1 to
 * KVF_BACKWARD_BELOW - 1 bytes past a source, else KVF_FORWARD. */
enum { KVF_FORWARD, KVF_BACKWARD, KVF_PAIRED };
static inline int kvf_order(const char *dst, const char *const *srcs, int m) {
    int paired = 1, backward = 0;
    for (int i = 0; i < m; i++) {
        size_t ahead = kvf_ahead(dst, srcs[i]);
        paired &= kvf_pairable(ahead);
        backward |= kvf_backward(ahead);
    }
    return paired ? KVF_PAIRED : backward ? KVF_BACKWARD : KVF_FORWARD;
}

/* b[k] = blocks i + k (k < group) of `w`'s walk over `src`; the pages of the `group` blocks
 * after them (`nbytes` each) are asked for meanwhile (prefetch_pages). */
static inline void group_blocks(const struct walk *w, const char *src, Py_ssize_t i, Py_ssize_t group,
                                size_t nbytes, const char **b) {
    for (Py_ssize_t k = 0; k < group; k++) {
        b[k] = src + kvf_block(w, i + k) * w->block_stride;
        if (i + group + k < w->n)
            prefetch_pages(src + kvf_block(w, i + group + k) * w->block_stride, nbytes);
    }
}

#define KVF_STREAM_KERNEL(name, isa, unit, copy128, copy4s, copy_unit)                             \
    __attribute__((target(isa))) static inline void name##_piece(char *dst, const char *src,      \
                                                                 size_t n) {                      \
        if (((uintptr_t)dst & (unit - 1)) == 0 && (n & 127) == 0 && n < 2 * KVF_PAGE) {            \
            for (; n; dst += 128, src += 128, n -= 128) /* the common case, e.g. a head slice */   \
                copy128(dst, src);                                                                 \
            return;                                                                                \
        }                                                                                          \
        size_t head = align_head(dst, src, n, unit);                                               \
        dst += head, src += head, n -= head;                                                       \
        for (size_t pages = 4; pages >= 2; pages /= 2)                                             \
            for (; n >= pages * KVF_PAGE; dst += pages * KVF_PAGE, src += pages * KVF_PAGE,        \
                                          n -= pages * KVF_PAGE)                                   \
                for (size_t at = 0; at < KVF_PAGE; at += 128)                                      \
                    for (size_t page = 0; page < pages * KVF_PAGE; page += KVF_PAGE)               \
                        copy128(dst + page + at, src + page + at);                                 \
        for (; n >= 128; dst += 128, src += 128, n -= 128)                                         \
            copy128(dst, src);                                                                     \
        for (; n >= unit; dst += unit, src += unit, n -= unit)                                     \
            copy_unit(dst, src);                                                                   \
        if (n)                                                                                     \
            memcpy(dst, src, n);                                                                   \
    }                                                                                              \
    __attribute__((target(isa))) static inline void name##_copy4(char *dst, const char *src) {  \
        const char *s[4] = {src, src + KVF_PAGE, src + 2 * KVF_PAGE, src + 3 * KVF_PAGE};          \
        copy4s(dst, s);                                                                            \
    }                                                                                              \
    /* One 4-page stretch, name##_copy4 a step (128 bytes of each page read, then written),     \
     * walked backward through the page where the destination lies 1 to KVF_BACKWARD_BELOW - 1   \
     * bytes past the source within a page (kvf_ahead), forward otherwise. */                   \
    __attribute__((target(isa))) static inline void name##_stretch(char *dst, const char *src) { \
        if (kvf_backward(kvf_ahead(dst, src))) {                                                   \
            dst += KVF_PAGE, src += KVF_PAGE;                                                      \
            for (int step = 0; step < KVF_PAGE / 128; step++) {                                    \
                dst -= 128, src -= 128;                                                            \
                name##_copy4(dst, src);                                                            \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        for (int step = 0; step < KVF_PAGE / 128; step++, dst += 128, src += 128)                  \
            name##_copy4(dst, src);                                                                \
    }                                                                                              \
    /* Two 4-page stretches (8 memory streams) stepped together where no store of one can be     \
     * taken for an earlier write to the next loads' addresses (kvf_pair_ok), else one after the  \
     * other (name##_stretch). */                                                                  \
    __attribute__((target(isa))) static inline void name##_two_stretches(                        \
        char *da, const char *sa, char *db, const char *sb) {                                      \
        if (kvf_pair_ok(da, sa, db, sb)) { /* pointers stepped: indexing spilled offsets */     \
            for (int step = 0; step < KVF_PAGE / 128; step++) {                                    \
                name##_copy4(da, sa);                                                              \
                name##_copy4(db, sb);                                                              \
                da += 128, sa += 128, db += 128, sb += 128;                                        \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        name##_stretch(da, sa);                                                                    \
        name##_stretch(db, sb);                                                                    \
    }                                                                                              \
    /* Blocks of 1 or 2 pages where some destination page lies within a few lines of a source  \
     * page (kvf_order is not KVF_PAIRED): their 8 pages (s[0..8), in order) into the 8          \
     * consecutive pages at dst, each four on its own, forward or backward (copy4s). Elsewhere   \
     * KVF_GROUP_PAGES's order, a store right after each read, measured faster for them: 8 KiB   \
     * blocks 0.84-0.96x memcpy against 0.68-0.85x for copy4s steps. */                          \
    __attribute__((target(isa))) static inline void name##_eight(char *dst, const char *const *s, \
                                                                 int order) {                     \
        for (int half = 0; half < 8; half += 4) {                                                  \
            char *const d = dst + half * KVF_PAGE;                                                 \
            const char *const h0 = s[half], *const h1 = s[half + 1], *const h2 = s[half + 2],      \
                              *const h3 = s[half + 3];                                             \
            for (size_t step = 0; step < KVF_PAGE; step += 128) {                                  \
                size_t at = order == KVF_BACKWARD ? KVF_PAGE - 128 - step : step;                  \
                const char *h[4] = {h0 + at, h1 + at, h2 + at, h3 + at};                           \
                copy4s(d + at, h);                                                                 \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* One block whose rows are the splits' pieces side by side (tiled_ok): read in the order    \
     * of a whole-block copy (4 or 2 pages at a time, 128 bytes from each in turn: the several   \
     * memory streams that make whole blocks fast), each 128-byte step stored to the split and   \
     * row it belongs to, in each of its `reps` copies (the step is still in L1 for the next).   \
     * One copy (a fan-out's head slices) takes a loop of its own over whole 4-page stretches,  \
     * its page loop a constant the compiler unrolls (as the whole-block loop in name() below):  \
     * a test of `reps` per step and a page loop of variable length cost 5-10 %; two slices keep \
     * both destinations in registers (a char store may alias dsts[], so the array is read again \
     * after every store otherwise: 4-5 % more). What is left of a block, and blocks copied      \
     * several times, take the general loop; piece by piece was 15-25 % slower, two pages at a   \
     * time 10 %, each page's rows in turn 24 %. */                                             \
    /* Two 4-page stretches of tiled blocks together (KVF_EIGHT_PAGES): stretch `a` is bytes      \
     * [xa, xa + 4 pages) of its block, stored `sa` bytes further on in every destination; `b`    \
     * the same with xb and sb (the next block's first stretch: sb = one block's part). */        \
    __attribute__((target(isa))) static inline void name##_tiled_pair(                            \
        char **dsts, const char *a, size_t xa, size_t sa, const char *b, size_t xb, size_t sb,    \
        int pshift, int rshift, size_t nsplit, size_t reps) {                                     \
        if (reps == 1 && nsplit == 2) { /* both destinations held in registers, as below */       \
            char *const d0 = dsts[0], *const d1 = dsts[1];                                         \
            KVF_EIGHT_PAGES(y, KVF_TWO_SLICE_STORE(copy128, d0, d1, a, xa, sa, y, pshift, rshift), \
                            KVF_TWO_SLICE_STORE(copy128, d0, d1, b, xb, sb, y, pshift, rshift))    \
            return;                                                                                \
        }                                                                                          \
        KVF_EIGHT_PAGES(y,                                                                         \
                        KVF_TILED_STORE(copy128, dsts, a, xa, sa, y, pshift, rshift, nsplit, reps),\
                        KVF_TILED_STORE(copy128, dsts, b, xb, sb, y, pshift, rshift, nsplit, reps))\
    }                                                                                              \
    /* Tiled blocks of 1 page, 8 of them read together. Blocks of 2 or 4 pages were read 4 or  \
     * 2 at a time too (measured faster on an earlier build); with copy4s in registers, on AMD  \
     * EPYC Zen 3 (AVX2), 235 MB of scattered 16 KiB blocks split in two (512-byte slices), one \
     * block at a time ran 0.82-0.95x memcpy against 0.55-0.80x two at a time (five placements \
     * of the destinations, two processes each); split in four, each slice written twice,      \
     * 0.85-0.90x against 0.78-0.90x; 8 KiB blocks split in two 1.30-1.42x against 1.13-1.41x  \
     * (x memcpy of the bytes: 256-byte slices of a 117 MB cache). 4 KiB blocks (128-byte      \
     * slices) 8 at a time 0.77-0.80x against 0.60-0.86x one at a time. */                     \
    __attribute__((target(isa))) static inline void name##_tiled_group(                           \
        char **dsts, const char *const *b, size_t part, int pshift, int rshift, size_t nsplit,    \
        size_t reps) {                                                                             \
        KVF_TILED_GROUP(copy128, 8, 1, dsts, b, part, pshift, rshift, nsplit, reps);               \
    }                                                                                              \
    __attribute__((target(isa))) static inline void name##_tiled(char **dsts, const char *src,    \
                                                                 size_t span, int pshift,         \
                                                                 int rshift, size_t nsplit,       \
                                                                 size_t reps) {                   \
        size_t pmask = ((size_t)1 << pshift) - 1, x = 0;                                           \
        for (; span - x >= 8 * KVF_PAGE; x += 8 * KVF_PAGE) /* two stretches at a time */          \
            name##_tiled_pair(dsts, src + x, x, 0, src + x + 4 * KVF_PAGE, x + 4 * KVF_PAGE, 0,    \
                              pshift, rshift, nsplit, reps);                                       \
        if (reps == 1 && nsplit == 2) { /* two slices: both destinations held in registers */    \
            char *const d0 = dsts[0], *const d1 = dsts[1];                                         \
            KVF_FOUR_PAGES(x, span, y,                                                             \
                           copy128((((y >> pshift) & 1) ? d1 : d0) + ((y >> rshift) << pshift)    \
                                       + (y & pmask),                                              \
                                   src + y))                                                       \
        }                                                                                          \
        if (reps == 1)                                                                             \
            KVF_FOUR_PAGES(x, span, y,                                                             \
                           copy128(dsts[(y >> pshift) & (nsplit - 1)] + ((y >> rshift) << pshift)  \
                                       + (y & pmask),                                              \
                                   src + y))                                                       \
        for (size_t pages = 4; pages >= 2; pages /= 2)                                             \
            for (; span - x >= pages * KVF_PAGE; x += pages * KVF_PAGE)                            \
                for (size_t at = 0; at < KVF_PAGE; at += 128)                                      \
                    for (size_t page = 0; page < pages * KVF_PAGE; page += KVF_PAGE) {             \
                        size_t y = x + page + at;                                                  \
                        size_t off = ((y >> rshift) << pshift) + (y & pmask);                      \
                        if (reps == 1) { /* the common case (head slices for a fan-out) */         \
                            copy128(dsts[(y >> pshift) & (nsplit - 1)] + off, src + y);            \
                            continue;                                                              \
                        }                                                                          \
                        char **to = dsts + ((y >> pshift) & (nsplit - 1)) * reps;                  \
                        for (size_t r = 0; r < reps; r++)                                          \
                            copy128(to[r] + off, src + y);                                         \
                    }                                                                              \
        for (; x < span; x += 128) {                                                               \
            size_t off = ((x >> rshift) << pshift) + (x & pmask);                                  \
            char **to = dsts + ((x >> pshift) & (nsplit - 1)) * reps;                              \
            for (size_t r = 0; r < reps; r++)                                                      \
                copy128(to[r] + off, src + x);                                                     \
        }                                                                                          \
    }                                                                                              \
    __attribute__((target(isa))) static void name(char *dst, const char *src,                     \
                                                  const struct walk *w) {                         \
        if (w->nsplit && w->row_shift) {                                                           \
            size_t span = (size_t)w->d2 * (size_t)w->s2, part = (size_t)w->d2 * w->piece;          \
            for (Py_ssize_t i = 0; i < w->n; i++) {                                                \
                Py_ssize_t group = span == KVF_PAGE ? 8 : 0;                                       \
                if (group && i + group <= w->n) { /* blocks of one page: 8 at once */              \
                    const char *b[8];                                                              \
                    group_blocks(w, src, i, group, span, b);                                       \
                    name##_tiled_group(w->dsts, b, part, w->piece_shift, w->row_shift,             \
                                       (size_t)w->nsplit, (size_t)w->replicas);                    \
                    for (Py_ssize_t j = 0; j < w->nsplit * w->replicas; j++)                       \
                        w->dsts[j] += group * part;                                                \
                    i += group - 1;                                                                \
                    continue;                                                                      \
                }                                                                                  \
                if (i + 1 < w->n)                                                                  \
                    prefetch_pages(src + kvf_block(w, i + 1) * w->block_stride, span);             \
                name##_tiled(w->dsts, src + kvf_block(w, i) * w->block_stride, span,               \
                             w->piece_shift, w->row_shift, (size_t)w->nsplit, (size_t)w->replicas);\
                for (Py_ssize_t j = 0; j < w->nsplit * w->replicas; j++)                           \
                    w->dsts[j] += part;                                                            \
            }                                                                                      \
        } else if (w->nsplit == 1 && w->replicas == 2 && w->d0 == 1 && w->d1 == 1 && w->d2 == 1   \
                   && w->piece >= 4 * KVF_PAGE && w->piece < 8 * KVF_PAGE                          \
                   && !(w->piece & (unit - 1)) && !((uintptr_t)w->dsts[0] & (unit - 1))            \
                   && !((uintptr_t)w->dsts[1] & (unit - 1))) {                                     \
            /* Whole blocks of one stretch (and up to 4 pages more: a latent of 576 bf16 values  \
             * a token is 4.5 pages a block), each into two destinations (an MLA latent for two    \
             * receivers), two blocks at a time: the bench's MLA row's two sender ranks, sends   \
             * alternated in one process, medians of 40: 29.8 -> 24.8 ms. Stretch by stretch     \
             * where a copy lies within a few lines past a block in a page (kvf_ahead): 0.23-0.38x \
             * -> 1.05-1.12x memcpy at 0-64 bytes ahead (docs/extraction.md). */                  \
            const size_t piece = w->piece;                                                         \
            char *c0 = w->dsts[0], *c1 = w->dsts[1];                                               \
            Py_ssize_t i = 0;                                                                      \
            for (; i + 1 < w->n; i += 2, c0 += 2 * piece, c1 += 2 * piece) {                       \
                const char *a = src + kvf_block(w, i) * w->block_stride;                           \
                const char *b = src + kvf_block(w, i + 1) * w->block_stride;                       \
                for (Py_ssize_t k = i + 2; k < i + 4 && k < w->n; k++)                             \
                    prefetch_pages(src + kvf_block(w, k) * w->block_stride, piece);                \
                if (kvf_pair_ok(c0, a, c1, b) && kvf_pair_ok(c0 + piece, a, c1 + piece, b))       \
                    KVF_EIGHT_PAGES(y,                                                             \
                                    {                                                              \
                                        copy128(c0 + y, a + y);                                    \
                                        copy128(c1 + y, a + y);                                    \
                                    },                                                             \
                                    {                                                              \
                                        copy128(c0 + piece + y, b + y);                            \
                                        copy128(c1 + piece + y, b + y);                            \
                                    })                                                             \
                else { /* a copy within a few lines of a block in a page: see kvf_ahead */         \
                    name##_stretch(c0, a);                                                         \
                    name##_stretch(c1, a);                                                         \
                    name##_stretch(c0 + piece, b);                                                 \
                    name##_stretch(c1 + piece, b);                                                 \
                }                                                                                  \
                if (piece > 4 * KVF_PAGE) { /* the rest of each block, to each copy */             \
                    const size_t four = 4 * KVF_PAGE, rest = piece - four;                         \
                    name##_piece(c0 + four, a + four, rest);                                       \
                    name##_piece(c1 + four, a + four, rest);                                       \
                    name##_piece(c0 + piece + four, b + four, rest);                               \
                    name##_piece(c1 + piece + four, b + four, rest);                               \
                }                                                                                  \
            }                                                                                      \
            if (i < w->n) { /* an odd last block */                                                \
                const char *a = src + kvf_block(w, i) * w->block_stride;                           \
                name##_piece(c0, a, piece);                                                        \
                name##_piece(c1, a, piece);                                                        \
                c0 += piece, c1 += piece;                                                          \
            }                                                                                      \
            w->dsts[0] = c0, w->dsts[1] = c1;                                                      \
        } else if (w->nsplit) {                                                                    \
            KVF_WALK_SPLIT(w, src, name##_piece)                                                   \
        } else if (w->d0 == 1 && w->d1 == 1 && w->d2 == 1) {                                       \
            /* Whole blocks (or runs of them). Into an aligned destination, blocks of 1 or 2     \
             * pages go 8 or 4 at a time (KVF_GROUP_PAGES: 1024 scattered 4 KiB blocks 0.440 ->    \
             * 0.281 ms, 512 of 8 KiB 0.398 -> 0.263 ms, one process, medians of 60; before, each  \
             * block was one stream); whole 4-page stretches go two at a time (a block's own, or  \
             * a block of one stretch with the next block: name##_two_stretches), a last single   \
             * one through name##_stretch; both pick their order of steps from kvf_ahead. The     \
             * rest of a block goes through name##_piece. */                                      \
            const size_t piece = w->piece, four = 4 * KVF_PAGE;                                    \
            for (Py_ssize_t i = 0; i < w->n; i++, dst += piece) {                                  \
                const char *block = src + kvf_block(w, i) * w->block_stride;                       \
                int aligned = ((uintptr_t)dst & (unit - 1)) == 0; /* a piece may not keep it */   \
                Py_ssize_t group = piece == KVF_PAGE ? 8 : piece == 2 * KVF_PAGE ? 4 : 0;          \
                if (group && aligned && i + group <= w->n) { /* blocks of 1 or 2 pages: 8 at once */ \
                    const char *b[8];                                                              \
                    group_blocks(w, src, i, group, piece, b);                                      \
                    const char *s8[8];                                                             \
                    for (int p = 0; p < 8; p++) /* the group's 8 pages, in order */                \
                        s8[p] = b[p / (8 / group)] + (p % (8 / group)) * KVF_PAGE;                 \
                    int order = kvf_order(dst, s8, 8);                                             \
                    if (order != KVF_PAIRED)                                                       \
                        name##_eight(dst, s8, order);                                              \
                    else if (group == 8)                                                           \
                        KVF_GROUP_PAGES(8, 1, k, y, copy128(dst + k * piece + y, b[k] + y))        \
                    else                                                                           \
                        KVF_GROUP_PAGES(4, 2, k, y, copy128(dst + k * piece + y, b[k] + y))        \
                    i += group - 1, dst += (group - 1) * piece;                                    \
                    continue;                                                                      \
                }                                                                                  \
                if (aligned && piece >= four && piece < 2 * four && (piece & (unit - 1)) == 0     \
                    && i + 1 < w->n) { /* one stretch a block: with the next block's */            \
                    const char *next = src + kvf_block(w, i + 1) * w->block_stride;                \
                    char *dnext = dst + piece;                                                     \
                    for (Py_ssize_t k = i + 2; k < i + 4 && k < w->n; k++)                         \
                        prefetch_pages(src + kvf_block(w, k) * w->block_stride, piece);            \
                    name##_two_stretches(dst, block, dnext, next);                                 \
                    if (piece > four) {                                                            \
                        name##_piece(dst + four, block + four, piece - four);                      \
                        name##_piece(dnext + four, next + four, piece - four);                     \
                    }                                                                              \
                    i++, dst += piece;                                                             \
                    continue;                                                                      \
                }                                                                                  \
                if (i + 1 < w->n)                                                                  \
                    prefetch_pages(src + kvf_block(w, i + 1) * w->block_stride, piece);            \
                size_t x = 0;                                                                      \
                if (aligned) {                                                                     \
                    for (; piece - x >= 2 * four; x += 2 * four) { /* two stretches at a time */   \
                        char *d = dst + x;                                                         \
                        const char *b = block + x;                                                 \
                        name##_two_stretches(d, b, d + four, b + four);                            \
                    }                                                                              \
                    for (; piece - x >= four; x += four)                                           \
                        name##_stretch(dst + x, block + x);                                        \
                }                                                                                  \
                if (x < piece)                                                                     \
                    name##_piece(dst + x, block + x, piece - x);                                   \
            }                                                                                      \
        } else {                                                                                   \
            KVF_WALK(w, dst, src, name##_piece)                                                    \
        }                                                                                          \
        _mm_sfence();                                                                              \
    }

__attribute__((target("avx512f"))) static KVF_INLINE void unit_avx512(char *dst, const char *src) {
    _mm512_stream_si512((void *)dst, _mm512_loadu_si512((const void *)src));
}
__attribute__((target("avx512f"))) static KVF_INLINE void copy128_avx512(char *dst, const char *src) {
    __m512i a = _mm512_loadu_si512((const void *)src);
    __m512i b = _mm512_loadu_si512((const void *)(src + 64));
    _mm512_stream_si512((void *)dst, a);
    _mm512_stream_si512((void *)(dst + 64), b);
}
/* copy4s: 128 bytes from each of s[0..3], all read before any is written, to the same offset
 * of 4 consecutive destination pages (see kvf_ahead); copy4: from 4 consecutive source pages.
 * Written out register by register and always inlined: as loops over an array of vectors, GCC
 * 12 -O3 kept the loops where it inlined them into the whole-block kernel and put the array on
 * the stack, so each step went through 512 bytes of stack (16 plain stores and 16 loads more,
 * beside the 16 streaming stores): 16 KiB blocks ran 0.67-0.74x memcpy at 512-3712 bytes ahead
 * in that build (six processes) and 0.96-1.06x in a build of the same source with one more
 * global test in it, which kept them in registers (docs/extraction.md). */
#define KVF_LOAD2_512(v, p)                                                                        \
    __m512i v##0 = _mm512_loadu_si512((const void *)(p));                                         \
    __m512i v##1 = _mm512_loadu_si512((const void *)((p) + 64))
#define KVF_STORE2_512(d, v)                                                                       \
    _mm512_stream_si512((void *)(d), v##0);                                                        \
    _mm512_stream_si512((void *)((d) + 64), v##1)
/* copy4s for one instruction set from its LOAD and STORE macros (4 sources' bytes into named
 * registers, then streamed out to 4 consecutive destination pages). */
#define KVF_DEFINE_COPY4S(name, isa, LOAD, STORE)                                                  \
    __attribute__((target(isa))) static KVF_INLINE void name(char *dst, const char *const *s) {   \
        LOAD(a, s[0]);                                                                             \
        LOAD(b, s[1]);                                                                             \
        LOAD(c, s[2]);                                                                             \
        LOAD(e, s[3]);                                                                             \
        STORE(dst, a);                                                                             \
        STORE(dst + KVF_PAGE, b);                                                                  \
        STORE(dst + 2 * KVF_PAGE, c);                                                              \
        STORE(dst + 3 * KVF_PAGE, e);                                                              \
    }
KVF_DEFINE_COPY4S(copy4s_avx512, "avx512f", KVF_LOAD2_512, KVF_STORE2_512)
KVF_STREAM_KERNEL(gather_nt_avx512, "avx512f", 64, copy128_avx512, copy4s_avx512, unit_avx512)

__attribute__((target("avx2"))) static KVF_INLINE void unit_avx2(char *dst, const char *src) {
    _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
}
__attribute__((target("avx2"))) static KVF_INLINE void copy128_avx2(char *dst, const char *src) {
    __m256i a = _mm256_loadu_si256((const __m256i *)src);
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
    __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
    _mm256_stream_si256((__m256i *)dst, a);
    _mm256_stream_si256((__m256i *)(dst + 32), b);
    _mm256_stream_si256((__m256i *)(dst + 64), c);
    _mm256_stream_si256((__m256i *)(dst + 96), d);
}
/* The 16 vector registers AVX2 has: 4 of each source. */
/* 4 vectors of type T from p (w bytes each) into v0..v3; the 4 streamed out to d. */
#define KVF_LOAD4(T, load, w, v, p)                                                                \
    T v##0 = load((const T *)(p));                                                                 \
    T v##1 = load((const T *)((p) + (w)));                                                         \
    T v##2 = load((const T *)((p) + 2 * (w)));                                                     \
    T v##3 = load((const T *)((p) + 3 * (w)))
#define KVF_STORE4(T, stream, w, d, v)                                                             \
    stream((T *)(d), v##0);                                                                        \
    stream((T *)((d) + (w)), v##1);                                                                \
    stream((T *)((d) + 2 * (w)), v##2);                                                            \
    stream((T *)((d) + 3 * (w)), v##3)
#define KVF_LOAD4_256(v, p) KVF_LOAD4(__m256i, _mm256_loadu_si256, 32, v, p)
#define KVF_STORE4_256(d, v) KVF_STORE4(__m256i, _mm256_stream_si256, 32, d, v)
KVF_DEFINE_COPY4S(copy4s_avx2, "avx2", KVF_LOAD4_256, KVF_STORE4_256)
KVF_STREAM_KERNEL(gather_nt_avx2, "avx2", 32, copy128_avx2, copy4s_avx2, unit_avx2)

__attribute__((target("sse2"))) static KVF_INLINE void unit_sse2(char *dst, const char *src) {
    _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
}
__attribute__((target("sse2"))) static KVF_INLINE void copy128_sse2(char *dst, const char *src) {
    for (int i = 0; i < 128; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}
/* SSE2 has 16 registers, 256 bytes: 64 bytes of each of the 4 sources read, then written, twice. */
#define KVF_LOAD4_128(v, p) KVF_LOAD4(__m128i, _mm_loadu_si128, 16, v, p)
#define KVF_STORE4_128(d, v) KVF_STORE4(__m128i, _mm_stream_si128, 16, d, v)
KVF_DEFINE_COPY4S(copy4s_sse2_64, "sse2", KVF_LOAD4_128, KVF_STORE4_128)
__attribute__((target("sse2"))) static KVF_INLINE void copy4s_sse2(char *dst, const char *const *s) {
    const char *second[4] = {s[0] + 64, s[1] + 64, s[2] + 64, s[3] + 64};
    copy4s_sse2_64(dst, s);
    copy4s_sse2_64(dst + 64, second);
}
KVF_STREAM_KERNEL(gather_nt_sse2, "sse2", 16, copy128_sse2, copy4s_sse2, unit_sse2)

#endif

/* The streaming gather in use and its name; "memcpy" when there is none. */
static gather_fn stream_gather = gather_plain;
static const char *stream_isa = "memcpy";

static int select_isa(const char *name) {
#ifdef KVF_X86
    __builtin_cpu_init();
    int any = name == NULL;
    if ((any || !strcmp(name, "avx512f")) && __builtin_cpu_supports("avx512f")) {
        stream_gather = gather_nt_avx512, stream_isa = "avx512f";
        return 1;
    }
    if ((any || !strcmp(name, "avx2")) && __builtin_cpu_supports("avx2")) {
        stream_gather = gather_nt_avx2, stream_isa = "avx2";
        return 1;
    }
    if ((any || !strcmp(name, "sse2")) && __builtin_cpu_supports("sse2")) {
        stream_gather = gather_nt_sse2, stream_isa = "sse2";
        return 1;
    }
#endif
    if (name == NULL || !strcmp(name, "memcpy")) {
        stream_gather = gather_plain, stream_isa = "memcpy";
        return 1;
    }
    return 0;
}

/* ValueError for a negative count or size, IndexError for a block id outside [0, nblocks)
 * (ids NULL: n blocks from the start); 0 with the error set, before any byte moves. */
static int check_walk(const char *fn, const int64_t *ids, Py_ssize_t n, Py_ssize_t nblocks,
                      Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t d2, Py_ssize_t piece) {
    if (n < 0 || d0 < 0 || d1 < 0 || d2 < 0 || piece < 0) {
        PyErr_Format(PyExc_ValueError, "%s: negative count or size", fn);
        return 0;
    }
    if (ids) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= nblocks) {
                PyErr_Format(PyExc_IndexError, "%s: block id %lld outside [0, %zd)", fn,
                             (long long)ids[i], nblocks);
                return 0;
            }
    } else if (n > nblocks) {
        PyErr_Format(PyExc_IndexError, "%s: %zd blocks from a view of %zd", fn, n, nblocks);
        return 0;
    }
    return 1;
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
    const int64_t *ids = (const int64_t *)(uintptr_t)index;
    if (!check_walk("gather", ids, n, nblocks, d0, d1, d2, piece))
        return NULL;
    struct walk w = {ids, n, block_stride, d0, s0, d1, s1, d2, s2, (size_t)piece, 0, 0, NULL, 1, 0, 0};
    gather_fn run = stream && piece >= STREAM_MIN_PIECE ? stream_gather : gather_plain;
    double bytes = (double)n * (double)d0 * (double)d1 * (double)d2 * (double)piece;
    KVF_RUN(run, (char *)(uintptr_t)dst, (const char *)(uintptr_t)src, &w, bytes);
    Py_RETURN_NONE;
}

#define KVF_MAX_SPLIT 64

/* log2(v) for a power of two v > 0, else -1. */
static int log2_exact(Py_ssize_t v) {
    if (v <= 0 || (v & (v - 1)))
        return -1;
    int shift = 0;
    while (((Py_ssize_t)1 << shift) != v)
        shift++;
    return shift;
}

/* Whether the splits tile every block, so the tiled kernel applies: one level of pieces
 * (d0 = d1 = 1), each row of a block is the nsplit pieces side by side (s2 = nsplit * piece,
 * split_stride = piece), piece and nsplit powers of two, piece a multiple of 128 bytes and every
 * destination 64-byte aligned. Sets the shifts (0 when it does not apply). */
static void tiled_ok(struct walk *w) {
    w->piece_shift = w->row_shift = 0;
    int pshift = log2_exact((Py_ssize_t)w->piece), nshift = log2_exact(w->nsplit);
    if (w->d0 != 1 || w->d1 != 1 || pshift < 7 || nshift < 1 || w->split_stride != (Py_ssize_t)w->piece
        || w->s2 != w->nsplit * (Py_ssize_t)w->piece)
        return;
    for (Py_ssize_t j = 0; j < w->nsplit * w->replicas; j++)
        if ((uintptr_t)w->dsts[j] & 63)
            return;
    w->piece_shift = pshift;
    w->row_shift = pshift + nshift;
}
PyDoc_STRVAR(gather_split_doc,
"gather_split(dsts, split_stride, src, index, n, nblocks, block_stride, d0, s0, d1, s1, d2, s2,\n"
"             piece, stream, replicas=1)\n"
"\n"
"gather() into len(dsts) destinations in one pass over the source: destination j (an address)\n"
"gets what gather() would write reading from src + (j // replicas)*split_stride (e.g. head\n"
"slice j of every block; with replicas r, each slice into r destinations, written from one\n"
"read). len(dsts) a multiple of replicas, at most 64 destinations. Errors as gather().");
static PyObject *gather_split(PyObject *self, PyObject *args) {
    PyObject *targets;
    unsigned long long src, index;
    Py_ssize_t split_stride, n, nblocks, block_stride, d0, s0, d1, s1, d2, s2, piece;
    int stream;
    Py_ssize_t replicas = 1;
    if (!PyArg_ParseTuple(args, "O!nKKnnnnnnnnnnp|n:gather_split", &PyTuple_Type, &targets,
                          &split_stride, &src, &index, &n, &nblocks, &block_stride, &d0, &s0, &d1,
                          &s1, &d2, &s2, &piece, &stream, &replicas))
        return NULL;
    Py_ssize_t ndst = PyTuple_GET_SIZE(targets);
    if (ndst < 1 || ndst > KVF_MAX_SPLIT) {
        PyErr_Format(PyExc_ValueError, "gather_split: need 1 to %d destinations, got %zd",
                     KVF_MAX_SPLIT, ndst);
        return NULL;
    }
    if (replicas < 1 || ndst % replicas) {
        PyErr_Format(PyExc_ValueError, "gather_split: %zd destinations are not a multiple of %zd replicas",
                     ndst, replicas);
        return NULL;
    }
    Py_ssize_t nsplit = ndst / replicas;
    char *dsts[KVF_MAX_SPLIT];
    for (Py_ssize_t j = 0; j < ndst; j++) {
        unsigned long long address = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(targets, j));
        if (PyErr_Occurred())
            return NULL;
        dsts[j] = (char *)(uintptr_t)address;
    }
    const int64_t *ids = (const int64_t *)(uintptr_t)index;
    if (!check_walk("gather_split", ids, n, nblocks, d0, d1, d2, piece))
        return NULL;
    struct walk w = {ids, n, block_stride, d0, s0, d1, s1, d2, s2, (size_t)piece,
                     nsplit, split_stride, dsts, replicas, 0, 0};
    tiled_ok(&w);
    gather_fn run = stream && piece >= STREAM_MIN_PIECE ? stream_gather : gather_plain;
    double bytes = (double)n * (double)d0 * (double)d1 * (double)d2 * (double)piece * (double)ndst;
    KVF_RUN(run, NULL, (const char *)(uintptr_t)src, &w, bytes);
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
    return PyBool_FromLong(select_isa(name));
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"gather_split", gather_split, METH_VARARGS, gather_split_doc},
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
