"""Issue 23: what the text rule costs a cold prompt against absolute alignment — time to
the first token of prompts with no cache (code, prose, a chat with a long tool output),
each rule, best of 3, alternated.

    python scripts/probes/piece_rule_cold.py
"""
import time, trio
from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, default_model_path

CODE = "\n".join(f"def f{i}(x):\n    y = x * {i} + {i % 7}\n    return y if y > {i} else -y\n" for i in range(60))
PROSE = "The history of the city is long and rich. In 1437 the people of the harbour met again. " * 45
CHAT = ("<start_of_turn>user\nRead the log.<end_of_turn>\n<start_of_turn>model\ncall read_log()<end_of_turn>\n"
        "<start_of_turn>user\nread_log returned: " + "\n".join(f"line {i}: ship {i} arrived with grain." for i in range(120))
        + "<end_of_turn>\n<start_of_turn>model\n")


async def ttft(engine, prompt):
    prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=1, sampling=SamplingParams(temperature=0.0), cache_prompt=False))
    t = time.perf_counter()
    async with engine.stream(prepared) as events:
        async for _ in events:
            pass
    return time.perf_counter() - t, len(prepared.tokens)


async def main():
    engines = {}
    for rule in ("aligned", "text"):
        backend = await LlamaBackend.aload(LlamaSettings(default_model_path(), slots=1, n_threads=2, piece_rule=rule))
        engines[rule] = Engine(backend)
    best = {}
    for name, prompt in (("code", CODE), ("prose", PROSE), ("chat + tool output", CHAT)):
        for _ in range(3):
            for rule, engine in engines.items():
                s, n = await ttft(engine, prompt)
                best[(name, rule)] = min(best.get((name, rule), 1e9), s)
                best[(name, "n")] = n
        a, t = best[(name, "aligned")], best[(name, "text")]
        pieces = len(engines["text"].backend.piece_rule.cuts(engines["text"].backend.tokenize(prompt)))
        print(f"{name}: {best[(name, 'n')]} tokens, {pieces} cuts; aligned {a*1e3:.0f} ms, text {t*1e3:.0f} ms: {t/a:.3f}×")
    for engine in engines.values():
        await engine.aclose()


trio.run(main)
