/* Y = X W^T + b for a float32 linear layer whose weight is stored in panels (x86-64, AVX2 + FMA).
 *
 * Layout: the weight W [N, K] (nn.Linear's [out, in]) is copied once into panels of NR = 16
 * output columns, P[N/16][K][16]: one panel is a contiguous strip the kernel streams from the
 * first byte to the last, and the last panel is padded with zeros when N is not a multiple
 * of 16. A micro-kernel holds up to 6 input rows x 16 columns of sums in 12 AVX registers and,
 * per k, loads 16 weights once and uses them for every row: the weights are read from memory
 * once per product whatever the number of rows (rows are taken 48 at a time, and with more
 * rows than that the panels go in groups of ~128 KiB, each group kept in cache while every
 * block of rows passes through it). A one-row product (a lone stream's
 * decode step) reads four panels side by side, four streams from memory in flight instead of
 * one: it took a batch-1 step of SmolLM2 from about 82 to 69 ms here.
 *
 * Every output is one running sum over k in order (one FMA per k, then the bias), in every
 * path, so a row's result does not depend on which other rows share the product or on how
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
#include <string.h>

#define NR 16
#define MR 6
#define MB 48
#define GROUP_BYTES (128L * 1024)
#define PF_DIST 256 /* floats: 1 KiB ahead of the panel being read */

long panel_nr(void) { return NR; }

long panel_floats(long n, long k) { return ((n + NR - 1) / NR) * k * NR; }

/* W [N, K] row-major (row stride ldw) into P [ceil(N/16)][K][16], zero padded. */
void panel_pack(const float *w, long ldw, long n, long k, float *p) {
    long panels = (n + NR - 1) / NR;
    for (long q = 0; q < panels; q++) {
        float *dst = p + q * k * NR;
        for (long j = 0; j < NR; j++) {
            long row = q * NR + j;
            if (row < n) {
                const float *src = w + row * ldw;
                for (long kk = 0; kk < k; kk++) dst[kk * NR + j] = src[kk];
            } else {
                for (long kk = 0; kk < k; kk++) dst[kk * NR + j] = 0.0f;
            }
        }
    }
}

/* mr (1..6) rows of x (row stride ldx) times one panel; 16 sums per row into y (stride ldy). */
static inline __attribute__((always_inline)) void micro(
    int mr, long k, const float *pan, const float *x, long ldx, float *y, long ldy,
    const float *bias16) {
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
    __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
    __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    __m256 a40 = _mm256_setzero_ps(), a41 = _mm256_setzero_ps();
    __m256 a50 = _mm256_setzero_ps(), a51 = _mm256_setzero_ps();
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx;
    const float *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
    for (long kk = 0; kk < k; kk++) {
        const float *w = pan + kk * NR;
        _mm_prefetch((const char *)(w + PF_DIST), _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), b;
        b = _mm256_broadcast_ss(x0 + kk);
        a00 = _mm256_fmadd_ps(b, w0, a00);
        a01 = _mm256_fmadd_ps(b, w1, a01);
        if (mr > 1) {
            b = _mm256_broadcast_ss(x1 + kk);
            a10 = _mm256_fmadd_ps(b, w0, a10);
            a11 = _mm256_fmadd_ps(b, w1, a11);
        }
        if (mr > 2) {
            b = _mm256_broadcast_ss(x2 + kk);
            a20 = _mm256_fmadd_ps(b, w0, a20);
            a21 = _mm256_fmadd_ps(b, w1, a21);
        }
        if (mr > 3) {
            b = _mm256_broadcast_ss(x3 + kk);
            a30 = _mm256_fmadd_ps(b, w0, a30);
            a31 = _mm256_fmadd_ps(b, w1, a31);
        }
        if (mr > 4) {
            b = _mm256_broadcast_ss(x4 + kk);
            a40 = _mm256_fmadd_ps(b, w0, a40);
            a41 = _mm256_fmadd_ps(b, w1, a41);
        }
        if (mr > 5) {
            b = _mm256_broadcast_ss(x5 + kk);
            a50 = _mm256_fmadd_ps(b, w0, a50);
            a51 = _mm256_fmadd_ps(b, w1, a51);
        }
    }
    __m256 c0 = _mm256_loadu_ps(bias16), c1 = _mm256_loadu_ps(bias16 + 8);
#define STORE(i, A0, A1)                                               \
    do {                                                               \
        _mm256_storeu_ps(y + (i) * ldy, _mm256_add_ps(A0, c0));        \
        _mm256_storeu_ps(y + (i) * ldy + 8, _mm256_add_ps(A1, c1));    \
    } while (0)
    STORE(0, a00, a01);
    if (mr > 1) STORE(1, a10, a11);
    if (mr > 2) STORE(2, a20, a21);
    if (mr > 3) STORE(3, a30, a31);
    if (mr > 4) STORE(4, a40, a41);
    if (mr > 5) STORE(5, a50, a51);
#undef STORE
}

#define MICRO(m)                                                                         \
    static void micro##m(long k, const float *pan, const float *x, long ldx, float *y,    \
                         long ldy, const float *bias16) {                                \
        micro(m, k, pan, x, ldx, y, ldy, bias16);                                        \
    }
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)
MICRO(5)
MICRO(6)
typedef void (*micro_fn)(long, const float *, const float *, long, float *, long, const float *);
static const micro_fn MICROS[MR + 1] = {0, micro1, micro2, micro3, micro4, micro5, micro6};

/* One row times four panels at once: four weight streams in flight instead of one. */
static void row4(long k, const float *pan, const float *x, float *y, const float *bias64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps();
    __m256 a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
    const float *p0 = pan, *p1 = pan + k * NR, *p2 = pan + 2 * k * NR, *p3 = pan + 3 * k * NR;
    for (long kk = 0; kk < k; kk++) {
        long o = kk * NR;
        __m256 b = _mm256_broadcast_ss(x + kk);
        a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p0 + o), a0);
        a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p0 + o + 8), a1);
        a2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p1 + o), a2);
        a3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p1 + o + 8), a3);
        a4 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p2 + o), a4);
        a5 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p2 + o + 8), a5);
        a6 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p3 + o), a6);
        a7 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p3 + o + 8), a7);
    }
    _mm256_storeu_ps(y, _mm256_add_ps(a0, _mm256_loadu_ps(bias64)));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(a1, _mm256_loadu_ps(bias64 + 8)));
    _mm256_storeu_ps(y + 16, _mm256_add_ps(a2, _mm256_loadu_ps(bias64 + 16)));
    _mm256_storeu_ps(y + 24, _mm256_add_ps(a3, _mm256_loadu_ps(bias64 + 24)));
    _mm256_storeu_ps(y + 32, _mm256_add_ps(a4, _mm256_loadu_ps(bias64 + 32)));
    _mm256_storeu_ps(y + 40, _mm256_add_ps(a5, _mm256_loadu_ps(bias64 + 40)));
    _mm256_storeu_ps(y + 48, _mm256_add_ps(a6, _mm256_loadu_ps(bias64 + 48)));
    _mm256_storeu_ps(y + 56, _mm256_add_ps(a7, _mm256_loadu_ps(bias64 + 56)));
}

/* Panels [q0, q1) of the product, every row. */
static void run_panels(const float *x, long m, long k, const float *p, long n, const float *bias,
                       float *y, long q0, long q1) {
    float tile[MR * NR];
    float b16[NR];
    if (m == 1) { /* whole groups of four panels, all columns real */
        float b64[4 * NR];
        while (q0 + 4 <= q1 && (q0 + 4) * NR <= n) {
            for (long j = 0; j < 4 * NR; j++) b64[j] = bias ? bias[q0 * NR + j] : 0.0f;
            row4(k, p + q0 * k * NR, x, y + q0 * NR, b64);
            q0 += 4;
        }
    }
    /* More rows than one block: panels in groups of about GROUP_BYTES, every block of rows
       through a group before the next, so each weight comes from memory once (the group
       stays in L2) and the inputs are what is read again (from cache). */
    long group = m <= MB ? q1 - q0 : GROUP_BYTES / (k * NR * (long)sizeof(float));
    if (group < 1) group = 1;
    for (long g0 = q0; g0 < q1; g0 += group) {
        long g1 = g0 + group < q1 ? g0 + group : q1;
        for (long mb = 0; mb < m; mb += MB) {
            long me = mb + MB < m ? mb + MB : m;
            for (long q = g0; q < g1; q++) {
                const float *pan = p + q * k * NR;
                long cols = n - q * NR < NR ? n - q * NR : NR;
                for (long j = 0; j < NR; j++)
                    b16[j] = (bias && j < cols) ? bias[q * NR + j] : 0.0f;
                for (long m0 = mb; m0 < me; m0 += MR) {
                    int mr = (int)(me - m0 < MR ? me - m0 : MR);
                    const float *xr = x + m0 * k;
                    if (cols == NR) {
                        MICROS[mr](k, pan, xr, k, y + m0 * n + q * NR, n, b16);
                    } else { /* the padded last panel: through a tile, then its real columns */
                        MICROS[mr](k, pan, xr, k, tile, NR, b16);
                        for (int i = 0; i < mr; i++)
                            memcpy(y + (m0 + i) * n + q * NR, tile + i * NR,
                                   cols * sizeof(float));
                    }
                }
            }
        }
    }
}

/* y [m, n] = x [m, k] @ W^T + bias, with W packed by panel_pack. x and y are contiguous.
   threads > 1: the panels are split between the threads of an OpenMP team. */
void panel_linear(const float *x, long m, long k, const float *p, long n, const float *bias,
                  float *y, int threads) {
    long panels = (n + NR - 1) / NR;
    if (threads > panels) threads = (int)panels;
    /* a product under ~64k multiply-adds is over before another thread could help */
    if (threads <= 1 || m * n * k < 65536) {
        run_panels(x, m, k, p, n, bias, y, 0, panels);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        long t = omp_get_thread_num(), team = omp_get_num_threads();
        long q0 = panels * t / team, q1 = panels * (t + 1) / team;
        if (q1 > q0) run_panels(x, m, k, p, n, bias, y, q0, q1);
    }
}
