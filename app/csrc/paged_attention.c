/* Decode attention read in place from the paged KV pool (x86-64, AVX2 + FMA, float32).
 *
 * One query token per row. Row b's keys and values are at the pool slots
 * read[offsets[b] .. offsets[b + 1]), in position order; every row reads its own slots and
 * nothing else, straight from the pool: no gathered copy, no padding, no mask. Grouped-query
 * attention: query head j reads KV head j / group.
 *
 * Per query head: its scores over the row's positions, softmax in float32 (max subtracted),
 * then the values weighted. head_dim 64 (SmolLM2's, Qwen2's and most small models') has its
 * own path (one_head64): each key and value read once for the group's query heads, eight
 * keys scored at a time with one horizontal pass per eight, a vector exp, the output's 64
 * sums held in registers, the positions ahead prefetched into L2; any other multiple of 8
 * goes through the general one (a dot product per key, expf). Rows x KV heads are shared out
 * over an OpenMP team of `threads` (torch's own pool, as in panel_gemm.c).
 *
 * The layer's pool is [2, slots, kv_heads, head_dim] (keys, then values), contiguous, in
 * float32 or bf16 (kv_bf16: half the bytes read; each key and value widened to float32 in
 * registers, a shift, so the sums are those of the float32 kernel over the same values).
 *
 * Checked before anything is read (paged_slots_check): offsets rise from 0 to at most the
 * length of read, and every slot read is within the pool (a few hundred comparisons a
 * layer: nothing against the attention they guard).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec_math.h"

/* Eight consecutive elements of a pool row as float32: `bf` (a constant where this is
   inlined): bf16, widened by a shift; else float32. */
static inline __attribute__((always_inline)) __m256 load8(const char *p, long c, int bf) {
    if (bf)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * c))), 16));
    return _mm256_loadu_ps((const float *)p + c);
}

static inline __attribute__((always_inline)) float dot8(const float *a, const char *b, long n,
                                                        int bf) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b, i, bf), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b, i + 8, bf), s1);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b, i, bf), s0);
    return hsum8(_mm256_add_ps(s0, s1));
}

/* keys, values: the KV head's first element in the pool; a slot's row is `stride` bytes */
static inline __attribute__((always_inline)) void one_head(
    const float *q, const char *keys, const char *values, long stride, long hd, long group,
    const long *slots, long n, float scale, float *out, float *scores, int bf) {
    /* q: the group's query heads [group, hd]; out likewise; scores: [group, n] */
    for (long i = 0; i < n; i++) {
        const char *k = keys + slots[i] * stride;
        for (long g = 0; g < group; g++) scores[g * n + i] = dot8(q + g * hd, k, hd, bf) * scale;
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * n;
        float top = s[0];
        for (long i = 1; i < n; i++) top = s[i] > top ? s[i] : top;
        float total = 0.0f;
        for (long i = 0; i < n; i++) {
            s[i] = expf(s[i] - top);
            total += s[i];
        }
        float *o = out + g * hd;
        for (long d = 0; d < hd; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
        for (long i = 0; i < n; i++) {
            const char *v = values + slots[i] * stride;
            __m256 p = _mm256_set1_ps(s[i]);
            for (long d = 0; d < hd; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, load8(v, d, bf),
                                                       _mm256_loadu_ps(o + d)));
        }
        __m256 inv = _mm256_set1_ps(1.0f / total);
        for (long d = 0; d < hd; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
    }
}

/* Eight sums of eight vectors each, as one vector (a[j]'s lanes summed into lane j). */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                            __m256 a6, __m256 a7) {
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                         _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* Keys (or values) this many positions ahead are prefetched, into L2 (prefetcht1): with
   the line fill buffers of L1 full of the demand misses, a prefetch into L1 waited for one
   (4 rows x 1,024 positions x 30 layers read at 7 GB/s, as without; into L2, 12-13 GB/s). */
#define AHEAD 32

/* Prefetch the 64 elements (four cache lines in float32, two in bf16) of each of positions
   [i, i + 8) of n, into L2. (always_inline: GCC takes a function of nothing but prefetches
   for one without effect and drops its calls.) */
static inline __attribute__((always_inline)) void prefetch8(const char *base,
                                                            const long *slots, long i, long n,
                                                            long stride, int bf) {
    if (i + 8 > n) return;
    for (int j = 0; j < 8; j++) {
        const char *p = base + slots[i + j] * stride;
        _mm_prefetch(p, _MM_HINT_T1);
        _mm_prefetch(p + 64, _MM_HINT_T1);
        if (!bf) {
            _mm_prefetch(p + 128, _MM_HINT_T1);
            _mm_prefetch(p + 192, _MM_HINT_T1);
        }
    }
}

/* Scores of the group's query heads against keys [i, i + 8), eight at a time with one
   horizontal pass per eight: s[g * n + i ..] for each head g. */
static inline __attribute__((always_inline)) void scores8(
    const float *q, long group, const char *const *k, long n, long i, __m256 vscale, float *s,
    int bf) {
    for (long g = 0; g < group; g++) {
        const float *qg = q + g * 64;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
        __m256 a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps();
        __m256 a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
        for (long c = 0; c < 64; c += 8) {
            __m256 qc = _mm256_loadu_ps(qg + c);
            a0 = _mm256_fmadd_ps(qc, load8(k[0], c, bf), a0);
            a1 = _mm256_fmadd_ps(qc, load8(k[1], c, bf), a1);
            a2 = _mm256_fmadd_ps(qc, load8(k[2], c, bf), a2);
            a3 = _mm256_fmadd_ps(qc, load8(k[3], c, bf), a3);
            a4 = _mm256_fmadd_ps(qc, load8(k[4], c, bf), a4);
            a5 = _mm256_fmadd_ps(qc, load8(k[5], c, bf), a5);
            a6 = _mm256_fmadd_ps(qc, load8(k[6], c, bf), a6);
            a7 = _mm256_fmadd_ps(qc, load8(k[7], c, bf), a7);
        }
        _mm256_storeu_ps(s + g * n + i, _mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7),
                                                      vscale));
    }
}

/* Softmax of one head's n scores in place (max subtracted); returns their sum. */
static float softmax_in_place(float *s, long n) {
    float top = s[0];
    for (long t = 1; t < n; t++) top = s[t] > top ? s[t] : top;
    __m256 vtop = _mm256_set1_ps(top), vsum = _mm256_setzero_ps();
    float total = 0.0f;
    long t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vtop));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    for (; t < n; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vsum);
    for (int j = 0; j < 8; j++) total += lanes[j];
    return total;
}

/* o[0 .. 64) += p[r] * values at positions [r0, r1), in position order. */
static inline __attribute__((always_inline)) void weigh_values(
    float *o, const float *p, const char *values, const long *slots, long r0, long r1,
    long stride, int bf) {
    __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8), o2 = _mm256_loadu_ps(o + 16);
    __m256 o3 = _mm256_loadu_ps(o + 24), o4 = _mm256_loadu_ps(o + 32);
    __m256 o5 = _mm256_loadu_ps(o + 40), o6 = _mm256_loadu_ps(o + 48);
    __m256 o7 = _mm256_loadu_ps(o + 56);
    for (long r = r0; r < r1; r++) {
        const char *v = values + slots[r] * stride;
        __m256 w = _mm256_set1_ps(p[r]);
        o0 = _mm256_fmadd_ps(w, load8(v, 0, bf), o0);
        o1 = _mm256_fmadd_ps(w, load8(v, 8, bf), o1);
        o2 = _mm256_fmadd_ps(w, load8(v, 16, bf), o2);
        o3 = _mm256_fmadd_ps(w, load8(v, 24, bf), o3);
        o4 = _mm256_fmadd_ps(w, load8(v, 32, bf), o4);
        o5 = _mm256_fmadd_ps(w, load8(v, 40, bf), o5);
        o6 = _mm256_fmadd_ps(w, load8(v, 48, bf), o6);
        o7 = _mm256_fmadd_ps(w, load8(v, 56, bf), o7);
    }
    _mm256_storeu_ps(o, o0);
    _mm256_storeu_ps(o + 8, o1);
    _mm256_storeu_ps(o + 16, o2);
    _mm256_storeu_ps(o + 24, o3);
    _mm256_storeu_ps(o + 32, o4);
    _mm256_storeu_ps(o + 40, o5);
    _mm256_storeu_ps(o + 48, o6);
    _mm256_storeu_ps(o + 56, o7);
}

/* one_head for head_dim 64: each key and each value is read once for all the group's query
   heads (a block of eight positions, 2 KB in float32, stays in L1 while every head of the
   group goes through it), AHEAD positions prefetched into L2. Per query head, every sum is
   taken in the same order as for that head alone (scores eight keys at a time, one
   horizontal pass per eight; the output's 64 sums over the positions in order), so a
   head's result does not depend on its group or on the batch. q, out: the group's
   [group, 64]; scores: [group, n] of scratch; a slot's row is `stride` bytes. */
static inline __attribute__((always_inline)) void one_head64(
    const float *q, const char *keys, const char *values, long stride, long group,
    const long *slots, long n, float scale, float *out, float *scores, int bf) {
    const long hd = 64;
    __m256 vscale = _mm256_set1_ps(scale);
    for (long i = 0; i < AHEAD && i < n; i += 8) prefetch8(keys, slots, i, n, stride, bf);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const char *k[8];
        for (int j = 0; j < 8; j++) k[j] = keys + slots[i + j] * stride;
        prefetch8(keys, slots, i + AHEAD, n, stride, bf);
        scores8(q, group, k, n, i, vscale, scores, bf);
    }
    for (; i < n; i++)
        for (long g = 0; g < group; g++)
            scores[g * n + i] = dot8(q + g * hd, keys + slots[i] * stride, hd, bf) * scale;
    for (long r = 0; r < AHEAD && r < n; r += 8) prefetch8(values, slots, r, n, stride, bf);
    float total[group];
    for (long g = 0; g < group; g++) {
        total[g] = softmax_in_place(scores + g * n, n);
        for (long d = 0; d < hd; d += 8) _mm256_storeu_ps(out + g * hd + d, _mm256_setzero_ps());
    }
    for (long r0 = 0; r0 < n; r0 += 8) {
        long r1 = r0 + 8 < n ? r0 + 8 : n;
        prefetch8(values, slots, r0 + AHEAD, n, stride, bf);
        for (long g = 0; g < group; g++)
            weigh_values(out + g * hd, scores + g * n, values, slots, r0, r1, stride, bf);
    }
    for (long g = 0; g < group; g++) {
        __m256 inv = _mm256_set1_ps(1.0f / total[g]);
        float *o = out + g * hd;
        for (long d = 0; d < hd; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
    }
}

/* The two heads' paths compiled once per pool dtype (bf: a constant in each). */
static void head64_f32(const float *q, const char *k, const char *v, long stride, long group,
                       const long *slots, long n, float scale, float *out, float *scores) {
    one_head64(q, k, v, stride, group, slots, n, scale, out, scores, 0);
}
static void head64_bf16(const float *q, const char *k, const char *v, long stride, long group,
                        const long *slots, long n, float scale, float *out, float *scores) {
    one_head64(q, k, v, stride, group, slots, n, scale, out, scores, 1);
}
static void head_f32(const float *q, const char *k, const char *v, long stride, long hd,
                     long group, const long *slots, long n, float scale, float *out,
                     float *scores) {
    one_head(q, k, v, stride, hd, group, slots, n, scale, out, scores, 0);
}
static void head_bf16(const float *q, const char *k, const char *v, long stride, long hd,
                      long group, const long *slots, long n, float scale, float *out,
                      float *scores) {
    one_head(q, k, v, stride, hd, group, slots, n, scale, out, scores, 1);
}

/* rows' new slots write[0 .. rows) (NULL: none) and the slots they read, read[offsets[b] ..
   offsets[b + 1]) for row b, against a pool of `slots` slots and a read of nread entries.
   Returns SK_OK, SK_BAD_SHAPE (rows, nread or slots below 0, a NULL offsets or read),
   SK_BAD_OFFSETS, SK_BAD_WRITE or SK_BAD_READ. */
int paged_slots_check(const long *write, long rows, const long *read, long nread,
                      const long *offsets, long slots) {
    if (rows < 0 || nread < 0 || slots < 0 || offsets == NULL || (nread > 0 && read == NULL))
        return SK_BAD_SHAPE;
    if (offsets[0] != 0) return SK_BAD_OFFSETS;
    for (long b = 0; b < rows; b++)
        if (offsets[b + 1] < offsets[b] || offsets[b + 1] > nread) return SK_BAD_OFFSETS;
    if (write != NULL)
        for (long b = 0; b < rows; b++)
            if (write[b] < 0 || write[b] >= slots) return SK_BAD_WRITE;
    for (long i = 0; i < offsets[rows]; i++)
        if (read[i] < 0 || read[i] >= slots) return SK_BAD_READ;
    return SK_OK;
}

/* q, out: [rows, kv_heads * group, hd]; keys, values: [slots, kv_heads, hd], float32 or
   (kv_bf16) bf16. Returns SK_OK, SK_UNSUPPORTED when hd is not a multiple of 8,
   SK_BAD_SHAPE for counts out of range, paged_slots_check's statuses, or SK_NO_MEMORY. */
int paged_decode_attention(const float *q, const void *keys, const void *values, long slots,
                           long kv_heads, long hd, long group, const long *read, long nread,
                           const long *offsets, long rows, float scale, float *out,
                           int threads, int kv_bf16) {
    if (kv_heads < 1 || group < 1 || hd < 1 || threads < 1) return SK_BAD_SHAPE;
    if (hd % 8 != 0) return SK_UNSUPPORTED;
    int status = paged_slots_check(NULL, rows, read, nread, offsets, slots);
    if (status != SK_OK) return status;
    if (rows > 0 && (q == NULL || keys == NULL || values == NULL || out == NULL))
        return SK_BAD_SHAPE;
    long longest = 0;
    for (long b = 0; b < rows; b++) {
        long n = offsets[b + 1] - offsets[b];
        longest = n > longest ? n : longest;
    }
    long tasks = rows * kv_heads;
    if (threads < 1 || tasks * longest < 4096) threads = 1;
    long per = group * (longest > 0 ? longest : 1);
    long es = kv_bf16 ? 2 : 4, stride = kv_heads * hd * es; /* a slot's row, in bytes */
    float *scratch = malloc(sizeof(float) * (size_t)(per * threads));
    if (scratch == NULL) return SK_NO_MEMORY;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; t++) {
        float *scores = scratch + per * omp_get_thread_num();
        long b = t / kv_heads, h = t % kv_heads;
        long n = offsets[b + 1] - offsets[b];
        long head0 = (b * kv_heads + h) * group * hd;
        const char *k = (const char *)keys + h * hd * es, *v = (const char *)values + h * hd * es;
        if (n > 0 && hd == 64) {
            (kv_bf16 ? head64_bf16 : head64_f32)(q + head0, k, v, stride, group,
                                                 read + offsets[b], n, scale, out + head0, scores);
        } else if (n > 0) {
            (kv_bf16 ? head_bf16 : head_f32)(q + head0, k, v, stride, hd, group,
                                             read + offsets[b], n, scale, out + head0, scores);
        } else {
            for (long i = 0; i < group * hd; i++) out[head0 + i] = 0.0f;
        }
    }
    free(scratch);
    return SK_OK;
}
