"""Every 0.5 s: system busy %, CPU % of the bench client, of the colocated replica, of the rest."""
import os, sys, time
def procs():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline').read().replace('\0', ' ')
            f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
            out[pid] = (cmd, int(f[11]) + int(f[12]))
        except (OSError, IndexError): pass
    return out
def kind(cmd):
    if 'bench serve' in cmd: return 'client'
    if 'ServeReplica' in cmd and ('Colocated' in cmd or 'Decode' in cmd or 'Prefill' in cmd): return 'engine'
    if 'ray::' in cmd: return 'stack'
    return 'other'
def cpu(): return list(map(int, open('/proc/stat').readline().split()[1:]))
dur = float(sys.argv[1]); t0 = time.time()
c0, p0 = cpu(), procs()
while time.time() - t0 < dur:
    time.sleep(0.5)
    c1, p1 = cpu(), procs()
    d = [y - x for x, y in zip(c0, c1)]; tot = sum(d) or 1
    k = {'client': 0, 'engine': 0, 'stack': 0, 'other': 0}
    for pid, (cmd, t) in p1.items():
        k[kind(cmd)] += t - p0.get(pid, (cmd, t))[1]
    print(f"{time.time()-t0:5.1f} busy {200*(tot-d[3])/tot:5.0f} client {200*k['client']/tot:4.0f} engine {200*k['engine']/tot:4.0f} stack {200*k['stack']/tot:4.0f} other {200*k['other']/tot:4.0f}", flush=True)
    c0, p0 = c1, p1
