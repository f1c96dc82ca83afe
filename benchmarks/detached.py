"""A detached stream nobody reads: how much CPU does it burn after its client left?

Per server: one streamed, greedy completion (``max_tokens`` 4000 by default, the end of
sequence banned so that it runs to it) opted in to resumption (``X-Conversation-Id``:
llama-server's #23226 and trioserve); the client reads the first event and closes.
Then the server's CPU is sampled from ``/proc/<pid>/stat`` every 100 ms for
``--watch`` seconds: its core-seconds after the client left, when it went quiet (the
first moment after which no 1 s window uses more than ``--quiet-pct`` % of a core),
and, for trioserve, when its log filled (``/health``'s ``detached`` says ``paused`` or
``parked``). At the end a reader attaches (``GET /v1/stream?conv_id=&from=<bytes
read>``) and reads to the end: every server must still complete the answer.

    python benchmarks/detached.py --json artifacts/detached.json

Columns and what to expect: docs/benchmarks.md, "A detached stream nobody reads".
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import RawStream, body
from benchmarks.harness.proc import cpu_seconds, wait_cpu_idle
from benchmarks.harness.stats import rows_table

SERVERS = (servers.TRIOSERVE, servers.LLAMA_SERVER)


def parse_args() -> Any:
    p = cli.parser(__doc__, (SERVERS, SERVERS), threads=2, ctx_size=4096, max_tokens=4000)
    p.add_argument("--prompt", default=cli.DEFAULT_PROMPT, help="the prompt (default: %(default)r)")
    cli.option(p, "--watch", 75.0, "seconds of sampling after the client left")
    cli.option(p, "--quiet-pct", 5.0, "a 1 s window under this %% of a core is quiet")
    return p.parse_args()


def _detached_state(server: servers.Server) -> str | None:
    if server.name != servers.TRIOSERVE:
        return None
    counts = server.health().get("detached", {})
    for state in ("parked", "paused", "running"):
        if counts.get(state):
            return state
    return None


def run_case(server: servers.Server, args: Any) -> dict[str, Any]:
    conversation = "bench-" + uuid.uuid4().hex[:12]
    payload = body(args.prompt, args.max_tokens, logit_bias={"1": -100, "106": -100})
    stream = RawStream(server.port, payload, {"X-Conversation-Id": conversation})
    stream.read_until(lambda: len(stream.events) >= 2, stream.sent_at + 120)
    left = stream.close()
    start_cpu = cpu_seconds(server.pid)
    samples: list[tuple[float, float]] = [(0.0, 0.0)]
    states: list[tuple[float, str | None]] = []
    while time.perf_counter() - left < args.watch:
        time.sleep(0.1)
        samples.append((time.perf_counter() - left, cpu_seconds(server.pid) - start_cpu))
        if len(samples) % 5 == 0:
            states.append((samples[-1][0], _detached_state(server)))
    quiet = None
    for i in range(len(samples)):
        rest = samples[i:]
        windows = [
            (b[1] - a[1]) / (b[0] - a[0]) * 100
            for a, b in zip(rest, rest[10:], strict=False)
            if b[0] - a[0] > 0
        ]
        if windows and max(windows) <= args.quiet_pct:
            quiet = samples[i][0]
            break
    full_at = next((t for t, state in states if state in ("paused", "parked")), None)
    parked_at = next((t for t, state in states if state == "parked"), None)
    # a reader comes back: the answer must still complete
    with httpx.Client(timeout=args.request_timeout) as client:
        resumed = client.get(server.url + "/v1/stream", params={"conv_id": conversation, "from": 0})
    complete = resumed.status_code == 200 and b"[DONE]" in resumed.content
    idle = wait_cpu_idle(server.pid, time.perf_counter(), 30.0)
    stop = stop_case(server, args)
    return {
        **stop,
        "server": server.name,
        "core_seconds_detached": samples[-1][1],
        "quiet_from_s": quiet,
        "log_full_at_s": full_at,
        "parked_at_s": parked_at,
        "resumed_status": resumed.status_code,
        "resumed_bytes": len(resumed.content),
        "completed_after_resume": complete,
        "busy_after_resume_s": idle.after_s,
        "samples": samples,
        "states": states,
    }


def stop_case(server: servers.Server, args: Any) -> dict[str, Any]:
    """A Stop while detached: a second stream, left 2 s after its first event (still
    decoding), then ``DELETE /v1/stream``: how long until the server's CPU is idle."""
    conversation = "bench-stop-" + uuid.uuid4().hex[:8]
    payload = body(args.prompt, args.max_tokens, logit_bias={"1": -100, "106": -100})
    stream = RawStream(server.port, payload, {"X-Conversation-Id": conversation})
    stream.read_until(lambda: len(stream.events) >= 2, stream.sent_at + 120)
    stream.close()
    time.sleep(2.0)
    with httpx.Client(timeout=30) as client:
        sent = time.perf_counter()
        answer = client.delete(server.url + "/v1/stream", params={"conv_id": conversation})
        answered = time.perf_counter() - sent
    idle = wait_cpu_idle(server.pid, sent, 30.0)
    return {
        "stop_status": answer.status_code,
        "stop_answer_ms": answered * 1000,
        "busy_after_stop_s": idle.after_s,
    }


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    cfg = cli.environment(model, **cli.pick(args, "threads ctx_size max_tokens prompt watch quiet_pct"))
    cases: list[dict[str, Any]] = []
    cfg["commands"] = {}
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        for name in args.contestants:
            server = servers.Server.start(name, model, Path(logs), **cli.pick(args, "threads ctx_size"))
            running.append(server)
            cfg["commands"][name] = server.command
            server.wait_ready(args.ready_timeout)
            warm = RawStream(server.port, body(args.prompt, 8))
            warm.read_until(warm.done, warm.sent_at + 60)
            wait_cpu_idle(server.pid, warm.close(), 20.0)
            cases.append(case := run_case(server, args))
            cli.log(
                f"{server.name:<14} {case['core_seconds_detached']:.1f} core-s in {args.watch:g} s detached, "
                f"quiet from {case['quiet_from_s']} s, log full at {case['log_full_at_s']} s"
            )
            server.stop()
            running.remove(server)
    return {"config": cfg, "cases": cases, "notes": []}


def report(result: dict[str, Any], args: Any) -> None:
    cfg = result["config"]
    what = f"max_tokens {cfg['max_tokens']}, {cfg['threads']} threads, watched {cfg['watch']:g} s"
    print(cli.header(cfg, what))

    def opt(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f}"

    columns = [
        ("server", lambda c: servers.LABELS.get(c["server"], c["server"])),
        ("core-s while detached", lambda c: f"{c['core_seconds_detached']:.1f}"),
        ("quiet from s", lambda c: opt(c["quiet_from_s"])),
        ("log full at s", lambda c: opt(c["log_full_at_s"])),
        ("parked at s", lambda c: opt(c["parked_at_s"])),
        ("resumed: status, bytes", lambda c: f"{c['resumed_status']}, {c['resumed_bytes']}"),
        ("completed", lambda c: "yes" if c["completed_after_resume"] else "no"),
        ("DELETE answered ms", lambda c: f"{c['stop_answer_ms']:.0f}"),
        ("busy after DELETE s", lambda c: opt(c["busy_after_stop_s"])),
    ]
    print(rows_table(result["cases"], columns))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
