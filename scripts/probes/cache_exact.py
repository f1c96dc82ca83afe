import time, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta, default_model_path

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "trains", "glaciers", "castles", "rivers"]

async def turn(engine, prompt, cache=True):
    prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=32, sampling=SamplingParams(temperature=0.0), cache_prompt=cache))
    text = []
    t = time.perf_counter(); ttft = None
    async with engine.stream(prepared) as events:
        async for e in events:
            if type(e) is TextDelta:
                ttft = ttft or time.perf_counter() - t
                text.append(e.text)
        usage = events.usage
    return "".join(text), usage, ttft

async def conversation(engine, name, turns, log):
    prompt = f"A conversation about {name}.\n"
    for i in range(turns):
        prompt += f"User: Tell me more about {TOPICS[(i + len(name)) % len(TOPICS)]} and {name}, please, in detail. " * 3 + "\nAssistant:"
        text, usage, ttft = await turn(engine, prompt)
        log.append((name, i, text, usage.prompt_tokens, usage.cached_tokens, ttft))
        prompt += text + "\n"

async def main():
    logs = {}
    for cache in (False, True):
        backend = await LlamaBackend.aload(LlamaSettings(default_model_path(), prompt_cache=cache, slots=4))
        async with Engine(backend) as engine:
            log = []
            # two conversations, interleaved turn by turn (sequentially)
            for i in range(6):
                for name in ("cats", "the sea"):
                    pass
            async def both():
                a = []; b = []
                pa = "A conversation about cats.\n"; pb = "A conversation about the sea.\n"
                for i in range(6):
                    for name, holder in (("cats", a), ("the sea", b)):
                        p = pa if name == "cats" else pb
                        p += f"User: Tell me more about {TOPICS[(i + len(name)) % len(TOPICS)]} and {name}, please, in detail. " * 3 + "\nAssistant:"
                        text, usage, ttft = await turn(engine, p)
                        log.append((name, i, text, usage.prompt_tokens, usage.cached_tokens, ttft))
                        p += text + "\n"
                        if name == "cats": pa = p
                        else: pb = p
            await both()
            logs[cache] = log
    same = 0
    for off, on in zip(logs[False], logs[True]):
        eq = off[2] == on[2]
        same += eq
        print(f"{on[0]:8s} turn {on[1]} prompt {on[3]:5d} cached {on[4]:5d}  ttft off {off[5]*1000:6.0f} on {on[5]*1000:6.0f} ms  equal={eq}")
        if not eq: print("   off:", repr(off[2][:60]), "\n   on: ", repr(on[2][:60]))
    print(f"{same}/{len(logs[True])} equal")
trio.run(main)
