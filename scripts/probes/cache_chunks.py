"""Does a solo request's greedy text depend on the prefill chunk size?"""
import sys, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path

PROMPTS = [("The history of the city " * 40) + " In summary,", ("def f(x):\n    return x * 2\n" * 30) + "# next", ("Once upon a time, a fox and a crow " * 35)]

async def run(n_batch, chunk):
    backend = await LlamaBackend.aload(LlamaSettings(default_model_path(), n_batch=n_batch, prefill_chunk=chunk, slots=1))
    out = []
    async with Engine(backend) as engine:
        for p in PROMPTS:
            prepared = await engine.prepare(GenerationRequest(prompt=p, max_tokens=48, sampling=SamplingParams(temperature=0.0)))
            text = []
            async with engine.stream(prepared) as events:
                async for e in events:
                    if type(e) is TextDelta: text.append(e.text)
            out.append(("".join(text), len(prepared.tokens)))
    return out

async def main():
    results = {}
    for nb, ch in [(512, 64), (64, 64), (128, 64), (256, 64)]:
        results[nb] = await run(nb, ch)
    base = results[512]
    for nb, r in results.items():
        print(nb, [ (a == b[0], b[1]) for (a, _), b in zip(r, base)])
    for i, (t, n) in enumerate(base):
        print(i, n, repr(t[:80]))
        for nb, r in results.items():
            if r[i][0] != t: print("   differs at", nb, repr(r[i][0][:80]))
trio.run(main)
