"""Stream a completion to the terminal with the engine in-process; Ctrl-C stops it.

    python examples/stream_cli.py "Once upon a time" --max-tokens 200

Ctrl-C (SIGINT) is turned into a cancel of the generation's scope: the inference thread
leaves llama.cpp through the abort callback — also in the middle of a long prompt — and
the program prints why it stopped and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

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


async def main(prompt: str, max_tokens: int, temperature: float, threads: int | None) -> None:
    backend = await LlamaBackend.aload(LlamaSettings(default_model_path(), n_threads=threads))
    async with Engine(backend) as engine:
        request = GenerationRequest(
            prompt=prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=temperature)
        )
        with trio.open_signal_receiver(signal.SIGINT) as signals, trio.CancelScope() as scope:

            async def cancel_on_ctrl_c() -> None:
                async for _ in signals:
                    scope.cancel()
                    return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_ctrl_c)
                async with engine.stream(request) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            print(event.text, end="", flush=True)
                        elif isinstance(event, Finished):
                            print(f"\n[{event.reason}: {event.usage.completion_tokens} tokens]")
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            print(f"\n[stopped by Ctrl-C; generations still running: {backend.generations.running}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    trio.run(main, args.prompt, args.max_tokens, args.temperature, args.threads)
    sys.exit(0)
