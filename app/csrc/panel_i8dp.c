/* Y = X W^T + b over int8 panels with the CPU's 16-bit integer dot product (AVX512-VNNI,
 * vpdpwssd).
 *
 * The widened int8 kind (panel_gemm.c) spends three instructions on 16 weights (widen to
 * 32 bits, convert to float, FMA), so a decode step over int8 panels is bound by those
 * instructions, not by the quarter of the bytes it reads. Here one vpmovsxbw widens 32
 * weights to 16 bits and one vpdpwssd does their 32 multiply-adds into 32-bit sums.
 *
 * The inputs enter a product as 16-bit integers: each row's k in blocks of 256, a block
 * scaled by its largest magnitude onto [-32767, 32767] and rounded to nearest (even). A
 * block's sums (256 products of at most 32767 x 127: below 2^31, no overflow) are converted
 * to float, multiplied by the row's scale for the block and added to the float sums; at the
 * end each column is multiplied by its weight scale and the bias added. 15 bits relative to
 * a block's largest input is finer than a bf16 input's 8 bits relative to itself wherever
 * an input is within 1/128 of its block's largest, and its error is bounded by the largest
 * one otherwise (an input that is not finite makes its block's scale NaN: the row's outputs
 * are NaN, as a float product's would be).
 *
 * Grouped weights (a scale per column for each group of g along k, g even, as a GGUF Q8_0
 * block or a compressed-tensors `group` checkpoint holds them): the inputs' blocks are the
 * groups, g / 2 pairs each, and a block's sums are multiplied by the row's scale times the
 * block's 16 column scales as they are folded in (one load and one multiply more a fold);
 * the end adds only the bias. With offsets (W = q * scale + offset: a GGUF Q4_1 block, a
 * zero point), each block's inputs' sum (its integers' exact sum times its scale) times
 * the block's 16 offsets joins the fold too. Scales and offsets are float32 or float16 (a
 * GGUF file's own), widened as they load. They lie panel by panel, [panels][groups][16]
 * ([panels][groups][2][16] with offsets), so a tile reads them in one run (laid out
 * [groups][columns], each group's row was a jump of a row's length: SmolLM2's LM head at
 * one row 1.14x per-channel's time at g = 128). g <= I8_MAX_GROUP keeps a block's 2g
 * products below 2^31.
 *
 * Layout (packed by panel_bf16dp.c's panel_pack_pairs_i8): as bf16's pairs, int8: P[N/16][K/2][16][2] (a column's weights at k and
 * k + 1 side by side, one 16-bit pair), K padded to even with a zero; panel_pair_elems counts
 * them. Tiles: 1-2 rows x 8 panels, up to 6 rows x 4 panels (decode) or 12 x 2 (prefill
 * blocks of 48 rows), at most 24 integer sums in registers; the float sums wait in y between
 * blocks. Every output is the same chain (blocks in order, each an exact integer sum, then
 * the scales and the bias) for every tile, block and thread split: a row's result does not
 * depend on its batch.
 *
 * Measured (2-core AMD EPYC VM, one thread, SmolLM2-135M's 30 layers' products): at one row
 * about the widened int8 kind's time (both stream the bytes at ~16 GB/s; in cache this one
 * is twice as fast), at 8 rows 0.6x its time, at 256 rows about bf16's dot product's. A
 * decode-sized product's first block of rows through a group of panels fetches the next
 * group's towards L2 as it goes (the step at batch 1 and 8 about 0.9x of without).
 *
 * Threads: as panel_bf16dp.c.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#define NR 16
#define MB 48
#define KB 128 /* pairs of k per block of the inputs' scales (per-channel weights) */
#define GROUP_BYTES (256L * 1024)

#define VN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* The CPU asked once (every product checks: linear_i8dp), the AVX2 limit every time. */
int panel_has_avx512vnni(void) {
    static int cpu = -1;
    int has = __atomic_load_n(&cpu, __ATOMIC_RELAXED);
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl");
        __atomic_store_n(&cpu, has, __ATOMIC_RELAXED);
    }
    return has && !panel_avx2_only();
}

/* x [m, k] float32 into xq [m, kp] pairs of int16 and xs [m, blocks] their blocks' scales
   (blocks of kb pairs); where xsum is not NULL, each block's sum of the inputs as they enter
   the products (its integers' exact sum times its scale) into xsum [m, blocks]. */
static VN_TARGET void to_i16(const float *x, long m, long k, long kb, uint32_t *xq,
                             float *xs, float *xsum) {
    long kp = (k + 1) / 2, blocks = (kp + kb - 1) / kb;
    for (long i = 0; i < m; i++) {
        const float *src = x + i * k;
        int16_t *dst = (int16_t *)(xq + i * kp);
        for (long b = 0; b < blocks; b++) {
            long k0 = b * 2 * kb, k1 = k0 + 2 * kb < k ? k0 + 2 * kb : k;
            __m512 big = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
            for (long d = k0; d < k1; d += 16) {
                __mmask16 mask = k1 - d >= 16 ? 0xFFFF : (__mmask16)((1u << (k1 - d)) - 1);
                __m512 v = _mm512_maskz_loadu_ps(mask, src + d);
                big = _mm512_max_ps(big, _mm512_abs_ps(v));
                /* x * 0 is NaN where x is not finite */
                bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps()));
            }
            float amax = _mm512_reduce_max_ps(big);
            int finite = _mm512_reduce_add_ps(bad) == 0.0f;
            xs[i * blocks + b] = finite ? amax / 32767.0f : NAN;
            __m512 inv = _mm512_set1_ps(finite && amax > 0.0f ? 32767.0f / amax : 0.0f);
            __m512i sum = _mm512_setzero_si512();
            for (long d = k0; d < k1; d += 16) {
                __mmask16 mask = k1 - d >= 16 ? 0xFFFF : (__mmask16)((1u << (k1 - d)) - 1);
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src + d), inv);
                __m512i q = _mm512_cvtps_epi32(v);
                sum = _mm512_add_epi32(sum, q); /* at most 512 x 32767: exact */
                _mm256_mask_storeu_epi16(dst + d, mask, _mm512_cvtsepi32_epi16(q));
            }
            if (xsum)
                xsum[i * blocks + b] = xs[i * blocks + b] * (float)_mm512_reduce_add_epi32(sum);
        }
        if (k % 2) dst[k] = 0;
    }
}

/* c += the pairwise products of b and w: vpdpwssd through asm, since GCC 12's own intrinsic
   copies every sum through the stack each step (its tied operand), at twice the time */
#define DPW(c, b, w) __asm__("vpdpwssd %2, %1, %0" : "+v"(c) : "v"(b), "v"(w))
#define VN_DECL(i)                                                                           \
    __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = c##i##0, c##i##2 = c##i##0,          \
            c##i##3 = c##i##0, c##i##4 = c##i##0, c##i##5 = c##i##0, c##i##6 = c##i##0,       \
            c##i##7 = c##i##0
#define VN_ROW(i)                                                                            \
    if (mr > i) {                                                                            \
        __m512i b = _mm512_set1_epi32((int)x[(i) * ldx + kk]);                               \
        DPW(c##i##0, b, w0);                                                                 \
        if (np > 1) DPW(c##i##1, b, w1);                                                     \
        if (np > 2) DPW(c##i##2, b, w2);                                                     \
        if (np > 3) DPW(c##i##3, b, w3);                                                     \
        if (np > 4) DPW(c##i##4, b, w4);                                                     \
        if (np > 4) DPW(c##i##5, b, w5);                                                     \
        if (np > 4) DPW(c##i##6, b, w6);                                                     \
        if (np > 4) DPW(c##i##7, b, w7);                                                     \
    }
/* Grouped weights' scales for a tile: gs the tile's first panel's, block by block (16
   scales a block, or with offsets 16 scales and then 16 offsets), the next panel's gld
   elements on, each float32 or (half) float16; xsum (offsets only, else NULL) its rows'
   inputs' sums, a row's lds on. */
struct vn_grp {
    const char *gs;
    const float *xsum;
    long gld;
    int half;
};

/* 16 scales (or offsets) at element `at` of a tile's, as float32 */
static inline __attribute__((always_inline)) VN_TARGET __m512 vn_scales(const struct vn_grp *gp,
                                                                         long at) {
    return gp->half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp->gs + 2 * at)))
                    : _mm512_loadu_ps((const float *)(gp->gs + 4 * at));
}

/* a block's integer sums, times the row's scale for it (and grouped weights' column scales
   for the block), into the float sums in y; with offsets, then the block's offsets times
   the row's sum of its inputs */
#define VN_FOLD1(i, j)                                                                       \
    {                                                                                        \
        float *o = y + (i) * ldy + (j) * NR;                                                 \
        __m512 v = _mm512_cvtepi32_ps(c##i##j), s = _mm512_set1_ps(xs[(i) * lds + blk]);    \
        if (gp) s = _mm512_mul_ps(s, g##j);                                                  \
        __m512 t = blk ? _mm512_fmadd_ps(v, s, _mm512_loadu_ps(o)) : _mm512_mul_ps(v, s);    \
        if (gp && gp->xsum)                                                                  \
            t = _mm512_fmadd_ps(_mm512_set1_ps(gp->xsum[(i) * lds + blk]),                   \
                                vn_scales(gp, (j) * gp->gld + blk * 2 * NR + NR), t);        \
        _mm512_storeu_ps(o, t);                                                              \
    }
#define VN_FOLD(i)                                                                           \
    if (mr > i) {                                                                            \
        VN_FOLD1(i, 0)                                                                       \
        if (np > 1) VN_FOLD1(i, 1)                                                           \
        if (np > 2) VN_FOLD1(i, 2)                                                           \
        if (np > 3) VN_FOLD1(i, 3)                                                           \
        if (np > 4) { VN_FOLD1(i, 4) VN_FOLD1(i, 5) VN_FOLD1(i, 6) VN_FOLD1(i, 7) }          \
    }
#define VN_W(j) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + (j) * ps)))

/* One block of k, pairs [k0, k1) (block blk), of mr rows (pairs, stride ldx; scales stride
   lds) x np panels (mr * np <= 24; np 8 for up to 2 rows): the integer sums, times each
   row's scale (and, grouped weights, gp: the block's column scales; with offsets, plus the
   offsets times the rows' sums), into the float sums in y (stride ldy). With `ahead`, the
   np panels after these are fetched towards L2 as these are read. */
static inline __attribute__((always_inline)) VN_TARGET void vn_block(
    int mr, int np, long blk, long k0, long k1, long ps, const int8_t *pan, const uint32_t *x,
    long ldx, const float *xs, long lds, float *y, long ldy, const struct vn_grp *gp,
    int ahead) {
    VN_DECL(0); VN_DECL(1); VN_DECL(2); VN_DECL(3); VN_DECL(4); VN_DECL(5);
    VN_DECL(6); VN_DECL(7); VN_DECL(8); VN_DECL(9); VN_DECL(10); VN_DECL(11);
    for (long kk = k0; kk < k1; kk++) {
        const int8_t *w = pan + kk * NR * 2;
        __m512i w0 = VN_W(0), w1 = w0, w2 = w0, w3 = w0, w4 = w0, w5 = w0, w6 = w0, w7 = w0;
        if (np > 1) w1 = VN_W(1);
        if (np > 2) w2 = VN_W(2);
        if (np > 3) w3 = VN_W(3);
        if (np > 4) w4 = VN_W(4), w5 = VN_W(5), w6 = VN_W(6), w7 = VN_W(7);
        if (ahead && (kk & 1) == 0) { /* a line holds two pairs; a hint never faults */
            const char *nx = (const char *)(w + np * ps);
            for (int jj = 0; jj < np; jj++) _mm_prefetch(nx + jj * ps, _MM_HINT_T1);
        }
        VN_ROW(0) VN_ROW(1) VN_ROW(2) VN_ROW(3) VN_ROW(4) VN_ROW(5)
        VN_ROW(6) VN_ROW(7) VN_ROW(8) VN_ROW(9) VN_ROW(10) VN_ROW(11)
    }
    __m512 g0 = _mm512_setzero_ps(), g1 = g0, g2 = g0, g3 = g0, g4 = g0, g5 = g0, g6 = g0,
           g7 = g0; /* grouped weights: the block's column scales, once for every row */
    if (gp) {
        long gld = gp->gld, b = blk * (gp->xsum ? 2 * NR : NR);
        g0 = vn_scales(gp, b);
        if (np > 1) g1 = vn_scales(gp, b + gld);
        if (np > 2) g2 = vn_scales(gp, b + 2 * gld);
        if (np > 3) g3 = vn_scales(gp, b + 3 * gld);
        if (np > 4) {
            g4 = vn_scales(gp, b + 4 * gld), g5 = vn_scales(gp, b + 5 * gld);
            g6 = vn_scales(gp, b + 6 * gld), g7 = vn_scales(gp, b + 7 * gld);
        }
    }
    VN_FOLD(0) VN_FOLD(1) VN_FOLD(2) VN_FOLD(3) VN_FOLD(4) VN_FOLD(5)
    VN_FOLD(6) VN_FOLD(7) VN_FOLD(8) VN_FOLD(9) VN_FOLD(10) VN_FOLD(11)
}

/* mr rows x np panels, every block of kb pairs of k, then y = y * wscale + bias over the
   tile's np * 16 columns. */
static inline __attribute__((always_inline)) VN_TARGET void vn_tile(
    int mr, int np, long kp, long kb, const int8_t *pan, const uint32_t *x, long ldx,
    const float *xs, long lds, float *y, long ldy, const struct vn_grp *gp,
    const float *wscale, const float *bias, int ahead) {
    long ps = kp * NR * 2; /* one panel's bytes */
    if (ahead && gp) { /* the next np panels' scales, as their weights are (vn_block) */
        long bytes = np * gp->gld * (gp->half ? 2 : 4);
        for (long o = 0; o < bytes; o += 64) _mm_prefetch(gp->gs + bytes + o, _MM_HINT_T1);
    }
    for (long blk = 0, k0 = 0; k0 < kp; blk++, k0 += kb)
        vn_block(mr, np, blk, k0, k0 + kb < kp ? k0 + kb : kp, ps, pan, x, ldx, xs, lds, y, ldy,
                 gp, ahead);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) {
            float *o = y + i * ldy + j * NR;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o),
                                                _mm512_loadu_ps(wscale + j * NR),
                                                _mm512_loadu_ps(bias + j * NR)));
        }
}
#undef VN_DECL
#undef VN_ROW
#undef VN_FOLD1
#undef VN_FOLD
#undef VN_W

typedef void (*vn_fn)(long, long, const int8_t *, const uint32_t *, long, const float *,
                      long, float *, long, const struct vn_grp *, const float *,
                      const float *, int);
#define VN(m, p)                                                                             \
    static VN_TARGET void vn_##m##_##p(long kp, long kb, const int8_t *pan,                  \
                                       const uint32_t *x, long ldx, const float *xs,         \
                                       long lds, float *y, long ldy,                         \
                                       const struct vn_grp *gp, const float *wscale,         \
                                       const float *bias, int ahead) {                       \
        vn_tile(m, p, kp, kb, pan, x, ldx, xs, lds, y, ldy, gp, wscale, bias, ahead);        \
    }
VN(1, 1) VN(1, 2) VN(1, 4) VN(1, 8) VN(2, 1) VN(2, 2) VN(2, 4) VN(2, 8) VN(3, 1) VN(3, 2) VN(3, 4)
VN(4, 1) VN(4, 2) VN(4, 4) VN(5, 1) VN(5, 2) VN(5, 4) VN(6, 1) VN(6, 2) VN(6, 4)
VN(7, 1) VN(7, 2) VN(8, 1) VN(8, 2) VN(9, 1) VN(9, 2) VN(10, 1) VN(10, 2)
VN(11, 1) VN(11, 2) VN(12, 1) VN(12, 2)
#undef VN
/* [rows][panels: 1, 2, 4, 8 -> index 0, 1, 2, 3] */
static const vn_fn VN_TILES[13][4] = {
    {0, 0, 0, 0}, {vn_1_1, vn_1_2, vn_1_4, vn_1_8}, {vn_2_1, vn_2_2, vn_2_4, vn_2_8},
    {vn_3_1, vn_3_2, vn_3_4, 0}, {vn_4_1, vn_4_2, vn_4_4, 0}, {vn_5_1, vn_5_2, vn_5_4, 0},
    {vn_6_1, vn_6_2, vn_6_4, 0}, {vn_7_1, vn_7_2, 0, 0}, {vn_8_1, vn_8_2, 0, 0},
    {vn_9_1, vn_9_2, 0, 0}, {vn_10_1, vn_10_2, 0, 0}, {vn_11_1, vn_11_2, 0, 0},
    {vn_12_1, vn_12_2, 0, 0}};

/* What one call works on: the inputs as pairs and scales (blocks of kb pairs; with offsets
   their sums too), the panels, their scales (wscale [n] per column, or gscale
   [panels][blocks][16], with offsets [panels][blocks][2][16], per group of k, kb pairs a
   group: a tile reads its panels' scales in one run, as it reads their weights), the
   outputs. */
struct vn_job {
    const uint32_t *xq;
    const float *xs, *xsum, *wscale, *bias;
    const char *gscale; /* float32, or float16 where half */
    const int8_t *p;
    float *y;
    long m, kp, kb, blocks, n;
    int half;
};

/* Rows [m0, m0 + mr) x panels [q, q + np), through a scratch tile where columns are padding. */
static void vn_rows(const struct vn_job *j, long m0, int mr, int np, long q, int ahead) {
    float s64[8 * NR], b64[8 * NR], scratch[12 * 4 * NR];
    long cols = j->n - q * NR < np * NR ? j->n - q * NR : np * NR;
    long gld = j->blocks * NR * (j->xsum ? 2 : 1); /* one panel's scales (and offsets) */
    struct vn_grp grp = {j->gscale ? j->gscale + q * gld * (j->half ? 2 : 4) : NULL,
                         j->xsum ? j->xsum + m0 * j->blocks : NULL, gld, j->half};
    const struct vn_grp *gp = j->gscale ? &grp : NULL;
    if (gp) /* grouped: the scales went in block by block, the end is y + bias */
        for (int c = 0; c < np * NR; c++) s64[c] = 1.0f;
    const float *sc = gp ? s64 : column_view(s64, j->wscale, q * NR, cols, np * NR);
    const float *b = column_view(b64, j->bias, q * NR, cols, np * NR);
    vn_fn tile = VN_TILES[mr][np == 8 ? 3 : np == 4 ? 2 : np - 1];
    const int8_t *pan = j->p + q * j->kp * NR * 2;
    const uint32_t *x = j->xq + m0 * j->kp;
    const float *xs = j->xs + m0 * j->blocks;
    if (cols == np * NR) {
        tile(j->kp, j->kb, pan, x, j->kp, xs, j->blocks, j->y + m0 * j->n + q * NR, j->n, gp,
             sc, b, ahead);
        return;
    }
    tile(j->kp, j->kb, pan, x, j->kp, xs, j->blocks, scratch, np * NR, gp, sc, b, ahead);
    for (int i = 0; i < mr; i++)
        memcpy(j->y + (m0 + i) * j->n + q * NR, scratch + i * np * NR, cols * sizeof(float));
}

/* Panels [q0, q1), every row: groups of panels (np of them for a decode-sized product, about
   GROUP_BYTES for a prefill-sized one), each block of up to 48 rows through a group. */
static void vn_run(const struct vn_job *j, long q0, long q1) {
    /* one or two rows: eight panels at once, eight chains of sums to hide vpdpwssd's latency
       and eight weight streams in flight (four left a lone row's product at the speed of
       bf16's, half the bytes a step notwithstanding); the integer sums are exact, so the
       tile a row goes through does not change its result */
    int np = j->m <= 2 ? 8 : j->m <= MB ? 4 : 2;
    long ps = j->kp * NR * 2;
    long group = j->m <= MB ? np : GROUP_BYTES / ps / np * np;
    if (group < np) group = np;
    for (long g0 = q0; g0 < q1; g0 += group) {
        long g1 = g0 + group < q1 ? g0 + group : q1;
        for (long mb = 0; mb < j->m; mb += MB) {
            long me = mb + MB < j->m ? mb + MB : j->m;
            for (long q = g0; q < g1;) {
                long left = g1 - q;
                int width = left >= np ? np : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                int rows = width == 8 ? 2 : width == 4 ? 6 : 12;
                for (long m0 = mb; m0 < me; m0 += rows) /* the next group on the way */
                    vn_rows(j, m0, (int)(me - m0 < rows ? me - m0 : rows), width, q,
                            j->m <= MB && m0 == mb);
                q += width;
            }
        }
    }
}

/* y [m, n] = x [m, k] @ (W * scale)^T + bias, W packed by panel_pack_pairs_i8; group 0:
   scale [n], one a column; group g (even, 2..I8_MAX_GROUP): scale [panels][ceil(k / g)][16],
   one a column for each g of k (the last group may be short), the columns padded to whole
   panels with zeros; offsets (grouped only): W = q * scale + offset, scale
   [panels][ceil(k / g)][2][16], each group's 16 scales and then its 16 offsets; half
   (grouped only): the scales (and offsets) are float16. Returns SK_OK, SK_BAD_SHAPE (a
   count, a group not even or too large, offsets or half without a group), SK_NO_ISA where
   the CPU lacks AVX512-VNNI, SK_NO_MEMORY. */
int linear_i8dp(const float *x, long m, long k, const int8_t *p, long n, const float *bias,
                const void *scale, long group, int offsets, int half, float *y, int threads) {
    if (!panel_has_avx512vnni()) return SK_NO_ISA;
    if (m < 0 || k < 1 || n < 1 || threads < 1) return SK_BAD_SHAPE;
    if (group < 0 || group % 2 || group > I8_MAX_GROUP || ((offsets || half) && !group))
        return SK_BAD_SHAPE;
    long kp = (k + 1) / 2, panels = (n + NR - 1) / NR, kb = group ? group / 2 : KB;
    long blocks = (kp + kb - 1) / kb;
    uint32_t *xq = malloc(sizeof(uint32_t) * (size_t)(m * kp));
    float *xs = malloc(sizeof(float) * (size_t)(m * blocks) * (offsets ? 2 : 1));
    if (xq == NULL || xs == NULL) {
        free(xq);
        free(xs);
        return SK_NO_MEMORY;
    }
    float *xsum = offsets ? xs + m * blocks : NULL;
    to_i16(x, m, k, kb, xq, xs, xsum);
    struct vn_job job = {xq, xs, xsum, group ? NULL : scale, bias, group ? scale : NULL, p, y,
                         m, kp, kb, blocks, n, half};
    if (threads > panels) threads = (int)panels;
    if (threads <= 1 || m * n * k < 65536) {
        vn_run(&job, 0, panels);
    } else if (m > MB) {
        /* as panel_bf16dp.c: groups within L2, at least four a thread */
        long group = GROUP_BYTES / (kp * NR * 2), fair = panels / (4L * threads);
        group = (group < fair ? group : fair) / 2 * 2;
        if (group < 2) group = 2;
        long chunks = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long q0 = c * group, q1 = q0 + group < panels ? q0 + group : panels;
            vn_run(&job, q0, q1);
        }
    } else {
#pragma omp parallel num_threads(threads)
        {
            long t = omp_get_thread_num(), team = omp_get_num_threads();
            long q0 = panels * t / team, q1 = panels * (t + 1) / team;
            if (q1 > q0) vn_run(&job, q0, q1);
        }
    }
    free(xq);
    free(xs);
    return SK_OK;
}
