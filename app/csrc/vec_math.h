/* Small vector helpers shared by the engine's CPU kernels (AVX2 + FMA, float32; the
   AVX-512 ones carry their own target attribute). */
#ifndef SPLITSERVE_VEC_MATH_H
#define SPLITSERVE_VEC_MATH_H

#include <immintrin.h>

/* dst[0, width) = src's columns [from, from + cols), then zeros (all zeros where src is NULL):
   a tile's bias or column scales, set up once a tile. Plain loads of src's own floats and
   plain stores: the loop `bias && j < cols ? bias[j] : 0` it replaces was vectorised with
   masked loads, and the masked loads through a NULL bias (every lane off) cost an AMD core
   about a thousand cycles a tile (presumably a microcode assist); memset's `rep stos` costs
   tens. SmolLM2's bf16 prefill products spent 8% of their time in that set-up. */
static inline void column_slice(float *dst, const float *src, long from, long cols,
                                long width) {
    long j = 0;
    if (src != NULL) {
        const float *s = src + from;
        for (; j + 8 <= cols; j += 8) _mm256_storeu_ps(dst + j, _mm256_loadu_ps(s + j));
        for (; j < cols; j++) dst[j] = s[j];
    }
    for (; j + 8 <= width; j += 8) _mm256_storeu_ps(dst + j, _mm256_setzero_ps());
    for (; j < width; j++) dst[j] = 0.0f;
}

/* column_slice's columns [from, from + width) where no copy is needed: src's own floats
   where all width of them are real columns, a static row of zeros where src is NULL (width
   at most 256), else column_slice's copy in dst. A tile's bias or scales, per tile: the
   copy's loops (turned into a call to memset by the compiler) cost a bf16 prefill pass
   about 1% of its time. */
static const float COLUMN_ZEROS[256] __attribute__((aligned(64), unused));
static inline const float *column_view(float *dst, const float *src, long from, long cols,
                                       long width) {
    if (src == NULL && width <= 256) return COLUMN_ZEROS;
    if (src != NULL && cols == width) return src + from;
    column_slice(dst, src, from, cols, width);
    return dst;
}

/* exp of 8 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), as in the
   widely used avx_mathfun; relative error about 2e-7 over the softmax's range (x <= 0). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    __m256 xx = _mm256_mul_ps(x, x);
    y = _mm256_fmadd_ps(y, xx, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx),
                                                   _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* exp8 in zmm (AVX-512, for the kernels' paths chosen at run time). */
static inline __attribute__((always_inline, target("avx512f"))) __m512 exp16(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    __m512 xx = _mm512_mul_ps(x, x);
    y = _mm512_fmadd_ps(y, xx, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx),
                                                   _mm512_set1_epi32(0x7f)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* 2^x of 16 floats for x <= 0 (AVX-512): x = n + f with n an integer and |f| <= 1/2, 2^f by
   a degree-5 polynomial (relative error about 2e-7 in float32, as exp16's), times 2^n by
   vscalefps, which underflows to zero past -149 without a clamp. Ten instructions where
   exp16 takes eighteen: the softmax of prefill attention's bf16 pass uses it with the
   scores pre-multiplied by log2(e). x = -inf gives NaN (f = -inf - -inf): callers mask
   such lanes out. */
static inline __attribute__((always_inline, target("avx512f"))) __m512 exp2_16_poly(
    __m512 x, int degree) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n), y;
    if (degree == 3) { /* relative error 7.5e-5 */
        y = _mm512_set1_ps(5.5171609e-2f);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4261111e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9326097e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.9992806e-1f));
    } else {
        y = _mm512_set1_ps(1.3266970636e-3f);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6754599362e-3f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5507425219e-2f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022121727e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314694405e-1f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001192f));
    }
    return _mm512_scalef_ps(y, n);
}
static inline __attribute__((always_inline, target("avx512f"))) __m512 exp2_16(__m512 x) {
    return exp2_16_poly(x, 5);
}
/* The same with a degree-3 polynomial (relative error 7.5e-5), two instructions fewer: for
   values rounded to bf16 next (8 significant bits, a relative error up to 2^-9). */
static inline __attribute__((always_inline, target("avx512f"))) __m512 exp2_16_d3(__m512 x) {
    return exp2_16_poly(x, 3);
}

/* The sum of a vector's eight lanes. */
static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The largest of a vector's eight lanes. */
static inline float hmax8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

#endif
