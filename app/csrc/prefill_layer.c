/* A Llama-style layer of a prefill or mixed pass in two calls around its attention
 * (x86-64, AVX2 + FMA, float32 activations; panels of any kind, as panel_linear_w).
 *
 * Through the model's modules a layer over a pass of hundreds of tokens is a dozen torch
 * operations besides the products: RMSNorm's square, mean, rsqrt and two products, rotary
 * embedding's rotate_half (a negation, a concatenation) and four products, SiLU, the gate
 * times up, two residual sums, each a trip through memory on torch's thread pool. A
 * 1,024-token prefill of SmolLM2 spent about a sixth of its time there, and q/k/v (and gate
 * and up) ran as separate products, the narrow k and v ones at a lower rate. Here:
 *
 *   layer_qkv:  xn = RMSNorm(hidden); qkv = xn @ [q; k; v] (one product, the panels side by
 *               side as the fused decode step lays them); rotary embedding on q and k, in
 *               place, each row at its own position (cos/sin: the model's rotary module's).
 *   (the caller's attention over q, k, v: its cache, masks and kernel stay Python's)
 *   layer_mlp:  hidden += att @ O; xn = RMSNorm(hidden); hidden += down(SiLU(gate) * up),
 *               gate and up one product.
 *
 * The arithmetic is decode_step.c's (layer_ops.h), row by row, so a row's values do not
 * depend on the other rows of the pass (the batch invariance of the products holds for the
 * whole layer). The elementwise parts share the rows out over an OpenMP team (torch's pool,
 * as the products do) once the pass has enough rows to pay for waking it.
 */
#include <omp.h>
#include <stddef.h>

#include "kernels.h"
#include "layer_ops.h"

#define PARALLEL_ROWS 32 /* fewer rows: the elementwise parts run on the calling thread */

int layer_qkv(const float *hidden, long m, long hsize, const float *norm_w, float eps,
              const void *qkv_panels, int wtype, const float *qkv_scale, const float *qkv_bias,
              long heads, long kv_heads, long hd, const float *cos, const float *sin,
              float *xn, float *qkv, int threads) {
    if (m < 1 || hsize < 1 || heads < 1 || kv_heads < 1 || hd < 2 || hd % 2 || threads < 1
        || hidden == NULL || norm_w == NULL || qkv_panels == NULL || cos == NULL
        || sin == NULL || xn == NULL || qkv == NULL)
        return SK_BAD_SHAPE;
    long nq = heads * hd, nkv = kv_heads * hd, nqkv = nq + 2 * nkv;
    int team = m >= PARALLEL_ROWS ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
    for (long i = 0; i < m; i++) rms_norm(hidden + i * hsize, 1, hsize, norm_w, eps, xn + i * hsize);
    int rc = panel_linear_w(xn, m, hsize, qkv_panels, wtype, qkv_scale, nqkv, qkv_bias, qkv,
                            threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static)
    for (long i = 0; i < m; i++) {
        float *row = qkv + i * nqkv;
        rope(row, heads, hd, cos + i * hd, sin + i * hd);
        rope(row + nq, kv_heads, hd, cos + i * hd, sin + i * hd);
    }
    return SK_OK;
}

int layer_mlp(float *hidden, long m, long hsize, const float *att, long nq, const void *o,
              const float *o_scale, const float *o_bias, const float *post_norm, float eps,
              const void *gate_up, const float *gate_up_scale, const float *gate_up_bias,
              long inter, const void *down, const float *down_scale, const float *down_bias,
              int wtype, float *scratch, int threads) {
    if (m < 1 || hsize < 1 || nq < 1 || inter < 1 || threads < 1 || hidden == NULL
        || att == NULL || o == NULL || post_norm == NULL || gate_up == NULL || down == NULL
        || scratch == NULL)
        return SK_BAD_SHAPE;
    /* scratch: m * (hsize + 3 * inter) floats */
    float *tmp = scratch, *wide = tmp + m * hsize, *act = wide + m * 2 * inter;
    int team = m >= PARALLEL_ROWS ? threads : 1;
    int rc = panel_linear_w(att, m, nq, o, wtype, o_scale, hsize, o_bias, tmp, threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static)
    for (long i = 0; i < m; i++) {
        float *h = hidden + i * hsize, *t = tmp + i * hsize;
        add_into(h, t, hsize);
        rms_norm(h, 1, hsize, post_norm, eps, t); /* the row's sum is read: t is free */
    }
    rc = panel_linear_w(tmp, m, hsize, gate_up, wtype, gate_up_scale, 2 * inter, gate_up_bias,
                        wide, threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static)
    for (long i = 0; i < m; i++) silu_mul(wide + i * 2 * inter, 1, inter, act + i * inter);
    rc = panel_linear_w(act, m, inter, down, wtype, down_scale, hsize, down_bias, tmp, threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static)
    for (long i = 0; i < m; i++) add_into(hidden + i * hsize, tmp + i * hsize, hsize);
    return SK_OK;
}
