/* The kernels' own thread team: see pool.h for what sk_parallel promises.
 *
 * A team is a caller thread's: two job slots used in turn (a loop's generation's parity),
 * each immutable from its publication until no helper holds it. A helper sees a new
 * generation, holds its slot (`active`), checks the generation again (a helper that slept
 * through a whole loop backs out: that loop's slot may be in reuse), then claims tasks from
 * the slot's counter until none are left. The caller publishes a loop only when the slot's
 * last holders have left, claims tasks itself, and then waits only for tasks that were
 * claimed: `done` reaching the count.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"
#include "pool.h"

#define MAX_HELPERS 63
#define HELPER_SPIN_NS 200000L /* a helper's spin after a loop before it sleeps */
#define CALLER_SPIN_NS 50000L  /* the caller's spin on a claimed task before it yields */

struct job {
    sk_task_fn fn;
    void *ctx;
    long tasks;
    int threads;
    atomic_long next, done;
    atomic_int active; /* helpers holding this slot */
};

struct team {
    atomic_uint gen; /* the futex word: the generation of the latest loop */
    atomic_int sleepers;
    int helpers;
    struct job slots[2];
};

struct helper_arg {
    struct team *team;
    int worker;
};

static __thread struct team *own_team;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void futex_wait(atomic_uint *word, unsigned seen) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *word) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
}

/* Claim and run tasks of `job` until none are left. */
static void work(struct job *job, int worker) {
    for (;;) {
        long task = atomic_fetch_add(&job->next, 1);
        if (task >= job->tasks) return;
        job->fn(job->ctx, task, worker);
        atomic_fetch_add(&job->done, 1);
    }
}

/* Until the generation differs from `seen`: spin, then sleep on the futex. */
static unsigned await_loop(struct team *team, unsigned seen) {
    long start = now_ns();
    for (int i = 0;; i++) {
        unsigned gen = atomic_load(&team->gen);
        if (gen != seen) return gen;
        if ((i & 63) == 63 && now_ns() - start > HELPER_SPIN_NS) break;
        _mm_pause();
    }
    for (;;) {
        atomic_fetch_add(&team->sleepers, 1);
        unsigned gen = atomic_load(&team->gen);
        if (gen == seen) futex_wait(&team->gen, seen);
        atomic_fetch_sub(&team->sleepers, 1);
        gen = atomic_load(&team->gen);
        if (gen != seen) return gen;
    }
}

static void *helper_main(void *p) {
    struct helper_arg arg = *(struct helper_arg *)p;
    free(p);
    struct team *team = arg.team;
    unsigned seen = atomic_load(&team->gen);
    for (;;) {
        unsigned gen = await_loop(team, seen);
        seen = gen;
        struct job *job = &team->slots[gen & 1];
        atomic_fetch_add(&job->active, 1);
        if (atomic_load(&team->gen) == gen && arg.worker < job->threads) work(job, arg.worker);
        atomic_fetch_sub(&job->active, 1);
    }
    return NULL;
}

/* The calling thread's team with at least `helpers` helpers (fewer where a thread could not
   be started: *short_of set). */
static struct team *team_for(int helpers, int *short_of) {
    struct team *team = own_team;
    if (team == NULL) {
        team = calloc(1, sizeof(*team));
        if (team == NULL) {
            *short_of = 1;
            return NULL;
        }
        own_team = team;
    }
    if (helpers > MAX_HELPERS) helpers = MAX_HELPERS;
    while (team->helpers < helpers) {
        struct helper_arg *arg = malloc(sizeof(*arg));
        pthread_t thread;
        if (arg == NULL) break;
        *arg = (struct helper_arg){team, team->helpers + 1};
        if (pthread_create(&thread, NULL, helper_main, arg) != 0) {
            free(arg);
            break;
        }
        pthread_detach(thread);
        team->helpers++;
    }
    *short_of = team->helpers < helpers;
    return team;
}

__attribute__((visibility("hidden"))) int sk_parallel(long tasks, sk_task_fn fn, void *ctx,
                                                    int threads) {
    if (tasks <= 0) return 0;
    if (threads > tasks) threads = (int)tasks;
    int short_of = 0;
    struct team *team = threads > 1 ? team_for(threads - 1, &short_of) : NULL;
    if (team == NULL) {
        for (long t = 0; t < tasks; t++) fn(ctx, t, 0);
        return short_of ? -1 : 0;
    }
    unsigned gen = atomic_load(&team->gen) + 1;
    struct job *job = &team->slots[gen & 1];
    while (atomic_load(&job->active) > 0) _mm_pause(); /* the slot's last loop's stragglers */
    job->fn = fn;
    job->ctx = ctx;
    job->tasks = tasks;
    job->threads = threads;
    atomic_store(&job->next, 0);
    atomic_store(&job->done, 0);
    atomic_store(&team->gen, gen);
    if (atomic_load(&team->sleepers) > 0) futex_wake_all(&team->gen);
    work(job, 0);
    long start = 0;
    for (int i = 0; atomic_load(&job->done) < tasks; i++) {
        _mm_pause();
        if ((i & 63) != 63) continue;
        if (start == 0) start = now_ns();
        else if (now_ns() - start > CALLER_SPIN_NS) sched_yield();
    }
    return short_of ? -1 : 0;
}

/* A check of the team for tests: runs `tasks` tasks on `threads` threads, each task
   recording in owner[task] the worker that ran it and counting its runs in runs[task]. */
struct selftest {
    long *owner;
    long *runs;
};

static void selftest_task(void *p, long task, int worker) {
    struct selftest *st = p;
    st->owner[task] = worker;
    __atomic_fetch_add(&st->runs[task], 1, __ATOMIC_RELAXED);
    for (volatile int spin = 0; spin < 2000; spin++) {
    }
}

int sk_pool_selftest(long tasks, int threads, long *owner, long *runs) {
    if (tasks < 0 || threads < 1 || (tasks > 0 && (owner == NULL || runs == NULL)))
        return SK_BAD_SHAPE;
    struct selftest st = {owner, runs};
    return sk_parallel(tasks, selftest_task, &st, threads) == 0 ? SK_OK : SK_NO_MEMORY;
}
