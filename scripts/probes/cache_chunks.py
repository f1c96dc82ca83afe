"""Does a solo request's greedy text depend on the prefill chunk size?"""
import sys, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path

PROMPTS = [("The history of the city " * 40) + " In summary,", ("def f(x):\n    return x * 2\n" * 30) + "# next", ("Once upon a time, a fox and a crow " * 35)]

async def run(size, _unused=None):
    # one llama_decode call per `size` prompt tokens (the prefill chunk), one sequence
    backend = await LlamaBackend.aload(LlamaSettings(default_model_path(), n_batch=max(512, size), prefill_chunk=size, slots=1, prompt_cache=False))
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
    for size in (512, 64, 128, 256):
        results[size] = await run(size)
    base = results[512]
    for nb, r in results.items():
        print(nb, [ (a == b[0], b[1]) for (a, _), b in zip(r, base)])
    for i, (t, n) in enumerate(base):
        print(i, n, repr(t[:80]))
        for nb, r in results.items():
            if r[i][0] != t: print("   differs at", nb, repr(r[i][0][:80]))
trio.run(main)
