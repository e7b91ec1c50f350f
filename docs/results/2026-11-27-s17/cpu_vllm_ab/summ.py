import json, glob, sys, os
R = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{R}/r*_[abc].json")):
    d = json.load(open(f)); tag = os.path.basename(f)[:-5]
    print(f"{tag:16s} {d['output_throughput']:8.1f} tok/s  TTFT p50 {d['median_ttft_ms']:7.1f}  ITL p50 {d['median_itl_ms']:6.2f}  TPOT p50 {d['median_tpot_ms']:6.2f}")
    rows[tag] = d['output_throughput']
for w in "abc":
    p = [v for k, v in rows.items() if k.endswith("pagelm_" + w)]; v = [x for k, x in rows.items() if k.endswith("vllm_" + w)]
    if p and v:
        pairs = [round(a / b, 2) for a, b in zip(p, v)]
        print(w, "pagelm", [round(x) for x in p], "vllm", [round(x) for x in v], "pairs", pairs, "means ratio", round(sum(p)/len(p)/(sum(v)/len(v)), 3))
