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
 * whole layer). Threads (an OpenMP team: torch's pool, as the products use):
 *   - from ROW_SPLIT rows on, each call is ONE parallel region over blocks of rows: a
 *     thread takes a block and runs the whole call on it (norm, its own one-thread
 *     products, rotary embedding or SiLU and the sums), blocks taken as threads come free.
 *     Two regions a layer instead of nine: every region's start and end is a wait for
 *     the slowest thread, and a wake-up of a sleeping one (libgomp sleeps its workers
 *     almost at once when a process has more pool threads than cores, as a replica has).
 *     Each thread reads the layer's weights itself; from ROW_SPLIT rows on a block reuses
 *     each weight over enough rows that the products stay bound by arithmetic.
 *   - below it, the products share their panels out over the team (panel_gemm.c), and the
 *     elementwise parts their rows from PARALLEL_ROWS rows on; fewer on the calling thread.
 */
#include <omp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "layer_ops.h"

#define PARALLEL_ROWS 32 /* fewer rows: the elementwise parts run on the calling thread */
#define ROW_SPLIT 64      /* from here on: one region a call, over blocks of rows */

/* Blocks of rows for a row-split call: two a thread once each has 128 rows or more (so a
   thread whose core is shared leaves the other at most half a share to wait for), else one
   a thread. */
static long row_blocks(long m, int threads) {
    return m >= 128L * threads ? 2L * threads : threads;
}

/* Each block [r0, r1) of m rows through fn(ctx, r0, r1) on the team, blocks taken as threads
   come free; a failing block's status (SK_OK when none fails). */
typedef int (*rows_fn)(const void *ctx, long r0, long r1);
static int over_row_blocks(rows_fn fn, const void *ctx, long m, int threads) {
    long blocks = row_blocks(m, threads), per = (m + blocks - 1) / blocks;
    int status = SK_OK;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long b = 0; b < blocks; b++) {
        long r0 = b * per, r1 = r0 + per < m ? r0 + per : m;
        int rc = r0 < r1 ? fn(ctx, r0, r1) : SK_OK;
        if (rc != SK_OK) {
#pragma omp atomic write
            status = rc;
        }
    }
    return status;
}

struct qkv_job {
    const float *hidden, *norm_w, *scale, *bias, *cos, *sin;
    const void *panels;
    float *xn, *qkv;
    long hsize, heads, kv_heads, hd;
    float eps;
    int wtype;
};

/* layer_qkv on rows [r0, r1): products on `threads` threads, elementwise parts on `team`. */
static int qkv_rows(const struct qkv_job *j, long r0, long r1, int threads, int team) {
    long m = r1 - r0, hs = j->hsize, hd = j->hd, nq = j->heads * hd;
    long nqkv = nq + 2 * j->kv_heads * hd;
    const float *hidden = j->hidden + r0 * hs;
    float *xn = j->xn + r0 * hs, *qkv = j->qkv + r0 * nqkv;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (long i = 0; i < m; i++) rms_norm(hidden + i * hs, 1, hs, j->norm_w, j->eps, xn + i * hs);
    int rc = panel_linear_w(xn, m, hs, j->panels, j->wtype, j->scale, nqkv, j->bias, qkv,
                            threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (long i = 0; i < m; i++) {
        float *row = qkv + i * nqkv;
        const float *c = j->cos + (r0 + i) * hd, *s = j->sin + (r0 + i) * hd;
        rope(row, j->heads, hd, c, s);
        rope(row + nq, j->kv_heads, hd, c, s);
    }
    return SK_OK;
}

static int qkv_block(const void *ctx, long r0, long r1) { return qkv_rows(ctx, r0, r1, 1, 1); }

int layer_qkv(const float *hidden, long m, long hsize, const float *norm_w, float eps,
              const void *qkv_panels, int wtype, const float *qkv_scale, const float *qkv_bias,
              long heads, long kv_heads, long hd, const float *cos, const float *sin,
              float *xn, float *qkv, int threads) {
    if (m < 1 || hsize < 1 || heads < 1 || kv_heads < 1 || hd < 2 || hd % 2 || threads < 1
        || hidden == NULL || norm_w == NULL || qkv_panels == NULL || cos == NULL
        || sin == NULL || xn == NULL || qkv == NULL)
        return SK_BAD_SHAPE;
    struct qkv_job j = {hidden, norm_w, qkv_scale, qkv_bias, cos, sin, qkv_panels, xn, qkv,
                        hsize, heads, kv_heads, hd, eps, wtype};
    if (m >= ROW_SPLIT && threads > 1) return over_row_blocks(qkv_block, &j, m, threads);
    return qkv_rows(&j, 0, m, threads, m >= PARALLEL_ROWS ? threads : 1);
}

struct mlp_job {
    float *hidden, *tmp, *wide, *act;
    const float *att, *o_scale, *o_bias, *post_norm, *gu_scale, *gu_bias, *down_scale,
        *down_bias;
    const void *o, *gate_up, *down;
    long hsize, nq, inter;
    float eps;
    int wtype;
};

/* layer_mlp on rows [r0, r1): products on `threads` threads, elementwise parts on `team`. */
static int mlp_rows(const struct mlp_job *j, long r0, long r1, int threads, int team) {
    long m = r1 - r0, hs = j->hsize, inter = j->inter;
    float *hidden = j->hidden + r0 * hs, *tmp = j->tmp + r0 * hs;
    float *wide = j->wide + r0 * 2 * inter, *act = j->act + r0 * inter;
    int rc = panel_linear_w(j->att + r0 * j->nq, m, j->nq, j->o, j->wtype, j->o_scale, hs,
                            j->o_bias, tmp, threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (long i = 0; i < m; i++) {
        float *h = hidden + i * hs, *t = tmp + i * hs;
        add_into(h, t, hs);
        rms_norm(h, 1, hs, j->post_norm, j->eps, t); /* the row's sum is read: t is free */
    }
    rc = panel_linear_w(tmp, m, hs, j->gate_up, j->wtype, j->gu_scale, 2 * inter, j->gu_bias,
                        wide, threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (long i = 0; i < m; i++) silu_mul(wide + i * 2 * inter, 1, inter, act + i * inter);
    rc = panel_linear_w(act, m, inter, j->down, j->wtype, j->down_scale, hs, j->down_bias,
                        tmp, threads);
    if (rc != SK_OK) return rc;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (long i = 0; i < m; i++) add_into(hidden + i * hs, tmp + i * hs, hs);
    return SK_OK;
}

static int mlp_block(const void *ctx, long r0, long r1) { return mlp_rows(ctx, r0, r1, 1, 1); }

int layer_mlp(float *hidden, long m, long hsize, const float *att, long nq, const void *o,
              const float *o_scale, const float *o_bias, const float *post_norm, float eps,
              const void *gate_up, const float *gate_up_scale, const float *gate_up_bias,
              long inter, const void *down, const float *down_scale, const float *down_bias,
              int wtype, float *scratch, int threads) {
    if (m < 1 || hsize < 1 || nq < 1 || inter < 1 || threads < 1 || hidden == NULL
        || att == NULL || o == NULL || post_norm == NULL || gate_up == NULL || down == NULL
        || scratch == NULL)
        return SK_BAD_SHAPE;
    /* scratch: m * (hsize + 3 * inter) floats: tmp [m, hsize], wide [m, 2 inter], act */
    struct mlp_job j = {hidden, scratch, scratch + m * hsize, scratch + m * (hsize + 2 * inter),
                        att, o_scale, o_bias, post_norm, gate_up_scale, gate_up_bias,
                        down_scale, down_bias, o, gate_up, down, hsize, nq, inter, eps, wtype};
    if (m >= ROW_SPLIT && threads > 1) return over_row_blocks(mlp_block, &j, m, threads);
    return mlp_rows(&j, 0, m, threads, m >= PARALLEL_ROWS ? threads : 1);
}

/* Layers [first, first + n_layers) of a mixed or prefill pass in one call: the decode rows
 * and prompt chunks of app.attention.MixedStep (a prefill pass: chunks only, a row each),
 * each chunk written into its prompt's KV so far (`into`), as the Python layer loop
 * (app.fused_layers.FusedLayers.layer, the cache views and the attention groups) runs them,
 * call for call: layer_qkv; the decode rows' keys and values into their pool slots and each
 * chunk's into its prompt's KV (kv_store_rows); the decode rows' attention over the pool in
 * place (paged_decode_attention); each chunk's over its past and itself (prefill_attention,
 * or prefill_attention_bf16 where attn_bf16); layer_mlp. The same kernels in the same
 * order, so the pass's values are the loop's, bit for bit; what goes is the loop's Python
 * between them (about 0.6 ms a layer, during which the OpenMP team waits).
 *
 * hidden [m, hsize] (updated in place), m = rows + the chunks' lengths, decode rows first;
 * ptrs: decode_step.c's per-layer table from layer 0 (the pool pointers read only when
 * rows > 0); write/read/offsets/slots/kv_bf16: the decode rows' slots, as decode_step;
 * chunk c: lens[c] tokens at positions pasts[c].., its prompt's KV at into[c], float32
 * [layers][2][kv_heads][rooms[c]][hd], positions [0, pasts[c]) filled. xn [m, hsize],
 * qkv [m, nq + 2 nkv], att [m, nq], scratch [m, hsize + 3 inter]: the caller's buffers. */
int mixed_layers(float *hidden, long m, long first, long n_layers, void *const *ptrs,
                 long hsize, long heads, long kv_heads, long hd, long inter, const float *cos,
                 const float *sin, float eps, float scale, long rows, const long *write,
                 const long *read, long nread, const long *offsets, long slots, int kv_bf16,
                 long chunks, const long *lens, const long *pasts, const long *rooms,
                 float *const *into, int attn_bf16, int wtype, float *xn, float *qkv,
                 float *att, float *scratch, int threads) {
    if (m < 1 || first < 0 || n_layers < 0 || rows < 0 || chunks < 0 || heads < 1
        || kv_heads < 1 || heads % kv_heads || hd < 1 || threads < 1 || ptrs == NULL
        || xn == NULL || qkv == NULL || att == NULL || scratch == NULL
        || (chunks > 0 && (lens == NULL || pasts == NULL || rooms == NULL || into == NULL)))
        return SK_BAD_SHAPE;
    long total = rows;
    for (long c = 0; c < chunks; c++) {
        if (lens[c] < 1 || pasts[c] < 0 || pasts[c] + lens[c] > rooms[c] || into[c] == NULL)
            return SK_BAD_SHAPE;
        total += lens[c];
    }
    if (total != m) return SK_BAD_SHAPE;
    if (rows > 0) {
        int status = paged_slots_check(write, rows, read, nread, offsets, slots);
        if (status != SK_OK) return status;
    }
    long nq = heads * hd, nkv = kv_heads * hd, nqkv = nq + 2 * nkv;
    float *q = rows > 0 ? malloc(sizeof(float) * (size_t)(rows * nq)) : NULL;
    if (rows > 0 && q == NULL) return SK_NO_MEMORY;
    int rc = SK_OK;
    for (long l = first; l < first + n_layers && rc == SK_OK; l++) {
        void *const *w = ptrs + l * LAYER_PTRS;
        rc = layer_qkv(hidden, m, hsize, w[IN_NORM], eps, w[QKV], wtype, w[QKV_SCALE],
                       w[QKV_BIAS], heads, kv_heads, hd, cos, sin, xn, qkv, threads);
        if (rc == SK_OK && rows > 0)
            rc = kv_store_rows(qkv + nq, qkv + nq + nkv, rows, nqkv, hd, kv_heads, hd, write,
                               slots, w[KEYS], w[VALUES], nkv, hd, kv_bf16);
        for (long c = 0, at = rows; c < chunks && rc == SK_OK; at += lens[c], c++) {
            float *keys = into[c] + l * 2 * nkv * rooms[c] + pasts[c] * hd;
            rc = kv_store_rows(qkv + at * nqkv + nq, qkv + at * nqkv + nq + nkv, lens[c], nqkv,
                               hd, kv_heads, hd, NULL, rooms[c] - pasts[c], keys,
                               keys + nkv * rooms[c], hd, rooms[c] * hd, 0);
        }
        if (rc == SK_OK && rows > 0) {
            for (long b = 0; b < rows; b++) memcpy(q + b * nq, qkv + b * nqkv, sizeof(float) * nq);
            rc = paged_decode_attention(q, w[KEYS], w[VALUES], slots, kv_heads, hd,
                                        heads / kv_heads, read, nread, offsets, rows, scale,
                                        att, threads, kv_bf16);
        }
        for (long c = 0, at = rows; c < chunks && rc == SK_OK; at += lens[c], c++) {
            const float *keys = into[c] + l * 2 * nkv * rooms[c], *values = keys + nkv * rooms[c];
            long t = pasts[c] + lens[c];
            rc = (attn_bf16 ? prefill_attention_bf16 : prefill_attention)(
                qkv + at * nqkv, 0, hd, nqkv, keys, 0, rooms[c] * hd, hd, values, 0,
                rooms[c] * hd, hd, att + at * nq, 0, hd, nq, 1, heads, kv_heads, lens[c], t,
                hd, pasts + c, pasts[c], scale, threads);
        }
        if (rc == SK_OK)
            rc = layer_mlp(hidden, m, hsize, att, nq, w[O], w[O_SCALE], w[O_BIAS],
                           w[POST_NORM], eps, w[GATE_UP], w[GATE_UP_SCALE], w[GATE_UP_BIAS],
                           inter, w[DOWN], w[DOWN_SCALE], w[DOWN_BIAS], wtype, scratch, threads);
    }
    free(q);
    return rc;
}
