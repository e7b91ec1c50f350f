import json, glob, os, sys
R = sys.argv[1]
for f in sorted(glob.glob(R + "/r*_*.json"), key=lambda p: (p[-6], int(os.path.basename(p).split("_")[0][1:]))):
    d = json.load(open(f))
    print(f"{os.path.basename(f):22s} {d['output_throughput']:8.1f} tok/s  ttft p50 {d['median_ttft_ms']:7.1f}  itl p50 {d['median_itl_ms']:6.2f}")
