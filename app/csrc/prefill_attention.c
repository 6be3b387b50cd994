/* Prefill attention (a prompt, or a chunk of one, attending causally to itself and to the
 * positions before it), float32, AVX-512 or AVX2: the part of a long prompt's prefill the linear
 * layers no longer dominate (a 1,024-token prefill of SmolLM2 spent about a third of its
 * time in torch's CPU flash attention, whose blocks go through a BLAS that runs only AVX2
 * code on this project's AMD machines).
 *
 * Row b of the batch, query position i (0 <= i < S) sees the keys j with
 *     j < starts[b]                (its own cached or earlier-chunk positions)
 *  or pmax <= j <= pmax + i        (the pass's own tokens, causally),
 * where T = pmax + S keys are laid out per row: a padded past of pmax positions (row b's
 * first starts[b] real), then the S new ones. With no past, starts = 0 and pmax = 0: plain
 * causal attention. Grouped-query attention: query head h reads KV head h / (H / KVH).
 *
 * Per (row, KV head) the keys are first copied into panels of 16 positions, [T/16][D][16],
 * so that one zmm register holds a key dimension of 16 positions. Then per (row, query head,
 * block of up to 12 query positions), panel by panel over the visible keys:
 *   scores [12][16]: per key dimension d one load of the panel and one FMA per query row
 *                    (12 sums in registers, as the panel GEMM's tiles);
 *   an online softmax per query row (running max and sum, the output rescaled when the
 *                    max grows), masked lanes set to exactly zero;
 *   output [12][D] += p [12][16] @ V [16][D], the row's D sums in registers, over the
 *                    keys the row sees only (a key it does not see is never read).
 * The AVX2 path (a CPU without AVX-512, or panel_set_avx512(0)) keeps the same panels and
 * blocks in ymm, as tiles of 6 query rows: scores [6][16] (12 sums in registers, two panel
 * loads per key dimension), then the rows' softmax steps, then output [6][16 of D] += p @ V
 * over the keys any of the tile's rows sees, two loads of V per key shared by the six rows
 * (a row that does not see a key has p exactly 0 there; the key is a real one, so finite).
 * Query blocks are shared out over an OpenMP team (torch's pool, as in panel_gemm.c), in
 * dynamic order: under the causal mask later blocks hold more work.
 *
 * Strides are in floats, for the batch, the head and the position; the head dimension is
 * contiguous. D must be a multiple of 16 and at most 256.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#define KP 16   /* key positions per panel: one zmm */
#define QB 12   /* query positions per block */
#define DMAX 256

/* scores[r][0..16) = q_r . keys of one panel, for mr (1..12) query rows (stride qs). */
#define SC_DECL(i) __m512 s##i = _mm512_setzero_ps()
#define SC_FMA(i) if (mr > i) s##i = _mm512_fmadd_ps(_mm512_set1_ps(q[(i) * qs + dd]), w, s##i);
#define SC_STORE(i) if (mr > i) _mm512_storeu_ps(scores + (i) * KP, s##i);
static inline __attribute__((always_inline, target("avx512f"))) void score_tile(
    int mr, const float *q, long qs, const float *panel, long d, float *scores) {
    SC_DECL(0); SC_DECL(1); SC_DECL(2); SC_DECL(3); SC_DECL(4); SC_DECL(5);
    SC_DECL(6); SC_DECL(7); SC_DECL(8); SC_DECL(9); SC_DECL(10); SC_DECL(11);
    for (long dd = 0; dd < d; dd++) {
        __m512 w = _mm512_loadu_ps(panel + dd * KP);
        SC_FMA(0) SC_FMA(1) SC_FMA(2) SC_FMA(3) SC_FMA(4) SC_FMA(5)
        SC_FMA(6) SC_FMA(7) SC_FMA(8) SC_FMA(9) SC_FMA(10) SC_FMA(11)
    }
    SC_STORE(0) SC_STORE(1) SC_STORE(2) SC_STORE(3) SC_STORE(4) SC_STORE(5)
    SC_STORE(6) SC_STORE(7) SC_STORE(8) SC_STORE(9) SC_STORE(10) SC_STORE(11)
}
#undef SC_DECL
#undef SC_FMA
#undef SC_STORE

#define SCORE(m)                                                                          \
    static __attribute__((target("avx512f"))) void score##m(const float *q, long qs,       \
                                                            const float *panel, long d,    \
                                                            float *scores) {               \
        score_tile(m, q, qs, panel, d, scores);                                           \
    }
SCORE(1) SCORE(2) SCORE(3) SCORE(4) SCORE(5) SCORE(6)
SCORE(7) SCORE(8) SCORE(9) SCORE(10) SCORE(11) SCORE(12)
#undef SCORE
typedef void (*score_fn)(const float *, long, const float *, long, float *);
static const score_fn SCORES[QB + 1] = {0, score1, score2, score3, score4, score5, score6,
                                        score7, score8, score9, score10, score11, score12};

/* Lanes of panel p (positions 16p..16p+15) that query i of a row sees. */
static inline __mmask16 visible(long p, long i, long start, long pmax, long t) {
    long lo = p * KP, hi = lo + KP; /* positions [lo, hi) */
    if (hi <= t && (hi <= start || (lo >= pmax && hi - 1 <= pmax + i))) return 0xFFFF;
    if (lo >= start && (hi <= pmax || lo > pmax + i)) return 0;
    __mmask16 m = 0;
    for (long j = 0; j < KP; j++) {
        long pos = p * KP + j;
        if (pos < t && (pos < start || (pos >= pmax && pos <= pmax + i))) m |= (__mmask16)1 << j;
    }
    return m;
}

/* One block: query positions [i0, i0 + mr) of one row and head. */
static __attribute__((target("avx512f"))) void attend_block(
    int mr, long i0, const float *q, long qs, const float *kt, const float *v, long vs,
    float *out, long os, long d, long t, long start, long pmax, float scale) {
    float scores[QB * KP] __attribute__((aligned(64)));
    float acc[QB * DMAX] __attribute__((aligned(64)));
    float top[QB], total[QB];
    long dv = d / 16;
    for (int r = 0; r < mr; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
        memset(acc + r * DMAX, 0, d * sizeof(float));
    }
    long last = pmax + i0 + mr - 1; /* the furthest key any row of the block sees */
    long panels = last / KP + 1;
    __m512 vscale = _mm512_set1_ps(scale);
    for (long p = 0; p < panels; p++) {
        /* the padded past between a row's own past and the new tokens: skip whole panels */
        if (p * KP >= start && (p + 1) * KP <= pmax) continue;
        SCORES[mr](q, qs, kt + p * d * KP, d, scores);
        const float *vp = v + p * KP * vs;
        for (int r = 0; r < mr; r++) {
            __mmask16 m = visible(p, i0 + r, start, pmax, t);
            if (m == 0) continue;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scores + r * KP), vscale);
            float blk = _mm512_mask_reduce_max_ps(m, s);
            float new_top = blk > top[r] ? blk : top[r];
            float alpha = top[r] == -INFINITY ? 0.0f : expf(top[r] - new_top);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_top))));
            total[r] = total[r] * alpha + _mm512_reduce_add_ps(e);
            top[r] = new_top;
            float pr[KP] __attribute__((aligned(64)));
            _mm512_store_ps(pr, e);
            float *o = acc + r * DMAX;
            __m512 va = _mm512_set1_ps(alpha);
            if (dv == 4) {
                __m512 o0 = _mm512_mul_ps(_mm512_load_ps(o), va);
                __m512 o1 = _mm512_mul_ps(_mm512_load_ps(o + 16), va);
                __m512 o2 = _mm512_mul_ps(_mm512_load_ps(o + 32), va);
                __m512 o3 = _mm512_mul_ps(_mm512_load_ps(o + 48), va);
                for (unsigned bits = m; bits; bits &= bits - 1) { /* visible keys only */
                    long j = __builtin_ctz(bits);
                    __m512 b = _mm512_set1_ps(pr[j]);
                    const float *vr = vp + j * vs;
                    o0 = _mm512_fmadd_ps(b, _mm512_loadu_ps(vr), o0);
                    o1 = _mm512_fmadd_ps(b, _mm512_loadu_ps(vr + 16), o1);
                    o2 = _mm512_fmadd_ps(b, _mm512_loadu_ps(vr + 32), o2);
                    o3 = _mm512_fmadd_ps(b, _mm512_loadu_ps(vr + 48), o3);
                }
                _mm512_store_ps(o, o0);
                _mm512_store_ps(o + 16, o1);
                _mm512_store_ps(o + 32, o2);
                _mm512_store_ps(o + 48, o3);
            } else {
                for (long c = 0; c < dv; c++)
                    _mm512_store_ps(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(o + 16 * c), va));
                for (unsigned bits = m; bits; bits &= bits - 1) {
                    long j = __builtin_ctz(bits);
                    __m512 b = _mm512_set1_ps(pr[j]);
                    const float *vr = vp + j * vs;
                    for (long c = 0; c < dv; c++)
                        _mm512_store_ps(o + 16 * c,
                                        _mm512_fmadd_ps(b, _mm512_loadu_ps(vr + 16 * c),
                                                        _mm512_load_ps(o + 16 * c)));
                }
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        float *dst = out + r * os;
        __m512 inv = _mm512_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
        for (long c = 0; c < dv; c++)
            _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + r * DMAX + 16 * c),
                                                         inv));
    }
}

#define PG 4 /* AVX2: panels per online-softmax step */
#define SG (PG * KP) /* AVX2: keys per online-softmax step, the stride of its scores' rows */

/* AVX2: scores[r][0..16) = q_r . keys of one panel for mr (1..6) query rows: 12 sums (6 rows
   x the panel's two halves) in registers, two panel loads per key dimension. */
#define SC_DECL(i) __m256 a##i = _mm256_setzero_ps(), b##i = _mm256_setzero_ps()
#define SC_FMA(i)                                                                         \
    if (mr > i) {                                                                         \
        __m256 x = _mm256_broadcast_ss(q + (i) * qs + dd);                                \
        a##i = _mm256_fmadd_ps(x, w0, a##i);                                              \
        b##i = _mm256_fmadd_ps(x, w1, b##i);                                              \
    }
#define SC_STORE(i)                                                                       \
    if (mr > i) {                                                                         \
        _mm256_store_ps(scores + (i) * SG, a##i);                                         \
        _mm256_store_ps(scores + (i) * SG + 8, b##i);                                     \
    }
static inline __attribute__((always_inline)) void score_tile8(
    int mr, const float *q, long qs, const float *panel, long d, float *scores) {
    SC_DECL(0); SC_DECL(1); SC_DECL(2); SC_DECL(3); SC_DECL(4); SC_DECL(5);
    for (long dd = 0; dd < d; dd++) {
        __m256 w0 = _mm256_loadu_ps(panel + dd * KP), w1 = _mm256_loadu_ps(panel + dd * KP + 8);
        SC_FMA(0) SC_FMA(1) SC_FMA(2) SC_FMA(3) SC_FMA(4) SC_FMA(5)
    }
    SC_STORE(0) SC_STORE(1) SC_STORE(2) SC_STORE(3) SC_STORE(4) SC_STORE(5)
}
#undef SC_DECL
#undef SC_FMA
#undef SC_STORE

/* AVX2: acc[r][c0..c0+16) = acc[r][..] * alpha[r] + sum over the keys in `keys` of
   pr[r][j] * V[j][c0..c0+16), for mr (1..6) rows: 12 sums in registers, two loads of V per
   key shared by the rows. A key in `keys` is one some row of the block sees (so a real one);
   a row that does not see it has pr exactly 0 there. */
#define PV_DECL(i)                                                                        \
    __m256 a##i = _mm256_setzero_ps(), b##i = _mm256_setzero_ps();                        \
    if (mr > i) {                                                                         \
        __m256 al = _mm256_broadcast_ss(alpha + (i));                                     \
        a##i = _mm256_mul_ps(_mm256_load_ps(acc + (i) * DMAX + c0), al);                  \
        b##i = _mm256_mul_ps(_mm256_load_ps(acc + (i) * DMAX + c0 + 8), al);              \
    }
#define PV_FMA(i)                                                                         \
    if (mr > i) {                                                                         \
        __m256 x = _mm256_broadcast_ss(pr + (i) * SG + j);                                \
        a##i = _mm256_fmadd_ps(x, v0, a##i);                                              \
        b##i = _mm256_fmadd_ps(x, v1, b##i);                                              \
    }
#define PV_STORE(i)                                                                       \
    if (mr > i) {                                                                         \
        _mm256_store_ps(acc + (i) * DMAX + c0, a##i);                                     \
        _mm256_store_ps(acc + (i) * DMAX + c0 + 8, b##i);                                 \
    }
static inline __attribute__((always_inline)) void pv_tile8(
    int mr, const float *pr, const float *alpha, unsigned long long keys, const float *vp,
    long vs, long d, float *acc) {
    for (long c0 = 0; c0 < d; c0 += 16) {
        PV_DECL(0) PV_DECL(1) PV_DECL(2) PV_DECL(3) PV_DECL(4) PV_DECL(5)
        for (unsigned long long bits = keys; bits; bits &= bits - 1) {
            long j = __builtin_ctzll(bits);
            const float *vr = vp + j * vs + c0;
            __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
            PV_FMA(0) PV_FMA(1) PV_FMA(2) PV_FMA(3) PV_FMA(4) PV_FMA(5)
        }
        PV_STORE(0) PV_STORE(1) PV_STORE(2) PV_STORE(3) PV_STORE(4) PV_STORE(5)
    }
}
#undef PV_DECL
#undef PV_FMA
#undef PV_STORE

#define TILES(m)                                                                          \
    static void score8_##m(const float *q, long qs, const float *panel, long d,            \
                           float *scores) {                                               \
        score_tile8(m, q, qs, panel, d, scores);                                          \
    }                                                                                     \
    static void pv8_##m(const float *pr, const float *alpha, unsigned long long keys,       \
                        const float *vp, long vs, long d, float *acc) {                   \
        pv_tile8(m, pr, alpha, keys, vp, vs, d, acc);                                     \
    }
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#undef TILES
#define RB 6 /* query rows per AVX2 tile */
static const score_fn SCORES8[RB + 1] = {0, score8_1, score8_2, score8_3, score8_4, score8_5,
                                         score8_6};
typedef void (*pv_fn)(const float *, const float *, unsigned long long, const float *, long,
                      long, float *);
static const pv_fn PVS8[RB + 1] = {0, pv8_1, pv8_2, pv8_3, pv8_4, pv8_5, pv8_6};

/* All-ones in lane j of the result where bit j of m is set (bits 0..8). */
static inline __m256 lane_mask(unsigned m) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)m), sel);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
}

/* attend_block in ymm: the same block, masks and online softmax, in steps of PG panels: the
   scores of all the block's rows for the step's panels, then each row's softmax step over
   its 64 keys (one rescale of its output per step), then p @ V for six rows at a time. */
static void attend_block8(int mr, long i0, const float *q, long qs, const float *kt,
                          const float *v, long vs, float *out, long os, long d, long t,
                          long start, long pmax, float scale) {
    float scores[QB * SG] __attribute__((aligned(32)));
    float acc[QB * DMAX] __attribute__((aligned(32)));
    float top[QB], total[QB], alpha[QB];
    for (int r = 0; r < mr; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
        memset(acc + r * DMAX, 0, d * sizeof(float));
    }
    long last = pmax + i0 + mr - 1;
    long panels = last / KP + 1;
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (long p0 = 0; p0 < panels; p0 += PG) {
        unsigned long long seen[QB], keys[2] = {0, 0};
        for (int r = 0; r < mr; r++) seen[r] = 0;
        for (long p = p0; p < p0 + PG && p < panels; p++) {
            if (p * KP >= start && (p + 1) * KP <= pmax) continue; /* padding: never read */
            const float *panel = kt + p * d * KP;
            for (int r0 = 0; r0 < mr; r0 += RB)
                SCORES8[mr - r0 < RB ? mr - r0 : RB](q + r0 * qs, qs, panel, d,
                                                     scores + r0 * SG + (p - p0) * KP);
            for (int r = 0; r < mr; r++)
                seen[r] |= (unsigned long long)visible(p, i0 + r, start, pmax, t)
                           << ((p - p0) * KP);
        }
        for (int r = 0; r < mr; r++) {
            float *sr = scores + r * SG; /* the row's scores become its probabilities */
            unsigned long long m = seen[r];
            keys[r / RB] |= m;
            if (m == 0) {
                alpha[r] = 1.0f;
                for (int c = 0; c < SG; c += 8) _mm256_store_ps(sr + c, _mm256_setzero_ps());
                continue;
            }
            __m256 mx = ninf;
            for (int c = 0; c < SG; c += 8) {
                __m256 x = _mm256_mul_ps(_mm256_load_ps(sr + c), vscale);
                x = _mm256_blendv_ps(ninf, x, lane_mask((unsigned)(m >> c) & 0xFF));
                _mm256_store_ps(sr + c, x);
                mx = _mm256_max_ps(mx, x);
            }
            float blk = hmax8(mx);
            float new_top = blk > top[r] ? blk : top[r];
            alpha[r] = top[r] == -INFINITY ? 0.0f : expf(top[r] - new_top);
            __m256 nt = _mm256_set1_ps(new_top), sum = _mm256_setzero_ps();
            for (int c = 0; c < SG; c += 8) {
                /* a masked lane is -inf: exp8 clamps it to a tiny number, zeroed here */
                __m256 e = _mm256_and_ps(lane_mask((unsigned)(m >> c) & 0xFF),
                                         exp8(_mm256_sub_ps(_mm256_load_ps(sr + c), nt)));
                _mm256_store_ps(sr + c, e);
                sum = _mm256_add_ps(sum, e);
            }
            total[r] = total[r] * alpha[r] + hsum8(sum);
            top[r] = new_top;
        }
        const float *vp = v + p0 * KP * vs;
        for (int r0 = 0; r0 < mr; r0 += RB)
            if (keys[r0 / RB])
                PVS8[mr - r0 < RB ? mr - r0 : RB](scores + r0 * SG, alpha + r0, keys[r0 / RB],
                                                  vp, vs, d, acc + r0 * DMAX);
    }
    for (int r = 0; r < mr; r++) {
        float *dst = out + r * os;
        __m256 inv = _mm256_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
        for (long c = 0; c < d; c += 8)
            _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_load_ps(acc + r * DMAX + c), inv));
    }
}

/* The arguments' checks of prefill_attention and prefill_attention_bf16: SK_OK (also for
   no rows or no positions: nothing to attend, the pointers not read); SK_UNSUPPORTED for a
   head_dim the kernels do not serve (the engine checks the model's at start-up,
   app/prefill_attention.py:prefill_attention_unavailable, and then runs every pass in
   torch's attention; at call time it is an error); SK_BAD_SHAPE for counts out of range
   (batch, s, pmax < 0, heads not a multiple of kv_heads, t not pmax + s, threads < 1) or a
   NULL pointer; SK_BAD_STARTS for a row whose cached positions are not within [0, pmax]. */
int prefill_attention_args(const float *q, const float *k, const float *v, const float *out,
                           long batch, long heads, long kv_heads, long s, long t, long d,
                           const long *starts, long pmax, int threads) {
    if (batch < 0 || s < 0 || pmax < 0 || heads < 1 || kv_heads < 1 || heads % kv_heads != 0
        || t != pmax + s || threads < 1)
        return SK_BAD_SHAPE;
    if (d < 16 || d % 16 != 0 || d > DMAX) return SK_UNSUPPORTED;
    if (batch * s == 0) return SK_OK; /* nothing to attend: the pointers are not read */
    if (q == NULL || k == NULL || v == NULL || out == NULL || starts == NULL) return SK_BAD_SHAPE;
    for (long b = 0; b < batch; b++)
        if (starts[b] < 0 || starts[b] > pmax) return SK_BAD_STARTS;
    return SK_OK;
}

/* Those statuses, or SK_NO_MEMORY. AVX-512 where the panel kernel uses it
   (panel_uses_avx512), AVX2 otherwise. */
int prefill_attention(const float *q, long qsb, long qsh, long qss,
                      const float *k, long ksb, long ksh, long kss,
                      const float *v, long vsb, long vsh, long vss,
                      float *out, long osb, long osh, long oss,
                      long batch, long heads, long kv_heads, long s, long t, long d,
                      const long *starts, long pmax, float scale, int threads) {
    int status = prefill_attention_args(q, k, v, out, batch, heads, kv_heads, s, t, d, starts,
                                        pmax, threads);
    if (status != SK_OK || batch * s == 0) return status;
    int wide = panel_uses_avx512();
    long group = heads / kv_heads, tp = (t + KP - 1) / KP;
    long per = tp * d * KP;
    float *kt = aligned_alloc(64, (size_t)(batch * kv_heads * per) * sizeof(float) + 64);
    if (kt == NULL) return SK_NO_MEMORY;
    long pairs = batch * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long bg = 0; bg < pairs; bg++) {
        long b = bg / kv_heads, g = bg % kv_heads;
        /* keys [T][D] are a weight's rows to the panel layout: [T/16][D][16] */
        panel_pack(k + b * ksb + g * ksh, kss, t, d, kt + bg * per);
    }
    long blocks = (s + QB - 1) / QB, tasks = batch * heads * blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long task = tasks - 1; task >= 0; task--) { /* longest (last) blocks first */
        long blk = task % blocks, bh = task / blocks;
        long b = bh / heads, h = bh % heads, g = h / group;
        long i0 = blk * QB;
        int mr = (int)(s - i0 < QB ? s - i0 : QB);
        (wide ? attend_block : attend_block8)(
            mr, i0, q + b * qsb + h * qsh + i0 * qss, qss, kt + (b * kv_heads + g) * per,
            v + b * vsb + g * vsh, vss, out + b * osb + h * osh + i0 * oss, oss, d, t,
            starts[b], pmax, scale);
    }
    free(kt);
    return SK_OK;
}
