"""Does one large request stall the event loop? ``/health`` latency beside large bodies.

One ``trioserve serve --scripted``. A separate process (its own GIL) polls ``GET /health``
every ``--interval`` s on one keep-alive connection and times each answer; meanwhile this
process sends ``--reps`` of each large body, one after another: ``count-text`` (an
Anthropic ``/v1/messages/count_tokens`` body of one ~``--mib`` MiB user message),
``count-turns`` (the same size as many short messages: decoding and validation of many
objects) and ``chat-text`` (a ``/v1/chat/completions`` body of one ~``--mib`` MiB
message, which the scripted model's context refuses after parsing: 400). Reported per
body: the requests' time, and the polls that overlapped a request: count, p50, p99, max.
The bar (issue 53): the worst ``/health`` beside any single request ≤ 50 ms.

    python benchmarks/loop_stall.py [--mib 3.5] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.stats import table


def parse_args() -> Any:
    p = cli.parser(__doc__)
    cli.option(p, "--mib", 3.5, "size of each large body, MiB")
    cli.option(p, "--reps", 5, "requests of each body")
    cli.option(p, "--interval", 0.002, "seconds between /health polls")
    p.add_argument("--server-arg", action="append", default=[], help="one more trioserve flag (repeatable)")
    return p.parse_args()


def poll(port: int, interval: float, stop: Any, out: Any) -> None:
    """In a process of its own: (start, seconds) of each ``/health`` until ``stop``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    samples = []
    while not stop.is_set():
        started = time.time()
        conn.request("GET", "/health")
        conn.getresponse().read()
        samples.append((started, time.time() - started))
        time.sleep(interval)
    out.put(samples)


def bodies(mib: float) -> dict[str, tuple[str, bytes]]:
    size = int(mib * 1024 * 1024)
    text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    # (4,000 turns: under --max-messages' default, 4,096)
    turn = text[: size // 4000 - 40]
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": turn} for i in range(4000)]
    count = "/v1/messages/count_tokens"
    return {
        "count-text": (
            count,
            json.dumps({"model": "scripted", "messages": [{"role": "user", "content": text}]}).encode(),
        ),
        "count-turns": (count, json.dumps({"model": "scripted", "messages": turns}).encode()),
        "chat-text": (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode(),
        ),
    }


def nearest_rank(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))] if values else float("nan")


def run(args: Any) -> dict[str, Any]:
    cfg = cli.environment(None, **cli.pick(args, "mib reps interval server_arg"))
    port = servers.free_port()
    windows: list[tuple[str, float, float, int]] = []
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        argv = servers.trioserve_command(port, "--scripted", *args.server_arg)
        running.append(server := servers.Server(servers.TRIOSERVE, argv, port, Path(logs)))
        server.wait_ready(args.ready_timeout)
        poller = ctx.Process(target=poll, args=(port, args.interval, stop, out))
        poller.start()
        time.sleep(1.0)  # (the poller's first answers: its imports and connection are done)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for name, (path, data) in bodies(args.mib).items():
                for _ in range(args.reps):
                    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
                    started = time.time()
                    response = client.post(path, content=data, headers=headers)
                    windows.append((name, started, time.time(), response.status_code))
                    time.sleep(0.2)
        stop.set()
        samples = out.get(timeout=30)
        poller.join(timeout=10)
    rows = []
    for name in dict.fromkeys(w[0] for w in windows):
        mine = [w for w in windows if w[0] == name]
        beside = [s for _, a, b, _ in mine for (t, s) in samples if t + s >= a and t <= b]
        rows.append(
            {
                "body": name,
                "bytes": len(bodies(args.mib)[name][1]),
                "statuses": sorted({w[3] for w in mine}),
                "request_ms_median": sorted((b - a) * 1e3 for _, a, b, _ in mine)[len(mine) // 2],
                "polls": len(beside),
                "p50_ms": nearest_rank(beside, 0.5) * 1e3,
                "p99_ms": nearest_rank(beside, 0.99) * 1e3,
                "max_ms": max(beside, default=float("nan")) * 1e3,
            }
        )
    idle = [s for (t, s) in samples if not any(a - 0.1 <= t <= b + 0.1 for _, a, b, _ in windows)]
    return {"config": cfg, "rows": rows, "idle_max_ms": max(idle, default=float("nan")) * 1e3}


def report(result: dict[str, Any], args: Any) -> None:
    print(cli.header(result["config"], f"/health beside {result['config']['mib']} MiB bodies"))
    rows = [["body", "bytes", "status", "request ms (median)", "polls beside", "p50 ms", "p99 ms", "max ms"]]
    for r in result["rows"]:
        rows.append(
            [
                r["body"],
                str(r["bytes"]),
                ",".join(map(str, r["statuses"])),
                f"{r['request_ms_median']:.0f}",
                str(r["polls"]),
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['max_ms']:.1f}",
            ]
        )
    print(table(rows))
    print(f"\n/health max between requests: {result['idle_max_ms']:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
