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
 * [slots, kv_heads, head_dim] each). Row b writes its new key and value at write[b] and
 * attends the slots read[offsets[b] .. offsets[b + 1]) (its own, in position order,
 * the new one last). Those indices are checked against the pool's `slots` and read's
 * `nread` entries before anything is written (paged_slots_check).
 *
 * Threads: the whole step is one parallel region. Each thread computes its share of every
 * product's panels (its own one-thread product over those panels: every output the same
 * chain of sums as on one thread) and its share of the rows of the elementwise parts and
 * attention, and the threads meet at a spinning barrier between the parts (eight a layer).
 * As a parallel region per product, a step of SmolLM2 was ~150 regions, each a futex
 * wake-up where libgomp has put its workers to sleep (a process with more OpenMP pool
 * threads than cores, as a replica is), and two threads were slower than one.
 *
 * Built at run time by app/cpu_kernels.py with the other kernels.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
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

#define SPINS 4096 /* a barrier's pauses before it yields the core (a thread held up) */

struct barrier { int count, sense; };

/* All n threads of the step meet here; `sense` is the calling thread's own flag. */
static void barrier_wait(struct barrier *b, int *sense, int n) {
    if (n == 1) return;
    int s = !*sense;
    *sense = s;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == n) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, s, __ATOMIC_RELEASE);
        return;
    }
    for (long spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != s; spins++) {
        if (spins < SPINS) _mm_pause();
        else sched_yield();
    }
}

/* Bytes of one 16-column panel of a k-wide weight of kind wtype (panel_linear_w's). */
static long panel_bytes(int wtype, long k) {
    long nr = panel_nr();
    switch (wtype) {
    case 0: return panel_floats(nr, k) * 4;     /* float32 */
    case 1: return panel_floats(nr, k) * 2;     /* bf16, widened */
    case 2: return panel_floats(nr, k);         /* int8 */
    case 3: return panel_pair_elems(nr, k) * 2; /* bf16 pairs */
    default: return panel_pair_elems(nr, k);    /* int8 pairs */
    }
}

struct step {
    float *hidden, *xn, *tmp, *q, *att, *wide, *act, *ys;
    void *const *ptrs;
    const float *cos, *sin;
    const long *write, *read, *offsets;
    long *offs; /* each thread's rows' offsets from 0 (thread t's at offs + r0 + t) */
    long m, n_layers, hsize, heads, kv_heads, hd, inter, nread, slots, share;
    float eps, scale;
    int wtype, threads, err;
    struct barrier bar;
};

/* Thread t's share of y [m, n] = x W^T + b (panels p, column scales, bias): its panels'
   columns, through its scratch rows when the step has several threads and rows. */
static int share_linear(const struct step *s, int t, const float *x, long k, const void *p,
                        const float *scale, const float *bias, long n, float *y) {
    long nr = panel_nr(), panels = (n + nr - 1) / nr, m = s->m;
    long c0 = panels * t / s->threads * nr, c1 = panels * (t + 1) / s->threads * nr;
    if (c1 > n) c1 = n;
    if (c1 <= c0) return SK_OK;
    long w = c1 - c0;
    const char *pp = (const char *)p + c0 / nr * panel_bytes(s->wtype, k);
    float *out = (m == 1 || w == n) ? y + c0 : s->ys + t * m * s->share;
    int rc = panel_linear_w(x, m, k, pp, s->wtype, scale ? scale + c0 : NULL, w,
                            bias ? bias + c0 : NULL, out, 1);
    if (rc != SK_OK || out == y + c0) return rc;
    for (long i = 0; i < m; i++) memcpy(y + i * n + c0, out + i * w, sizeof(float) * w);
    return SK_OK;
}

/* q/k/v, rotary, the KV write and attention of layer w for thread t (rows [r0, r1)). */
static int attend(struct step *s, void *const *w, int t, long r0, long r1, int *sense) {
    long hd = s->hd, nq = s->heads * hd, nkv = s->kv_heads * hd, nqkv = nq + 2 * nkv;
    float *keys = w[KEYS], *values = w[VALUES];
    int rc = share_linear(s, t, s->xn, s->hsize, w[QKV], w[QKV_SCALE], w[QKV_BIAS], nqkv,
                          s->wide);
    barrier_wait(&s->bar, sense, s->threads);
    for (long b = r0; b < r1; b++) {
        float *row = s->wide + b * nqkv;
        rope(row, s->heads, hd, s->cos + b * hd, s->sin + b * hd);
        rope(row + nq, s->kv_heads, hd, s->cos + b * hd, s->sin + b * hd);
        memcpy(s->q + b * nq, row, sizeof(float) * nq);
        memcpy(keys + s->write[b] * nkv, row + nq, sizeof(float) * nkv);
        memcpy(values + s->write[b] * nkv, row + nq + nkv, sizeof(float) * nkv);
    }
    barrier_wait(&s->bar, sense, s->threads); /* every row's new key in the pool */
    if (r1 > r0 && rc == SK_OK) {
        long *offs = s->offs + r0 + t, first = s->offsets[r0];
        for (long b = r0; b <= r1; b++) offs[b - r0] = s->offsets[b] - first;
        rc = paged_decode_attention(s->q + r0 * nq, keys, values, s->slots, s->kv_heads, hd,
                                    s->heads / s->kv_heads, s->read + first,
                                    s->offsets[r1] - first, offs, r1 - r0, s->scale,
                                    s->att + r0 * nq, 1);
    }
    barrier_wait(&s->bar, sense, s->threads);
    return rc;
}

/* Every layer for thread t of the step's threads (`sense`: its barrier flag); a failing
   part's status in s->err. */
static void step_layers(struct step *s, int t, int *sense) {
    long m = s->m, hs = s->hsize, inter = s->inter, nq = s->heads * s->hd;
    long r0 = m * t / s->threads, r1 = m * (t + 1) / s->threads;
    for (long l = 0; l < s->n_layers; l++) {
        void *const *w = s->ptrs + l * LAYER_PTRS;
        rms_norm(s->hidden + r0 * hs, r1 - r0, hs, w[IN_NORM], s->eps, s->xn + r0 * hs);
        barrier_wait(&s->bar, sense, s->threads);
        int rc = attend(s, w, t, r0, r1, sense);
        rc = rc ? rc : share_linear(s, t, s->att, nq, w[O], w[O_SCALE], w[O_BIAS], hs, s->tmp);
        barrier_wait(&s->bar, sense, s->threads);
        add_into(s->hidden + r0 * hs, s->tmp + r0 * hs, (r1 - r0) * hs);
        rms_norm(s->hidden + r0 * hs, r1 - r0, hs, w[POST_NORM], s->eps, s->xn + r0 * hs);
        barrier_wait(&s->bar, sense, s->threads);
        rc = rc ? rc : share_linear(s, t, s->xn, hs, w[GATE_UP], w[GATE_UP_SCALE],
                                    w[GATE_UP_BIAS], 2 * inter, s->wide);
        barrier_wait(&s->bar, sense, s->threads);
        silu_mul(s->wide + r0 * 2 * inter, r1 - r0, inter, s->act + r0 * inter);
        barrier_wait(&s->bar, sense, s->threads);
        rc = rc ? rc : share_linear(s, t, s->act, inter, w[DOWN], w[DOWN_SCALE], w[DOWN_BIAS],
                                    hs, s->tmp);
        barrier_wait(&s->bar, sense, s->threads);
        add_into(s->hidden + r0 * hs, s->tmp + r0 * hs, (r1 - r0) * hs);
        if (rc != SK_OK) __atomic_store_n(&s->err, rc, __ATOMIC_RELAXED);
        barrier_wait(&s->bar, sense, s->threads); /* every thread sees the same err */
        if (__atomic_load_n(&s->err, __ATOMIC_RELAXED) != SK_OK) return;
    }
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
                int threads, int wtype, const float *head_scale) {
    if (m < 1 || n_layers < 0 || hsize < 1 || inter < 1 || heads < 1 || kv_heads < 1
        || heads % kv_heads != 0 || hd < 1 || vocab < 1 || threads < 1 || ptrs == NULL
        || hidden == NULL || cos == NULL || sin == NULL || write == NULL)
        return SK_BAD_SHAPE;
    if (hd % 8 != 0) return SK_UNSUPPORTED;
    int status = paged_slots_check(write, m, read, nread, offsets, slots);
    if (status != SK_OK) return status;
    long nq = heads * hd, nkv = kv_heads * hd, nqkv = nq + 2 * nkv, nr = panel_nr();
    long widest = nqkv > 2 * inter ? nqkv : 2 * inter;
    /* a thread's rows of its share of the widest product, when it has a share (two threads
       or more, whatever the team got) */
    long most = widest > vocab ? widest : vocab;
    long share = threads > 1 ? ((most + nr - 1) / nr + 1) / 2 * nr : 0;
    size_t floats = (size_t)(m * (2 * hsize + 2 * nq + widest + inter + threads * share));
    float *scratch = malloc(sizeof(float) * floats);
    long *offs = malloc(sizeof(long) * (size_t)(m + threads + 1));
    if (scratch == NULL || offs == NULL) {
        free(scratch);
        free(offs);
        return SK_NO_MEMORY;
    }
    struct step s = {hidden, scratch, scratch + m * hsize, scratch + 2 * m * hsize, NULL, NULL,
                     NULL, NULL, ptrs, cos, sin, write, read, offsets, offs, m, n_layers, hsize,
                     heads, kv_heads, hd, inter, nread, slots, share, eps, scale, wtype,
                     threads, SK_OK, {0, 0}};
    s.att = s.q + m * nq;
    s.wide = s.att + m * nq;
    s.act = s.wide + m * widest;
    s.ys = s.act + m * inter;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), sense = 0;
#pragma omp single
        s.threads = omp_get_num_threads(); /* what the team got; a barrier follows */
        step_layers(&s, t, &sense);
        if (s.err == SK_OK && head != NULL) {
            long r0 = m * t / s.threads, r1 = m * (t + 1) / s.threads;
            rms_norm(hidden + r0 * hsize, r1 - r0, hsize, final_norm, eps, s.xn + r0 * hsize);
            barrier_wait(&s.bar, &sense, s.threads);
            int rc = share_linear(&s, t, s.xn, hsize, head, head_scale, head_bias, vocab,
                                  logits);
            if (rc != SK_OK) __atomic_store_n(&s.err, rc, __ATOMIC_RELAXED);
        }
    }
    free(scratch);
    free(offs);
    return s.err;
}
