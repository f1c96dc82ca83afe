"""Two generations at once, in one Trio program, under one deadline.

    python examples/two_generations.py --deadline 3

The engine has two slots (two sequences of one llama context, decoded together). Both
generations run inside one ``trio.move_on_after``: when it expires, both are cancelled
through the same path a client disconnect takes — their inference threads leave
llama.cpp at once — and the program prints what each had produced and exits 0.
"""

from __future__ import annotations

import argparse

import trio

from trioserve import (
    Engine,
    Finished,
    GenerationRequest,
    LlamaBackend,
    LlamaSettings,
    SamplingParams,
    TextDelta,
    default_model_path,
)


async def generate(engine: Engine, name: str, prompt: str, results: dict[str, str]) -> None:
    results[name] = ""
    request = GenerationRequest(
        prompt=prompt, max_tokens=2000, sampling=SamplingParams(temperature=0.7, seed=1)
    )
    async with engine.stream(request) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                results[name] += event.text
            elif isinstance(event, Finished):
                results[name] += f"  [{event.reason}]"


async def main(deadline: float) -> None:
    settings = LlamaSettings(default_model_path(), slots=2, n_ctx=2048)
    backend = await LlamaBackend.aload(settings)
    results: dict[str, str] = {}
    async with Engine(backend) as engine:
        with trio.move_on_after(deadline) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate, engine, "story", "Once upon a time", results)
                nursery.start_soon(generate, engine, "recipe", "The recipe begins with", results)
        for name, text in results.items():
            print(f"--- {name} ({len(text)} characters)\n{text.strip()}")
        ended = "the deadline cancelled both" if scope.cancelled_caught else "both finished in time"
        print(f"--- {ended}; generations still running: {backend.generations.running}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=3.0)
    trio.run(main, parser.parse_args().deadline)
