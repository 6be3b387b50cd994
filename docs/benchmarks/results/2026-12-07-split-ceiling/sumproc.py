import sys, re, collections
f = sys.argv[1]; tok = float(sys.argv[2])
g = collections.Counter()
for line in open(f).read().splitlines()[2:]:
    parts = line.split(None, 4)
    if len(parts) < 5: continue
    cpu = float(parts[0]); name = parts[4]
    proc, _, thr = name.partition(' / ')
    if 'ray::IDLE' in thr and ('DecodeServe' in proc or 'PrefillServ' in proc or 'Colocated' in proc) and cpu > 20:
        key = proc.strip()[:40] + ' ENGINE'
    else:
        key = proc.strip()[:40]
    g[key] += cpu
tot = 0
for k, v in g.most_common():
    print(f'{v:6.1f}%  {v*10/tok:6.2f} ms/tok  {k}')
