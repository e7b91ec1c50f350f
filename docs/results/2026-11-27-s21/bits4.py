import torch, torch.nn.functional as F
torch.manual_seed(0)
def both(f):
    torch.set_num_threads(1); a=f(); torch.set_num_threads(2); b=f(); return torch.equal(a,b)
for K,N in ((64,512),(256,2048),(64,192),(256,1376),(688,256),(256,512)):
    bad=[M for M in range(1,80) if not both(lambda: F.linear(x,w)) for x,w in [(torch.randn(M,K),torch.randn(N,K))]] if False else []
    bad=[]
    for M in list(range(1,40))+[64,100,128,256,512,1000,2048]:
        x=torch.randn(M,K); w=torch.randn(N,K)
        if not both(lambda: F.linear(x,w)): bad.append(M)
    print(K,N,"differs at M =",bad)
