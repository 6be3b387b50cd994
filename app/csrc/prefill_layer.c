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
 * whole layer). The elementwise parts share the rows out over the kernels' team (pool.h,
 * as the products do) once the pass has enough rows to pay for waking it.
 */
#include <stddef.h>

#include "kernels.h"
#include "layer_ops.h"
#include "pool.h"

#define PARALLEL_ROWS 32 /* fewer rows: the elementwise parts run on the calling thread */
#define ROW_TASKS 4      /* tasks a thread for the elementwise parts */

enum row_op { NORM, ROPE, ADD_NORM, SILU_MUL, ADD };

/* One elementwise part over rows: its operands (those `op` reads) and the rows a task. */
struct rows_job {
    enum row_op op;
    float *a, *b, *c;
    const float *w, *cos, *sin;
    float eps;
    long m, width, inter, heads, kv_heads, hd, nq, rows;
};

static void rows_task(void *ctx, long task, int worker) {
    const struct rows_job *j = ctx;
    long i1 = (task + 1) * j->rows < j->m ? (task + 1) * j->rows : j->m, hd = j->hd;
    (void)worker;
    for (long i = task * j->rows; i < i1; i++) {
        switch (j->op) {
        case NORM: rms_norm(j->a + i * j->width, 1, j->width, j->w, j->eps, j->b + i * j->width);
            break;
        case ROPE:
            rope(j->a + i * j->width, j->heads, hd, j->cos + i * hd, j->sin + i * hd);
            rope(j->a + i * j->width + j->nq, j->kv_heads, hd, j->cos + i * hd, j->sin + i * hd);
            break;
        case ADD_NORM: /* the row's sum is read: b is free */
            add_into(j->a + i * j->width, j->b + i * j->width, j->width);
            rms_norm(j->a + i * j->width, 1, j->width, j->w, j->eps, j->b + i * j->width);
            break;
        case SILU_MUL: silu_mul(j->a + i * 2 * j->inter, 1, j->inter, j->b + i * j->inter);
            break;
        case ADD: add_into(j->a + i * j->width, j->b + i * j->width, j->width); break;
        }
    }
}

/* `job`'s part over its m rows: on `team` threads, ROW_TASKS tasks each. */
static void rows_run(struct rows_job *job, int team) {
    long tasks = team > 1 ? (long)team * ROW_TASKS : 1;
    job->rows = (job->m + tasks - 1) / tasks;
    sk_parallel((job->m + job->rows - 1) / job->rows, rows_task, job, team);
}

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
    struct rows_job norm = {.op = NORM, .a = (float *)hidden, .b = xn, .w = norm_w, .eps = eps,
                            .m = m, .width = hsize};
    rows_run(&norm, team);
    int rc = panel_linear_w(xn, m, hsize, qkv_panels, wtype, qkv_scale, nqkv, qkv_bias, qkv,
                            threads);
    if (rc != SK_OK) return rc;
    struct rows_job rot = {.op = ROPE, .a = qkv, .cos = cos, .sin = sin, .m = m,
                           .width = nqkv, .heads = heads, .kv_heads = kv_heads, .hd = hd,
                           .nq = nq};
    rows_run(&rot, team);
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
    struct rows_job add_norm = {.op = ADD_NORM, .a = hidden, .b = tmp, .w = post_norm,
                                .eps = eps, .m = m, .width = hsize};
    rows_run(&add_norm, team);
    rc = panel_linear_w(tmp, m, hsize, gate_up, wtype, gate_up_scale, 2 * inter, gate_up_bias,
                        wide, threads);
    if (rc != SK_OK) return rc;
    struct rows_job gate = {.op = SILU_MUL, .a = wide, .b = act, .m = m, .inter = inter};
    rows_run(&gate, team);
    rc = panel_linear_w(act, m, inter, down, wtype, down_scale, hsize, down_bias, tmp, threads);
    if (rc != SK_OK) return rc;
    struct rows_job add = {.op = ADD, .a = hidden, .b = tmp, .m = m, .width = hsize};
    rows_run(&add, team);
    return SK_OK;
}
