import json,sys,statistics as st
d=json.load(open(sys.argv[1]))['data']
print(len(d))
keys=['prefill_queue_s','prefill_compute_s','kv_hop_s','first_token_s','decode_queue_s']
paths={}
for r in d: paths[r.get('prefill_path')]=paths.get(r.get('prefill_path'),0)+1
print(paths)
for k in keys:
    v=[r['breakdown'][k] for r in d if r['breakdown'] and r['breakdown'][k] is not None]
    if v: print(k, 'mean %.0f med %.0f max %.0f ms'%(1000*st.mean(v),1000*st.median(v),1000*max(v)))
v=[r['ttft_s'] for r in d]; print('ttft mean %.0f med %.0f'%(1000*st.mean(v),1000*st.median(v)))
for p in ('local','remote'):
    v=[r['ttft_s'] for r in d if r.get('prefill_path')==p]
    if v: print(p,'ttft mean %.0f'%(1000*st.mean(v)), 'compute mean %.0f'%(1000*st.mean([r['prefill_compute_s'] for r in d if r.get('prefill_path')==p])))
if len(sys.argv)>2:
  for r in d[:int(sys.argv[2])]: print(r['prefill_path'], {k:round(1000*(r['breakdown'][k] or 0)) for k in keys}, round(1000*r['ttft_s']))
