"""report SS JSON: the W-long window from the run's json (end date, duration)."""
import json, sys, datetime
snaps=[json.loads(l) for l in open(sys.argv[1])]
d=json.load(open(sys.argv[2]))
end=datetime.datetime.strptime(d['date'],'%Y%m%d-%H%M%S').replace(tzinfo=datetime.timezone.utc).timestamp()
t0=end-d['duration']+1; t1=end-1
sel=[s for s in snaps if t0<=s['t']<=t1]
a,b=sel[0],sel[-1]; wall=(b['t']-a['t'])*1e9
tot=sum(b['cpu'])-sum(a['cpu']); idle=(b['cpu'][3]+b['cpu'][4])-(a['cpu'][3]+a['cpu'][4])
rows=[]
for tid,v in b['th'].items():
    o=a['th'].get(tid,[0,0,0,0,0,0])
    rows.append(((v[2]-o[2])/wall,(v[3]-o[3])/wall,v[4]-o[4],v[5]-o[5],v[0],tid,v[1][:45]))
rows.sort(reverse=True)
print(f"window {wall/1e9:.1f} s busy {1-idle/tot:.3f} all on CPU {sum(r[0] for r in rows):.2f}")
for r in rows[:int(sys.argv[3]) if len(sys.argv)>3 else 4]:
    print(f"run {r[0]*100:5.1f}% rqwait {r[1]*100:5.1f}% vol/s {r[2]/wall*1e9:6.0f} inv/s {r[3]/wall*1e9:5.0f} {r[4]}/{r[5]} {r[6]}")
pid=rows[0][4]; print('replica threads', sum(1 for v in b['th'].values() if v[0]==pid))
