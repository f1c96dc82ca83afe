"""The stack's own CPU per streamed token: ``trioserve serve --scripted``, server CPU ÷ tokens.

The scripted backend makes tokens as fast as it can (``--interval`` 0) or paced
(``--interval 0.0005``: 2,000 tokens/s, the consumer keeps up, one event per token), so
the server's CPU is the stack: the thread bridge, the engine, SSE, hypercorn, the socket
writes. The raw-socket client runs in this process (its CPU is not counted) and reads
``--runs`` streams of ``--tokens`` one after another. Method: docs/benchmarks.md.

    python benchmarks/overhead.py --runs 5 --tokens 4000 [--interval 0.0005]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import RawStream
from benchmarks.harness.proc import cpu_seconds
from benchmarks.harness.stats import table


def parse_args() -> Any:
    p = cli.parser(__doc__)
    cli.option(p, "--tokens", 4000, "tokens per stream")
    cli.option(p, "--runs", 5, "streams, one after another")
    cli.option(p, "--interval", 0.0, "--scripted-interval, s")
    return p.parse_args()


def read(server: servers.Server, tokens: int) -> RawStream:
    stream = RawStream(server.port, {"prompt": "p", "max_tokens": tokens, "stream": True})
    for _ in stream.iter_events():
        pass
    if stream.done_at is None:
        raise RuntimeError(f"the stream did not end with [DONE]: {stream.events[-1:]!r}")
    return stream


def run(args: Any) -> dict[str, Any]:
    cfg = cli.environment(None, tokens=args.tokens, runs=args.runs, interval=args.interval)
    per_token_us, events, port = [], [], servers.free_port()
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        argv = servers.trioserve_command(port, "--scripted", "--scripted-interval", str(args.interval))
        running.append(server := servers.Server(servers.TRIOSERVE, argv, port, Path(logs)))
        server.wait_ready(args.ready_timeout)
        read(server, 200)  # warm-up: imports, first-request paths
        for i in range(args.runs):
            before, stream = cpu_seconds(server.pid), read(server, args.tokens)
            used = cpu_seconds(server.pid) - before
            per_token_us.append(used / args.tokens * 1e6)
            events.append(stream.data_events())
            cli.log(f"run {i + 1}: {used * 1e3:.0f} ms CPU, {events[-1]} events, {per_token_us[-1]:.1f} µs")
    note = f"CPU time has clock-tick resolution: 10 ms ÷ {args.tokens} tokens = {1e4 / args.tokens:.1f} µs"
    out = {"config": cfg, "per_token_us": per_token_us, "events": events, "notes": [note]}
    return out | {"median_us": statistics.median(per_token_us)}


def report(result: dict[str, Any], args: Any) -> None:
    cfg = result["config"]  # (the run's settings, not today's defaults)
    print(cli.header(cfg, f"{cfg['tokens']} tokens per stream, --scripted-interval {cfg['interval']:g}"))
    rows = [["stream", "server CPU per token (µs)", "SSE events"]]
    pairs = enumerate(zip(result["per_token_us"], result["events"], strict=True))
    rows += [[str(i + 1), f"{v:.1f}", str(e)] for i, (v, e) in pairs]
    rows.append(["median", f"{result['median_us']:.1f}", str(int(statistics.median(result["events"])))])
    print(table(rows))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
