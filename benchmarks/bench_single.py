"""One stream, paired: trioserve's decode rate against the bare llama.cpp decode loop.

Each pair runs, the same minute, (1) ``decode-only`` — ``bench_batched.py``'s in-process
low-level loop for one sequence (prefill, then ``max_tokens − 1`` ``llama_decode`` calls
each followed by llama.cpp's greedy sampler; tok/s = those tokens ÷ the loop's time) — and
(2) ``trioserve serve`` with its default flags but ``--threads``/``--ctx-size`` matched,
read by a raw-socket client that only splits the SSE stream (no JSON parsing, no httpx):
tok/s = (tokens − 1) ÷ (last event − first event). Only one of the two computes at a time.

The light client matters on a small machine: the client runs on the same cores as
llama.cpp's threads, and a Python SSE client (httpx, as ``bench_batched.py`` uses)
costs enough CPU per token to show in the ratio (measured: 0.96× with it, see
docs/benchmarks.md).

    python benchmarks/bench_single.py --pairs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx
from _common import (
    ServerProcess,
    argument_parser,
    bench_main,
    environment,
    free_port,
    log,
    markdown_table,
    raw_sse_events,
    resolve_model,
    trioserve_command,
)
from bench_batched import LowLevel

PROMPT = "Once upon a time"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--pairs", type=int, default=5, help="paired runs (default: 5)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream (default: 128)")
    p.add_argument("--threads", type=int, default=2, help="threads, both contestants (default: 2)")
    p.add_argument("--ctx-size", type=int, default=2048, help="context per sequence (default: 2048)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    args.prompt_list = [PROMPT]
    return args


def _stream_rate(port: int, max_tokens: int) -> tuple[float, int]:
    """tok/s between the first and the last text event, and the events seen."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    first = last = 0.0
    events = 0
    for now, event in raw_sse_events(port, body):
        if b'"text":"' in event and b'"finish_reason":null' in event:
            events += 1
            first = first or now
            last = now
    if events < 2:
        raise RuntimeError("trioserve streamed fewer than two text events")
    return (max_tokens - 1) / (last - first), events


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    low = LowLevel(model, args)
    pairs: list[dict[str, float]] = []
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        command = trioserve_command(model, port, args.threads, args.ctx_size)
        server = ServerProcess("trioserve", command, port, "/health", Path(logs))
        try:
            with httpx.Client() as client:
                server.wait_ready(client, 120)
            ctx = low.context(1)
            _stream_rate(port, 8)  # warm-up
            for index in range(args.pairs):
                loop = low.generate(ctx, [PROMPT], args.max_tokens)
                bare = (args.max_tokens - 1) / loop["loop_s"]
                served, events = _stream_rate(port, args.max_tokens)
                pairs.append(
                    {"decode_only": bare, "trioserve": served, "ratio": served / bare, "events": events}
                )
                ratio = served / bare
                log(f"pair {index + 1}: decode-only {bare:.1f}, trioserve {served:.1f} tok/s ({ratio:.3f}x)")
        finally:
            server.stop()
            low.close()
    return {
        "config": {
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "ctx_size": args.ctx_size,
            **environment(),
        },
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
        "notes": [],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [["pair", "decode-only tok/s", "trioserve tok/s", "ratio"]]
    for i, p in enumerate(result["pairs"]):
        rows.append([str(i + 1), f"{p['decode_only']:.1f}", f"{p['trioserve']:.1f}", f"{p['ratio']:.3f}×"])
    rows.append(["median", "", "", f"{result['median_ratio']:.3f}×"])
    print(markdown_table(rows))
    if args.out is None:
        print(json.dumps({"median_ratio": result["median_ratio"]}))


if __name__ == "__main__":
    raise SystemExit(bench_main(None, parse_args, run, report))
