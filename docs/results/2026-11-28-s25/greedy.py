import json, sys, random, urllib.request
port, out = sys.argv[1], sys.argv[2]
rng = random.Random(0)
res = []
for n in (8, 32, 64, 200, 700):
    ids = [rng.randrange(10, 2000) for _ in range(n)]
    body = {"model": "/tmp/s25/demo_shaped", "prompt": ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req))
    res.append(r["choices"][0]["logprobs"]["tokens"])
json.dump(res, open(out, "w"))
