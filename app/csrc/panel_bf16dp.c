/* Y = X W^T + b over bf16 panels with the CPU's bf16 dot product (AVX512-BF16, vdpbf16ps).
 *
 * Where the CPU has it, one vdpbf16ps does 32 multiply-adds (16 columns x 2 k), where an
 * fp32 FMA does 16: at eight rows and more the panel kernel's products are bound by
 * arithmetic (panel_gemm.c's header), so this kind computes them in about half the
 * instructions, and reads half the bytes of float32 panels. The inputs are rounded to bf16
 * (round to nearest even) as they enter a product, as a bf16 model's activations are; every
 * sum is float32.
 *
 * Layout: panels of 16 output columns as in panel_gemm.c, but k in pairs: P[N/16][K/2][16][2]
 * (the pair of a column's weights at k and k + 1 side by side, one 32-bit lane), K padded
 * to even with a zero. A row's input is converted once per product into pairs [K/2] of
 * 32 bits, broadcast to every lane, so per pair of k one load of 64 bytes of weights serves
 * every row of a tile.
 *
 * Tiles: up to 6 rows x 4 panels (four weight streams in flight) or, from 7 rows on, 8 rows
 * x 3 panels, every further block of rows through the same panels from cache (dp_run); a
 * prefill's blocks of 48 rows too (8 x 3: eleven loads for 24 dot products, where 12 x 2
 * takes fourteen; in cache 230 GFLOP/s a core against 220); 12 rows x 2 or 1 panels for a
 * product's last panels; at most 24 sums in registers. Every output is the same chain of
 * vdpbf16ps over the pairs of k in order, then the bias (for every tile, block and thread
 * split), so a row's result does not depend on the batch it is in.
 *
 * Threads: as panel_gemm.c: a decode-sized product's panels in equal shares, a prefill-sized
 * one's in groups (kept in L2 while every block of 48 rows passes through) taken as threads
 * come free.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#define NR 16
#define MB 48
#define GROUP_BYTES (256L * 1024)

#define DP_TARGET __attribute__((target("avx512f,avx512bf16")))

/* The CPU asked once (every product checks: linear_bf16dp), the AVX2 limit every time. */
int panel_has_avx512bf16(void) {
    static int cpu = -1;
    int has = __atomic_load_n(&cpu, __ATOMIC_RELAXED);
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512bf16");
        __atomic_store_n(&cpu, has, __ATOMIC_RELAXED);
    }
    return has && !panel_avx2_only();
}

/* Elements (bf16) in the pair panels of an [n, k] weight. */
long panel_pair_elems(long n, long k) { return ((n + NR - 1) / NR) * ((k + 1) / 2) * NR * 2; }

/* W [N, K] row-major (row stride ldw) into pair panels [N/16][K/2][16][2], zero padded;
   elements of `size` bytes copied as they are (2: bf16 here, 1: int8 for panel_i8dp.c). */
static void pack_pairs_any(const char *w, long ldw, long n, long k, char *p, size_t size) {
    long panels = (n + NR - 1) / NR, kp = (k + 1) / 2;
    for (long q = 0; q < panels; q++) {
        char *dst = p + (size_t)(q * kp * NR * 2) * size;
        for (long j = 0; j < NR; j++) {
            long row = q * NR + j;
            for (long kk = 0; kk < 2 * kp; kk++) {
                char *d = dst + (size_t)((kk / 2) * NR * 2 + j * 2 + (kk % 2)) * size;
                if (row < n && kk < k) memcpy(d, w + (size_t)(row * ldw + kk) * size, size);
                else memset(d, 0, size);
            }
        }
    }
}

void panel_pack_pairs(const uint16_t *w, long ldw, long n, long k, uint16_t *p) {
    pack_pairs_any((const char *)w, ldw, n, k, (char *)p, sizeof(uint16_t));
}

void panel_pack_pairs_i8(const int8_t *w, long ldw, long n, long k, int8_t *p) {
    pack_pairs_any((const char *)w, ldw, n, k, (char *)p, sizeof(int8_t));
}

/* x [m, k] float32 into xb [m, kp] pairs of bf16 (RNE), the last pair padded with zero. */
static DP_TARGET void to_pairs(const float *x, long m, long k, uint32_t *xb) {
    long kp = (k + 1) / 2;
    for (long i = 0; i < m; i++) {
        const float *src = x + i * k;
        uint16_t *dst = (uint16_t *)(xb + i * kp);
        long d = 0;
        for (; d + 16 <= k; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
        if (d < 2 * kp) { /* the tail through a zero-padded vector: the same rounding */
            float tail[16] = {0};
            uint16_t out[16];
            memcpy(tail, src + d, sizeof(float) * (size_t)(k - d));
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tail)));
            memcpy(dst + d, out, sizeof(uint16_t) * (size_t)(2 * kp - d));
        }
    }
}

#define DP_DECL(i)                                                                           \
    __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = _mm512_setzero_ps(),                     \
           a##i##2 = _mm512_setzero_ps(), a##i##3 = _mm512_setzero_ps()
#define DP_ROW(i)                                                                            \
    if (mr > i) {                                                                            \
        __m512bh b = (__m512bh)_mm512_set1_epi32((int)x[(i) * ldx + kk]);                    \
        a##i##0 = _mm512_dpbf16_ps(a##i##0, b, w0);                                           \
        if (np > 1) a##i##1 = _mm512_dpbf16_ps(a##i##1, b, w1);                               \
        if (np > 2) a##i##2 = _mm512_dpbf16_ps(a##i##2, b, w2);                               \
        if (np > 3) a##i##3 = _mm512_dpbf16_ps(a##i##3, b, w3);                               \
    }
#define DP_STORE(i)                                                                          \
    if (mr > i) {                                                                            \
        _mm512_storeu_ps(y + (i) * ldy, _mm512_add_ps(a##i##0, _mm512_loadu_ps(bias)));      \
        if (np > 1) _mm512_storeu_ps(y + (i) * ldy + NR,                                     \
                                     _mm512_add_ps(a##i##1, _mm512_loadu_ps(bias + NR)));    \
        if (np > 2) _mm512_storeu_ps(y + (i) * ldy + 2 * NR,                                 \
                                     _mm512_add_ps(a##i##2, _mm512_loadu_ps(bias + 2 * NR)));\
        if (np > 3) _mm512_storeu_ps(y + (i) * ldy + 3 * NR,                                 \
                                     _mm512_add_ps(a##i##3, _mm512_loadu_ps(bias + 3 * NR)));\
    }

/* mr rows (of pairs, stride ldx) x np panels side by side (mr * np <= 24); y stride ldy.
   With `ahead`, the np panels after these are fetched towards L2 as these are read. */
static inline __attribute__((always_inline)) DP_TARGET void dp_tile(
    int mr, int np, long kp, const uint16_t *pan, const uint32_t *x, long ldx, float *y,
    long ldy, const float *bias, int ahead) {
    DP_DECL(0); DP_DECL(1); DP_DECL(2); DP_DECL(3); DP_DECL(4); DP_DECL(5);
    DP_DECL(6); DP_DECL(7); DP_DECL(8); DP_DECL(9); DP_DECL(10); DP_DECL(11);
    long ps = kp * NR * 2; /* one panel's elements */
    for (long kk = 0; kk < kp; kk++) {
        const uint16_t *w = pan + kk * NR * 2;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = w0, w2 = w0, w3 = w0;
        if (np > 1) w1 = (__m512bh)_mm512_loadu_si512(w + ps);
        if (np > 2) w2 = (__m512bh)_mm512_loadu_si512(w + 2 * ps);
        if (np > 3) w3 = (__m512bh)_mm512_loadu_si512(w + 3 * ps);
        if (ahead) { /* a hint: never faults, also past the product's last panel */
            const char *nx = (const char *)(w + np * ps);
            _mm_prefetch(nx, _MM_HINT_T1);
            if (np > 1) _mm_prefetch(nx + 2 * ps, _MM_HINT_T1);
            if (np > 2) _mm_prefetch(nx + 4 * ps, _MM_HINT_T1);
            if (np > 3) _mm_prefetch(nx + 6 * ps, _MM_HINT_T1);
        }
        DP_ROW(0) DP_ROW(1) DP_ROW(2) DP_ROW(3) DP_ROW(4) DP_ROW(5)
        DP_ROW(6) DP_ROW(7) DP_ROW(8) DP_ROW(9) DP_ROW(10) DP_ROW(11)
    }
    DP_STORE(0) DP_STORE(1) DP_STORE(2) DP_STORE(3) DP_STORE(4) DP_STORE(5)
    DP_STORE(6) DP_STORE(7) DP_STORE(8) DP_STORE(9) DP_STORE(10) DP_STORE(11)
}
#undef DP_DECL
#undef DP_ROW
#undef DP_STORE

typedef void (*dp_fn)(long, const uint16_t *, const uint32_t *, long, float *, long,
                      const float *, int);
#define DP(m, p)                                                                             \
    static DP_TARGET void dp_##m##_##p(long kp, const uint16_t *pan, const uint32_t *x,      \
                                       long ldx, float *y, long ldy, const float *bias,      \
                                       int ahead) {                                          \
        dp_tile(m, p, kp, pan, x, ldx, y, ldy, bias, ahead);                                 \
    }
DP(1, 1) DP(1, 2) DP(1, 3) DP(1, 4) DP(2, 1) DP(2, 2) DP(2, 3) DP(2, 4)
DP(3, 1) DP(3, 2) DP(3, 3) DP(3, 4) DP(4, 1) DP(4, 2) DP(4, 3) DP(4, 4)
DP(5, 1) DP(5, 2) DP(5, 3) DP(5, 4) DP(6, 1) DP(6, 2) DP(6, 3) DP(6, 4)
DP(7, 1) DP(7, 2) DP(7, 3) DP(8, 1) DP(8, 2) DP(8, 3) DP(9, 1) DP(9, 2) DP(10, 1) DP(10, 2)
DP(11, 1) DP(11, 2) DP(12, 1) DP(12, 2)
#undef DP
/* [rows][panels - 1] */
static const dp_fn DP_TILES[13][4] = {
    {0, 0, 0, 0}, {dp_1_1, dp_1_2, dp_1_3, dp_1_4}, {dp_2_1, dp_2_2, dp_2_3, dp_2_4},
    {dp_3_1, dp_3_2, dp_3_3, dp_3_4}, {dp_4_1, dp_4_2, dp_4_3, dp_4_4},
    {dp_5_1, dp_5_2, dp_5_3, dp_5_4}, {dp_6_1, dp_6_2, dp_6_3, dp_6_4},
    {dp_7_1, dp_7_2, dp_7_3, 0}, {dp_8_1, dp_8_2, dp_8_3, 0}, {dp_9_1, dp_9_2, 0, 0},
    {dp_10_1, dp_10_2, 0, 0}, {dp_11_1, dp_11_2, 0, 0}, {dp_12_1, dp_12_2, 0, 0}};

/* Rows [0, mr) x panels [q, q + np), through a scratch tile where columns are padding. */
static void dp_rows(int mr, int np, long kp, const uint16_t *pan, const uint32_t *x, float *y,
                    long n, long q, const float *bias, int ahead) {
    float b64[4 * NR], scratch[12 * 4 * NR];
    long cols = n - q * NR < np * NR ? n - q * NR : np * NR;
    const float *b = column_view(b64, bias, q * NR, cols, np * NR);
    dp_fn tile = DP_TILES[mr][np - 1];
    if (cols == np * NR) {
        tile(kp, pan, x, kp, y + q * NR, n, b, ahead);
        return;
    }
    tile(kp, pan, x, kp, scratch, np * NR, b, ahead);
    for (int i = 0; i < mr; i++)
        memcpy(y + i * n + q * NR, scratch + i * np * NR, cols * sizeof(float));
}

/* Panels [q0, q1), every row: groups of panels (np of them for a decode-sized product, about
   GROUP_BYTES for a prefill-sized one), each block of up to 48 rows through a group.
   A decode-sized product (batch 8: 2.2 GFLOP over 326 MB of SmolLM2's bf16 weights, a step
   on one core as bound by the arithmetic as by the memory) takes its rows in one tile where
   it can (up to 6 rows x 4 panels, 8 x 3 from 7 rows on: the weights stream once, and the
   first block of rows through a group fetches the next group's panels meanwhile, so that
   memory and arithmetic overlap; batch 8's step 0.86x of 6 + 2 rows through 4 panels).
   A prefill-sized product's first block of rows fetches each tile's next panels (the
   group's next, or the next group's first) while its second tile of rows reads these
   from cache: a prefill layer's 64-row block on one thread 0.96x the time, 256 rows 0.99x
   (docs/benchmarks/results/2026-12-06-attention-softmax/dp_ab.py). */
/* Panels side by side in a product's tiles: 4 for up to 6 rows, else 3 (8 rows a tile). */
static int dp_width(long m) { return m <= 6 ? 4 : 3; }

static void dp_run(const uint32_t *xb, long m, long kp, const uint16_t *p, long n,
                   const float *bias, float *y, long q0, long q1) {
    int np = dp_width(m);
    long ps = kp * NR * 2;
    long group = m <= MB ? np : GROUP_BYTES / (ps * 2) / np * np;
    if (group < np) group = np;
    for (long g0 = q0; g0 < q1; g0 += group) {
        long g1 = g0 + group < q1 ? g0 + group : q1;
        for (long mb = 0; mb < m; mb += MB) {
            long me = mb + MB < m ? mb + MB : m;
            for (long q = g0; q < g1;) {
                long left = g1 - q;
                int width = left >= np ? np : (left >= 2 ? 2 : 1);
                int rows = width == 4 ? 6 : (width == 3 ? 8 : 12);
                for (long m0 = mb; m0 < me; m0 += rows) {
                    int mr = (int)(me - m0 < rows ? me - m0 : rows);
                    int ahead = m <= MB ? m0 == mb && mr >= 3
                                        : mb == 0 && m0 == mb + rows && mr >= 3;
                    dp_rows(mr, width, kp, p + q * ps, xb + m0 * kp, y + m0 * n, n, q, bias,
                            ahead);
                }
                q += width;
            }
        }
    }
}

/* y [m, n] = x [m, k] @ W^T + bias, W packed by panel_pack_pairs. Returns SK_OK,
   SK_BAD_SHAPE, SK_NO_ISA where the CPU lacks AVX512-BF16, SK_NO_MEMORY. */
int linear_bf16dp(const float *x, long m, long k, const uint16_t *p, long n, const float *bias,
                  float *y, int threads) {
    if (!panel_has_avx512bf16()) return SK_NO_ISA;
    if (m < 0 || k < 1 || n < 1 || threads < 1) return SK_BAD_SHAPE;
    long kp = (k + 1) / 2, panels = (n + NR - 1) / NR;
    uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)(m * kp));
    if (xb == NULL) return SK_NO_MEMORY;
    to_pairs(x, m, k, xb);
    if (threads > panels) threads = (int)panels;
    if (threads <= 1 || m * n * k < 65536) {
        dp_run(xb, m, kp, p, n, bias, y, 0, panels);
    } else if (m > MB) {
        /* groups no larger than L2 holds, and at least four per thread, so that a thread
           whose core is shared (or that drew the last group) leaves the others little to
           wait for: a product of 60 panels in groups of 14 kept one of two threads idle
           for a fifth of it */
        long group = GROUP_BYTES / (kp * NR * 2 * 2), fair = panels / (4L * threads);
        long np = dp_width(m); /* whole tiles in a group */
        group = (group < fair ? group : fair) / np * np;
        if (group < np) group = np;
        long chunks = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long q0 = c * group, q1 = q0 + group < panels ? q0 + group : panels;
            dp_run(xb, m, kp, p, n, bias, y, q0, q1);
        }
    } else {
#pragma omp parallel num_threads(threads)
        {
            long t = omp_get_thread_num(), team = omp_get_num_threads();
            long q0 = panels * t / team, q1 = panels * (t + 1) / team;
            if (q1 > q0) dp_run(xb, m, kp, p, n, bias, y, q0, q1);
        }
    }
    free(xb);
    return SK_OK;
}
