/* Decode attention read in place from the paged KV pool (x86-64, AVX2 + FMA, float32).
 *
 * One query token per row. Row b's keys and values are at the pool slots
 * read[offsets[b] .. offsets[b + 1]), in position order; every row reads its own slots and
 * nothing else, straight from the pool: no gathered copy, no padding, no mask. Grouped-query
 * attention: query head j reads KV head j / group.
 *
 * Per (row, KV head): the scores of the group's query heads over the row's positions (each
 * key loaded once for the group), softmax in float32 (max subtracted, expf), then the values
 * weighted. Rows x KV heads are shared out over an OpenMP team of `threads` (torch's own
 * pool, as in panel_gemm.c).
 *
 * The layer's pool is [2, slots, kv_heads, head_dim] (keys, then values), contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

static inline float dot8(const float *a, const float *b, long n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
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

/* q, out: [rows, kv_heads * group, hd]. Returns 0, or -1 when hd is not a multiple of 8, -2
   when scratch memory cannot be had. */
int paged_decode_attention(const float *q, const float *keys, const float *values,
                           long kv_heads, long hd, long group, const long *read,
                           const long *offsets, long rows, float scale, float *out,
                           int threads) {
    if (hd % 8 != 0) return -1;
    long longest = 0;
    for (long b = 0; b < rows; b++) {
        long n = offsets[b + 1] - offsets[b];
        longest = n > longest ? n : longest;
    }
    long tasks = rows * kv_heads;
    if (threads < 1 || tasks * longest < 4096) threads = 1;
    long per = group * (longest > 0 ? longest : 1);
    float *scratch = malloc(sizeof(float) * (size_t)(per * threads));
    if (scratch == NULL) return -2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; t++) {
        float *scores = scratch + per * omp_get_thread_num();
        long b = t / kv_heads, h = t % kv_heads;
        long n = offsets[b + 1] - offsets[b];
        long head0 = (b * kv_heads + h) * group * hd;
        if (n > 0) {
            one_head(q + head0, keys + h * hd, values + h * hd, kv_heads, hd, group,
                     read + offsets[b], n, scale, out + head0, scores);
        } else {
            for (long i = 0; i < group * hd; i++) out[head0 + i] = 0.0f;
        }
    }
    free(scratch);
    return 0;
}
