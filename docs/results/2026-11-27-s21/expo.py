import torch, time
torch.set_num_threads(1)
def t(f, n=200):
    f(); s=time.thread_time()
    for _ in range(n): f()
    return (time.thread_time()-s)/n*1e6
x=torch.empty(16,2048)
p=torch.softmax(torch.randn(16,2048),-1)
print("exponential_ us", t(lambda: x.exponential_()))
print("rand us", t(lambda: torch.rand(16,2048)))
print("-log(rand) us", t(lambda: torch.rand(16,2048).log_().neg_()))
print("softmax us", t(lambda: torch.softmax(p,-1)))
print("div+argmax us", t(lambda: (p/x).argmax(-1)))
print("cumsum+searchsorted us", t(lambda: torch.searchsorted(p.cumsum(-1), torch.rand(16,1)).clamp_max_(2047)))
print("multinomial us", t(lambda: torch.multinomial(p,1)))
x64=torch.empty(16,2048,dtype=torch.float64)
print("exponential_ f64 us", t(lambda: x64.exponential_()))
