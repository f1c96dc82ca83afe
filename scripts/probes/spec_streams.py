"""Probe (issue 24): 8 concurrent greedy streams (library, slots 8, 96 tokens each), speculation off and
auto, two rounds: total tok/s, and the verify calls made (speculation applies only to a stream that
decodes alone, so none are expected while the eight run).

    .venv/bin/python scripts/probes/spec_streams.py
"""

import sys, time, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path
PROMPTS = [f"List {i}: red, green, blue, red, green, blue, red," if i % 2 else f"Story {i}: Once upon a time, a fox" for i in range(8)]
async def one(engine, p, out, i):
    parts = []
    async with engine.stream(GenerationRequest(prompt=p, max_tokens=96, sampling=SamplingParams(temperature=0))) as ev:
        async for e in ev:
            if type(e) is TextDelta: parts.append(e.text)
        out[i] = (ev.usage.completion_tokens, "".join(parts))
async def main():
    for rnd in range(2):
        for mode in ("off", "auto"):
            b = await LlamaBackend.aload(LlamaSettings(default_model_path(), n_ctx=1024, slots=8, speculate=mode, prompt_cache=False))
            async with Engine(b) as engine:
                out = {}
                t = time.perf_counter()
                async with trio.open_nursery() as n:
                    for i, p in enumerate(PROMPTS): n.start_soon(one, engine, p, out, i)
                dt = time.perf_counter() - t
                tokens = sum(v[0] for v in out.values())
                print(f"round {rnd} {mode}: {tokens} tokens in {dt:.2f} s = {tokens/dt:.1f} tok/s; verify calls {b.speculation_stats()['verify_calls']}", flush=True)
trio.run(main)
