"""Per-thread CPU accounting: `sample OUT` snapshots every second; `report OUT` sums the busy window."""
import json, os, sys, time
def snap():
    d = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline','rb').read().replace(b'\0',b' ').decode()[:90]
            for tid in os.listdir(f'/proc/{pid}/task'):
                s = open(f'/proc/{pid}/task/{tid}/stat').read()
                comm = s[s.index('(')+1:s.rindex(')')]
                f = s[s.rindex(')')+2:].split()
                st = open(f'/proc/{pid}/task/{tid}/status').read()
                vol = int(st.split('voluntary_ctxt_switches:')[1].split()[0])
                nv = int(st.split('nonvoluntary_ctxt_switches:')[1].split()[0])
                d[tid] = [pid, cmd, comm, int(f[11]) + int(f[12]), vol, nv]
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
    i0, i1 = idx[0], idx[-1] + 1
    a, b = snaps[i0], snaps[i1]
    tot = sum(b['cpu']) - sum(a['cpu']); idle = (b['cpu'][3]+b['cpu'][4]) - (a['cpu'][3]+a['cpu'][4])
    print(f"window {b['t']-a['t']:.1f} s, busy {1-idle/tot:.3f}, busy per second min {min(busy[i0:i1]):.2f}")
    rows = []
    for tid, v in b['th'].items():
        o = a['th'].get(tid, [0, 0, 0, 0, 0, 0])
        dt = v[3] - o[3]
        if dt > 0: rows.append((dt, v[4]-o[4], v[5]-o[5], v[0], tid, v[2], v[1][:70]))
    rows.sort(reverse=True)
    wall = (b['t'] - a['t']) * 100
    print(f"ticks/s total {sum(r[0] for r in rows)/(b['t']-a['t']):.0f} (200 = two cores)")
    for r in rows[:25]:
        print(f"{r[0]/wall*100:5.1f}% vol {r[1]:6d} inv {r[2]:6d} pid {r[3]} tid {r[4]} {r[5]:16s} {r[6]}")
