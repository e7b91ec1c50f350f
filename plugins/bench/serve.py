"""``pagelm bench serve``: load-test a running pagelm (or any OpenAI-compatible) server.

For each concurrency level, that many clients send requests back to back (closed loop) until
the workload is done; requests/s and output tokens/s are measured over the whole run, TTFT and
inter-token latency per streamed request. With ``--in-process MODEL`` the same workload also
runs through ``LLM.generate`` in this process with ``max_num_seqs`` = the level (the peer the
server is compared with; engine flags configure it — give the server the same ones).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagelm.plugins.bench.workload import Workload
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="load-test a running server (optionally against in-process LLM.generate)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)")
    p.add_argument("--model", help="served model name (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("PAGELM_API_KEY"), help="API key (default: $PAGELM_API_KEY)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions", help="API to load (default: %(default)s)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, help="requests per level (default: 16 x clients, at least 64)")
    p.add_argument("--input-words", type=int, default=24, help="words per prompt (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per completion, EOS ignored (default: %(default)s)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="stream responses (default: on)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--in-process", metavar="MODEL", help="also run the workload through LLM.generate on MODEL")
    p.add_argument("--repeats", type=int, default=1, help="runs per level; the best is kept (default: 1)")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass
class LevelResult:
    target: str  # "server" or "in-process"
    concurrency: int
    num_requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    mean_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_itl_ms: float | None = None


@dataclass
class _Sample:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    itl: float | None = None


# ---- the server side ------------------------------------------------------------------------


class _Client:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        import httpx

        self.args, self.model = args, model
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.http = httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.path = "/v1/completions" if args.endpoint == "completions" else "/v1/chat/completions"

    def payload(self, prompt: str, output_len: int) -> dict:
        body = {
            "model": self.model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": self.args.stream,
        }
        if self.args.stream:
            body["stream_options"] = {"include_usage": True}
        if self.args.endpoint == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        return body

    async def one(self, prompt: str, output_len: int) -> _Sample:
        start = time.perf_counter()
        body = self.payload(prompt, output_len)
        if not self.args.stream:
            r = await self.http.post(self.path, json=body)
            if r.status_code != 200:
                return _Sample(False)
            return _Sample(True, r.json()["usage"]["completion_tokens"])
        first = last = None
        chunks = 0
        tokens = 0
        async with self.http.stream("POST", self.path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _Sample(False)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                if data.startswith('{"error"'):
                    return _Sample(False)
                # Only the usage chunk is parsed: the client must not be the bottleneck.
                if '"usage":{' in data:
                    tokens = json.loads(data)["usage"]["completion_tokens"]
                    continue
                if '"role":"assistant"' in data and '"content":""' in data:
                    continue  # chat's opening chunk carries no token
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
        ttft = None if first is None else first - start
        itl = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
        return _Sample(True, tokens, ttft, itl)

    async def run_level(self, workload: Workload, concurrency: int) -> LevelResult:
        queue = list(reversed(workload.prompts))
        samples: list[_Sample] = []

        async def worker() -> None:
            while queue:
                samples.append(await self.one(queue.pop(), workload.output_len))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return _summarize("server", concurrency, samples, time.perf_counter() - start)


def _summarize(target: str, concurrency: int, samples: list[_Sample], duration: float) -> LevelResult:
    ok = [s for s in samples if s.ok]
    ttfts = sorted(s.ttft for s in ok if s.ttft is not None)
    itls = [s.itl for s in ok if s.itl is not None]
    return LevelResult(
        target, concurrency, len(samples), len(samples) - len(ok), duration,
        len(ok) / duration, sum(s.output_tokens for s in ok) / duration,
        1000 * statistics.fmean(ttfts) if ttfts else None,
        1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        1000 * statistics.fmean(itls) if itls else None,
    )


async def _bench_server(args: argparse.Namespace, workload: Workload, concurrency: int) -> LevelResult:
    import httpx

    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(headers=headers, timeout=10) as http:
            r = await http.get(f"{args.base_url}/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    client = _Client(args, model)
    try:
        # Warm-up: open the connections, take the server's first-request paths.
        await client.run_level(Workload(workload.prompts[:concurrency], 4), concurrency)
        return await client.run_level(workload, concurrency)
    finally:
        await client.http.aclose()


# ---- the in-process peer --------------------------------------------------------------------


class _InProcessPeer:
    """``LLM.generate`` over the same workload, ``max_num_seqs`` = the number of clients."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pagelm.config import EngineConfig
        from pagelm.engine.core_proc import share_cpu

        self.args = args
        self.kwargs = engine_kwargs(args)
        self.kwargs.pop("model", None)
        # The server's engine core leaves one CPU core to HTTP; the peer gets the same share.
        share_cpu(EngineConfig.from_kwargs(args.in_process, **self.kwargs))
        self._llms: dict[int, object] = {}

    def run(self, workload: Workload, concurrency: int) -> LevelResult:
        from pagelm import LLM, SamplingParams

        if concurrency not in self._llms:
            self._llms.clear()  # one engine at a time
            self._llms[concurrency] = LLM(self.args.in_process, **{**self.kwargs, "max_num_seqs": concurrency})
        llm = self._llms[concurrency]
        params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
        if self.args.endpoint == "chat":
            prompts = [[{"role": "user", "content": p}] for p in workload.prompts]
            run = lambda ps: llm.chat(ps, params, use_tqdm=False)  # noqa: E731
        else:
            prompts = workload.prompts
            run = lambda ps: llm.generate(ps, params, use_tqdm=False)  # noqa: E731
        run(prompts[:concurrency])  # warm-up
        start = time.perf_counter()
        outs = run(prompts)
        duration = time.perf_counter() - start
        samples = [_Sample(True, len(o.outputs[0].token_ids)) for o in outs]
        return _summarize("in-process", concurrency, samples, duration)


# ---- report ---------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _print_row(r: LevelResult) -> None:
    print(
        f"{r.target:>10}  clients={r.concurrency:<4} requests={r.num_requests:<5} errors={r.errors:<3} "
        f"{r.requests_per_s:8.2f} req/s {r.output_tokens_per_s:9.1f} out tok/s  "
        f"TTFT mean {_fmt(r.mean_ttft_ms)} ms p99 {_fmt(r.p99_ttft_ms)} ms  ITL mean {_fmt(r.mean_itl_ms, '.2f')} ms",
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    peer = _InProcessPeer(args) if args.in_process else None
    results: list[LevelResult] = []
    ratios = []
    # Server and peer alternate level by level (and repeat), so a change in the machine's
    # load hits both alike; the best of the repeats is kept for each.
    for c in levels:
        workload = Workload.synthetic(
            args.num_prompts or max(64, 16 * c), args.input_words, args.output_len, args.workload_seed
        )
        best: dict[str, LevelResult] = {}
        for _ in range(args.repeats):
            runs = [asyncio.run(_bench_server(args, workload, c))]
            if peer is not None:
                runs.append(peer.run(workload, c))
            for r in runs:
                _print_row(r)
                if r.target not in best or r.output_tokens_per_s > best[r.target].output_tokens_per_s:
                    best[r.target] = r
        results += best.values()
        if peer is not None:
            ratios.append((c, best["server"].output_tokens_per_s / best["in-process"].output_tokens_per_s))
    if args.repeats > 1:
        print(f"\nbest of {args.repeats}:")
        for r in results:
            _print_row(r)
    if ratios:
        print("\nserver / in-process (output tokens/s):")
        for c, ratio in ratios:
            print(f"  clients={c:<4} {ratio:6.1%}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.errors == 0 for r in results) else 1
