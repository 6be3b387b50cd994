/* A whole decode step of a Llama-style decoder in one call (x86-64, AVX2 + FMA, float32).
 *
 * Every layer of a decode step is a dozen small operations on a handful of rows: RMSNorm,
 * the q/k/v product, rotary embedding, the KV write, attention, the output product, the
 * residual, RMSNorm again, gate/up, SiLU, down, the residual. Through the model's Python
 * modules that is hundreds of torch calls a step, each a few microseconds of dispatch, and
 * on one core those microseconds are the step's time beyond reading the weights. Here the
 * whole stack runs in C, the products through panel_gemm.c and attention through
 * paged_attention.c, so a step costs what its arithmetic and memory traffic cost.
 *
 * The arithmetic is the model's: RMSNorm as Llama's (x * rsqrt(mean(x^2) + eps), then the
 * weight), rotary embedding as Hugging Face's rotate_half form over the cos/sin the model's
 * own rotary module computed for each row's position (so any rope scaling it implements
 * holds), SiLU(gate) * up, the residual sums. Sums run in another order than torch's, so
 * values differ from the model's in the last bits, as the panel kernel's products do.
 *
 * Per layer, the caller passes LAYER_PTRS pointers (see the enum): the norms' weights, the
 * panels (float32, bf16 or int8, one kind for the whole model: wtype, as panel_linear_w) of q/k/v side by side (one product for all three: the 192-wide k and v products
 * alone stream too little to reach the memory's speed), the output product's, gate/up side
 * by side, down, any biases (NULL when absent), int8 panels' column scales, and the layer's KV pool (keys, values:
 * [slots, kv_heads, head_dim] each, float32 or (kv_bf16) bf16, rounded to nearest even as
 * torch rounds a float32 tensor to bf16). Row b writes its new key and value at write[b] and
 * attends the slots read[offsets[b] .. offsets[b + 1]) (its own, in position order,
 * the new one last). Those indices are checked against the pool's `slots` and read's
 * `nread` entries before anything is written (paged_slots_check).
 *
 * Threads: the whole step is one OpenMP parallel region. The threads share every product's
 * panels in chunks claimed from a counter of its own by whichever thread comes free, large
 * first and small last (panel_linear_claim), and attention's (row, KV head) tasks one at a
 * time (paged_decode_attention_claim): every output is the same chain of sums as on one
 * thread, so a step's values depend neither on its thread count nor on who computed what.
 * They split the rows of the elementwise parts and meet at a barrier between the parts
 * (nine a layer). Served, the serving stack takes an engine thread's core hundreds of times
 * a second; with equal shares the other thread then waited at the next barrier (15% of a
 * replica's samples, in libgomp's spin), where with chunks it takes the chunks left. A
 * region per product, the elementwise parts on the calling thread between them, made two
 * threads slower than one.
 *
 * Built at run time by app/cpu_kernels.py with the other kernels.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "layer_ops.h"

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

long decode_step_layer_ptrs(void) { return LAYER_PTRS; }

/* n float32 values into the pool at dst: as they are, or (bf) rounded to bf16, nearest
   even (a NaN as torch's, 0x7fc0), as torch's float32 -> bfloat16 conversion rounds. */
static void store_kv(void *dst, const float *src, long n, int bf) {
    if (!bf) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *out = dst;
    for (long i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            out[i] = 0x7fc0u; /* torch's NaN */
        else
            out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

struct step {
    float *hidden, *xn, *tmp, *q, *att, *wide, *act, *logits;
    void *const *ptrs;
    const float *cos, *sin, *final_norm, *head, *head_bias, *head_scale;
    const long *write, *read, *offsets;
    long *next; /* a zeroed counter for each product and attention of the step, in order */
    long m, n_layers, hsize, heads, kv_heads, hd, inter, nread, slots, vocab;
    float eps, scale;
    int wtype, kv_bf16, team, err;
};

#define CLAIMS_PER_LAYER 5 /* the counters a layer uses: q/k/v, attention, O, gate/up, down */

/* A product's chunks are whole tiles of the kernels' for m rows (panel_bf16dp.c: 4 panels
   side by side up to 6 rows, else 3; panel_i8dp.c: 8 up to 2 rows). */
static long tile_panels(long m) { return m <= 2 ? 8 : m <= 6 ? 4 : 3; }

/* A part's failure, kept for the step's status (the team goes on through every barrier). */
static void fail(struct step *s, int rc) {
    if (rc != SK_OK) __atomic_store_n(&s->err, rc, __ATOMIC_RELAXED);
}

/* This thread's chunks of one of layer w's products (its panels, bias and scales), claimed
   from the layer's counter i. */
#define PART(in, k, P, n, out, i)                                                              \
    fail(s, panel_linear_claim(in, s->m, k, w[P], s->wtype, w[P##_SCALE], n, w[P##_BIAS], out, \
                               next + i, tile_panels(s->m), s->team))

/* Layer l for this thread (its rows [r0, r1) of the elementwise parts). */
static void step_layer(struct step *s, long l, long r0, long r1) {
    void *const *w = s->ptrs + l * LAYER_PTRS;
    long *next = s->next + l * CLAIMS_PER_LAYER;
    long hs = s->hsize, hd = s->hd, inter = s->inter, nq = s->heads * hd;
    long nkv = s->kv_heads * hd, nqkv = nq + 2 * nkv, es = s->kv_bf16 ? 2 : 4;
    char *keys = w[KEYS], *values = w[VALUES];
    rms_norm(s->hidden + r0 * hs, r1 - r0, hs, w[IN_NORM], s->eps, s->xn + r0 * hs);
#pragma omp barrier
    PART(s->xn, hs, QKV, nqkv, s->wide, 0);
#pragma omp barrier
    for (long b = r0; b < r1; b++) {
        float *row = s->wide + b * nqkv;
        rope(row, s->heads, hd, s->cos + b * hd, s->sin + b * hd);
        rope(row + nq, s->kv_heads, hd, s->cos + b * hd, s->sin + b * hd);
        memcpy(s->q + b * nq, row, sizeof(float) * nq);
        store_kv(keys + s->write[b] * nkv * es, row + nq, nkv, s->kv_bf16);
        store_kv(values + s->write[b] * nkv * es, row + nq + nkv, nkv, s->kv_bf16);
    }
#pragma omp barrier
    fail(s, paged_decode_attention_claim(s->q, keys, values, s->slots, s->kv_heads, hd,
                                         s->heads / s->kv_heads, s->read, s->nread,
                                         s->offsets, s->m, s->scale, s->att, s->kv_bf16,
                                         next + 1));
#pragma omp barrier
    PART(s->att, nq, O, hs, s->tmp, 2);
#pragma omp barrier
    add_into(s->hidden + r0 * hs, s->tmp + r0 * hs, (r1 - r0) * hs);
    rms_norm(s->hidden + r0 * hs, r1 - r0, hs, w[POST_NORM], s->eps, s->xn + r0 * hs);
#pragma omp barrier
    PART(s->xn, hs, GATE_UP, 2 * inter, s->wide, 3);
#pragma omp barrier
    silu_mul(s->wide + r0 * 2 * inter, r1 - r0, inter, s->act + r0 * inter);
#pragma omp barrier
    PART(s->act, inter, DOWN, hs, s->tmp, 4);
#pragma omp barrier
    add_into(s->hidden + r0 * hs, s->tmp + r0 * hs, (r1 - r0) * hs);
}
#undef PART

/* The whole step for thread t of `team`: every layer, then the final norm and the head's
   product where there is a head. Every thread passes every barrier, whatever fails. */
static void step_thread(struct step *s, int t, int team) {
    long m = s->m, hs = s->hsize, r0 = m * t / team, r1 = m * (t + 1) / team;
#pragma omp single
    s->team = team; /* what the team got (a barrier ends the single) */
    for (long l = 0; l < s->n_layers; l++) step_layer(s, l, r0, r1);
    if (s->head == NULL) return;
    rms_norm(s->hidden + r0 * hs, r1 - r0, hs, s->final_norm, s->eps, s->xn + r0 * hs);
#pragma omp barrier
    fail(s, panel_linear_claim(s->xn, m, hs, s->head, s->wtype, s->head_scale, s->vocab,
                               s->head_bias, s->logits, s->next + s->n_layers * CLAIMS_PER_LAYER,
                               tile_panels(m), team));
}

/* hidden [m, H] (updated in place) through n_layers layers; then, when head is not NULL,
   the final norm and the LM head's product into logits [m, vocab]. cos, sin: [m, hd].
   Returns SK_OK; SK_UNSUPPORTED for a head_dim the kernels do not take; SK_BAD_SHAPE for
   counts out of range; paged_slots_check's statuses (nothing written); SK_NO_MEMORY; or a
   product's or attention's own status. */
int decode_step(float *hidden, long m, long n_layers, void *const *ptrs, long hsize,
                long heads, long kv_heads, long hd, long inter, const float *cos,
                const float *sin, float eps, float scale, const long *write, const long *read,
                long nread, const long *offsets, long slots, const float *final_norm,
                const float *head, const float *head_bias, long vocab, float *logits,
                int threads, int wtype, const float *head_scale, int kv_bf16) {
    if (m < 1 || n_layers < 0 || hsize < 1 || inter < 1 || heads < 1 || kv_heads < 1
        || heads % kv_heads != 0 || hd < 1 || vocab < 1 || threads < 1 || ptrs == NULL
        || hidden == NULL || cos == NULL || sin == NULL || write == NULL)
        return SK_BAD_SHAPE;
    if (hd % 8 != 0) return SK_UNSUPPORTED;
    int status = paged_slots_check(write, m, read, nread, offsets, slots);
    if (status != SK_OK) return status;
    long nq = heads * hd, nkv = kv_heads * hd, nqkv = nq + 2 * nkv;
    long widest = nqkv > 2 * inter ? nqkv : 2 * inter;
    float *scratch = malloc(sizeof(float) * (size_t)(m * (2 * hsize + 2 * nq + widest + inter)));
    long *next = calloc((size_t)(n_layers * CLAIMS_PER_LAYER + 1), sizeof(long));
    if (scratch == NULL || next == NULL) {
        free(scratch);
        free(next);
        return SK_NO_MEMORY;
    }
    struct step s = {hidden, scratch, scratch + m * hsize, scratch + 2 * m * hsize, NULL, NULL,
                     NULL, logits, ptrs, cos, sin, final_norm, head, head_bias, head_scale,
                     write, read, offsets, next, m, n_layers, hsize, heads, kv_heads, hd,
                     inter, nread, slots, vocab, eps, scale, wtype, kv_bf16, 1, SK_OK};
    s.att = s.q + m * nq;
    s.wide = s.att + m * nq;
    s.act = s.wide + m * widest;
#pragma omp parallel num_threads(threads) if (threads > 1)
    step_thread(&s, omp_get_thread_num(), omp_get_num_threads());
    free(scratch);
    free(next);
    return s.err;
}
