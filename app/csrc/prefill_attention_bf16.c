/* Prefill attention with bf16 products (AVX512-BF16): prefill_attention.c's pass (the same
 * arguments, masks and causal layout after a padded past) for an engine serving bf16, where
 * q, k, v and the probabilities enter the products rounded to bf16 (round to nearest even)
 * and every sum is float32, as vLLM's and SGLang's CPU attention computes a bf16 model.
 *
 * The float32 kernel is as fast as a float32 product can be on these cores; a bf16 dot
 * product (vdpbf16ps) does two multiply-adds per lane, so both products here take half
 * the instructions. Layout, per (row, KV head), packed once per pass:
 *   keys   [T/16][D/2][16][2]: one zmm holds two key dimensions of 16 positions;
 *   values [T/2][D][2]:        one zmm holds 16 value dimensions of two positions;
 * and per block of up to 12 query positions, the block's queries as bf16 pairs. Per step of
 * 64 keys (four panels): scores [6 rows][64] in 24 registers (per pair of dimensions one
 * load per panel and one broadcast per row), each row's online-softmax step over its 64
 * keys (one rescale of its output per step, its running max raised only where a score
 * passes it, its sums kept lane by lane until the block's end; masked lanes exactly zero),
 * the probabilities rounded to bf16 pairs, then out [6 rows][64 dims] += p @ V in 24
 * registers (per pair of keys four loads of V shared by the six rows). Pairs of keys no row
 * of the tile sees are skipped; a key a row does not see has p exactly 0, and the positions
 * no row sees (a padded past's padding, past t) are packed as zeros, so what fills them is
 * never read.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,bmi2")))
#define KP 16  /* positions per key panel */
#define PS 4   /* panels per softmax step */
#define SK (PS * KP) /* keys per step */
#define QB 12  /* query positions per block */
#define RB 6   /* rows per register tile */
#define DMAX 256

/* Whether position pos of a row whose own past ends at start holds a real key: not past t,
   not in the padding [start, pmax) between its past and the pass's tokens (what fills the
   padding is never read: it is packed as zeros, as the positions past t are, so that a
   pair of keys half real multiplies its other half's zero probability by a finite zero). */
#define REAL(pos) ((pos) < t && ((pos) < start || (pos) >= pmax))

/* keys [T][D] (position stride ks) -> [tp][D/2][16][2]. A key row's pairs of dimensions
   are already adjacent: round the row to bf16, then each pair is one 32-bit word, and a
   panel is a transpose of 16 rows of words. */
static BF_TARGET void pack_keys(const float *k, long ks, long t, long start, long pmax,
                                long tp, long d, uint16_t *out) {
    uint32_t rows[KP][DMAX / 2] __attribute__((aligned(64)));
    long dw = d / 2;
    uint32_t *o = (uint32_t *)out;
    for (long p = 0; p < tp; p++) {
        for (long j = 0; j < KP; j++) {
            long pos = p * KP + j;
            for (long c = 0; c < d; c += 16) {
                __m256i w = REAL(pos)
                                ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(k + pos * ks + c))
                                : _mm256_setzero_si256();
                _mm256_store_si256((__m256i *)(rows[j] + c / 2), w);
            }
        }
        for (long dd = 0; dd < dw; dd++)
            for (long j = 0; j < KP; j++) o[(p * dw + dd) * KP + j] = rows[j][dd];
    }
}

/* values [T][D] -> [tp * 8][D][2] (pairs of positions). */
static BF_TARGET void pack_values(const float *v, long vs, long t, long start, long pmax,
                                  long tp, long d, uint16_t *out) {
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
    const __m512 zero = _mm512_setzero_ps();
    for (long pr = 0; pr < tp * KP / 2; pr++) {
        long a = 2 * pr, b = a + 1;
        for (long c = 0; c < d; c += 16) {
            __m512 va = REAL(a) ? _mm512_loadu_ps(v + a * vs + c) : zero;
            __m512 vb = REAL(b) ? _mm512_loadu_ps(v + b * vs + c) : zero;
            /* words a0..a15 b0..b15 -> a0 b0 a1 b1 ... */
            __m512i w = _mm512_permutexvar_epi16(mix, (__m512i)_mm512_cvtne2ps_pbh(vb, va));
            _mm512_storeu_si512(out + (pr * d + c) * 2, w);
        }
    }
}

/* Lanes of panel p (positions 16p..16p+15) that query i of a row sees (as the float32
   kernel's visible()). */
/* Whether every position of [lo, hi) is a real key that query i of a row sees. */
static inline int all_seen(long lo, long hi, long i, long start, long pmax, long t) {
    return hi <= t && (hi <= start || (lo >= pmax && hi - 1 <= pmax + i));
}

static inline uint32_t seen_lanes(long p, long i, long start, long pmax, long t) {
    long lo = p * KP, hi = lo + KP;
    if (all_seen(lo, hi, i, start, pmax, t)) return 0xFFFF;
    if (lo >= start && (hi <= pmax || lo > pmax + i)) return 0;
    uint32_t m = 0;
    for (long j = 0; j < KP; j++) {
        long pos = lo + j;
        if (pos < t && (pos < start || (pos >= pmax && pos <= pmax + i))) m |= 1u << j;
    }
    return m;
}

/* scores[r][0..SK) = q_r . keys of panels p0..p0+np-1, for mr (1..6) rows; qb: the rows'
   queries as bf16 pairs (row stride d/2 words). */
#define S_DECL(i) __m512 s##i##0 = _mm512_setzero_ps(), s##i##1 = s##i##0, s##i##2 = s##i##0, \
                         s##i##3 = s##i##0
#define S_DP(i)                                                                            \
    if (mr > i) {                                                                          \
        __m512bh x = (__m512bh)_mm512_set1_epi32((int)qb[(i) * dw + dd]);                   \
        s##i##0 = _mm512_dpbf16_ps(s##i##0, x, k0);                                        \
        s##i##1 = _mm512_dpbf16_ps(s##i##1, x, k1);                                        \
        s##i##2 = _mm512_dpbf16_ps(s##i##2, x, k2);                                        \
        s##i##3 = _mm512_dpbf16_ps(s##i##3, x, k3);                                        \
    }
#define S_STORE(i)                                                                         \
    if (mr > i) {                                                                          \
        _mm512_store_ps(scores + (i) * SK, s##i##0);                                       \
        _mm512_store_ps(scores + (i) * SK + 16, s##i##1);                                  \
        _mm512_store_ps(scores + (i) * SK + 32, s##i##2);                                  \
        _mm512_store_ps(scores + (i) * SK + 48, s##i##3);                                  \
    }
static inline __attribute__((always_inline)) BF_TARGET void score_step(
    int mr, const uint32_t *qb, long dw, const uint16_t *kp, long np, float *scores) {
    S_DECL(0); S_DECL(1); S_DECL(2); S_DECL(3); S_DECL(4); S_DECL(5);
    long pstride = dw * KP * 2; /* bf16 elements per key panel */
    const __m512i zero = _mm512_setzero_si512();
    for (long dd = 0; dd < dw; dd++) {
        const uint16_t *base = kp + dd * KP * 2;
        __m512bh k0 = (__m512bh)_mm512_load_si512(base);
        __m512bh k1 = (__m512bh)(np > 1 ? _mm512_load_si512(base + pstride) : zero);
        __m512bh k2 = (__m512bh)(np > 2 ? _mm512_load_si512(base + 2 * pstride) : zero);
        __m512bh k3 = (__m512bh)(np > 3 ? _mm512_load_si512(base + 3 * pstride) : zero);
        S_DP(0) S_DP(1) S_DP(2) S_DP(3) S_DP(4) S_DP(5)
    }
    S_STORE(0) S_STORE(1) S_STORE(2) S_STORE(3) S_STORE(4) S_STORE(5)
}

/* acc[r][c0..c0+16*nv) = acc * alpha[r] + sum over the pairs in `pairs` (bit j: keys 2j and
   2j+1 of the step) of p[r][pair] . V[pair][c], for mr (1..6) rows and nv (1..4) vectors. */
#define P_DECL(i)                                                                          \
    __m512 o##i##0 = _mm512_setzero_ps(), o##i##1 = o##i##0, o##i##2 = o##i##0,            \
           o##i##3 = o##i##0;                                                              \
    if (mr > i) {                                                                          \
        __m512 al = _mm512_set1_ps(alpha[i]);                                              \
        float *a = acc + (i) * DMAX + c0;                                                  \
        o##i##0 = _mm512_mul_ps(_mm512_load_ps(a), al);                                    \
        if (nv > 1) o##i##1 = _mm512_mul_ps(_mm512_load_ps(a + 16), al);                   \
        if (nv > 2) o##i##2 = _mm512_mul_ps(_mm512_load_ps(a + 32), al);                   \
        if (nv > 3) o##i##3 = _mm512_mul_ps(_mm512_load_ps(a + 48), al);                   \
    }
#define P_DP(i)                                                                            \
    if (mr > i) {                                                                          \
        __m512bh x = (__m512bh)_mm512_set1_epi32((int)pw[(i) * (SK / 2) + j]);              \
        o##i##0 = _mm512_dpbf16_ps(o##i##0, x, v0);                                        \
        o##i##1 = _mm512_dpbf16_ps(o##i##1, x, v1);                                        \
        o##i##2 = _mm512_dpbf16_ps(o##i##2, x, v2);                                        \
        o##i##3 = _mm512_dpbf16_ps(o##i##3, x, v3);                                        \
    }
#define P_STORE(i)                                                                         \
    if (mr > i) {                                                                          \
        float *a = acc + (i) * DMAX + c0;                                                  \
        _mm512_store_ps(a, o##i##0);                                                       \
        if (nv > 1) _mm512_store_ps(a + 16, o##i##1);                                      \
        if (nv > 2) _mm512_store_ps(a + 32, o##i##2);                                      \
        if (nv > 3) _mm512_store_ps(a + 48, o##i##3);                                      \
    }
static inline __attribute__((always_inline)) BF_TARGET void pv_cols(
    int mr, long nv, long c0, const uint32_t *pw, const float *alpha, uint32_t pairs,
    const uint16_t *vp, long d, float *acc) {
    const __m512i zero = _mm512_setzero_si512();
    P_DECL(0) P_DECL(1) P_DECL(2) P_DECL(3) P_DECL(4) P_DECL(5)
    for (uint32_t bits = pairs; bits; bits &= bits - 1) {
        long j = __builtin_ctz(bits);
        const uint16_t *vr = vp + (j * d + c0) * 2;
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(vr);
        __m512bh v1 = (__m512bh)(nv > 1 ? _mm512_loadu_si512(vr + 32) : zero);
        __m512bh v2 = (__m512bh)(nv > 2 ? _mm512_loadu_si512(vr + 64) : zero);
        __m512bh v3 = (__m512bh)(nv > 3 ? _mm512_loadu_si512(vr + 96) : zero);
        P_DP(0) P_DP(1) P_DP(2) P_DP(3) P_DP(4) P_DP(5)
    }
    P_STORE(0) P_STORE(1) P_STORE(2) P_STORE(3) P_STORE(4) P_STORE(5)
}
static inline __attribute__((always_inline)) BF_TARGET void pv_step(
    int mr, const uint32_t *pw, const float *alpha, uint32_t pairs, const uint16_t *vp,
    long d, float *acc) {
    for (long c0 = 0; c0 < d; c0 += 64) {
        long nv = (d - c0) / 16 < 4 ? (d - c0) / 16 : 4;
        if (nv == 4) pv_cols(mr, 4, c0, pw, alpha, pairs, vp, d, acc);
        else pv_cols(mr, nv, c0, pw, alpha, pairs, vp, d, acc);
    }
}

/* The two products for a tile of RB rows (over a whole step's panels: every step but a
   prompt's last) compiled for that tile alone, without the inner loops' tests of the rows
   and panels in use; other tiles through the general code. */
static BF_TARGET void score_tile(int mr, const uint32_t *qb, long dw, const uint16_t *kp,
                                 long np, float *scores) {
    if (mr == RB && np == PS) score_step(RB, qb, dw, kp, PS, scores);
    else score_step(mr, qb, dw, kp, np, scores);
}
static BF_TARGET void pv_tile(int mr, const uint32_t *pw, const float *alpha, uint32_t pairs,
                              const uint16_t *vp, long d, float *acc) {
    if (mr == RB) pv_step(RB, pw, alpha, pairs, vp, d, acc);
    else pv_step(mr, pw, alpha, pairs, vp, d, acc);
}

/* One row's softmax step over its SK scores (lanes in `m` seen), in base 2: the scores times
   c2 (the scale times log2(e)), the row's running max `top` (in those units) raised to the
   step's, the probabilities 2^(x - top) as bf16 pairs into pw (exp2_16_d3: its error a 26th
   of bf16's rounding; the rows' rescales keep exp2_16, and out is acc / sum, both taking
   the same factor) and their float32 sums, lane by lane, into *sum. A step whose scores stay under the row's max (most steps of a long
   prompt, once its first keys are seen) reads no lane across: one compare instead of a
   reduction; the rescale of the row's earlier sums waits for rescale_rows, all rows at
   once, and the sums' own reduction for the block's end. A step every key of which the
   row sees (`m` all ones) masks nothing. */
static inline __attribute__((always_inline)) BF_TARGET void softmax_row(
    const float *sr, uint64_t m, int full, float c2, float *top, __m512 *sum, uint32_t *pw) {
    const __m512 vc = _mm512_set1_ps(c2);
    __m512 x[PS], mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < PS; c++) { /* the raw scores: c2 > 0 keeps their order */
        x[c] = _mm512_load_ps(sr + 16 * c);
        mx = full ? _mm512_max_ps(mx, x[c])
                  : _mm512_mask_max_ps(mx, (__mmask16)(m >> (16 * c)), mx, x[c]);
    }
    mx = _mm512_mul_ps(mx, vc);
    __m512 nt = _mm512_set1_ps(*top);
    if (_mm512_cmp_ps_mask(mx, nt, _CMP_GT_OQ)) {
        *top = _mm512_reduce_max_ps(mx);
        nt = _mm512_set1_ps(*top);
    }
    __m512 total = _mm512_setzero_ps(), e[PS];
    for (int c = 0; c < PS; c++) { /* unseen lanes (finite: their keys are zeros) to 0 */
        e[c] = exp2_16_d3(_mm512_fmsub_ps(x[c], vc, nt));
        if (!full) e[c] = _mm512_maskz_mov_ps((__mmask16)(m >> (16 * c)), e[c]);
        total = _mm512_add_ps(total, e[c]);
    }
    *sum = total;
    for (int c = 0; c < PS; c += 2) /* 32 probabilities -> 16 pairs (keys in order) */
        _mm512_storeu_si512(pw + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(e[c + 1], e[c]));
}
static inline BF_TARGET void softmax_step(const float *sr, uint64_t m, float c2, float *top,
                                          __m512 *sum, uint32_t *pw) {
    if (m == 0) {
        *sum = _mm512_setzero_ps();
        memset(pw, 0, SK * sizeof(uint16_t));
    } else if (m == ~0ull) {
        softmax_row(sr, m, 1, c2, top, sum, pw);
    } else {
        softmax_row(sr, m, 0, c2, top, sum, pw);
    }
}

/* After a step's softmax_step for rows 0..mr-1: alpha = 2^(old top - new top), the factor
   of each row's earlier sums (0 while the row had seen nothing: its sums are zeros), and
   each row's sums (a vector of lanes) = sums * alpha + the step's. */
static inline BF_TARGET void rescale_rows(int mr, const float *old, const float *top,
                                          const __m512 *sum, __m512 *total, float *alpha) {
    __mmask16 k = (__mmask16)((1u << mr) - 1);
    __m512 o = _mm512_maskz_loadu_ps(k, old);
    __mmask16 seen = _mm512_mask_cmp_ps_mask(k, o, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    __m512 a = _mm512_maskz_mov_ps(seen, exp2_16(_mm512_sub_ps(o, _mm512_maskz_loadu_ps(k, top))));
    _mm512_mask_storeu_ps(alpha, k, a);
    for (int r = 0; r < mr; r++)
        total[r] = _mm512_fmadd_ps(total[r], _mm512_set1_ps(alpha[r]), sum[r]);
}

static BF_TARGET void attend_block_bf16(int mr, long i0, const float *q, long qs,
                                        const uint16_t *kp, const uint16_t *vpk, float *out,
                                        long os, long d, long t, long start, long pmax,
                                        float scale) {
    float scores[QB * SK] __attribute__((aligned(64)));
    float acc[QB * DMAX] __attribute__((aligned(64)));
    uint32_t qb[QB * DMAX / 2] __attribute__((aligned(64)));
    uint32_t pw[QB * SK / 2] __attribute__((aligned(64)));
    float top[QB], old[QB], alpha[QB];
    __m512 sum[QB], total[QB];
    const float c2 = scale * 1.44269504088896341f; /* scores to base 2 */
    long dw = d / 2;
    for (int r = 0; r < mr; r++) {
        top[r] = -INFINITY;
        total[r] = _mm512_setzero_ps();
        memset(acc + r * DMAX, 0, d * sizeof(float));
        uint16_t *qr = (uint16_t *)(qb + r * dw);
        for (long c = 0; c < d; c += 16)
            _mm256_storeu_si256((__m256i *)(qr + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + r * qs + c)));
    }
    long panels = (pmax + i0 + mr - 1) / KP + 1;
    for (long p0 = 0; p0 < panels; p0 += PS) {
        long np = panels - p0 < PS ? panels - p0 : PS;
        uint64_t seen[QB];
        uint32_t pairs[2] = {0, 0};
        if (all_seen(p0 * KP, (p0 + np) * KP, i0, start, pmax, t)) {
            /* every key of the step seen by the block's first row, so by every row (most
               steps of a long prompt): seen_lanes' answer for each, without asking */
            uint64_t all = np * KP == 64 ? ~0ull : (1ull << (np * KP)) - 1;
            for (int r = 0; r < mr; r++) seen[r] = all;
        } else {
            for (int r = 0; r < mr; r++) {
                seen[r] = 0;
                for (long p = p0; p < p0 + np; p++)
                    seen[r] |= (uint64_t)seen_lanes(p, i0 + r, start, pmax, t)
                               << ((p - p0) * KP);
            }
        }
        const uint16_t *kstep = kp + p0 * dw * KP * 2;
        for (int r0 = 0; r0 < mr; r0 += RB) {
            int n = mr - r0 < RB ? mr - r0 : RB;
            score_tile(n, qb + r0 * dw, dw, kstep, np, scores + r0 * SK);
        }
        memcpy(old, top, mr * sizeof(float));
        for (int r = 0; r < mr; r++) {
            softmax_step(scores + r * SK, seen[r], c2, top + r, sum + r, pw + r * (SK / 2));
            uint64_t m = seen[r] | (seen[r] >> 1); /* pair j seen: bit 2j */
            pairs[r / RB] |= (uint32_t)_pext_u64(m, 0x5555555555555555ull);
        }
        rescale_rows(mr, old, top, sum, total, alpha);
        const uint16_t *vstep = vpk + p0 * KP / 2 * d * 2;
        for (int r0 = 0; r0 < mr; r0 += RB) {
            int n = mr - r0 < RB ? mr - r0 : RB;
            pv_tile(n, pw + r0 * (SK / 2), alpha + r0, pairs[r0 / RB], vstep, d,
                    acc + r0 * DMAX);
        }
    }
    for (int r = 0; r < mr; r++) {
        float all = _mm512_reduce_add_ps(total[r]);
        __m512 inv = _mm512_set1_ps(all > 0.0f ? 1.0f / all : 0.0f);
        for (long c = 0; c < d; c += 16)
            _mm512_storeu_ps(out + r * os + c,
                             _mm512_mul_ps(_mm512_load_ps(acc + r * DMAX + c), inv));
    }
}

/* prefill_attention's arguments and statuses; SK_NO_ISA where the CPU lacks AVX512-BF16. */
int prefill_attention_bf16(const float *q, long qsb, long qsh, long qss,
                           const float *k, long ksb, long ksh, long kss,
                           const float *v, long vsb, long vsh, long vss,
                           float *out, long osb, long osh, long oss,
                           long batch, long heads, long kv_heads, long s, long t, long d,
                           const long *starts, long pmax, float scale, int threads) {
    int status = prefill_attention_args(q, k, v, out, batch, heads, kv_heads, s, t, d, starts,
                                        pmax, threads);
    if (status != SK_OK) return status;
    if (!panel_has_avx512bf16()) return SK_NO_ISA;
    if (batch * s == 0) return SK_OK;
    long group = heads / kv_heads, tp = (t + KP - 1) / KP;
    tp = (tp + PS - 1) / PS * PS; /* whole steps: a step's panels all exist (zero past t) */
    long per = tp * KP * d; /* bf16 elements per (row, KV head), keys and values alike */
    long pairs = batch * kv_heads;
    uint16_t *kt = aligned_alloc(64, (size_t)(2 * pairs * per) * sizeof(uint16_t) + 64);
    if (kt == NULL) return SK_NO_MEMORY;
    uint16_t *vt = kt + pairs * per;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long bg = 0; bg < 2 * pairs; bg++) {
        long x = bg % pairs, b = x / kv_heads, g = x % kv_heads;
        if (bg < pairs)
            pack_keys(k + b * ksb + g * ksh, kss, t, starts[b], pmax, tp, d, kt + x * per);
        else
            pack_values(v + b * vsb + g * vsh, vss, t, starts[b], pmax, tp, d, vt + x * per);
    }
    long blocks = (s + QB - 1) / QB, tasks = batch * heads * blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long task = tasks - 1; task >= 0; task--) { /* longest (last) blocks first */
        long blk = task % blocks, bh = task / blocks;
        long b = bh / heads, h = bh % heads, g = h / group;
        long i0 = blk * QB;
        int mr = (int)(s - i0 < QB ? s - i0 : QB);
        attend_block_bf16(mr, i0, q + b * qsb + h * qsh + i0 * qss, qss,
                          kt + (b * kv_heads + g) * per, vt + (b * kv_heads + g) * per,
                          out + b * osb + h * osh + i0 * oss, oss, d, t, starts[b], pmax,
                          scale);
    }
    free(kt);
    return SK_OK;
}
