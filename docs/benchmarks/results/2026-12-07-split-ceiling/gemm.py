import torch, time
from torch import nn
from app.packed_linear import PanelLinear
torch.set_num_threads(1)
for (m,k,n) in [(64,896,9728),(64,4864,896),(64,896,1152),(12,896,9728),(128,896,9728)]:
    lin = nn.Linear(k, n, bias=False)
    p = PanelLinear(lin, weights="bfloat16dp")
    x = torch.randn(m, k)
    for _ in range(3): p(x)
    ts=[]
    for _ in range(15):
        t=time.perf_counter(); p(x); ts.append(time.perf_counter()-t)
    t=sorted(ts)[len(ts)//2]
    print(m,k,n, '%.2f ms  %.0f GFLOPS'%(t*1e3, 2*m*k*n/t/1e9))
