"""M = 16 GEMMs of the demo model (qkv, gate_up, lm_head, down): F.linear vs a pre-transposed
weight vs oneDNN prepacked weights, one thread; microseconds, median of 5 x 2000 calls."""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
def bench(f, n=2000):
    for _ in range(50): f()
    ts=[]
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter()-t)/n*1e6)
    return sorted(ts)[2]
for (M,K,N) in [(16,256,1376),(16,256,2048),(16,688,256),(16,256,512)]:
    x=torch.randn(M,K); w=torch.randn(N,K)
    wt=w.t().contiguous()
    pk = torch.ops.mkldnn._reorder_linear_weight(w, M) if hasattr(torch.ops.mkldnn,'_reorder_linear_weight') else None
    r={"F.linear":bench(lambda: F.linear(x,w)), "x@wT(contig)":bench(lambda: x@wt)}
    if torch.backends.mkldnn.is_available():
        try:
            pk = torch._C._nn.mkldnn_reorder_linear_weight(w.to_mkldnn()) if False else torch.ops.mkldnn._reorder_linear_weight(w, M)
            r["mkldnn_packed"]=bench(lambda: torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [], ""))
            assert torch.allclose(torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [], ""), F.linear(x,w), atol=1e-4)
        except Exception as e: r["mkldnn"]=repr(e)[:100]
    print((M,K,N), {k:(round(v,1) if isinstance(v,float) else v) for k,v in r.items()})
