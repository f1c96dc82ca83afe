"""Cancel latency: how soon a server stops computing once a request is abandoned.

Causes, each one streamed ``POST /v1/completions`` (greedy) on the raw-socket client:
``decode`` (``"Once upon a time"`` or ``--decode-prompt``, ``max_tokens`` 2000: read ``--events`` events, then
close, an RST by default), ``prefill`` (a ~1,700-token prompt behind a per-run tag, no
cached prefix; close ``--prefill-delay`` after sending, or once the computing server has
used ``--prefill-close-cpu`` CPU-s) and, trioserve only, ``deadline`` (the decode request
with ``X-Request-Timeout``, read to ``[DONE]``). Measured: the black-box CPU idle − cause
(``front-llama-server``, trioserve --upstream in front of a llama-server: that
llama-server's), trioserve's ``cancel_latency_ms`` log field (white-box), send → ``[DONE]``
(deadline); the bars; prefill runs left out, and why; llama-server's prompt tokens/s.
Rounds run every (server, cause) job once, the start rotating; before each job every
server must be idle. Method and bars: docs/benchmarks.md, "Method" and "Cancel latency";
llama-server settings: docs/deployment.md, "Upstream llama-server".

``--endpoint messages``: the same causes as streamed Anthropic ``POST /v1/messages``
(``{"model", "max_tokens", "messages": [{"role": "user", "content": the same text}],
"stream": true, "temperature": 0}``; the server renders its chat template around it), on
trioserve, llama-server (which serves it too) and front-llama-server (trioserve relays it
as a completion); not llama-cpp-python, which has no such endpoint. An event read in
decode is a ``content_block_delta``; the deadline's stream ends with ``message_delta``
(``stop_reason`` ``max_tokens`` + ``trioserve.end_cause``) and ``message_stop``, timed
as send → ``message_stop``.

``--endpoint ollama``: the same causes as Ollama's streamed ``POST /api/chat`` (``{"model",
"messages": [{"role": "user", "content": the same text}], "options": {"temperature": 0,
"num_predict", "repeat_penalty": 1}}``, NDJSON lines; the chat template around it), on
trioserve and front-llama-server (trioserve relays it as a completion): llama-server and
llama-cpp-python serve no ``/api/chat``. An event read in decode is a ``"done":false`` line
with text (a heartbeat line has none); the deadline's stream ends with a ``"done":true``
line (``done_reason`` ``length`` + ``trioserve.end_cause``), timed as send → that line.

    python benchmarks/cancel.py --markdown --json artifacts/cancel.json
    python benchmarks/cancel.py --contestants llama-server,front-llama-server --llama-server-args="-b 16"
    python benchmarks/cancel.py --endpoint messages --contestants trioserve,llama-server --causes prefill
    python benchmarks/cancel.py --endpoint ollama --contestants trioserve --causes prefill,decode
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import (
    COMPLETIONS,
    MESSAGES,
    OLLAMA_CHAT,
    PROGRESS,
    RawStream,
    body,
    messages_body,
    ollama_chat_body,
)
from benchmarks.harness.proc import cpu_seconds, wait_cpu_idle
from benchmarks.harness.stats import dict_table, dist, fmt, median, rows_table

DECODE, PREFILL, DEADLINE, TS, LS = "decode", "prefill", "deadline", servers.TRIOSERVE, servers.LLAMA_SERVER
#: cancel by id (trioserve only): POST /v1/requests/{id}/cancel from another connection
BY_ID_DECODE, BY_ID_PREFILL = "id-decode", "id-prefill"
SERVERS, FRONT = (TS, servers.LLAMA_CPP_PYTHON, LS), f"front-{LS}"
SENTENCE = "The history of the city is long and varied. "
CAUSES = {
    DECODE: "disconnect in decode",
    PREFILL: "disconnect mid-prefill",
    DEADLINE: "deadline in decode",
    BY_ID_DECODE: "cancel by id in decode",
    BY_ID_PREFILL: "cancel by id mid-prefill",
}
#: the causes only trioserve has
OWN_CAUSES = (DEADLINE, BY_ID_DECODE, BY_ID_PREFILL)
NO_WORK_MS = 50.0  # a prefill run with less CPU than this before and after the close did no prefill
TIMINGS = re.compile(rb'"(prompt_n|prompt_per_second)": ?([\d.]+)')
INPUT_TOKENS = re.compile(rb'"input_tokens": ?(\d+)')  # Anthropic message_start's usage
ENDPOINTS = {"completions": COMPLETIONS, "messages": MESSAGES, "ollama": OLLAMA_CHAT}
LOG_LINE = re.compile(r"trioserve\.requests: request (\S+) \S+ (.*)")


def parse_args() -> Any:
    p = cli.parser(__doc__, ((*SERVERS, FRONT), SERVERS), threads=2, ctx_size=4096, reps=20)
    p.add_argument("--trioserve-arg", action="append", default=[], help="an extra `trioserve serve` option")
    cli.option(p, "--llama-server-args", "", "extra llama-server flags (also behind front-llama-server)")
    help_ = "JSON merged into each request llama-server gets (front-llama-server: its --upstream-body)"
    p.add_argument("--request-extra", type=json.loads, default={}, help=help_)
    p.add_argument(
        "--prefill-reps",
        type=int,
        help="mid-prefill runs per server (default: half of --reps; all of it with --causes prefill)",
    )
    cli.option(p, "--events", 5, "decode: events read before the close")
    help_ = "decode (and deadline): the prompt (a list to continue keeps trioserve's verify calls busy)"
    cli.option(p, "--decode-prompt", "Once upon a time", help_)
    cli.option(p, "--prefill-repeats", 170, "prefill: sentences in the prompt (170: ~1,700 tokens)")
    cli.option(p, "--prefill-delay", 0.3, "prefill: seconds from the send to the close")
    cli.option(p, "--prefill-close-cpu", 0.0, "prefill: close at this CPU-s since the send instead (0: off)")
    cli.option(p, "--deadline", 0.5, "deadline: X-Request-Timeout, seconds")
    cli.option(p, "--close", "rst", "how the client leaves: rst (SO_LINGER 0) or fin")
    cli.option(p, "--idle-cap", 15.0, "seconds to wait for idle per run")
    help_ = "completions: streamed POST /v1/completions; messages: streamed Anthropic POST /v1/messages"
    help_ += " (trioserve, llama-server, front-llama-server); ollama: Ollama's streamed POST /api/chat"
    help_ += " (trioserve, front-llama-server); default: completions"
    p.add_argument("--endpoint", choices=ENDPOINTS, default="completions", help=help_)
    help_ = f"comma-separated subset of {','.join(CAUSES)} (deadline, id-*: trioserve only; default: all)"
    p.add_argument("--causes", type=causes, default=list(CAUSES), help=help_)
    args = p.parse_args()
    half = (args.reps + 1) // 2 if args.causes != [PREFILL] else args.reps
    args.prefill_reps = half if args.prefill_reps is None else args.prefill_reps
    if args.endpoint == "messages" and servers.LLAMA_CPP_PYTHON in args.contestants:
        if args.contestants != p.get_default("contestants"):
            p.error("--endpoint messages: llama-cpp-python serves no /v1/messages")
        args.contestants.remove(servers.LLAMA_CPP_PYTHON)  # (the default set)
    if args.endpoint == "ollama":
        others = {servers.LLAMA_CPP_PYTHON, LS} & set(args.contestants)
        if others and args.contestants != p.get_default("contestants"):
            p.error(f"--endpoint ollama: {', '.join(sorted(others))} serve(s) no /api/chat")
        args.contestants = [c for c in args.contestants if c not in others]
    return args


def causes(text: str) -> list[str]:
    chosen = {x.strip() for x in text.split(",") if x.strip()}
    if not chosen or chosen - set(CAUSES):
        raise ValueError(text)
    return [c for c in CAUSES if c in chosen]


def log_fields(server: servers.Server, request_id: str) -> dict[str, str]:
    """trioserve's request log line for ``request_id`` (waiting up to 5 s for it)."""
    give_up = time.monotonic() + 5.0
    while server.name == servers.TRIOSERVE:
        for found in LOG_LINE.finditer(server.log_text()):
            if found[1] == request_id:
                return dict(re.findall(r"(\w+)=(\S+)", found[2].split(" error=")[0]))
        if time.monotonic() > give_up:
            break
        time.sleep(0.02)
    return {}


def number(fields: dict[str, str], key: str) -> float | None:
    return None if fields.get(key, "-") == "-" else float(fields[key])  # ("-": none)


def wait_idle(running: list[servers.Server], args: Any, warnings: list[str]) -> None:
    """Before a job: trioserve's /health drained, and every server's CPU idle."""
    for server in running:
        server.check_alive()
        drained = server.wait_drained(args.idle_cap) if server.name == servers.TRIOSERVE else 0.0
        if drained is None or wait_cpu_idle(server.pid, time.perf_counter(), args.idle_cap).after_s is None:
            warnings.append(f"{server.name} still busy {args.idle_cap:g} s before a job")
            cli.log(f"warning: {warnings[-1]}")
    time.sleep(0.1)


def start(name: str, model: Path, logs: Path, args: Any, running: list[servers.Server]) -> servers.Server:
    """Start contestant ``name`` into ``running``; ``server.work``: the process that computes."""
    kind = name.removeprefix("front-")
    extra = {TS: ["--log-level", "info", *args.trioserve_arg], LS: shlex.split(args.llama_server_args)}
    settings = {"threads": args.threads, "ctx_size": args.ctx_size, "extra": extra.get(kind, [])}
    running.append(work := servers.Server.start(kind + "-upstream" * (name != kind), model, logs, **settings))
    if name != kind:
        work.wait_ready(args.ready_timeout)
        port, upstream = servers.free_port(), ["--upstream", work.url]
        upstream += ["--upstream-body", json.dumps(args.request_extra)] if args.request_extra else []
        running.append(servers.Server(name, servers.trioserve_command(port, *upstream), port, logs))
    running[-1].work = work
    return running[-1]


def request(server: servers.Server, args: Any, tag: str | None, max_tokens: int) -> dict[str, Any]:
    """The long prompt behind ``tag``, or the decode prompt (``tag`` ``None``); with
    ``--endpoint messages`` as the user message of an Anthropic request."""
    text = args.decode_prompt if tag is None else f"Record {tag}. " + SENTENCE * args.prefill_repeats
    extra = args.request_extra if server.name == LS else {}
    if args.endpoint == "messages":
        return messages_body(text, max_tokens, args.model_name, **extra)
    if args.endpoint == "ollama":
        return ollama_chat_body(text, max_tokens, args.model_name, **extra)
    return body(text, max_tokens, **extra)


def open_stream(
    server: servers.Server, payload: dict[str, Any], headers: dict[str, str], args: Any
) -> RawStream:
    return RawStream(server.port, payload, headers, path=ENDPOINTS[args.endpoint])


def run_job(server: Any, cause: str, round_: int, args: Any) -> dict[str, Any]:
    """One abandoned request and its measurements."""
    rid = str(uuid.uuid4())  # llama-cpp-python answers 400 to an X-Request-Id that is not a UUID
    timeout = {"X-Request-Timeout": f"{args.deadline:g}"} if cause == DEADLINE else {}
    headers, cpu_at_send, t_cause = {"X-Request-Id": rid, **timeout}, cpu_seconds(server.work.pid), None
    prefill = cause in (PREFILL, BY_ID_PREFILL)
    payload = request(server, args, rid, 5) if prefill else request(server, args, None, 2000)
    stream = open_stream(server, payload, headers, args)
    answered_ms, events_at_cause = None, None
    if cause in (BY_ID_DECODE, BY_ID_PREFILL):
        if cause == BY_ID_DECODE:
            if not stream.read_until(lambda: stream.data_events() >= args.events, stream.sent_at + 60):
                raise RuntimeError(f"{server.name} {rid}: {stream.data_events()} events in 60 s")
        else:
            stream.read_until(lambda: False, stream.sent_at + args.prefill_delay)
        t_cause, events_at_cause = time.perf_counter(), stream.data_events()
        answer = httpx.post(f"{server.url}/v1/requests/{rid}/cancel", timeout=30)
        answered_ms = (time.perf_counter() - t_cause) * 1e3
        if answer.status_code != 200:
            raise RuntimeError(f"{server.name} {rid}: cancel: HTTP {answer.status_code}: {answer.text[:200]}")
        stream.read_until(lambda: False, time.perf_counter() + 5)  # (its final event, to the end)
        stream.close()
    elif cause == DECODE:
        if not stream.read_until(lambda: stream.data_events() >= args.events, stream.sent_at + 60):
            raise RuntimeError(f"{server.name} {rid}: {stream.data_events()} of {args.events} events in 60 s")
        t_cause = stream.close(args.close)
    elif cause == PREFILL and args.prefill_close_cpu:  # the CPU sampled every ~1 ms
        busy, give_up = lambda: cpu_seconds(server.work.pid) - cpu_at_send, stream.sent_at + 60
        while busy() < args.prefill_close_cpu and time.perf_counter() < give_up:
            if not stream.receive(time.perf_counter() + 0.001) and stream.eof:
                time.sleep(0.001)
        t_cause = stream.close(args.close)
    elif cause == PREFILL:
        stream.read_until(lambda: False, stream.sent_at + args.prefill_delay)
        t_cause = stream.close(args.close)
    else:
        stream.read_until(lambda: False, stream.sent_at + args.deadline + 10)  # to the server's close
        stream.close()
    if stream.status not in (None, 200):
        raise RuntimeError(f"{server.name} {cause}: HTTP {stream.status}: {stream.events[:1]!r}")
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(stream.token_times())] if cause == DECODE else []
    done_ms = (stream.done_at - stream.sent_at) * 1e3 if stream.done_at else None
    s = {"server": server.name, "cause": cause, "round": round_, "id": rid, "step_gaps_ms": gaps}
    s["cancel_answered_ms"] = answered_ms
    s.update(
        done_ms=done_ms,
        events_before_cause=stream.data_events() if events_at_cause is None else events_at_cause,
        finish_reason=stream.finish_reason(),
        end_cause=stream.end_cause(),
    )
    if t_cause is not None:
        idle = wait_cpu_idle(server.work.pid, t_cause, args.idle_cap)
        s["idle_ms"] = math.inf if idle.after_s is None else idle.after_s * 1e3
        s["cpu_after_cause_ms"] = idle.cpu_s * 1e3
        s["cpu_before_cause_ms"] = (idle.cpu_at_start - cpu_at_send) * 1e3
    line = log_fields(server, rid)
    s.update(cancel_latency_ms=number(line, "cancel_latency_ms"), log_ttft_ms=number(line, "ttft_ms"))
    # speculation: "draft_accepted=A/P" (guesses accepted / proposed) when the stream speculated
    s.update(log_cause=line.get("cause"), draft=line.get("draft_accepted"), excluded=exclusion(s))
    return s


def exclusion(s: dict[str, Any]) -> str | None:
    """Why a prefill run did not measure a cancel mid-prefill (``None``: it did)."""
    if s["cause"] not in (PREFILL, BY_ID_PREFILL):
        return None
    if s["events_before_cause"]:
        return f"{s['events_before_cause']} token(s) arrived before the close: the prefill was over"
    if s["log_ttft_ms"] is not None:
        return f"trioserve logged a first token (ttft {s['log_ttft_ms']} ms): the prefill was over"
    if max(s["cpu_before_cause_ms"], s["cpu_after_cause_ms"]) < NO_WORK_MS:
        return "under 50 ms of CPU before and after the close: the prefill never started"
    return None


def warm_up(server: servers.Server, args: Any) -> dict[str, Any]:
    """A short completion, then the long prompt with ``max_tokens`` 1: its TTFT is the prefill
    (llama-server: and its ``timings``; messages: the first ``content_block_delta``)."""
    for long in (False, True):
        rid = str(uuid.uuid4())
        payload = request(server, args, rid if long else None, 1 if long else 8)
        stream = open_stream(server, payload, {"X-Request-Id": rid}, args)
        if not stream.read_until(stream.done, stream.sent_at + 120):
            raise RuntimeError(f"{server.name}: warm-up: no {END[args.endpoint]} in 120 s ({stream.status})")
        stream.close()
    line, first = log_fields(server, rid), next(t for t, e in stream.events if PROGRESS not in e)
    tokened = (stream.anthropic or stream.ollama) and stream.token_times()
    first = stream.token_times()[0] if tokened else first
    timings = {k.decode(): json.loads(v) for e in stream.events for k, v in TIMINGS.findall(e[1])}
    inputs = [int(n) for _, e in stream.events for n in INPUT_TOKENS.findall(e)][:1]
    prompt_tokens = line.get("prompt_tokens") or timings.get("prompt_n") or (inputs or [None])[0]
    return {"prefill_ms": (first - stream.sent_at) * 1e3, "prompt_tokens": prompt_tokens, **timings}


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    args.model_name = model.stem  # the id trioserve serves it as (messages: the request's "model")
    names = "threads ctx_size reps prefill_reps events prefill_repeats prefill_delay prefill_close_cpu"
    names += " deadline close idle_cap llama_server_args request_extra endpoint causes decode_prompt"
    cfg, samples, warnings, reference = cli.environment(model, **cli.pick(args, names)), [], [], {}
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        contestants = [start(name, model, Path(logs), args, running) for name in args.contestants]
        for server in running:
            server.wait_ready(args.ready_timeout)
        cfg["commands"] = {s.name: s.command for s in running}
        for server in contestants:
            wait_idle(running, args, warnings)
            reference[server.name] = warm_up(server, args)
            cli.log(f"warm-up {server.name}: {reference[server.name]}")
        for round_ in range(max(args.reps, args.prefill_reps)):
            todo = {DECODE: round_ < args.reps, PREFILL: round_ < args.prefill_reps}
            todo[DEADLINE] = todo[BY_ID_DECODE] = todo[DECODE]
            todo[BY_ID_PREFILL] = todo[PREFILL]
            todo = {c: todo[c] and c in args.causes for c in todo}
            jobs = [
                (s, c) for c in todo for s in contestants if todo[c] and (c not in OWN_CAUSES or s.name == TS)
            ]
            turn = round_ % len(jobs) if jobs else 0
            for server, cause in jobs[turn:] + jobs[:turn]:
                wait_idle(running, args, warnings)
                samples.append(s := run_job(server, cause, round_, args))
                times = f"idle {fmt(s.get('idle_ms'))} ms, {END[args.endpoint]} {fmt(s['done_ms'])} ms"
                times += f", log {fmt(s['cancel_latency_ms'])} ms"
                times += f", drafts {s['draft']} accepted" if s.get("draft") else ""
                cli.log(f"{round_:>2} {server.name:<16} {cause:<8} {times}")
        wait_idle(running, args, warnings)
    out = {"config": cfg, "reference": reference, "samples": samples}
    return out | {"notes": warnings + notes(samples, args)}


def notes(samples: list[dict[str, Any]], args: Any) -> list[str]:
    out = []
    for s in samples:
        where = f"{s['server']} {s['cause']} round {s['round']} ({s['id']})"
        out += [f"{where}: left out: {s['excluded']}"] if s["excluded"] else []
        out += [f"{where}: CPU not idle within {args.idle_cap:g} s"] if s.get("idle_ms") == math.inf else []
        expected = {DEADLINE: "deadline", BY_ID_DECODE: "cancelled", BY_ID_PREFILL: "cancelled"}.get(
            s["cause"], "disconnect"
        )
        end = END[args.endpoint]
        logged = (s["log_cause"], s["cancel_latency_ms"])
        if s["server"] == servers.TRIOSERVE and (logged[0] != expected or logged[1] is None):
            out.append(f"{where}: log cause, cancel_latency_ms {logged}; expected {expected}")
        if s["server"] == servers.TRIOSERVE and s["cause"] == DEADLINE and s["end_cause"] != "deadline":
            out.append(f"{where}: end_cause {s['end_cause']!r}, expected 'deadline'")
        length = "max_tokens" if args.endpoint == "messages" else "length"
        if s["cause"] == DEADLINE and (s["finish_reason"] != length or s["done_ms"] is None):
            out.append(f"{where}: finish_reason {s['finish_reason']!r}, {end} after {s['done_ms']} ms")
    return out


METRICS = {
    "idle_ms": "CPU idle − cause (black-box)",
    "cancel_latency_ms": "cancel_latency_ms (log)",
    "cancel_answered_ms": "cancel call → its answer",
}
#: what ends a stream, per --endpoint
END = {"completions": "[DONE]", "messages": "message_stop", "ollama": '"done":true line'}


def summary(samples: list[dict[str, Any]], cfg: dict[str, Any], step: dict[str, float]) -> list[Any]:
    """Per cause, server and metric: the distribution, CPU burnt after the cause, the bar."""
    rows = []
    for cause, name, key in itertools.product(CAUSES, step, [*METRICS, "done_ms"]):
        runs = [s for s in samples if s["server"] == name and s["cause"] == cause and not s["excluded"]]
        values = [s[key] for s in runs if s.get(key) is not None]
        if (key == "done_ms") != (cause == DEADLINE) or not (d := dist(values)):
            continue
        # (cancel by id, issue 36: the CPU idle within 100 ms of the cancel call)
        bars = {DECODE: step[name] + 10, PREFILL: 100.0, DEADLINE: cfg["deadline"] * 1e3 + 100}
        bar = bars.get(cause, 100.0)
        bar = None if cause in (PREFILL, BY_ID_PREFILL, BY_ID_DECODE) and key != "idle_ms" else bar
        cpu = dist([s["cpu_after_cause_ms"] for s in runs]) if key == "idle_ms" else None
        cpu_text = f"{cpu['p50']:.0f} / {cpu['max']:.0f}" if cpu else "—"
        end = END[cfg.get("endpoint", "completions")]
        metric, label = METRICS.get(key, f"send → {end}"), servers.LABELS.get(name, name)
        label = name if cfg.get("llama_server_args") else label  # (LABELS: llama-server's defaults)
        rows.append({"server": label, "cause": CAUSES[cause], "metric": metric, **d})
        rows[-1].update(cpu=cpu_text, bar=bar, met="—" if bar is None else "yes" if d["p99"] <= bar else "no")
    return rows


def report(result: dict[str, Any], args: Any) -> None:
    cfg, samples, ref = result["config"], result["samples"], result["reference"]
    if args.markdown:
        keys = "round server cause events_before_cause cpu_before_cause_ms idle_ms cpu_after_cause_ms"
        keys += " cancel_latency_ms done_ms log_cause finish_reason excluded"
        print(dict_table(samples, keys) + "\n")
    runs = f"{cfg['reps']} decode/deadline and {cfg['prefill_reps']} prefill runs per server"
    endpoint = ENDPOINTS[cfg.get("endpoint", "completions")]
    only = "" if cfg.get("causes", list(CAUSES)) == list(CAUSES) else f" ({', '.join(cfg['causes'])} only)"
    runs = f"POST {endpoint}{only}, {runs}"
    what = f"{cfg['threads']} threads, ctx {cfg['ctx_size']}, {runs}, close={cfg['close']}"
    cpu, delay = cfg.get("prefill_close_cpu"), f"{cfg['prefill_delay']:g} s"
    what += f", prefill closed after {f'{cpu:g} CPU-s' if cpu else delay}, deadline {cfg['deadline']:g} s"
    what += f", llama-server {cfg.get('llama_server_args') or 'defaults'}, {cfg.get('request_extra')}"
    print(cli.header(cfg, what))
    gaps = {n: [g for s in samples if s["server"] == n for g in s["step_gaps_ms"]] for n in ref}
    step = {n: median(gaps[n]) for n in ref}
    cap, summary_rows = f"> {cfg['idle_cap']:g} s", summary(samples, cfg, step)
    print(dict_table(summary_rows, "server cause metric n p50 p99 max cpu bar met").replace("timeout", cap))
    print("\n(cpu: CPU ms burnt after the cause, p50 / max; bar: p99 ≤, ms; nearest-rank percentiles)\n")
    columns = [("server", str), ("decode step ms (median gap)", lambda n: f"{fmt(step[n])} ({len(gaps[n])})")]
    columns += [("long-prompt prefill ms (warm-up TTFT)", lambda n: fmt(ref[n]["prefill_ms"], ".0f"))]
    columns += [("prefill tokens/s (llama-server timings)", lambda n: fmt(ref[n].get("prompt_per_second")))]
    print(rows_table(ref, [*columns, ("prompt tokens", lambda n: str(ref[n]["prompt_tokens"] or "—"))]))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
