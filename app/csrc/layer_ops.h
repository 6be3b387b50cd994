/* A Llama-style layer's elementwise parts, float32 (AVX2 + FMA), shared by the fused decode
   step (decode_step.c) and the fused layers of prefill and mixed passes (prefill_layer.c). */
#ifndef SPLITSERVE_LAYER_OPS_H
#define SPLITSERVE_LAYER_OPS_H

#include <immintrin.h>
#include <math.h>

#include "vec_math.h"

/* A layer's entries in the pointer table of decode_step and mixed_layers (decode_step.c's
   header has what each holds). */
enum {
    IN_NORM,   /* [hidden] */
    QKV,       /* panels of [q; k; v] weights, [heads + 2 kv_heads] * head_dim outputs */
    QKV_BIAS,  /* [q; k; v] bias or NULL */
    O,         /* panels of the output product, hidden outputs */
    O_BIAS,
    POST_NORM, /* [hidden] */
    GATE_UP,   /* panels of [gate; up], 2 * inter outputs */
    GATE_UP_BIAS,
    DOWN,      /* panels of down, hidden outputs */
    DOWN_BIAS,
    QKV_SCALE, /* int8 panels: each product's [outputs] column scales; else NULL */
    O_SCALE,
    GATE_UP_SCALE,
    DOWN_SCALE,
    KEYS,      /* the layer's pool: [slots, kv_heads, head_dim] */
    VALUES,
    LAYER_PTRS
};

/* out[i] = w * (x[i] * rsqrt(mean(x[i]^2) + eps)) for each of m rows of h values. */
static inline void rms_norm(const float *x, long m, long h, const float *w, float eps, float *out) {
    for (long i = 0; i < m; i++) {
        const float *xi = x + i * h;
        float *oi = out + i * h;
        __m256 acc = _mm256_setzero_ps();
        long d = 0;
        for (; d + 8 <= h; d += 8) {
            __m256 v = _mm256_loadu_ps(xi + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum8(acc);
        for (; d < h; d++) sum += xi[d] * xi[d];
        float r = 1.0f / sqrtf(sum / (float)h + eps);
        for (d = 0; d < h; d++) oi[d] = w[d] * (xi[d] * r);
    }
}

/* Rotary embedding in place on `heads` heads of hd values: x * cos + rotate_half(x) * sin. */
static inline void rope(float *x, long heads, long hd, const float *cos, const float *sin) {
    long half = hd / 2;
    for (long h = 0; h < heads; h++) {
        float *v = x + h * hd;
        for (long d = 0; d < half; d++) {
            float a = v[d], b = v[d + half];
            v[d] = a * cos[d] - b * sin[d];
            v[d + half] = b * cos[d + half] + a * sin[d + half];
        }
    }
}

/* act[i] = silu(gate[i]) * up[i] over m rows, gate and up side by side in gu [m, 2 * inter]. */
static inline void silu_mul(const float *gu, long m, long inter, float *act) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (long i = 0; i < m; i++) {
        const float *g = gu + i * 2 * inter, *u = g + inter;
        float *a = act + i * inter;
        long d = 0;
        for (; d + 8 <= inter; d += 8) {
            __m256 gv = _mm256_loadu_ps(g + d);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(a + d, _mm256_mul_ps(s, _mm256_loadu_ps(u + d)));
        }
        for (; d < inter; d++) a[d] = g[d] / (1.0f + expf(-g[d])) * u[d];
    }
}

static inline void add_into(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++) x[i] += y[i];
}

#endif
