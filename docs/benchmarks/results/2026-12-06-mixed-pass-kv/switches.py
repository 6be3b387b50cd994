"""The engine threads' time off their cores in a served W-long: `perf script -F
comm,pid,tid,time,event,trace` of `perf record -a -e sched:sched_switch` (abstats.sh with
PERF=1 PERF_OPTS="-e sched:sched_switch -e sched:sched_wakeup --call-graph dwarf,8192"),
on stdin. Per thread: time on a core, time off it by state (R: preempted, S: asleep) and who
preempted it."""
import collections, re, sys

sw = re.compile(r'\s(\d+\.\d+): sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) '
                r'prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)')
ev = [m.groups() for m in map(sw.search, sys.stdin) if m]
dur = float(ev[-1][0]) - float(ev[0][0])
on, start, off = collections.Counter(), {}, {}
offs, offn = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
prio, comm, by = {}, {}, collections.defaultdict(collections.Counter)
for t, pc, pp, ppr, st, nc, np_, npr in ev:
    t = float(t)
    if pp in start:
        on[pp] += t - start.pop(pp)
    off[pp] = (t, st); prio[pp], comm[pp] = ppr, pc
    if st.startswith('R'):
        by[pp][nc] += 1
    start[np_] = t; prio[np_], comm[np_] = npr, nc
    if np_ in off:
        t0, s = off.pop(np_); offs[np_][s[0]] += t - t0; offn[np_][s[0]] += 1
print(f'window {dur:.2f} s')
for tid, v in on.most_common(8):
    print(tid, comm[tid], 'prio', prio[tid], f'on {100 * v / dur:.1f}%',
          {k: f'{100 * x / dur:.1f}% n={offn[tid][k]}' for k, x in offs[tid].items()})
for tid, _ in on.most_common(2):
    print(tid, 'preempted by', by[tid].most_common(8))
