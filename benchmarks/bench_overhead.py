"""The stack's own cost per streamed token: server CPU time per token with the scripted backend.

``trioserve serve --scripted --scripted-interval 0`` makes tokens as fast as it can, so
whatever CPU the server process burns is the stack itself: the thread bridge, the
engine, SSE encoding, hypercorn and the socket writes. A raw-socket client reads one
stream of ``--tokens`` tokens as fast as it can; the server's CPU time (utime + stime,
all threads, ``/proc/<pid>/stat``) over the stream, divided by the tokens, is the figure.
The client runs in this process, so its own CPU is not counted. The report also counts
the SSE events: at no delay the consumer falls behind the producer and one event carries
several tokens; ``--interval 0.0005`` (2,000 tokens/s) paces the producer so that the
consumer keeps up and every token is an event of its own (the scripted thread sleeps
between tokens, so its pacing costs little CPU).

    python benchmarks/bench_overhead.py --runs 5 --tokens 4000
    python benchmarks/bench_overhead.py --runs 5 --tokens 4000 --interval 0.0005
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    ServerProcess,
    bench_main,
    cpu_seconds,
    environment,
    free_port,
    log,
    markdown_table,
    raw_sse_events,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000, help="tokens per stream (default: 4000)")
    p.add_argument("--runs", type=int, default=5, help="streams, one after another (default: 5)")
    p.add_argument("--interval", type=float, default=0.0, help="--scripted-interval, seconds (default: 0)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    return p.parse_args(argv)


def _read_stream(port: int, tokens: int) -> tuple[int, int, bytes]:
    """One stream over a raw socket, read as fast as possible; returns (bytes, SSE
    events, last event)."""
    total = events = 0
    last = b""
    for _, event in raw_sse_events(port, {"prompt": "p", "max_tokens": tokens, "stream": True}):
        total += len(event) + 2
        events += b"data: " in event
        last = event
    return total, events, last


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    exe = Path(sys.executable).with_name("trioserve")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "trioserve._cli"]
    command = [
        *launcher,
        "serve",
        "--scripted",
        "--scripted-interval",
        str(args.interval),
        "--port",
        str(port),
    ]
    per_token_us: list[float] = []
    events_per_run: list[int] = []
    with tempfile.TemporaryDirectory() as logs:
        server = ServerProcess("trioserve", command, port, "/health", Path(logs))
        try:
            with httpx.Client() as client:
                server.wait_ready(client, 60)
            _read_stream(port, 200)  # warm-up: imports, first-request paths
            for run_index in range(args.runs):
                before = cpu_seconds(server.pid)
                started = time.perf_counter()
                size, events, tail = _read_stream(port, args.tokens)
                wall = time.perf_counter() - started
                used = cpu_seconds(server.pid) - before
                if b"[DONE]" not in tail:
                    raise RuntimeError(f"run {run_index}: the stream did not end with [DONE]: {tail!r}")
                per_token_us.append(used / args.tokens * 1e6)
                events_per_run.append(events)
                log(
                    f"run {run_index + 1}: {used * 1000:.0f} ms CPU, {wall * 1000:.0f} ms wall, "
                    f"{size} bytes, {events} events, {per_token_us[-1]:.1f} µs/token"
                )
        finally:
            server.stop()
    return {
        "config": {"tokens": args.tokens, "runs": args.runs, "interval": args.interval, **environment()},
        "per_token_us": per_token_us,
        "events": events_per_run,
        "median_us": statistics.median(per_token_us),
        "notes": ["CPU time has clock-tick resolution (10 ms): with 4,000 tokens that is 2.5 µs per token."],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [["stream", "server CPU per token (µs)", "SSE events"]]
    rows += [
        [str(i + 1), f"{v:.1f}", str(e)]
        for i, (v, e) in enumerate(zip(result["per_token_us"], result["events"], strict=True))
    ]
    rows.append(["median", f"{result['median_us']:.1f}", str(int(statistics.median(result["events"])))])
    print(markdown_table(rows))
    if args.out is None:
        print(json.dumps({"median_us": result["median_us"]}))


if __name__ == "__main__":
    raise SystemExit(bench_main(None, parse_args, run, report))
