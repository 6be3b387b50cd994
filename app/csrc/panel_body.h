/* The panel kernel's body, for one kind of weight: included by panel_gemm.c once per kind
 * with
 *   WT        the panels' element type (float, uint16_t holding bf16, int8_t),
 *   SFX       the suffix of this kind's function names (N(name) -> name_SFX),
 *   W8X2(p, w0, w1)  a k's sixteen weights at p as two ymm registers of eight floats,
 *             columns 0-7 and 8-15 (AVX2),
 *   W16(p)    sixteen as a zmm register (AVX-512, in functions with that target).
 * A weight is widened to float in registers and every product is the same chain of float
 * FMAs whatever the kind: only the bytes read from memory differ (4, 2 or 1 a weight).
 * An int8 panel's per-column scale is applied after the sums (panel_gemm.c). See
 * panel_gemm.c's header for the layout, the tiles and the threading.
 */
/* mr (1..6) rows of x (row stride ldx) times one panel; 16 sums per row into y (stride ldy).
   A slice of k (run_panels_big): resume: the sums start from what y holds (the slices
   before, no bias yet) instead of zero; bias16 NULL: store the sums without the bias (a
   slice before the last). Each sum stays one FMA per k in order, so the bits are the same
   sliced or not. */
static inline __attribute__((always_inline)) void N(micro_sums)(
    int mr, int resume, long k, const WT *pan, const float *x, long ldx, float *y,
    long ldy, const float *bias16) {
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
    __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
    __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    __m256 a40 = _mm256_setzero_ps(), a41 = _mm256_setzero_ps();
    __m256 a50 = _mm256_setzero_ps(), a51 = _mm256_setzero_ps();
    if (resume) {
#define LOAD(i, A0, A1)                                                \
        if (mr > i) {                                                  \
            A0 = _mm256_loadu_ps(y + (i) * ldy);                       \
            A1 = _mm256_loadu_ps(y + (i) * ldy + 8);                   \
        }
        LOAD(0, a00, a01) LOAD(1, a10, a11) LOAD(2, a20, a21)
        LOAD(3, a30, a31) LOAD(4, a40, a41) LOAD(5, a50, a51)
#undef LOAD
    }
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx;
    const float *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
    for (long kk = 0; kk < k; kk++) {
        const WT *w = pan + kk * NR;
        _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
        __m256 w0, w1, b;
        W8X2(w, w0, w1);
        b = _mm256_broadcast_ss(x0 + kk);
        a00 = _mm256_fmadd_ps(b, w0, a00);
        a01 = _mm256_fmadd_ps(b, w1, a01);
        if (mr > 1) {
            b = _mm256_broadcast_ss(x1 + kk);
            a10 = _mm256_fmadd_ps(b, w0, a10);
            a11 = _mm256_fmadd_ps(b, w1, a11);
        }
        if (mr > 2) {
            b = _mm256_broadcast_ss(x2 + kk);
            a20 = _mm256_fmadd_ps(b, w0, a20);
            a21 = _mm256_fmadd_ps(b, w1, a21);
        }
        if (mr > 3) {
            b = _mm256_broadcast_ss(x3 + kk);
            a30 = _mm256_fmadd_ps(b, w0, a30);
            a31 = _mm256_fmadd_ps(b, w1, a31);
        }
        if (mr > 4) {
            b = _mm256_broadcast_ss(x4 + kk);
            a40 = _mm256_fmadd_ps(b, w0, a40);
            a41 = _mm256_fmadd_ps(b, w1, a41);
        }
        if (mr > 5) {
            b = _mm256_broadcast_ss(x5 + kk);
            a50 = _mm256_fmadd_ps(b, w0, a50);
            a51 = _mm256_fmadd_ps(b, w1, a51);
        }
    }
    if (bias16 != NULL) {
        __m256 c0 = _mm256_loadu_ps(bias16), c1 = _mm256_loadu_ps(bias16 + 8);
        a00 = _mm256_add_ps(a00, c0), a01 = _mm256_add_ps(a01, c1);
        a10 = _mm256_add_ps(a10, c0), a11 = _mm256_add_ps(a11, c1);
        a20 = _mm256_add_ps(a20, c0), a21 = _mm256_add_ps(a21, c1);
        a30 = _mm256_add_ps(a30, c0), a31 = _mm256_add_ps(a31, c1);
        a40 = _mm256_add_ps(a40, c0), a41 = _mm256_add_ps(a41, c1);
        a50 = _mm256_add_ps(a50, c0), a51 = _mm256_add_ps(a51, c1);
    }
#define STORE(i, A0, A1)                                               \
    do {                                                               \
        _mm256_storeu_ps(y + (i) * ldy, A0);                           \
        _mm256_storeu_ps(y + (i) * ldy + 8, A1);                       \
    } while (0)
    STORE(0, a00, a01);
    if (mr > 1) STORE(1, a10, a11);
    if (mr > 2) STORE(2, a20, a21);
    if (mr > 3) STORE(3, a30, a31);
    if (mr > 4) STORE(4, a40, a41);
    if (mr > 5) STORE(5, a50, a51);
#undef STORE
}

static inline __attribute__((always_inline)) void N(micro)(
    int mr, long k, const WT *pan, const float *x, long ldx, float *y, long ldy,
    const float *bias16) {
    N(micro_sums)(mr, 0, k, pan, x, ldx, y, ldy, bias16);
}

#define MICRO(m)                                                                         \
    static void N(micro##m)(long k, const WT *pan, const float *x, long ldx, float *y,    \
                         long ldy, const float *bias16) {                                \
        N(micro)(m, k, pan, x, ldx, y, ldy, bias16);                                        \
    }
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)
MICRO(5)
MICRO(6)
#undef MICRO
typedef void (*N(micro_fn))(long, const WT *, const float *, long, float *, long, const float *);
static const N(micro_fn) N(MICROS)[MR + 1] = {0, N(micro1), N(micro2), N(micro3), N(micro4), N(micro5), N(micro6)};

/* Six rows through a slice of k (the prefill path's blocks are whole blocks of six). */
static void N(micro6_slice)(int resume, long k, const WT *pan, const float *x, long ldx,
                         float *y, long ldy, const float *bias16) {
    N(micro_sums)(MR, resume, k, pan, x, ldx, y, ldy, bias16);
}

/* Tiles of one to three rows times several panels side by side: with 8-12 sums in flight
   the FMA's latency is hidden, where one or two rows alone on one panel hold too few and
   such a pass cost about as much as a pass of six. A block of six leaves these rows over;
   they go through the panels the block has just brought into cache. (The sums are named
   one by one: as an array, the compiler kept them in memory.) */
#define FMA_PAIR(A0, A1, B, W)                                     \
    do {                                                           \
        __m256 w0_, w1_;                                           \
        W8X2(W, w0_, w1_);                                         \
        A0 = _mm256_fmadd_ps(B, w0_, A0);                          \
        A1 = _mm256_fmadd_ps(B, w1_, A1);                          \
    } while (0)
#define STORE_PAIR(Y, A0, A1, BIAS)                                          \
    do {                                                                     \
        _mm256_storeu_ps(Y, _mm256_add_ps(A0, _mm256_loadu_ps(BIAS)));       \
        _mm256_storeu_ps((Y) + 8, _mm256_add_ps(A1, _mm256_loadu_ps((BIAS) + 8))); \
    } while (0)

/* One row times four panels: four weight streams in flight (a lone stream's decode step).
   int8 (NEXT_EVERY > 0) also prefetches the next four panels towards L2, four more streams
   the core reads ahead: an int8 stream holds a quarter of float32's bytes per k, and four
   of them alone left the core reading memory well below float32's rate (SmolLM2's 121
   products, one row, AVX2 path, one thread of an AMD EPYC: 0.62-0.65x the time, 16 -> 25
   GB/s; bf16 0-3%, float32 nothing; BENCHMARKS.md §1, "The AVX2 paths").
   The last tile's prefetch reads past its panels: a prefetch never faults. */
static void N(tile1x4)(long k, const WT *pan, const float *x, long ldx, float *y, long ldy,
                    const float *bias) {
    (void)ldx, (void)ldy;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps();
    __m256 a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
    const WT *p0 = pan, *p1 = pan + k * NR, *p2 = pan + 2 * k * NR, *p3 = pan + 3 * k * NR;
    for (long kk = 0; kk < k; kk++) {
        long o = kk * NR;
#if NEXT_EVERY
        if (kk % NEXT_EVERY == 0)
            for (int j = 4; j < 8; j++)
                _mm_prefetch((const char *)(pan + j * k * NR + o), _MM_HINT_T1);
#endif
        __m256 b = _mm256_broadcast_ss(x + kk);
        FMA_PAIR(a0, a1, b, p0 + o);
        FMA_PAIR(a2, a3, b, p1 + o);
        FMA_PAIR(a4, a5, b, p2 + o);
        FMA_PAIR(a6, a7, b, p3 + o);
    }
    STORE_PAIR(y, a0, a1, bias);
    STORE_PAIR(y + NR, a2, a3, bias + NR);
    STORE_PAIR(y + 2 * NR, a4, a5, bias + 2 * NR);
    STORE_PAIR(y + 3 * NR, a6, a7, bias + 3 * NR);
}

/* Two rows times two panels. */
static void N(tile2x2)(long k, const WT *pan, const float *x, long ldx, float *y, long ldy,
                    const float *bias) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    const WT *p0 = pan, *p1 = pan + k * NR;
    const float *x1 = x + ldx;
    for (long kk = 0; kk < k; kk++) {
        long o = kk * NR;
        __m256 w0, w1, w2, w3;
        W8X2(p0 + o, w0, w1);
        W8X2(p1 + o, w2, w3);
        __m256 b = _mm256_broadcast_ss(x + kk);
        a0 = _mm256_fmadd_ps(b, w0, a0);
        a1 = _mm256_fmadd_ps(b, w1, a1);
        a2 = _mm256_fmadd_ps(b, w2, a2);
        a3 = _mm256_fmadd_ps(b, w3, a3);
        b = _mm256_broadcast_ss(x1 + kk);
        c0 = _mm256_fmadd_ps(b, w0, c0);
        c1 = _mm256_fmadd_ps(b, w1, c1);
        c2 = _mm256_fmadd_ps(b, w2, c2);
        c3 = _mm256_fmadd_ps(b, w3, c3);
    }
    STORE_PAIR(y, a0, a1, bias);
    STORE_PAIR(y + NR, a2, a3, bias + NR);
    STORE_PAIR(y + ldy, c0, c1, bias);
    STORE_PAIR(y + ldy + NR, c2, c3, bias + NR);
}

/* Three rows times two panels (the weights read from cache once per row). */
static void N(tile3x2)(long k, const WT *pan, const float *x, long ldx, float *y, long ldy,
                    const float *bias) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps(), e0 = _mm256_setzero_ps();
    __m256 e1 = _mm256_setzero_ps(), e2 = _mm256_setzero_ps(), e3 = _mm256_setzero_ps();
    const WT *p0 = pan, *p1 = pan + k * NR;
    const float *x1 = x + ldx, *x2 = x + 2 * ldx;
    for (long kk = 0; kk < k; kk++) {
        long o = kk * NR;
        __m256 b = _mm256_broadcast_ss(x + kk);
        FMA_PAIR(a0, a1, b, p0 + o);
        FMA_PAIR(a2, a3, b, p1 + o);
        b = _mm256_broadcast_ss(x1 + kk);
        FMA_PAIR(c0, c1, b, p0 + o);
        FMA_PAIR(c2, c3, b, p1 + o);
        b = _mm256_broadcast_ss(x2 + kk);
        FMA_PAIR(e0, e1, b, p0 + o);
        FMA_PAIR(e2, e3, b, p1 + o);
    }
    STORE_PAIR(y, a0, a1, bias);
    STORE_PAIR(y + NR, a2, a3, bias + NR);
    STORE_PAIR(y + ldy, c0, c1, bias);
    STORE_PAIR(y + ldy + NR, c2, c3, bias + NR);
    STORE_PAIR(y + 2 * ldy, e0, e1, bias);
    STORE_PAIR(y + 2 * ldy + NR, e2, e3, bias + NR);
}
#undef FMA_PAIR
#undef STORE_PAIR

/* by leftover rows: the tile kernel and how many panels it takes (NULL: one panel at a time) */
static const N(micro_fn) N(TILES)[MR] = {0, N(tile1x4), N(tile2x2), N(tile3x2), 0, 0};
static const int N(TILE_PANELS)[MR] = {1, 4, 2, 2, 1, 1};

/* One panel, rows [m0, m0 + mr), through a tile when its last columns are padding. */
static void N(panel_rows)(int mr, long k, const WT *pan, const float *x, float *y, long n,
                       long q, const float *bias) {
    float b16[NR], tile16[MR * NR];
    long cols = n - q * NR < NR ? n - q * NR : NR;
    const float *b = column_view(b16, bias, q * NR, cols, NR);
    if (cols == NR) {
        N(MICROS)[mr](k, pan, x, k, y + q * NR, n, b);
        return;
    }
    N(MICROS)[mr](k, pan, x, k, tile16, NR, b);
    for (int i = 0; i < mr; i++) memcpy(y + i * n + q * NR, tile16 + i * NR, cols * sizeof(float));
}

/* A decode-sized product (at most MB rows), panels [q0, q1): every whole block of six rows
   through each panel, then the leftover rows through a tile over the panels just read. */
static void N(run_panels_small)(const float *x, long m, long k, const WT *p, long n,
                             const float *bias, float *y, long q0, long q1) {
    long full = m / MR * MR;
    int rest = (int)(m - full), width = N(TILE_PANELS)[rest];
    float bias_tile[4 * NR];
    for (long q = q0; q < q1; q += width) {
        long qe = q + width < q1 ? q + width : q1;
        for (long qq = q; qq < qe; qq++)
            for (long m0 = 0; m0 < full; m0 += MR)
                N(panel_rows)(MR, k, p + qq * k * NR, x + m0 * k, y + m0 * n, n, qq, bias);
        if (rest == 0) continue;
        if (N(TILES)[rest] != NULL && qe - q == width && qe * NR <= n) {
            N(TILES)[rest](k, p + q * k * NR, x + full * k, k, y + full * n + q * NR, n,
                           column_view(bias_tile, bias, q * NR, width * NR, width * NR));
        } else {
            for (long qq = q; qq < qe; qq++)
                N(panel_rows)(rest, k, p + qq * k * NR, x + full * k, y + full * n, n, qq, bias);
        }
    }
}

#include "panel_body512.h"

/* run_panels' prefill path with k in slices of at most KC (every column a real one): a
   panel's slice (16 KiB at KC = 256) stays in L1 while each block of six rows of the 48
   passes through it, where a whole panel (36 KiB at k = 576, 96 at 1,536) came again from L2
   for every six rows. The sums go to y between slices (no bias until the last). */
static void N(run_panels_sliced)(const float *x, long m, long k, const WT *p, long n,
                              const float *bias, float *y, long q0, long q1, long group) {
    long slices = (k + KC - 1) / KC, kc = (k + slices - 1) / slices;
    for (long g0 = q0; g0 < q1; g0 += group) {
        long g1 = g0 + group < q1 ? g0 + group : q1;
        for (long mb = 0; mb < m; mb += MB) {
            long me = mb + MB < m ? mb + MB : m, full = mb + (me - mb) / MR * MR;
            for (long q = g0; q < g1; q++) {
                float b16[NR];
                const float *bq = column_view(b16, bias, q * NR, NR, NR);
                const WT *pan = p + q * k * NR;
                for (long k0 = 0; k0 < k; k0 += kc) {
                    long len = k - k0 < kc ? k - k0 : kc;
                    const float *b = k0 + len == k ? bq : NULL;
                    for (long m0 = mb; m0 < full; m0 += MR)
                        N(micro6_slice)(k0 > 0, len, pan + k0 * NR, x + m0 * k + k0, k,
                                     y + m0 * n + q * NR, n, b);
                }
                if (me > full) /* the block's last rows, fewer than six: whole k */
                    N(panel_rows)((int)(me - full), k, pan, x + full * k, y + full * n, n, q,
                               bias);
            }
        }
    }
}

/* Panels [q0, q1) of the product, every row. */
static void N(run_panels)(const float *x, long m, long k, const WT *p, long n, const float *bias,
                       float *y, long q0, long q1) {
    /* one to three rows are bound by reading the weights: for float32 the AVX2 tiles over
       four and two panels keep more streams in flight than a zmm tile would; narrower
       weights cost instructions to widen, which the narrow zmm tiles halve */
    if (panel_uses_avx512() && m < 4 && sizeof(WT) < sizeof(float)) {
        N(run_narrow)(x, m, k, p, n, bias, y, q0, q1);
        return;
    }
    if (panel_uses_avx512() && m >= 4) {
        N(run_panels512)(x, m, k, p, n, bias, y, q0, q1);
        return;
    }
    if (m <= MB) {
        N(run_panels_small)(x, m, k, p, n, bias, y, q0, q1);
        return;
    }
    /* More rows than one block: panels in groups of about GROUP_BYTES, every block of rows
       through a group before the next, so each weight comes from memory once (the group
       stays in L2) and the inputs are what is read again (from cache). */
    long group = GROUP_BYTES / (k * NR * (long)sizeof(WT));
    if (group < 1) group = 1;
    if (n % NR == 0 && k > KC) {
        N(run_panels_sliced)(x, m, k, p, n, bias, y, q0, q1, group);
        return;
    }
    for (long g0 = q0; g0 < q1; g0 += group) {
        long g1 = g0 + group < q1 ? g0 + group : q1;
        for (long mb = 0; mb < m; mb += MB) {
            long me = mb + MB < m ? mb + MB : m;
            for (long q = g0; q < g1; q++)
                for (long m0 = mb; m0 < me; m0 += MR)
                    N(panel_rows)((int)(me - m0 < MR ? me - m0 : MR), k, p + q * k * NR,
                               x + m0 * k, y + m0 * n, n, q, bias);
        }
    }
}


/* Panels [q0, q1) of the product; with scale (int8), the sums then scaled and the bias added. */
static void N(run_scaled)(const float *x, long m, long k, const WT *p, long n,
                          const float *bias, const float *scale, float *y, long q0, long q1) {
    if (scale == NULL) {
        N(run_panels)(x, m, k, p, n, bias, y, q0, q1);
        return;
    }
    N(run_panels)(x, m, k, p, n, NULL, y, q0, q1);
    scale_cols(y, m, n, scale, bias, q0 * NR, q1 * NR < n ? q1 * NR : n);
}

/* y [m, n] = x [m, k] @ W^T + bias (x and y contiguous). threads > 1: the panels are split
   between the threads of an OpenMP team (a decode-sized product in equal shares, a
   prefill-sized one in groups taken as threads come free). */
static void N(linear)(const float *x, long m, long k, const WT *p, long n, const float *bias,
                      const float *scale, float *y, int threads) {
    long panels = (n + NR - 1) / NR;
    if (threads > panels) threads = (int)panels;
    /* a product under ~64k multiply-adds is over before another thread could help */
    if (threads <= 1 || m * n * k < 65536) {
        N(run_scaled)(x, m, k, p, n, bias, scale, y, 0, panels);
        return;
    }
    if (m > MB) {
        /* a prefill-sized product: groups of panels handed out one at a time, so a thread
           that shares its core with another process (a decode replica on the same machine)
           takes fewer and the others do not wait for it at the end */
        long group = N(pair_group)(k);
        long chunks = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long q0 = c * group, q1 = q0 + group < panels ? q0 + group : panels;
            N(run_scaled)(x, m, k, p, n, bias, scale, y, q0, q1);
        }
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        long t = omp_get_thread_num(), team = omp_get_num_threads();
        long q0 = panels * t / team, q1 = panels * (t + 1) / team;
        if (q1 > q0) N(run_scaled)(x, m, k, p, n, bias, scale, y, q0, q1);
    }
}

#undef WT
#undef SFX
#undef NEXT_EVERY
#undef W8
#undef W8X2
#undef W16
