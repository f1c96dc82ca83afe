"""The cost of a streamed event: N concurrent streams of ``trioserve serve --scripted``
beside the floor (a bare ASGI app on hypercorn's Trio worker writing the same
``chat.completion.chunk`` events at the same pace: ``benchmarks/harness/floor.py``, stock
hypercorn), the same with trioserve's hypercorn send patches (``floor+patches``:
``floor.py --patched``) and that one with its paced events made in a worker thread per
stream (``floor+thread``: ``--patched --threaded``; skipped at full speed).

Paced (``--interval`` 0.02: one event per 20 ms per stream) and at full speed
(``--interval`` 0), for each of ``--streams`` (16, 64, 256). One Trio raw-socket client in
this process opens every stream at once, reads all of them to ``[DONE]`` (each bounded by
``--request-timeout``) and stops. Per run: the server's CPU per content event (process
CPU from ``/proc``, all threads), events/s, the server's cores, the p99 gap between a
stream's reads that carried events, when the last stream's first event came (from the
run's start), and the streams complete. Method: docs/benchmarks.md.

    python benchmarks/fanout.py [--streams 16,64,256] [--events 100] [--full-tokens 500]
        [--modes paced,full] [--contestants trioserve,floor,floor+patches,floor+thread] [--json out.json]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.proc import cpu_seconds
from benchmarks.harness.stats import table

TRIOSERVE, FLOOR, FLOOR_PATCHED, FLOOR_THREAD = "trioserve", "floor", "floor+patches", "floor+thread"
CONTENT = b'{"content":'  # a content delta (the role chunk's delta starts with "role")
FLOOR_SCRIPT = Path(__file__).resolve().parent / "harness" / "floor.py"


def parse_args() -> Any:
    every = (TRIOSERVE, FLOOR, FLOOR_PATCHED, FLOOR_THREAD)
    p = cli.parser(__doc__, (every, every), streams=[16, 64, 256])
    cli.option(p, "--interval", 0.02, "seconds between a paced stream's events")
    cli.option(p, "--events", 100, "content events per paced stream")
    cli.option(p, "--full-tokens", 500, "tokens per stream at full speed")
    cli.option(p, "--modes", "paced,full", "paced, full (speed) or both")
    p.add_argument("--server-arg", action="append", default=[], help="one more trioserve flag (repeatable)")
    return p.parse_args()


class Stream:
    __slots__ = ("done", "events", "first", "gaps", "last", "status")

    def __init__(self) -> None:
        self.events = 0
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.done = False
        self.status = b""


async def read_stream(port: int, tokens: int, stream: Stream, bound: float) -> None:
    payload = json.dumps(
        {
            "model": "scripted",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    )
    head += f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    now = trio.current_time
    with trio.move_on_after(bound):
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        async with sock:
            await sock.send_all(head.encode() + payload)
            tail = b""
            while data := await sock.receive_some(65536):
                if not stream.status:
                    stream.status = data[9:12]
                window = tail + data
                count = window.count(CONTENT) - tail.count(CONTENT)
                if count:
                    at = now()
                    if stream.first is None:
                        stream.first = at
                    elif stream.last is not None:
                        stream.gaps.append(at - stream.last)
                    stream.last = at
                    stream.events += count
                if b"data: [DONE]" in window:
                    stream.done = True
                tail = window[-16:]


async def one_run(port: int, streams: int, tokens: int, bound: float) -> tuple[list[Stream], float, float]:
    out = [Stream() for _ in range(streams)]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for stream in out:
            nursery.start_soon(read_stream, port, tokens, stream, bound)
    return out, started, trio.current_time()


def measure(server: servers.Server, streams: int, tokens: int, timeout: float) -> dict[str, Any]:
    before = cpu_seconds(server.pid)
    results, started, ended = trio.run(one_run, server.port, streams, tokens, timeout)
    cpu = cpu_seconds(server.pid) - before
    wall = ended - started
    events = sum(s.events for s in results)
    gaps = sorted(g for s in results for g in s.gaps)
    firsts = [s.first - started for s in results if s.first is not None]
    return {
        "streams": streams,
        "tokens_per_stream": tokens,
        "wall_s": wall,
        "server_cpu_s": cpu,
        "events": events,
        "cpu_per_event_us": cpu / events * 1e6 if events else math.nan,
        "cpu_per_token_us": cpu / (streams * tokens) * 1e6,
        "events_per_s": events / wall,
        "server_cores": cpu / wall,
        "gap_p50_ms": statistics.median(gaps) * 1e3 if gaps else math.nan,
        "gap_p99_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3 if gaps else math.nan,
        "gap_max_ms": gaps[-1] * 1e3 if gaps else math.nan,
        "last_first_event_ms": max(firsts) * 1e3 if firsts else math.nan,
        "complete": sum(s.done for s in results),
        "statuses": sorted({s.status.decode() for s in results}),
    }


def start(name: str, port: int, interval: float, slots: int, logs: Path, extra: list[str]) -> servers.Server:
    if name in (FLOOR, FLOOR_PATCHED, FLOOR_THREAD):
        argv = [sys.executable, str(FLOOR_SCRIPT), "--port", str(port), "--interval", str(interval)]
        argv += ["--patched"] if name in (FLOOR_PATCHED, FLOOR_THREAD) else []
        argv += ["--threaded"] if name == FLOOR_THREAD else []
    else:
        options = ["--scripted", "--scripted-interval", str(interval), "--slots", str(slots)]
        argv = servers.trioserve_command(port, *options, "--max-queue", str(slots), *extra)
    return servers.Server(f"{name}-{interval:g}", argv, port, logs)


def run(args: Any) -> dict[str, Any]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cfg = cli.environment(None, **cli.pick(args, "streams interval events full_tokens contestants"))
    cfg |= {"modes": modes, "server_args": args.server_arg}
    rows: list[dict[str, Any]] = []
    slots = max(args.streams)
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        for mode in modes:
            interval, tokens = (args.interval, args.events) if mode == "paced" else (0.0, args.full_tokens)
            for name in args.contestants:
                if name == FLOOR_THREAD and not interval:
                    continue  # (its thread paces: at full speed it is the floor)
                server = start(name, servers.free_port(), interval, slots, Path(logs), args.server_arg)
                running.append(server)
                server.wait_ready(args.ready_timeout)
                measure(server, 4, 20, args.request_timeout)  # warm-up: imports, first-request paths
                for streams in args.streams:
                    row = measure(server, streams, tokens, args.request_timeout)
                    rows.append({"contestant": name, "mode": mode, **row})
                    cli.log(
                        f"{name} {mode} {streams}: {row['cpu_per_event_us']:.0f} µs/event, "
                        f"{row['events_per_s']:.0f} events/s, {row['server_cores']:.2f} cores, "
                        f"gap p99 {row['gap_p99_ms']:.0f} ms, "
                        f"last first {row['last_first_event_ms']:.0f} ms, "
                        f"{row['complete']}/{streams}"
                    )
                server.check_alive()
                server.stop()
                running.remove(server)
    problems = [
        f"{r['contestant']} {r['mode']} {r['streams']}: {r['complete']} complete"
        for r in rows
        if r["complete"] < r["streams"]
    ]
    note = "server CPU has clock-tick resolution (10 ms); the client shares the machine with the server"
    return {"config": cfg, "rows": rows, "problems": problems, "notes": [note]}


def report(result: dict[str, Any], args: Any) -> None:
    cfg = result["config"]
    print(
        cli.header(
            cfg,
            f"fan-out, paced {cfg['interval']:g} s × {cfg['events']} events, "
            f"full speed {cfg['full_tokens']} tokens",
        )
    )
    head = ["mode", "streams", "contestant", "CPU/event µs", "CPU/token µs", "events/s", "cores"]
    rows = [[*head, "gap p50 ms", "gap p99 ms", "last stream's first event ms", "complete"]]
    for r in result["rows"]:
        rows.append(
            [
                r["mode"],
                str(r["streams"]),
                r["contestant"],
                f"{r['cpu_per_event_us']:.0f}",
                f"{r['cpu_per_token_us']:.1f}",
                f"{r['events_per_s']:.0f}",
                f"{r['server_cores']:.2f}",
                f"{r['gap_p50_ms']:.1f}",
                f"{r['gap_p99_ms']:.1f}",
                f"{r['last_first_event_ms']:.0f}",
                f"{r['complete']}/{r['streams']}",
            ]
        )
    print(table(rows))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
