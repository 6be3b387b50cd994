/* The kernels' own thread team (pool.c): a parallel loop whose calling thread never waits
 * for a helper that has not started.
 *
 * sk_parallel(tasks, fn, ctx, threads) runs fn(ctx, task, worker) once for every task in
 * [0, tasks), on the calling thread (worker 0) and up to threads - 1 helper threads (workers
 * 1 .. threads - 1), each task claimed by whichever comes first. It returns when every task
 * has run. The caller claims tasks like any helper, so a helper whose core is busy with
 * another process (the serving stack, another replica) leaves its share to the caller
 * instead of holding the caller at a barrier (an OpenMP team's end waits for every thread
 * of the team, so a thread that the scheduler has not run costs the whole team its wait).
 * What the caller can wait for is a task a helper claimed and has not finished.
 *
 * Every caller thread has a team of its own (made on its first parallel loop, grown as a
 * call asks for more threads); its helpers inherit the caller's scheduling priority. They
 * spin for a while after each loop (a pass's next loop comes within microseconds) and then
 * sleep until the next one. Results must not depend on which worker runs a task: every
 * kernel's tasks write disjoint outputs, each in a fixed order of its own.
 */
#ifndef SPLITSERVE_POOL_H
#define SPLITSERVE_POOL_H

typedef void (*sk_task_fn)(void *ctx, long task, int worker);

/* 0, or -1 where a helper could not be started (its tasks then ran on the others). Not
   exported: the kernels' own (kernels.h lists what Python binds). */
__attribute__((visibility("hidden"))) int sk_parallel(long tasks, sk_task_fn fn, void *ctx,
                                                    int threads);

#endif
