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
 * Per layer, the caller passes LAYER_PTRS pointers (the enum in layer_ops.h): the norms' weights, the
 * panels (float32, bf16 or int8, one kind for the whole model: wtype, as panel_linear_w) of q/k/v side by side (one product for all three: the 192-wide k and v products
 * alone stream too little to reach the memory's speed), the output product's, gate/up side
 * by side, down, any biases (NULL when absent), int8 panels' column scales, and the layer's KV pool (keys, values:
 * [slots, kv_heads, head_dim] each, float32 or (kv_bf16) bf16, rounded to nearest even as
 * torch rounds a float32 tensor to bf16). Row b writes its new key and value at write[b] and
 * attends the slots read[offsets[b] .. offsets[b + 1]) (its own, in position order,
 * the new one last). Those indices are checked against the pool's `slots` and read's
 * `nread` entries before anything is written (paged_slots_check).
 *
 * Built at run time by app/cpu_kernels.py with the other kernels.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "layer_ops.h"


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

/* A pass's rows' keys and values into a KV pool or a prompt's KV so far, as torch's
   indexed copies would write them, in one call a layer (those copies cost a mixed pass
   about 0.4 ms a layer, a page-faulting copy each). Row i (0 <= i < n) of the source: its
   keys at k + i * src_row, head h src_head further on, hd float32 each; its values likewise
   at v. They go to slot s = slots[i] (slots not NULL) or i, at dst_k / dst_v + s * dst_slot
   + h * dst_head elements, float32 or (bf) rounded to bf16 as store_kv rounds. `nslots`:
   the slots the destination holds; a slot outside [0, nslots) writes nothing (SK_BAD_WRITE,
   every slot checked first). */
int kv_store_rows(const float *k, const float *v, long n, long src_row, long src_head,
                  long kv_heads, long hd, const long *slots, long nslots, void *dst_k,
                  void *dst_v, long dst_slot, long dst_head, int bf) {
    if (n < 0 || kv_heads < 1 || hd < 1 || nslots < 0 || src_row < 0 || src_head < 0
        || dst_slot < 0 || dst_head < 0 || (n > 0 && (k == NULL || v == NULL || dst_k == NULL
                                                       || dst_v == NULL)))
        return SK_BAD_SHAPE;
    for (long i = 0; i < n; i++) {
        long s = slots != NULL ? slots[i] : i;
        if (s < 0 || s >= nslots) return SK_BAD_WRITE;
    }
    long es = bf ? 2 : 4;
    for (long i = 0; i < n; i++) {
        long s = slots != NULL ? slots[i] : i;
        for (long h = 0; h < kv_heads; h++) {
            long at = (s * dst_slot + h * dst_head) * es, from = i * src_row + h * src_head;
            store_kv((char *)dst_k + at, k + from, hd, bf);
            store_kv((char *)dst_v + at, v + from, hd, bf);
        }
    }
    return SK_OK;
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
    if (scratch == NULL) return SK_NO_MEMORY;
    float *xn = scratch, *tmp = xn + m * hsize, *q = tmp + m * hsize, *att = q + m * nq;
    float *wide = att + m * nq, *act = wide + m * widest;
    int rc = 0;
/* one of the layer's products: its panels, bias and scales from the table */
#define LINEAR(in, k, P, n, out)                                                               \
    panel_linear_w(in, m, k, w[P], wtype, w[P##_SCALE], n, w[P##_BIAS], out, threads)
    for (long l = 0; l < n_layers && rc == 0; l++) {
        void *const *w = ptrs + l * LAYER_PTRS;
        char *keys = w[KEYS], *values = w[VALUES];
        long es = kv_bf16 ? 2 : 4; /* the pool's element size */
        rms_norm(hidden, m, hsize, w[IN_NORM], eps, xn);
        rc = LINEAR(xn, hsize, QKV, nqkv, wide);
        if (rc != 0) break;
        for (long b = 0; b < m; b++) {
            float *row = wide + b * nqkv;
            rope(row, heads, hd, cos + b * hd, sin + b * hd);
            rope(row + nq, kv_heads, hd, cos + b * hd, sin + b * hd);
            memcpy(q + b * nq, row, sizeof(float) * nq);
            store_kv(keys + write[b] * nkv * es, row + nq, nkv, kv_bf16);
            store_kv(values + write[b] * nkv * es, row + nq + nkv, nkv, kv_bf16);
        }
        rc = paged_decode_attention(q, keys, values, slots, kv_heads, hd, heads / kv_heads,
                                    read, nread, offsets, m, scale, att, threads, kv_bf16);
        if (rc != SK_OK) break;
        rc = LINEAR(att, nq, O, hsize, tmp);
        add_into(hidden, tmp, m * hsize);
        rms_norm(hidden, m, hsize, w[POST_NORM], eps, xn);
        rc = rc ? rc : LINEAR(xn, hsize, GATE_UP, 2 * inter, wide);
        silu_mul(wide, m, inter, act);
        rc = rc ? rc : LINEAR(act, inter, DOWN, hsize, tmp);
        add_into(hidden, tmp, m * hsize);
    }
    if (rc == 0 && head != NULL) {
        rms_norm(hidden, m, hsize, final_norm, eps, xn);
        rc = panel_linear_w(xn, m, hsize, head, wtype, head_scale, vocab, head_bias, logits,
                            threads);
    }
#undef LINEAR
    free(scratch);
    return rc;
}
