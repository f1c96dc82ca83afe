"""The llama_decode calls of each turn of the conversation benchmark (issue 35, "turns
5–7"): benchmarks/conversation.py's one conversation on ``/v1/completions`` (8 turns,
~180 new tokens a turn, 32-token greedy replies, the next turn sent at once), in
process, every ``llama_decode`` recorded — its rows, its time, and whether it was a
request's prefill piece, a decode step or an idle recompute — between a turn's send and
its first token.

    python scripts/probes/turn_calls.py [--idle-recompute on|off] [--piece-rule text|aligned]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.conversation import user_text
from trioserve import (
    Engine,
    GenerationRequest,
    LlamaBackend,
    LlamaSettings,
    SamplingParams,
    TextDelta,
    default_model_path,
)
from trioserve._backends._llama import _executor

CALLS: list[tuple[float, int, float]] = []  # (start, rows, seconds)


def record() -> None:
    original = _executor.Executor.decode

    def decode(self: _executor.Executor) -> object:
        began = time.perf_counter()
        outcome = original(self)
        CALLS.append((began, int(self.batch.n_tokens), time.perf_counter() - began))
        return outcome

    _executor.Executor.decode = decode  # type: ignore[method-assign]


async def main(args: argparse.Namespace) -> None:
    record()
    settings = LlamaSettings(
        str(default_model_path()),
        n_threads=2,
        idle_recompute=args.idle_recompute == "on",
        piece_rule=args.piece_rule,
        prefill_chunk=args.prefill_chunk,
    )
    backend = await LlamaBackend.aload(settings)
    prompt = ""
    async with Engine(backend) as engine:
        for turn in range(1, 9):
            text = user_text(0, turn, tag="probe-")
            prompt += f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
            greedy = SamplingParams(temperature=0.0)
            request = GenerationRequest(prompt=prompt, max_tokens=32, sampling=greedy)
            sent = time.perf_counter()
            mark = len(CALLS)
            prepared = await engine.prepare(request)
            first = None
            text = []
            async with engine.stream(prepared) as events:
                async for event in events:
                    if type(event) is TextDelta:
                        first = first or time.perf_counter()
                        text.append(event.text)
                usage = events.usage
            assert first is not None
            before = [c for c in CALLS[mark:] if c[0] < first]
            # the first token's call is the last one before it; the rest are prefill
            pieces = [rows for _, rows, _ in before]
            busy = sum(s for _, _, s in before)
            evaluated = usage.prompt_tokens - usage.cached_tokens
            print(
                f"turn {turn}: prompt {usage.prompt_tokens:5d}, evaluated {evaluated:4d}, "
                f"TTFT {(first - sent) * 1000:5.0f} ms, {len(before)} calls {pieces} "
                f"= {busy * 1000:5.0f} ms in llama_decode; reply starts {''.join(text)[:24]!r}",
                flush=True,
            )
            if args.verbose:
                for began, rows, seconds in CALLS[mark : mark + len(before) + 2]:
                    at = (began - sent) * 1000
                    print(f"    call {rows:4d} rows at {at:6.1f} ms for {seconds * 1000:5.1f} ms")
                print(f"    first text at {(first - sent) * 1000:6.1f} ms")
            prompt += "".join(text) + "<end_of_turn>\n"
    backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--idle-recompute", default="on", choices=["on", "off"])
    parser.add_argument("--piece-rule", default="text", choices=["text", "aligned"])
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--verbose", action="store_true", help="every call's start and time")
    trio.run(main, parser.parse_args())
