"""The stack's own cost per streamed token: server CPU time per token with the scripted backend.

``trioserve serve --scripted --scripted-interval 0`` makes tokens as fast as it can, so
whatever CPU the server process burns is the stack itself: the thread bridge, the
engine, SSE encoding, hypercorn and the socket writes. A raw-socket client reads one
stream of ``--tokens`` tokens as fast as it can; the server's CPU time (utime + stime,
all threads, ``/proc/<pid>/stat``) over the stream, divided by the tokens, is the figure.
The client runs in this process, so its own CPU is not counted.

    python benchmarks/bench_overhead.py --runs 5 --tokens 4000
"""

from __future__ import annotations

import argparse
import json
import socket
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
    completion_request,
    cpu_seconds,
    environment,
    free_port,
    log,
    markdown_table,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000, help="tokens per stream (default: 4000)")
    p.add_argument("--runs", type=int, default=5, help="streams, one after another (default: 5)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    return p.parse_args(argv)


def _read_stream(port: int, tokens: int) -> tuple[int, bytes]:
    """One stream over a raw socket, read as fast as possible; returns (bytes, tail)."""
    body = {"prompt": "p", "max_tokens": tokens, "stream": True}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(completion_request("127.0.0.1", port, body))
        total = 0
        tail = b""
        while chunk := sock.recv(1 << 20):
            total += len(chunk)
            tail = (tail + chunk)[-200:]
    return total, tail


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    exe = Path(sys.executable).with_name("trioserve")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "trioserve._cli"]
    command = [*launcher, "serve", "--scripted", "--scripted-interval", "0", "--port", str(port)]
    per_token_us: list[float] = []
    with tempfile.TemporaryDirectory() as logs:
        server = ServerProcess("trioserve", command, port, "/health", Path(logs))
        try:
            with httpx.Client() as client:
                server.wait_ready(client, 60)
            _read_stream(port, 200)  # warm-up: imports, first-request paths
            for run_index in range(args.runs):
                before = cpu_seconds(server.pid)
                started = time.perf_counter()
                size, tail = _read_stream(port, args.tokens)
                wall = time.perf_counter() - started
                used = cpu_seconds(server.pid) - before
                if b"[DONE]" not in tail:
                    raise RuntimeError(f"run {run_index}: the stream did not end with [DONE]: {tail!r}")
                per_token_us.append(used / args.tokens * 1e6)
                log(
                    f"run {run_index + 1}: {used * 1000:.0f} ms CPU, {wall * 1000:.0f} ms wall, "
                    f"{size} bytes, {per_token_us[-1]:.1f} µs/token"
                )
        finally:
            server.stop()
    return {
        "config": {"tokens": args.tokens, "runs": args.runs, **environment()},
        "per_token_us": per_token_us,
        "median_us": statistics.median(per_token_us),
        "notes": ["CPU time has clock-tick resolution (10 ms): with 4,000 tokens that is 2.5 µs per token."],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [["stream", "server CPU per token (µs)"]]
    rows += [[str(i + 1), f"{v:.1f}"] for i, v in enumerate(result["per_token_us"])]
    rows.append(["median", f"{result['median_us']:.1f}"])
    print(markdown_table(rows))
    if args.out is None:
        print(json.dumps({"median_us": result["median_us"]}))


if __name__ == "__main__":
    raise SystemExit(bench_main(None, parse_args, run, report))
