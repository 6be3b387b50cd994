import json, statistics as st, sys
d = json.load(open(sys.argv[1]))['data']
for path in ('local','remote'):
    rs = [r for r in d if r.get('prefill_path')==path and r['output_tokens']>=60]
    if not rs: continue
    def m(f): return st.mean(f(r) for r in rs)
    b = lambda k: (lambda r: r['breakdown'].get(k) or 0)
    print(path, len(rs), 'ttft %.3f'%m(lambda r:r['ttft_s']), ' '.join('%s %.3f'%(k.replace('_s',''), m(b(k))) for k in rs[0]['breakdown']), 'decode/tok %.4f'%m(lambda r:r['breakdown']['decode_s']/r['output_tokens']))
