"""sample OUT: every second, per-thread schedstat (run ns, wait ns, slices) and voluntary/involuntary switches of every thread;
report OUT: over the busy window, the top threads' on-CPU, runqueue-wait and the rest (sleeping)."""
import json, os, sys, time
def snap():
    d = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline','rb').read().replace(b'\0',b' ').decode()[:60]
            for tid in os.listdir(f'/proc/{pid}/task'):
                r, w, n = map(int, open(f'/proc/{pid}/task/{tid}/schedstat').read().split())
                st = open(f'/proc/{pid}/task/{tid}/status').read()
                vol = int(st.split('voluntary_ctxt_switches:')[1].split()[0])
                nv = int(st.split('nonvoluntary_ctxt_switches:')[1].split()[0])
                d[tid] = [pid, cmd, r, w, vol, nv]
        except Exception: pass
    cpu = [int(x) for x in open('/proc/stat').readline().split()[1:]]
    return {'t': time.time(), 'cpu': cpu, 'th': d}
if sys.argv[1] == 'sample':
    with open(sys.argv[2], 'w') as f:
        while True:
            f.write(json.dumps(snap()) + '\n'); f.flush(); time.sleep(1)
else:
    snaps = [json.loads(l) for l in open(sys.argv[2])]
    busy = []
    for a, b in zip(snaps, snaps[1:]):
        tot = sum(b['cpu']) - sum(a['cpu']); idle = (b['cpu'][3] + b['cpu'][4]) - (a['cpu'][3] + a['cpu'][4])
        busy.append(1 - idle / max(tot, 1))
    thr = float(sys.argv[3]) if len(sys.argv) > 3 else 0.9
    idx = [i for i, x in enumerate(busy) if x > thr]
    # the longest run of consecutive busy seconds
    best, cur = (0, 0), None
    for i in idx:
        cur = (cur[0], i) if cur and cur[1] == i - 1 else (i, i)
        if cur[1] - cur[0] > best[1] - best[0]: best = cur
    i0, i1 = best[0], best[1] + 1
    a, b = snaps[i0], snaps[i1]; wall = (b['t'] - a['t']) * 1e9
    tot = sum(b['cpu']) - sum(a['cpu']); idle = (b['cpu'][3]+b['cpu'][4]) - (a['cpu'][3]+a['cpu'][4])
    print(f"window {wall/1e9:.1f} s, machine busy {1-idle/tot:.3f}")
    rows = []
    for tid, v in b['th'].items():
        o = a['th'].get(tid, [0, 0, 0, 0, 0, 0])
        rows.append(((v[2]-o[2])/wall, (v[3]-o[3])/wall, v[4]-o[4], v[5]-o[5], v[0], tid, v[1]))
    rows.sort(reverse=True)
    print(f"all threads on CPU: {sum(r[0] for r in rows):.2f} cores")
    for r in rows[:14]:
        print(f"run {r[0]*100:5.1f}% rq-wait {r[1]*100:5.1f}% other {100-100*(r[0]+r[1]):5.1f}% vol/s {r[2]/wall*1e9:6.0f} inv/s {r[3]/wall*1e9:6.0f} {r[4]}/{r[5]} {r[6]}")
