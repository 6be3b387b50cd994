"""Per-thread CPU, runqueue wait and context switches of the Ray Serve replicas over an interval."""
import os, sys, time, subprocess
def snap():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try: cmd = open(f'/proc/{pid}/cmdline').read().replace('\0', ' ')
        except OSError: continue
        for tid in os.listdir(f'/proc/{pid}/task'):
            try:
                comm = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
                run, wait, n = map(int, open(f'/proc/{pid}/task/{tid}/schedstat').read().split())
                st = dict(l.split(':\t') for l in open(f'/proc/{pid}/task/{tid}/status').read().splitlines() if ':\t' in l)
                out[(pid, tid)] = (cmd[:40], comm, run, wait, int(st['voluntary_ctxt_switches']), int(st['nonvoluntary_ctxt_switches']))
            except (OSError, ValueError, KeyError): pass
    return out
def cpu(): return list(map(int, open('/proc/stat').readline().split()[1:]))
dur = float(sys.argv[1]); c0=cpu(); a = snap(); time.sleep(dur); b = snap(); c1=cpu()
d=[y-x for x,y in zip(c0,c1)]; tot=sum(d)
print('system: user %.0f%% nice %.0f%% sys %.0f%% idle %.0f%% softirq %.0f%% steal %.0f%% (of 200)'%tuple(200*d[i]/tot for i in (0,1,2,3,6,7)))
rows = []
for k, v in b.items():
    if k not in a: continue
    u = a[k]
    rows.append((v[2]-u[2], v[0], v[1], k[1], (v[3]-u[3]), v[4]-u[4], v[5]-u[5]))
rows.sort(reverse=True)
print(f"{'cpu%':>6} {'rqwait%':>7} {'vol/s':>7} {'invol/s':>7}  process / thread")
for r in rows[:int(sys.argv[2]) if len(sys.argv)>2 else 25]:
    print(f"{r[0]/dur/1e7:6.1f} {r[4]/dur/1e7:7.1f} {r[5]/dur:7.0f} {r[6]/dur:7.0f}  {r[1]} / {r[2]} ({r[3]})")
