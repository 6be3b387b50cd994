/* Every function the engine's CPU kernels export, in one place: each .c file includes this
 * header, and app/cpu_kernels.py reads it to give ctypes the signatures (a declaration here
 * is the binding: one per statement, `type name(arguments);`, pointers of any type are
 * passed as addresses, `long` and `int` as C longs and ints, `float` as a C float).
 *
 * Every entry point that takes indices or counts from the caller checks them before it
 * touches memory and returns one of the statuses below; app/cpu_kernels.py turns a status
 * into an exception naming the argument (sk_status_message). Sizes the kernel cannot see
 * (a buffer's length behind a pointer) are the Python wrappers' to check before they take
 * the pointers.
 */
#ifndef SPLITSERVE_KERNELS_H
#define SPLITSERVE_KERNELS_H

#include <stdint.h>

enum sk_status {
    SK_OK = 0,
    SK_UNSUPPORTED = -1,  /* shapes this kernel does not serve: the caller takes torch's path */
    SK_NO_MEMORY = -2,    /* scratch memory could not be had */
    SK_BAD_SHAPE = -3,    /* a count or width out of range */
    SK_BAD_KIND = -4,     /* an unknown kind of weight (or group), int8 panels without scales */
    SK_NO_ISA = -5,       /* the CPU lacks the instructions this kind of panel needs */
    SK_BAD_WRITE = -6,    /* write: a slot outside the pool */
    SK_BAD_READ = -7,     /* read: a slot outside the pool */
    SK_BAD_OFFSETS = -8,  /* offsets: not rising from 0 to at most the length of read */
    SK_BAD_STARTS = -9,   /* starts: a row's cached positions outside [0, pmax] */
    SK_BAD_SIZE = -10,    /* an element size other than 1 or 2 bytes */
};

/* What a status means, naming the argument at fault. */
const char *sk_status_message(int status);

/* panel_gemm.c: panels of 16 output columns, float32 / bf16 / int8. panel_linear_w's wtype is
 * the kind of weight (panel_gemm.c's W_*) plus, for int8 pair panels (W_I8DP) with a scale per
 * group of k instead of per column, the group's length times I8_GROUP_SHIFT's power of two,
 * I8_OFFSETS where each group has an offset too, I8_HALF where its scales (and offsets) are
 * float16. */
#define I8_HALF 0x40
#define I8_OFFSETS 0x80
#define I8_GROUP_SHIFT 8
#define I8_MAX_GROUP 512
long panel_nr(void);
long panel_floats(long n, long k);
void panel_pack(const float *w, long ldw, long n, long k, float *p);
int panel_pack_bytes(const void *w, long ldw, long n, long k, void *p, long size);
int panel_avx2_only(void);
int panel_limit_avx2(int on);
int panel_has_avx512(void);
int panel_set_avx512(int on);
int panel_uses_avx512(void);
void panel_linear(const float *x, long m, long k, const float *p, long n, const float *bias,
                  float *y, int threads);
int panel_linear_w(const float *x, long m, long k, const void *p, int wtype,
                   const float *scale, long n, const float *bias, float *y, int threads);

/* panel_bf16dp.c: bf16 pair panels through vdpbf16ps (and the pair packing of both kinds) */
int panel_has_avx512bf16(void);
long panel_pair_elems(long n, long k);
void panel_pack_pairs(const uint16_t *w, long ldw, long n, long k, uint16_t *p);
void panel_pack_pairs_i8(const int8_t *w, long ldw, long n, long k, int8_t *p);
int linear_bf16dp(const float *x, long m, long k, const uint16_t *p, long n, const float *bias,
                  float *y, int threads);

/* panel_i8dp.c: int8 pair panels through vpdpwssd */
int panel_has_avx512vnni(void);
int linear_i8dp(const float *x, long m, long k, const int8_t *p, long n, const float *bias,
                const void *scale, long group, int offsets, int half, float *y, int threads);

/* paged_attention.c: decode attention read in place from the paged pool */
int paged_decode_attention(const float *q, const void *keys, const void *values, long slots,
                           long kv_heads, long hd, long group, const long *read, long nread,
                           const long *offsets, long rows, float scale, float *out,
                           int threads, int kv_bf16);
int paged_slots_check(const long *write, long rows, const long *read, long nread,
                      const long *offsets, long slots);

/* decode_step.c: a whole decode step of a Llama-style model */
long decode_step_layer_ptrs(void);
int decode_step(float *hidden, long m, long n_layers, void *const *ptrs, long hsize,
                long heads, long kv_heads, long hd, long inter, const float *cos,
                const float *sin, float eps, float scale, const long *write, const long *read,
                long nread, const long *offsets, long slots, const float *final_norm,
                const float *head, const float *head_bias, long vocab, float *logits,
                int threads, int wtype, const float *head_scale, int kv_bf16);

int kv_store_rows(const float *k, const float *v, long n, long src_row, long src_head,
                  long kv_heads, long hd, const long *slots, long nslots, void *dst_k,
                  void *dst_v, long dst_slot, long dst_head, int bf);

/* prefill_layer.c: a Llama-style layer of a prefill or mixed pass, around its attention */
int layer_qkv(const float *hidden, long m, long hsize, const float *norm_w, float eps,
              const void *qkv_panels, int wtype, const float *qkv_scale, const float *qkv_bias,
              long heads, long kv_heads, long hd, const float *cos, const float *sin,
              float *xn, float *qkv, int threads);
int layer_mlp(float *hidden, long m, long hsize, const float *att, long nq, const void *o,
              const float *o_scale, const float *o_bias, const float *post_norm, float eps,
              const void *gate_up, const float *gate_up_scale, const float *gate_up_bias,
              long inter, const void *down, const float *down_scale, const float *down_bias,
              int wtype, float *scratch, int threads);
int mixed_layers(float *hidden, long m, long first, long n_layers, void *const *ptrs,
                 long hsize, long heads, long kv_heads, long hd, long inter, const float *cos,
                 const float *sin, float eps, float scale, long rows, const long *write,
                 const long *read, long nread, const long *offsets, long slots, int kv_bf16,
                 long chunks, const long *lens, const long *pasts, const long *rooms,
                 float *const *into, int attn_bf16, int wtype, float *xn, float *qkv,
                 float *att, float *scratch, int threads);

/* prefill_attention.c: causal attention of a pass's new tokens over their past */
int prefill_attention_args(const float *q, const float *k, const float *v, const float *out,
                           long batch, long heads, long kv_heads, long s, long t, long d,
                           const long *starts, long pmax, int threads);
int prefill_attention(const float *q, long qsb, long qsh, long qss,
                      const float *k, long ksb, long ksh, long kss,
                      const float *v, long vsb, long vsh, long vss,
                      float *out, long osb, long osh, long oss,
                      long batch, long heads, long kv_heads, long s, long t, long d,
                      const long *starts, long pmax, float scale, int threads);

/* prefill_attention_bf16.c: the same with bf16 products (AVX512-BF16; SK_NO_ISA without) */
int prefill_attention_bf16(const float *q, long qsb, long qsh, long qss,
                           const float *k, long ksb, long ksh, long kss,
                           const float *v, long vsb, long vsh, long vss,
                           float *out, long osb, long osh, long oss,
                           long batch, long heads, long kv_heads, long s, long t, long d,
                           const long *starts, long pmax, float scale, int threads);

#endif
