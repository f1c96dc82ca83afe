"""Restore from host memory vs recompute: one sequence, a 1,500-token prefix evicted by another prompt."""
import time, trio, uuid
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path

async def run(engine, prompt, cache=True):
    prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=1, sampling=SamplingParams(temperature=0.0), cache_prompt=cache))
    t = time.perf_counter()
    async with engine.stream(prepared) as events:
        async for e in events: pass
        return time.perf_counter() - t, events.usage

async def main():
    b = await LlamaBackend.aload(LlamaSettings(default_model_path(), slots=1))
    s = b._scheduler.kv  # (the cell manager: its save/restore timers)
    async with Engine(b) as engine:
        rows = []
        for rep in range(3):
            tag = uuid.uuid4().hex
            base = f"[{tag}] " + "The history of the city is long and varied. " * 150
            cold, u0 = await run(engine, base + " Question one?")
            await run(engine, f"[{uuid.uuid4().hex}] other " * 20)  # evicts to host memory
            r0, s0 = s.restore_seconds, s.save_seconds
            warm, u1 = await run(engine, base + " Question two?")
            restore = s.restore_seconds - r0
            rows.append((u0.prompt_tokens, cold, u1.cached_tokens, warm, restore, s0))
        st = b.cache_stats()["ram"]
        for r in rows:
            print(f"prompt {r[0]} tokens: cold TTFT {r[1]*1000:.0f} ms; after eviction to host memory: {r[2]} restored, TTFT {r[3]*1000:.0f} ms (restore {r[4]*1000:.1f} ms)")
        print("host", st, "kv bytes/token", s.kv_bytes_per_token)
trio.run(main)
