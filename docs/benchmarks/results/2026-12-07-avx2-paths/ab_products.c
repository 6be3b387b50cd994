#include <dlfcn.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef long (*floats_fn)(long, long);
typedef int (*packb_fn)(const void*, long, long, long, void*, long);
typedef void (*pack_fn)(const float*, long, long, long, float*);
typedef int (*lin_fn)(const float*, long, long, const void*, int, const float*, long, const float*, float*, int);
typedef int (*lim_fn)(int);
typedef void (*packf_fn)(const float*, long, long, long, float*);
static int cmp(const void *a, const void *b){ double x=*(double*)a, y=*(double*)b; return x<y?-1:x>y; }
int main(int argc, char **argv) {
    int nl = argc - 2, rows = atoi(argv[1]);
    long shapes[121][2]; for (int i = 0; i < 120; i++) { long sh[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}; shapes[i][0] = sh[i % 4][0]; shapes[i][1] = sh[i % 4][1]; } shapes[120][0] = 49152; shapes[120][1] = 576;
    enum { MATS = 121, R = 11 };
    const char *kn[3] = {"float32", "bfloat16", "int8"}; int wt[3] = {0, 1, 2}; int sz[3] = {4, 2, 1};
    char *panels[4][3][MATS]; lin_fn lin[4];
    float *x = malloc(64 * 1536 * 4), *y = malloc(64 * 49152 * 4), *scale = malloc(49152 * 4);
    for (int i = 0; i < 64 * 1536; i++) x[i] = 0.001f * (i % 997);
    for (int i = 0; i < 49152; i++) scale[i] = 0.01f;
    long bytes[3] = {0};
    for (int l = 0; l < nl; l++) {
        void *h = dlopen(argv[2 + l], RTLD_NOW | RTLD_LOCAL);
        if (!h) { printf("%s\n", dlerror()); return 1; }
        floats_fn fl = dlsym(h, "panel_floats"); packb_fn pb = dlsym(h, "panel_pack_bytes");
        lin[l] = dlsym(h, "panel_linear_w"); ((lim_fn)dlsym(h, "panel_limit_avx2"))(getenv("NOCAP") ? 0 : 1);
        for (int kd = 0; kd < 3; kd++) { bytes[kd] = 0;
            for (int m = 0; m < MATS; m++) {
                long n = shapes[m][0], k = shapes[m][1];
                char *w = malloc(n * k * sz[kd]);
                for (long i = 0; i < n * k * sz[kd]; i++) w[i] = (char)(i * 7 % 13);
                if (kd == 1) for (long i = 0; i < n * k; i++) ((uint16_t*)w)[i] = 0x3c00 + (i % 255);
                if (kd == 0) for (long i = 0; i < n * k; i++) ((float*)w)[i] = 0.01f * (i % 255);
                { size_t b = (fl(n, k) * sz[kd] + 63) / 64 * 64; if (getenv("HUGE")) { b = (b + (2<<20) - 1) / (2<<20) * (2<<20); panels[l][kd][m] = aligned_alloc(2<<20, b); madvise(panels[l][kd][m], b, MADV_HUGEPAGE); } else panels[l][kd][m] = aligned_alloc(64, b); }
                if (kd == 0) ((packf_fn)dlsym(h, "panel_pack"))((float*)w, k, n, k, (float*)panels[l][kd][m]); else pb(w, k, n, k, panels[l][kd][m], sz[kd]); free(w); bytes[kd] += n * k * sz[kd];
            }
        }
    }
    double t[4][3][R];
    for (int r = 0; r < R; r++)
        for (int kd = 0; kd < 3; kd++)
            for (int li = 0; li < nl; li++) { int l = (li + r) % nl;
                double s = now();
                for (int rep = 0; rep < 3; rep++)
                    for (int m = 0; m < MATS; m++) {
                        long n = shapes[m][0], k = shapes[m][1];
                        int rc = lin[l](x, rows, k, panels[l][kd][m], wt[kd], kd == 2 ? scale : NULL, n, NULL, y, 1);
                        if (rc) { printf("rc %d\n", rc); return 1; }
                    }
                t[l][kd][r] = (now() - s) / 3;
            }
    for (int kd = 0; kd < 3; kd++) {
        printf("%-9s rows=%d", kn[kd], rows);

        for (int l = 0; l < nl; l++) {
            double ratio[R]; for (int r = 0; r < R; r++) { ratio[r] = t[l][kd][r] / t[0][kd][r]; }
            qsort(ratio, R, sizeof(double), cmp);
            double c[R]; for (int r = 0; r < R; r++) c[r] = t[l][kd][r]; qsort(c, R, sizeof(double), cmp);
            printf(" | lib%d %.3f ms %.1f GB/s, /lib0 %.3f (%.3f-%.3f)", l, c[R/2]*1e3, bytes[kd]/c[R/2]/1e9, ratio[R/2], ratio[0], ratio[R-1]);
        }
        printf("\n");
    }
    return 0;
}
