"""fast vs exact vs cache-off: texts equal to cache-off, and TTFT per turn (3 conversations x 8 turns)."""
import statistics, time, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path
TOPICS = ["sailing ships and trade winds", "volcanoes and islands", "old trains and stations"]
async def turn(engine, prompt):
    prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=32, sampling=SamplingParams(temperature=0.0)))
    text = []; t = time.perf_counter(); ttft = None
    async with engine.stream(prepared) as events:
        async for e in events:
            if type(e) is TextDelta:
                ttft = ttft or time.perf_counter() - t
                text.append(e.text)
        return "".join(text), events.usage, ttft
async def conversations(engine, b, wait_idle):
    out = []
    for topic in TOPICS:
        prompt = f"<start_of_turn>user\nLet us talk about {topic}.<end_of_turn>\n"
        for i in range(8):
            prompt += "<start_of_turn>user\n" + f"Question {i}: tell me, in detail and with examples, about {topic}, the people and the places. " * 4 + "<end_of_turn>\n<start_of_turn>model\n"
            text, usage, ttft = await turn(engine, prompt)
            out.append((topic, i, text, usage.cached_tokens, ttft))
            prompt += text + "<end_of_turn>\n"
            if wait_idle:
                with trio.move_on_after(5):
                    while b.cache_stats()["idle_recompute"]["pending"]:
                        await trio.sleep(0.01)
    return out
async def main():
    res = {}
    for mode in ("off", "exact", "fast"):
        s = LlamaSettings(default_model_path(), prompt_cache=(mode != "off"), cache_mode=("fast" if mode == "fast" else "exact"))
        b = await LlamaBackend.aload(s)
        async with Engine(b) as engine:
            res[mode] = await conversations(engine, b, True)
    for mode in ("exact", "fast"):
        eq = sum(a[2] == r[2] for a, r in zip(res[mode], res["off"]))
        ttft = statistics.median(x[4] for x in res[mode] if x[1] > 0) * 1000
        cached = statistics.median(x[3] for x in res[mode] if x[1] > 0)
        print(f"{mode}: {eq}/{len(res['off'])} texts equal to cache-off; median TTFT turns 2-8 {ttft:.0f} ms; median cached {cached}")
    print(f"off: median TTFT turns 2-8 {statistics.median(x[4] for x in res['off'] if x[1] > 0)*1000:.0f} ms")
    for i in range(8):
        print(i + 1, " ".join(f"{m}={statistics.median(x[4] for x in res[m] if x[1] == i)*1000:.0f}" for m in ("off", "exact", "fast")))
trio.run(main)
