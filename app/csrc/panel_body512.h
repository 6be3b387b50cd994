/* The panel kernel's AVX-512 tiles, for one kind of weight: included by panel_body.h (see its
 * header for WT, SFX, N() and W16). */

/* AVX-512 (where the CPU has it; chosen at run time, see panel_uses_avx512):
   A panel's 16 columns are one zmm register, so a tile of up to 12 rows x 2 panels holds 24
   sums, loads two registers of weights per k and broadcasts each row's input once: 24 FMAs
   per 14 loads, where the AVX2 tile of 6 x 16 does 12 per 8. On this project's 2-core Zen 5
   VM a core does about 36 G multiply-adds/s with zmm against 22 G with ymm. Every sum is
   still one FMA per k in order and then the bias, lane for lane what the AVX2 paths compute,
   so a row's result does not depend on which path or tile it went through. */

#define T5_DECL(i) __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = _mm512_setzero_ps()
#define T5_FMA(i)                                                              \
    if (mr > i) {                                                              \
        __m512 b = _mm512_set1_ps(x[(i) * ldx + kk]);                          \
        a##i##0 = _mm512_fmadd_ps(b, w0, a##i##0);                             \
        if (np > 1) a##i##1 = _mm512_fmadd_ps(b, w1, a##i##1);                 \
    }
#define T5_STORE(i)                                                            \
    if (mr > i) {                                                              \
        _mm512_storeu_ps(y + (i) * ldy, _mm512_add_ps(a##i##0, c0));           \
        if (np > 1) _mm512_storeu_ps(y + (i) * ldy + NR, _mm512_add_ps(a##i##1, c1)); \
    }

/* mr (1..12) rows times np (1 or 2) panels side by side; 16 * np sums per row into y. */
static inline __attribute__((always_inline, target("avx512f"))) void N(tile512)(
    int mr, int np, long k, const WT *pan, const float *x, long ldx, float *y, long ldy,
    const float *bias) {
    T5_DECL(0); T5_DECL(1); T5_DECL(2); T5_DECL(3); T5_DECL(4); T5_DECL(5);
    T5_DECL(6); T5_DECL(7); T5_DECL(8); T5_DECL(9); T5_DECL(10); T5_DECL(11);
    const WT *p1 = pan + k * NR;
    for (long kk = 0; kk < k; kk++) {
        __m512 w0 = W16(pan + kk * NR);
        __m512 w1 = np > 1 ? W16(p1 + kk * NR) : w0;
        T5_FMA(0) T5_FMA(1) T5_FMA(2) T5_FMA(3) T5_FMA(4) T5_FMA(5)
        T5_FMA(6) T5_FMA(7) T5_FMA(8) T5_FMA(9) T5_FMA(10) T5_FMA(11)
    }
    __m512 c0 = _mm512_loadu_ps(bias), c1 = np > 1 ? _mm512_loadu_ps(bias + NR) : c0;
    T5_STORE(0) T5_STORE(1) T5_STORE(2) T5_STORE(3) T5_STORE(4) T5_STORE(5)
    T5_STORE(6) T5_STORE(7) T5_STORE(8) T5_STORE(9) T5_STORE(10) T5_STORE(11)
}
#undef T5_DECL
#undef T5_FMA
#undef T5_STORE

#define TILE512(m, p)                                                                        \
    static __attribute__((target("avx512f"))) void N(tile512_##m##_##p)(                    \
        long k, const WT *pan, const float *x, long ldx, float *y, long ldy,             \
        const float *bias) {                                                                \
        N(tile512)(m, p, k, pan, x, ldx, y, ldy, bias);                                        \
    }
#define TILE512_ROWS(m) TILE512(m, 1) TILE512(m, 2)
TILE512_ROWS(1) TILE512_ROWS(2) TILE512_ROWS(3) TILE512_ROWS(4) TILE512_ROWS(5)
TILE512_ROWS(6) TILE512_ROWS(7) TILE512_ROWS(8) TILE512_ROWS(9) TILE512_ROWS(10)
TILE512_ROWS(11) TILE512_ROWS(12)
#define TILE512_PAIR(m) {N(tile512_##m##_1), N(tile512_##m##_2)}
static const N(micro_fn) N(TILES512)[MR5 + 1][2] = {
    {0, 0}, TILE512_PAIR(1), TILE512_PAIR(2), TILE512_PAIR(3), TILE512_PAIR(4),
    TILE512_PAIR(5), TILE512_PAIR(6), TILE512_PAIR(7), TILE512_PAIR(8), TILE512_PAIR(9),
    TILE512_PAIR(10), TILE512_PAIR(11), TILE512_PAIR(12)};
#undef TILE512_PAIR
#undef TILE512_ROWS
#undef TILE512

/* Rows [0, mr) through panels q, q + np - 1, via a scratch tile where columns are padding. */
static void N(rows512)(int mr, int np, long k, const WT *pan, const float *x, float *y, long n,
                    long q, const float *bias) {
    float b32[2 * NR], scratch[MR5 * 2 * NR];
    long cols = n - q * NR < np * NR ? n - q * NR : np * NR;
    const float *b = column_view(b32, bias, q * NR, cols, np * NR);
    if (cols == np * NR) {
        N(TILES512)[mr][np - 1](k, pan, x, k, y + q * NR, n, b);
        return;
    }
    N(TILES512)[mr][np - 1](k, pan, x, k, scratch, 2 * NR, b);
    for (int i = 0; i < mr; i++)
        memcpy(y + i * n + q * NR, scratch + i * 2 * NR, cols * sizeof(float));
}

/* Panels per group of a prefill-sized product on the AVX-512 path: an even number (the tiles
   take panels in pairs) of about 2 x GROUP_BYTES (L2 holds it), at least one pair. The
   threads' share of such a product is handed out in groups of this size too. */
static long N(pair_group)(long k) {
    long group = 2 * GROUP_BYTES / (k * NR * (long)sizeof(WT)) / 2 * 2;
    return group < 2 ? 2 : group;
}

/* One to three rows of a product over narrow weights (bf16 widened, int8), where widening
   each weight costs instructions and the FMA chains' latency shows: 1 row x 8 panels or 2-3
   rows x 4, in zmm (8-12 sums in flight, 8 or 4 weight streams). Each sum is the same FMA
   chain over k as every other tile's, so the bits do not change. */
#define TN_DECL(i)                                                                           \
    __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = _mm512_setzero_ps(),                     \
           a##i##2 = _mm512_setzero_ps(), a##i##3 = _mm512_setzero_ps(),                     \
           a##i##4 = _mm512_setzero_ps(), a##i##5 = _mm512_setzero_ps(),                     \
           a##i##6 = _mm512_setzero_ps(), a##i##7 = _mm512_setzero_ps()
#define TN_FMA(i, j) if (mr > i && np > j) a##i##j = _mm512_fmadd_ps(b##i, w##j, a##i##j);
#define TN_ROW(i)                                                                            \
    TN_FMA(i, 0) TN_FMA(i, 1) TN_FMA(i, 2) TN_FMA(i, 3)                                      \
    TN_FMA(i, 4) TN_FMA(i, 5) TN_FMA(i, 6) TN_FMA(i, 7)
#define TN_ST(i, j)                                                                          \
    if (mr > i && np > j)                                                                    \
        _mm512_storeu_ps(y + (i) * ldy + (j) * NR,                                           \
                         _mm512_add_ps(a##i##j, _mm512_loadu_ps(bias + (j) * NR)));
#define TN_STORE(i)                                                                          \
    TN_ST(i, 0) TN_ST(i, 1) TN_ST(i, 2) TN_ST(i, 3) TN_ST(i, 4) TN_ST(i, 5) TN_ST(i, 6) TN_ST(i, 7)
static inline __attribute__((always_inline, target("avx512f"))) void N(tile_narrow)(
    int mr, int np, long k, const WT *pan, const float *x, long ldx, float *y, long ldy,
    const float *bias) {
    TN_DECL(0); TN_DECL(1); TN_DECL(2);
    const long ps = k * NR;
    for (long kk = 0; kk < k; kk++) {
        const WT *w = pan + kk * NR;
        __m512 w0 = W16(w), w1 = w0, w2 = w0, w3 = w0, w4 = w0, w5 = w0, w6 = w0, w7 = w0;
        if (np > 1) w1 = W16(w + ps);
        if (np > 2) w2 = W16(w + 2 * ps);
        if (np > 3) w3 = W16(w + 3 * ps);
        if (np > 4) w4 = W16(w + 4 * ps);
        if (np > 5) w5 = W16(w + 5 * ps);
        if (np > 6) w6 = W16(w + 6 * ps);
        if (np > 7) w7 = W16(w + 7 * ps);
        __m512 b0 = _mm512_set1_ps(x[kk]);
        __m512 b1 = mr > 1 ? _mm512_set1_ps(x[ldx + kk]) : b0;
        __m512 b2 = mr > 2 ? _mm512_set1_ps(x[2 * ldx + kk]) : b0;
        TN_ROW(0) TN_ROW(1) TN_ROW(2)
    }
    TN_STORE(0) TN_STORE(1) TN_STORE(2)
}
#undef TN_DECL
#undef TN_FMA
#undef TN_ROW
#undef TN_ST
#undef TN_STORE
static __attribute__((target("avx512f"))) void N(narrow_1x8)(
    long k, const WT *pan, const float *x, long ldx, float *y, long ldy, const float *bias) {
    N(tile_narrow)(1, 8, k, pan, x, ldx, y, ldy, bias);
}
static __attribute__((target("avx512f"))) void N(narrow_2x4)(
    long k, const WT *pan, const float *x, long ldx, float *y, long ldy, const float *bias) {
    N(tile_narrow)(2, 4, k, pan, x, ldx, y, ldy, bias);
}
static __attribute__((target("avx512f"))) void N(narrow_3x4)(
    long k, const WT *pan, const float *x, long ldx, float *y, long ldy, const float *bias) {
    N(tile_narrow)(3, 4, k, pan, x, ldx, y, ldy, bias);
}
static const N(micro_fn) N(NARROW)[4] = {0, N(narrow_1x8), N(narrow_2x4), N(narrow_3x4)};

/* Panels [q0, q1) of a product of one to three rows, in the narrow tiles; the panels left
   over (and a last one with padding columns) in rows512's. */
static void N(run_narrow)(const float *x, long m, long k, const WT *p, long n,
                          const float *bias, float *y, long q0, long q1) {
    int np = m == 1 ? 8 : 4;
    float bias_tile[8 * NR];
    long q = q0;
    for (; q + np <= q1 && (q + np) * NR <= n; q += np) {
        N(NARROW)[m](k, p + q * k * NR, x, k, y + q * NR, n,
                     column_view(bias_tile, bias, q * NR, np * NR, np * NR));
    }
    for (; q < q1; q += 2) {
        int width = q1 - q >= 2 ? 2 : 1;
        N(rows512)((int)m, width, k, p + q * k * NR, x, y, n, q, bias);
    }
}

/* Panels [q0, q1), every row, in pairs of panels: each block of up to 48 rows passes through
   a group of panels (~256 KiB, kept in L2) in tiles of 12 rows, so each weight comes from
   memory once per product. A decode-sized product (at most 48 rows) is one block. */
static void N(run_panels512)(const float *x, long m, long k, const WT *p, long n,
                          const float *bias, float *y, long q0, long q1) {
    long group = m <= MB ? 2 : N(pair_group)(k);
    for (long g0 = q0; g0 < q1; g0 += group) {
        long g1 = g0 + group < q1 ? g0 + group : q1;
        for (long mb = 0; mb < m; mb += MB) {
            long me = mb + MB < m ? mb + MB : m;
            for (long q = g0; q < g1; q += 2) {
                int np = g1 - q >= 2 ? 2 : 1;
                for (long m0 = mb; m0 < me; m0 += MR5)
                    N(rows512)((int)(me - m0 < MR5 ? me - m0 : MR5), np, k, p + q * k * NR,
                            x + m0 * k, y + m0 * n, n, q, bias);
            }
        }
    }
}

