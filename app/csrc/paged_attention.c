/* Decode attention read in place from the paged KV pool (x86-64, AVX2 + FMA, float32).
 *
 * One query token per row. Row b's keys and values are at the pool slots
 * read[offsets[b] .. offsets[b + 1]), in position order; every row reads its own slots and
 * nothing else, straight from the pool: no gathered copy, no padding, no mask. Grouped-query
 * attention: query head j reads KV head j / group.
 *
 * Per (row, KV head): the scores of the group's query heads over the row's positions,
 * softmax in float32 (max subtracted), then the values weighted. head_dim 64 (SmolLM2's, and
 * most small models') has its own path: eight keys scored at a time with one horizontal pass
 * per eight, a vector exp, the output's 64 sums held in registers; any other multiple of 8
 * goes through the general one (a dot product per key, expf). Rows x KV heads are shared out over an OpenMP team of `threads` (torch's own
 * pool, as in panel_gemm.c).
 *
 * The layer's pool is [2, slots, kv_heads, head_dim] (keys, then values), contiguous.
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

static inline float dot8(const float *a, const float *b, long n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum8(_mm256_add_ps(s0, s1));
}

static void one_head(const float *q, const float *keys, const float *values, long kv_heads,
                     long hd, long group, const long *slots, long n, float scale, float *out,
                     float *scores) {
    /* q: the group's query heads [group, hd]; out likewise; scores: [group, n] */
    for (long i = 0; i < n; i++) {
        const float *k = keys + (slots[i] * kv_heads) * hd;
        for (long g = 0; g < group; g++) scores[g * n + i] = dot8(q + g * hd, k, hd) * scale;
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
            const float *v = values + (slots[i] * kv_heads) * hd;
            __m256 p = _mm256_set1_ps(s[i]);
            for (long d = 0; d < hd; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d),
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

/* one_head for head_dim 64: scores eight keys at a time, one horizontal pass per eight; a
   vector softmax; the output's 64 sums held in registers over the values. */
static void one_head64(const float *q, const float *keys, const float *values, long kv_heads,
                       long group, const long *slots, long n, float scale, float *out,
                       float *scores) {
    const long hd = 64, stride = kv_heads * 64;
    __m256 vscale = _mm256_set1_ps(scale);
    for (long g = 0; g < group; g++) {
        const float *qg = q + g * hd;
        float *s = scores + g * n;
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            const float *k[8];
            for (int j = 0; j < 8; j++) k[j] = keys + slots[i + j] * stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
            __m256 a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps();
            __m256 a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
            for (long c = 0; c < hd; c += 8) {
                __m256 qc = _mm256_loadu_ps(qg + c);
                a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[0] + c), a0);
                a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[1] + c), a1);
                a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[2] + c), a2);
                a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[3] + c), a3);
                a4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[4] + c), a4);
                a5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[5] + c), a5);
                a6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[6] + c), a6);
                a7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[7] + c), a7);
            }
            _mm256_storeu_ps(s + i, _mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7),
                                                  vscale));
        }
        for (; i < n; i++) s[i] = dot8(qg, keys + slots[i] * stride, hd) * scale;
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
        __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps(), o2 = _mm256_setzero_ps();
        __m256 o3 = _mm256_setzero_ps(), o4 = _mm256_setzero_ps(), o5 = _mm256_setzero_ps();
        __m256 o6 = _mm256_setzero_ps(), o7 = _mm256_setzero_ps();
        for (long r = 0; r < n; r++) {
            const float *v = values + slots[r] * stride;
            __m256 p = _mm256_set1_ps(s[r]);
            o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), o0);
            o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), o1);
            o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), o2);
            o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), o3);
            o4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), o4);
            o5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), o5);
            o6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), o6);
            o7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), o7);
        }
        __m256 inv = _mm256_set1_ps(1.0f / total);
        float *o = out + g * hd;
        _mm256_storeu_ps(o, _mm256_mul_ps(o0, inv));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(o1, inv));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(o2, inv));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(o3, inv));
        _mm256_storeu_ps(o + 32, _mm256_mul_ps(o4, inv));
        _mm256_storeu_ps(o + 40, _mm256_mul_ps(o5, inv));
        _mm256_storeu_ps(o + 48, _mm256_mul_ps(o6, inv));
        _mm256_storeu_ps(o + 56, _mm256_mul_ps(o7, inv));
    }
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

/* q, out: [rows, kv_heads * group, hd]; keys, values: [slots, kv_heads, hd]. Returns SK_OK,
   SK_UNSUPPORTED when hd is not a multiple of 8, SK_BAD_SHAPE for counts out of range,
   paged_slots_check's statuses, or SK_NO_MEMORY. */
int paged_decode_attention(const float *q, const float *keys, const float *values, long slots,
                           long kv_heads, long hd, long group, const long *read, long nread,
                           const long *offsets, long rows, float scale, float *out,
                           int threads) {
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
    float *scratch = malloc(sizeof(float) * (size_t)(per * threads));
    if (scratch == NULL) return SK_NO_MEMORY;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; t++) {
        float *scores = scratch + per * omp_get_thread_num();
        long b = t / kv_heads, h = t % kv_heads;
        long n = offsets[b + 1] - offsets[b];
        long head0 = (b * kv_heads + h) * group * hd;
        if (n > 0 && hd == 64) {
            one_head64(q + head0, keys + h * hd, values + h * hd, kv_heads, group,
                       read + offsets[b], n, scale, out + head0, scores);
        } else if (n > 0) {
            one_head(q + head0, keys + h * hd, values + h * hd, kv_heads, hd, group,
                     read + offsets[b], n, scale, out + head0, scores);
        } else {
            for (long i = 0; i < group * hd; i++) out[head0 + i] = 0.0f;
        }
    }
    free(scratch);
    return SK_OK;
}
