import torch,time,sys
from app.cpu_kernels import load_kernel
lib=load_kernel()
def run(rows,n,kvh=3,group=3,slots_total=None,layers=30,iters=20, shuffle=False):
    slots_total=slots_total or rows*n+64
    pools=[torch.randn(2,slots_total,kvh,64) for _ in range(layers)]
    if shuffle:
        perm=torch.randperm(slots_total//16)
        blocks=perm[:rows*n//16]
        read=(blocks[:,None]*16+torch.arange(16)).reshape(-1).long()
    else:
        read=torch.arange(rows*n).long()
    offsets=torch.arange(rows+1).long()*n
    q=torch.randn(rows,kvh*group,64); out=torch.empty_like(q)
    def once():
        for p in pools:
            rc=lib.paged_decode_attention(q.data_ptr(),p[0].data_ptr(),p[1].data_ptr(),slots_total,kvh,64,group,read.data_ptr(),read.numel(),offsets.data_ptr(),rows,0.125,out.data_ptr(),1)
            assert rc==0
    once(); t=time.perf_counter()
    for _ in range(iters): once()
    dt=(time.perf_counter()-t)/iters
    gb=rows*n*kvh*64*4*2*layers/1e9
    print(f"rows {rows} n {n} kvh {kvh} group {group} shuffle {shuffle}: {dt*1e3:.2f} ms, {gb/dt:.1f} GB/s")
    return out.clone()
run(4,1024); run(4,1024,shuffle=True); run(8,64); run(4,1024,layers=1,iters=200); run(4,1024,kvh=2,group=7)
run(4,1024,kvh=1,group=9)
pools=[torch.randn(2,4160,3,64) for _ in range(30)]
t=time.perf_counter()
for _ in range(20):
    for p in pools: p.sum()
dt=(time.perf_counter()-t)/20; print('torch sum over the same bytes: %.2f ms %.1f GB/s'%(dt*1e3, 30*2*4160*3*64*4/1e9/dt))
print([l for l in open('/proc/self/smaps_rollup') if 'AnonHuge' in l])
