"""Issue 18: DP=2 throughput the way the server runs it, each replica an engine core in its
own process (AsyncLLM), on the nano-vllm workload of `pagelm bench throughput`. Offline
`LLM` steps its replicas in turn in one thread, so their host work does not overlap.
Run: python3 dp_async.py DP [model preset or directory] [small]  (prints output tok/s; `small`:
16 requests of <= 200 + 150 tokens, a CPU check of the script)"""
import asyncio
import sys
import time

from pagelm import SamplingParams
from pagelm.engine.async_llm import AsyncLLM
from pagelm.engine.output_processor import OutputKind
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.bench.workload import TokenWorkload


async def run_all(llm, workload, tag):
    async def one(i, ids, n):
        async for out in llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                      f"{tag}-{i}", output_kind=OutputKind.FINAL_ONLY):
            last = out
        return len(last.outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(workload.prompt_token_ids, workload.output_lens)))))


async def main():
    dp = int(sys.argv[1])
    preset = sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b"
    small = sys.argv[3:] == ["small"]
    model, kw = resolve_bench_model(preset, {"data_parallel_size": dp, "max_model_len": 512 if small else 4096})
    llm = AsyncLLM.from_model(model, **kw)
    await llm.start()
    warm = TokenWorkload.fixed(8 * dp, 64, 16, 1000, 1)
    await run_all(llm, warm, "warm")
    workload = TokenWorkload.nano_vllm(16, 200, 150) if small else TokenWorkload.nano_vllm()
    start = time.perf_counter()
    tokens = await run_all(llm, workload, "timed")
    elapsed = time.perf_counter() - start
    print(f"DP={dp} in processes (AsyncLLM), {preset}: {tokens} output tokens in {elapsed:.2f} s: "
          f"{tokens / elapsed:.1f} output tok/s, {(tokens + workload.num_prompt_tokens) / elapsed:.1f} total tok/s", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
