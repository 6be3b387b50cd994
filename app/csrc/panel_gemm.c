/* Y = X W^T + b for a linear layer whose weight is stored in panels (x86-64, AVX2 + FMA;
 * products of four rows or more through AVX-512 tiles where the CPU has it, see below).
 *
 * Weights: float32, bf16 or int8 (per output column scale), each widened to float32 in
 * registers; inputs, sums and outputs are float32 in every kind (panel_body.h holds the
 * kernels, compiled once per kind). A decode step reads its weights from memory, so bf16
 * panels halve its bytes and int8 quarter them; the arithmetic is the same float FMAs, on
 * AVX2 and AVX-512 alike. An int8 product is computed as sum_k x[k] * q[k] and then
 * multiplied by its column's scale and the bias added (one pass over the outputs).
 *
 * Layout: the weight W [N, K] (nn.Linear's [out, in]) is copied once into panels of NR = 16
 * output columns, P[N/16][K][16]: one panel is a contiguous strip the kernel streams from the
 * first byte to the last, and the last panel is padded with zeros when N is not a multiple
 * of 16. A micro-kernel holds up to 6 input rows x 16 columns of sums in 12 AVX registers and,
 * per k, loads 16 weights once and uses them for every row: the weights are read from memory
 * once per product whatever the number of rows (rows are taken 48 at a time, and with more
 * rows than that the panels go in groups of ~128 KiB, each group kept in cache while every
 * block of rows passes through it). The rows a block of six leaves over (a decode batch of
 * 1-5, 7-11, ...) go through tiles of one to three rows over several panels side by side:
 * a lone stream's product reads four panels at once, four streams from memory in flight
 * instead of one (it took a batch-1 step of SmolLM2 from about 82 to 69 ms here), and two
 * leftover rows over two panels hold eight sums in flight, where alone on one panel their
 * four could not hide the FMA's latency (two rows: 40-44 ms instead of 44-51 for the 30
 * layers' products on one thread).
 *
 * A prefill-sized product (more than 48 rows, k over KC) also takes k in slices of at most
 * KC = 256, each block of six rows passing through a panel's slice (16 KiB, in L1) before
 * the next slice, the sums kept in y between slices: 1024-row products at k = 576 ran 9-12%
 * faster on one AVX2 core of an AMD EPYC (79 -> 86-88 G FLOP/s; k = 1,536 unchanged).
 *
 * At 8 rows on this project's machine (a 2-core AMD EPYC VM, ~2 GHz) the products are
 * bound by arithmetic more than by memory: 6 rows x 16 columns reach about 32 G
 * multiply-adds/s with the weights in cache, so the 30 layers' 135M weights times 8 rows
 * take ~34 ms of FMAs where reading them takes ~28.
 *
 * Every output is one running sum over k in order (one FMA per k, then the bias; for int8
 * the scale first), in every path and kind, so a row's result does not depend on which other rows share the product or on how
 * the work is split between threads: a row computes bit for bit the same alone or in any
 * batch.
 *
 * Threads: panel_linear(.., threads > 1) splits the panels between the threads of an OpenMP
 * team. The library is linked against libgomp by SONAME and loaded after torch, so it runs on
 * the very runtime and thread pool torch's own operators use (torch ships libgomp.so.1):
 * no second pool competing for the cores between the products.
 *
 * Built at run time by app/cpu_kernels.py (cc -O3 -mavx2 -mfma -fopenmp -shared); no torch
 * headers.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#define NR 16
#define MR 6
#define MB 48
#define GROUP_BYTES (128L * 1024)
#define PF_BYTES 1024 /* prefetch this far ahead of the panel being read */
#define KC 256        /* k per slice of a prefill-sized product (run_panels_sliced) */
#define MR5 12        /* rows per AVX-512 tile */

/* The kinds of weight a panel holds (panel_linear_w's wtype; app/cpu_kernels.py's WTYPES). */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_BF16DP = 3, W_I8DP = 4 };

const char *sk_status_message(int status) {
    switch (status) {
    case SK_OK: return "ok";
    case SK_UNSUPPORTED: return "shapes this kernel does not serve (torch's path serves them)";
    case SK_NO_MEMORY: return "scratch memory could not be had";
    case SK_BAD_SHAPE: return "a count or width out of range (rows, k, n, heads, head_dim, "
                              "threads, an int8 group of k) or a required pointer is NULL";
    case SK_BAD_KIND: return "wtype: an unknown kind of weight, a group on another kind than "
                             "int8 pairs, or int8 panels without scales";
    case SK_NO_ISA: return "wtype: the CPU lacks the instructions this kind of panel needs";
    case SK_BAD_WRITE: return "write: a slot outside the pool";
    case SK_BAD_READ: return "read: a slot outside the pool";
    case SK_BAD_OFFSETS: return "offsets: not rising from 0 to at most the length of read";
    case SK_BAD_STARTS: return "starts: a row's cached positions outside [0, pmax]";
    case SK_BAD_SIZE: return "size: an element size other than 1 or 2 bytes";
    default: return "unknown status";
    }
}

long panel_nr(void) { return NR; }

/* Elements (of any kind) in the panels of an [n, k] weight. */
long panel_floats(long n, long k) { return ((n + NR - 1) / NR) * k * NR; }

/* W [N, K] row-major (row stride ldw) into P [ceil(N/16)][K][16], zero padded; elements of
   `size` bytes (4: float, 2: bf16, 1: int8), copied as they are. bf16 columns go in the
   order 0, 8, 1, 9, .. 7, 15 (slot BF16_SLOT(j)): each 32-bit word of a k's 16 holds
   columns j and j + 8, so one load, a shift and a mask widen all 16 (W8X2). */
#define BF16_SLOT(j) ((j) < 8 ? 2 * (j) : 2 * ((j) - 8) + 1)
static void pack_any(const char *w, long ldw, long n, long k, char *p, size_t size) {
    long panels = (n + NR - 1) / NR;
    for (long q = 0; q < panels; q++) {
        char *dst = p + (size_t)(q * k * NR) * size;
        for (long j = 0; j < NR; j++) {
            long row = q * NR + j, slot = size == 2 ? BF16_SLOT(j) : j;
            for (long kk = 0; kk < k; kk++) {
                char *d = dst + (size_t)(kk * NR + slot) * size;
                if (row < n) memcpy(d, w + (size_t)(row * ldw + kk) * size, size);
                else memset(d, 0, size);
            }
        }
    }
}

void panel_pack(const float *w, long ldw, long n, long k, float *p) {
    pack_any((const char *)w, ldw, n, k, (char *)p, sizeof(float));
}

/* panel_pack for 2-byte (bf16) or 1-byte (int8) weights. Returns SK_OK, or SK_BAD_SIZE. */
int panel_pack_bytes(const void *w, long ldw, long n, long k, void *p, long size) {
    if (size != 2 && size != 1) return SK_BAD_SIZE;
    pack_any(w, ldw, n, k, p, (size_t)size);
    return 0;
}

/* Which path products take: 1 = AVX-512 where the CPU has it, 0 = AVX2 only (set by
   panel_set_avx512, for a test or a comparison); -1 until decided, at the first product.
   Read and written atomically: prefill lanes run products on several threads at once. */
static int use512 = -1;

/* 1 while the kernels are kept to AVX2 and FMA (panel_limit_avx2): every AVX-512 path, the
   bf16 and VNNI dot products included, reports absent, as on a CPU without AVX-512. */
static int avx2_only = 0;

int panel_avx2_only(void) { return __atomic_load_n(&avx2_only, __ATOMIC_RELAXED); }

/* on: 1 keeps every kernel to AVX2 (for a test, or to measure an AVX2-only CPU's paths on
   one with AVX-512), 0 lets each take what the CPU has again. Returns the setting. */
int panel_limit_avx2(int on) {
    __atomic_store_n(&avx2_only, on ? 1 : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&use512, -1, __ATOMIC_RELAXED); /* decided again at the next product */
    return on ? 1 : 0;
}

int panel_has_avx512(void) {
    __builtin_cpu_init();
    return !panel_avx2_only() && __builtin_cpu_supports("avx512f");
}

/* on: 1 uses AVX-512 where the CPU has it, 0 keeps to AVX2. Returns the path now in force. */
int panel_set_avx512(int on) {
    int value = on && panel_has_avx512();
    __atomic_store_n(&use512, value, __ATOMIC_RELAXED);
    return value;
}

/* The path in force (deciding it, AVX-512 where the CPU has it, if no product has yet). */
int panel_uses_avx512(void) {
    int value = __atomic_load_n(&use512, __ATOMIC_RELAXED);
    return value < 0 ? panel_set_avx512(1) : value;
}

/* y[i][j] = y[i][j] * scale[j] + bias[j] over rows [0, m), columns [j0, j1) (int8 panels). */
static void scale_cols(float *y, long m, long n, const float *scale, const float *bias,
                       long j0, long j1) {
    for (long i = 0; i < m; i++) {
        float *row = y + i * n;
        for (long j = j0; j < j1; j++) row[j] = row[j] * scale[j] + (bias ? bias[j] : 0.0f);
    }
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define N(name) CAT(name, SFX)

/* NEXT_EVERY: a lone row's tile (tile1x4) prefetches the next four panels towards L2, a
   line of each every NEXT_EVERY k (64 bytes: 4 k of int8); 0: none (float32, whose four
   streams already read as fast as the core reads memory; bf16, which gained 0-3%) */
#define WT float
#define SFX f32
#define NEXT_EVERY 0
#define W8(p) _mm256_loadu_ps(p)
#define W8X2(p, w0, w1) (w0 = W8(p), w1 = W8((p) + 8))
#define W16(p) _mm512_loadu_ps(p)
#include "panel_body.h"

/* bf16 is float32's upper half. A k's 16 weights are 8 words of (column j, column j + 8)
   (pack_any): a shift moves columns 0-7 into the words' high halves, a mask keeps 8-15
   there; the zmm form takes the words in both halves, shifts the low half and masks both.
   (Against widening each half by vpmovzxwd and a shift: 8 rows through SmolLM2's products
   0.87x the time on the AVX2 path, one row no change; the zmm form no change either.) */
#define WT uint16_t
#define SFX bf16
#define NEXT_EVERY 0
#define BF16_HIGH(v) _mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u))
#define W8X2(p, w0, w1)                                                                 \
    (w0 = _mm256_castsi256_ps(_mm256_slli_epi32(                                        \
         _mm256_loadu_si256((const __m256i *)(p)), 16)),                                \
     w1 = _mm256_castsi256_ps(BF16_HIGH(_mm256_loadu_si256((const __m256i *)(p)))))
#define W16(p) _mm512_castsi512_ps(_mm512_and_si512(                                   \
    _mm512_sllv_epi32(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p))), \
                      _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0,                          \
                                       16, 16, 16, 16, 16, 16, 16, 16)),                \
    _mm512_set1_epi32((int)0xFFFF0000u)))
#include "panel_body.h"
#undef BF16_HIGH

#define WT int8_t
#define SFX i8
#define NEXT_EVERY 4
#define W8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define W8X2(p, w0, w1) (w0 = W8(p), w1 = W8((p) + 8))
#define W16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#include "panel_body.h"

/* y [m, n] = x [m, k] @ W^T + bias, W packed by panel_pack (float32). x and y contiguous. */
void panel_linear(const float *x, long m, long k, const float *p, long n, const float *bias,
                  float *y, int threads) {
    linear_f32(x, m, k, p, n, bias, NULL, y, threads);
}

/* The same for any kind of panels (wtype: W_F32, W_BF16 or W_I8 packed here, W_BF16DP by
   panel_pack_pairs, W_I8DP by panel_pack_pairs_i8, which may carry a group of k in its upper
   bits, I8_OFFSETS and I8_HALF (kernels.h); scale: int8's [n] column scales, or grouped
   int8's as linear_i8dp takes them, else ignored). Returns SK_OK; SK_BAD_SHAPE (m < 0, k or
   n < 1, threads < 1, a NULL x, p or y); SK_BAD_KIND (an unknown wtype, a group, offsets or
   float16 scales on another kind than W_I8DP, int8 panels without scales); or
   linear_bf16dp's / linear_i8dp's own status. */
int panel_linear_w(const float *x, long m, long k, const void *p, int wtype,
                   const float *scale, long n, const float *bias, float *y, int threads) {
    if (m < 0 || k < 1 || n < 1 || threads < 1) return SK_BAD_SHAPE;
    long group = wtype >> I8_GROUP_SHIFT;
    wtype -= (int)(group << I8_GROUP_SHIFT);
    int offsets = (wtype & I8_OFFSETS) != 0, half = (wtype & I8_HALF) != 0;
    wtype &= ~(I8_OFFSETS | I8_HALF);
    if (wtype < W_F32 || wtype > W_I8DP || ((group || offsets || half) && wtype != W_I8DP))
        return SK_BAD_KIND;
    if ((wtype == W_I8 || wtype == W_I8DP) && scale == NULL) return SK_BAD_KIND;
    if (m == 0) return SK_OK;
    if (x == NULL || p == NULL || y == NULL) return SK_BAD_SHAPE;
    switch (wtype) {
    case W_F32: linear_f32(x, m, k, p, n, bias, NULL, y, threads); return SK_OK;
    case W_BF16: linear_bf16(x, m, k, p, n, bias, NULL, y, threads); return SK_OK;
    case W_I8: linear_i8(x, m, k, p, n, bias, scale, y, threads); return SK_OK;
    case W_BF16DP: return linear_bf16dp(x, m, k, p, n, bias, y, threads);
    default: return linear_i8dp(x, m, k, p, n, bias, scale, group, offsets, half, y, threads);
    }
}
