import collections, sys
tot=0; self_=collections.Counter(); incl=collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rsplit(' ',1); n=int(n); tot+=n
    frames = stack.split(';')
    self_[frames[-1]] += n
    for f in set(frames): incl[f]+=n
print("total", tot)
for f,n in incl.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 60):
    if 'runpy' in f or '_call_impl' in f: continue
    print(f"{100*n/tot:5.1f}% {f[:140]}")
print("--- self")
for f,n in self_.most_common(25): print(f"{100*n/tot:5.1f}% {f[:140]}")
