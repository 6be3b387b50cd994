/* A prefill attention's arguments (prefill_attention.c, prefill_attention_bf16.c) as its
 * tasks on the kernels' team (pool.h) read them: first one task per (row, KV head) packing
 * its keys (and values), then one per block of up to QB query positions of a (row, head),
 * the longest (last) blocks first: under the causal mask later blocks hold more work. */
#ifndef SPLITSERVE_PREFILL_JOB_H
#define SPLITSERVE_PREFILL_JOB_H

struct prefill_job {
    const float *q, *k, *v;
    float *out;
    long qsb, qsh, qss, ksb, ksh, kss, vsb, vsh, vss, osb, osh, oss;
    long batch, heads, kv_heads, s, t, d, pmax, per, tp, blocks, tasks;
    const long *starts;
    float scale;
    void *kt, *vt; /* the packed keys (and values), `per` elements a (row, KV head) */
    int wide;      /* prefill_attention.c: AVX-512 */
};

/* Where attention task `task` is: its (row, head), KV head, first position and rows. */
struct prefill_block {
    long b, h, g, i0;
    int mr;
};

static inline struct prefill_block prefill_block_of(const struct prefill_job *j, long task,
                                                    long qb) {
    long bh = (j->tasks - 1 - task) / j->blocks, blk = (j->tasks - 1 - task) % j->blocks;
    struct prefill_block pb = {bh / j->heads, bh % j->heads, 0, blk * qb, 0};
    pb.g = pb.h / (j->heads / j->kv_heads);
    pb.mr = (int)(j->s - pb.i0 < qb ? j->s - pb.i0 : qb);
    return pb;
}

#endif
