import time, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, default_model_path
P = "The quick brown fox jumps over the lazy dog near the river bank. " * 130
async def run(nb):
    # one llama_decode call per `nb` prompt tokens (the prefill chunk), one sequence
    backend = await LlamaBackend.aload(LlamaSettings(default_model_path(), n_batch=max(512, nb), prefill_chunk=nb, slots=1, prompt_cache=False))
    async with Engine(backend) as engine:
        best = 1e9
        for _ in range(3):
            prepared = await engine.prepare(GenerationRequest(prompt=P, max_tokens=1, sampling=SamplingParams(temperature=0.0)))
            t = time.perf_counter()
            async with engine.stream(prepared) as events:
                async for e in events: pass
            best = min(best, time.perf_counter() - t)
        print(nb, len(prepared.tokens), f"{best*1000:.0f} ms", f"{len(prepared.tokens)/best:.0f} tok/s")
async def main():
    for nb in (512, 256, 128, 64, 32):
        await run(nb)
trio.run(main)
