"""TTFT per turn of a growing conversation: idle recompute on vs off (the user reads 1 s)."""
import sys, time, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path

async def turn(engine, prompt):
    prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=32, sampling=SamplingParams(temperature=0.0)))
    text = []; t = time.perf_counter(); ttft = None
    async with engine.stream(prepared) as events:
        async for e in events:
            if type(e) is TextDelta:
                ttft = ttft or time.perf_counter() - t
                text.append(e.text)
        return "".join(text), events.usage, ttft

async def main():
    out = {}
    for idle in (False, True):
        b = await LlamaBackend.aload(LlamaSettings(default_model_path(), idle_recompute=idle, slots=8))
        async with Engine(b) as engine:
            prompt = "<start_of_turn>user\nLet us talk about the history of the sea and ships.<end_of_turn>\n"
            rows = []
            for i in range(8):
                prompt += "<start_of_turn>user\n" + f"Question {i}: tell me, in detail and with examples, about sailing ships, ports, trade winds and navigation. " * 5 + "<end_of_turn>\n<start_of_turn>model\n"
                text, usage, ttft = await turn(engine, prompt)
                rows.append((i + 1, usage.prompt_tokens, usage.cached_tokens, ttft, text))
                prompt += text + "<end_of_turn>\n"
                # the user reads: wait until the idle work is done (bounded)
                with trio.move_on_after(5):
                    while b.cache_stats()["idle_recompute"]["pending"]:
                        await trio.sleep(0.01)
            out[idle] = rows
            print("idle", idle, b.cache_stats()["idle_recompute"])
    for a, b_ in zip(out[False], out[True]):
        print(f"turn {a[0]} prompt {a[1]:5d} | off: cached {a[2]:5d} ttft {a[3]*1000:5.0f} ms | on: cached {b_[2]:5d} ttft {b_[3]*1000:5.0f} ms | same text {a[4] == b_[4]}")
trio.run(main)
