import json, os, sys
snaps = [json.loads(l) for l in open(sys.argv[1])]
j = sys.argv[2]; d = json.load(open(j)); t1 = os.path.getmtime(j); t0 = t1 - d['duration']
sel = [s for s in snaps if t0 + 1 <= s['t'] <= t1 - 1]
a, b = sel[0], sel[-1]
tot = sum(b['cpu']) - sum(a['cpu']); idle = (b['cpu'][3]+b['cpu'][4]) - (a['cpu'][3]+a['cpu'][4])
wall = (b['t'] - a['t']) * 100
print(f"window {b['t']-a['t']:.1f} s of {d['duration']:.1f}, machine busy {1-idle/tot:.3f}")
rows = []
for tid, v in b['th'].items():
    o = a['th'].get(tid, [0, 0, 0, 0, 0, 0]); dt = v[3] - o[3]
    if dt > 0: rows.append((dt, v[4]-o[4], v[5]-o[5], v[0], tid, v[2], v[1][:60]))
rows.sort(reverse=True)
print(f"sum of threads {sum(r[0] for r in rows)/wall*100:.0f}% of a core")
for r in rows[:22]:
    print(f"{r[0]/wall*100:5.1f}% vol/s {r[1]/(wall/100):6.0f} inv/s {r[2]/(wall/100):6.0f} tid {r[4]} {r[5]:14s} {r[6]}")
