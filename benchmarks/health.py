"""``/health`` latency while 8 streams run, with the prompt cache and its host-memory tier busy.

One ``trioserve serve --slots 8 --cache-ram 64`` (``--slots``, ``--cache-ram`` MiB: small,
so prefixes are saved to host memory, restored from it and evicted). ``--conversations``
conversations (12, more than the sequences) rotate through ``--clients`` client threads
(8): a thread takes the conversation that has waited longest, streams its next turn
(``POST /v1/completions``, greedy, ``--max-tokens``; the prompt is the conversation so
far in Gemma's turn format + ~85 words of new user text, after a unique ~``--preamble``-word
first turn), appends the reply and puts it back; past ``--max-prompt`` tokens a
conversation starts again with a new preamble. So a turn often finds the cells of its
prefix overwritten by another conversation: saved to host memory first, then restored.
Meanwhile a separate process (not this one's GIL) polls ``GET /health`` every
``--interval`` s, a new connection each time as a load balancer's probe does, and times
each answer, send → whole body. Phases: ``idle`` (``--idle`` s, no load), ``ramp`` (the
load runs until every conversation has had its first turn, at most ``--ramp-cap`` s: the
host tier is busy only from then on), ``busy`` (the measured window, ``--duration`` s).
Reported per phase: polls, p50, p99, max (nearest rank), failures, the slots in use each
poll saw; ``batch.cache.ram`` at the window's start and end (saves, restores,
evictions); the turns (prompt and cached tokens, TTFT). The bar: in the window, p99 ≤
``--bar-ms`` (50 ms) and no failed poll. Everything is bounded: the load stops after the
window (each thread finishes its turn), the server is stopped on exit.
Method: docs/benchmarks.md, "Method" and "/health under load".

    python benchmarks/health.py --json artifacts/health.json
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.conversation import complete, user_text
from benchmarks.harness import cli, servers
from benchmarks.harness.stats import dist, fmt, median, rows_table, spread

IDLE, RAMP, BUSY, STOP = "idle", "ramp", "busy", "stop"
PHASES = (IDLE, RAMP, BUSY, STOP)  # the poller's phase: an index into this, shared with it
RAM_KEYS = ("saves", "restores", "evictions", "prefixes", "bytes", "budget_bytes")


def parse_args() -> Any:
    p = cli.parser(__doc__, threads=2, ctx_size=4096, slots=8, max_tokens=64)
    cli.option(
        p, "--clients", 8, "client threads, each streaming one turn after another: the streams at once"
    )
    cli.option(p, "--conversations", 12, "conversations rotating through the clients")
    cli.option(p, "--cache-ram", 64, "trioserve --cache-ram, MiB")
    cli.option(p, "--preamble", 300, "words of a conversation's first turn")
    cli.option(p, "--max-prompt", 2500, "prompt tokens after which a conversation starts again")
    cli.option(p, "--duration", 60.0, "seconds of polling under load")
    cli.option(p, "--idle", 3.0, "seconds of polling the idle server first")
    cli.option(p, "--ramp-cap", 180.0, "seconds the load may take to give every conversation a turn")
    cli.option(p, "--interval", 0.05, "seconds between /health polls")
    cli.option(p, "--poll-timeout", 5.0, "seconds a /health poll may take (then: failed)")
    cli.option(p, "--bar-ms", 50.0, "the bar: p99 under load ≤ this, ms")
    return p.parse_args()


def poller(port: int, interval: float, timeout: float, phase: Any, ready: Any, out: Any) -> None:
    """In a child process: ``GET /health`` every ``interval`` s on a fresh connection, each
    record labelled with the ``phase`` at its send, until the phase is ``stop``. Puts the
    records on ``out``. Times are ``perf_counter`` (CLOCK_MONOTONIC: the parent's clock)."""
    records: list[dict[str, Any]] = []
    t_next = time.perf_counter()
    ready.set()
    while (now := PHASES[phase.value]) != STOP:
        time.sleep(max(0.0, t_next - time.perf_counter()))
        conn, status, data = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout), None, b""
        t0 = time.perf_counter()
        try:
            conn.request("GET", "/health", headers={"Connection": "close"})
            response = conn.getresponse()
            status, data = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            data = f"{type(exc).__name__}: {exc}".encode()
        finally:
            t1 = time.perf_counter()
            conn.close()
        record: dict[str, Any] = {"t": t0, "ms": (t1 - t0) * 1e3, "status": status, "phase": now}
        try:
            health = json.loads(data)
            ram = (health.get("batch") or {}).get("cache", {}).get("ram", {})
            record |= {k: health.get(k) for k in ("slots_in_use", "generations_running", "queued")}
            record |= {k: ram.get(k) for k in ("saves", "restores", "evictions")}
        except ValueError:
            record["error"] = data.decode(errors="replace")[:200]
        records.append(record)
        t_next = max(t_next + interval, time.perf_counter())  # (one that overran: the next at once)
    out.put(records)


class Conversations:
    """The conversations, waiting in a queue; each thread takes the one that waited longest."""

    def __init__(self, count: int, args: Any) -> None:
        self.args, self.waiting, self.started = args, queue.Queue(), 0
        for c in range(count):
            self.waiting.put(self.new(c))

    def new(self, conv: int) -> dict[str, Any]:
        gen, self.started = self.started, self.started + 1  # a new number: a new, uncached preamble
        preamble = f"Conversation {gen}. " + user_text(100 + gen, 0, self.args.preamble)
        prompt = f"<start_of_turn>user\n{preamble}<end_of_turn>\n"
        return {"conv": conv, "gen": gen, "turn": 0, "prompt": prompt}

    def turn(self, client: httpx.Client, server: servers.Server) -> dict[str, Any]:
        """Take a conversation, stream its next turn, put it back (or a new one past --max-prompt)."""
        c = self.waiting.get()
        c["turn"] += 1
        if c["turn"] > 1:
            c["prompt"] += f"<start_of_turn>user\n{user_text(c['gen'], c['turn'])}<end_of_turn>\n"
        c["prompt"] += "<start_of_turn>model\n"
        record = {k: c[k] for k in ("conv", "gen", "turn")} | {"sent": time.perf_counter()}
        try:
            got = complete(client, server, c["prompt"], self.args.max_tokens)
        except Exception as exc:  # recorded; the conversation starts again
            got = {"error": f"{type(exc).__name__}: {exc}"}
        record |= {"end": time.perf_counter()} | {k: v for k, v in got.items() if k != "text"}
        c["prompt"] += got.get("text", "") + "<end_of_turn>\n"
        restart = "error" in got or (record.get("prompt_tokens") or 0) > self.args.max_prompt
        self.waiting.put(self.new(c["conv"]) if restart else c)
        return record


def load(server: servers.Server, args: Any, stop: threading.Event) -> tuple[list[Any], list[Any]]:
    """``--clients`` threads running turns until ``stop``; their threads and turn records."""
    convs, turns = Conversations(args.conversations, args), []
    timeout = httpx.Timeout(10.0, read=args.request_timeout)

    def worker() -> None:
        with httpx.Client(timeout=timeout) as client:
            while not stop.is_set():
                turns.append(convs.turn(client, server))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    return threads, turns


def ram(server: servers.Server) -> dict[str, Any]:
    health = server.health()
    return {k: health["batch"]["cache"]["ram"].get(k) for k in RAM_KEYS} | {"slots": health.get("slots")}


def summarize(polls: list[dict[str, Any]], phase: str) -> dict[str, Any]:
    mine = [p for p in polls if p["phase"] == phase]
    ok = [p["ms"] for p in mine if p["status"] == 200]
    slots = [p["slots_in_use"] for p in mine if p.get("slots_in_use") is not None]
    out = {"phase": phase, "polls": len(mine), "failed": len(mine) - len(ok), **(dist(ok) or {})}
    return out | {"slots_in_use": slots, "seconds": mine[-1]["t"] - mine[0]["t"] if mine else 0.0}


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    names = "threads ctx_size slots max_tokens clients conversations cache_ram preamble max_prompt duration"
    cfg = cli.environment(model, **cli.pick(args, names + " idle ramp_cap interval poll_timeout bar_ms"))
    mp, stop, notes, threads, turns = multiprocessing.get_context("spawn"), threading.Event(), [], [], []
    phase, ready, out = mp.Value("i", 0), mp.Event(), mp.Queue()
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        extra = ["--slots", str(args.slots), "--cache-ram", str(args.cache_ram), "--max-queue", "64"]
        settings = cli.pick(args, "threads ctx_size") | {"slots": args.slots, "extra": extra}
        running.append(server := servers.Server.start(servers.TRIOSERVE, model, Path(logs), **settings))
        server.wait_ready(args.ready_timeout)
        cfg["commands"] = {server.name: server.command}
        with httpx.Client(timeout=httpx.Timeout(10.0, read=args.request_timeout)) as client:
            complete(client, server, cli.DEFAULT_PROMPT, 8)  # warm-up
        server.wait_drained(30.0)
        ram_at = {"before the load": ram(server)}
        child = mp.Process(
            target=poller, args=(server.port, args.interval, args.poll_timeout, phase, ready, out)
        )
        try:
            child.start()
            if not ready.wait(60):
                raise RuntimeError("the /health poller did not start in 60 s")
            cli.log(f"polling /health every {args.interval:g} s: {args.idle:g} s idle")
            time.sleep(args.idle)
            threads, turns = load(server, args, stop)
            load_started, phase.value = time.perf_counter(), PHASES.index(RAMP)
            cli.log(f"{args.clients} streams, {args.conversations} conversations: until each has had a turn")
            while len({t["conv"] for t in turns if "error" not in t}) < args.conversations:
                server.check_alive()
                if time.perf_counter() - load_started > args.ramp_cap:
                    notes.append(f"not every conversation had a turn within --ramp-cap {args.ramp_cap:g} s")
                    break
                time.sleep(0.1)
            ram_at["the window's start"], window = ram(server), [time.perf_counter()]
            phase.value = PHASES.index(BUSY)
            cli.log(f"{window[0] - load_started:.0f} s: {len(turns)} turns; measuring {args.duration:g} s")
            while (left := window[0] + args.duration - time.perf_counter()) > 0:
                time.sleep(min(left, 10.0))
                server.check_alive()
                cli.log(f"{time.perf_counter() - window[0]:5.0f} s: {len(turns)} turns, ram {ram(server)}")
            window.append(time.perf_counter())
            phase.value = PHASES.index(STOP)
            ram_at["the window's end"] = ram(server)
            polls = out.get(timeout=30)
        finally:
            phase.value, _ = PHASES.index(STOP), stop.set()
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
        give_up = time.perf_counter() + args.request_timeout + 10
        for thread in threads:
            thread.join(timeout=max(0.1, give_up - time.perf_counter()))
        if alive := sum(t.is_alive() for t in threads):
            notes.append(f"{alive} stream thread(s) still running {args.request_timeout:g} s after the load")
        load_ended, ram_at["after the load"] = time.perf_counter(), ram(server)
        drained = server.wait_drained(30.0)
    for record in [*polls, *turns]:
        for key in ("t", "sent", "end"):
            if key in record:
                record[key] -= load_started  # seconds since the load started
    summary = [summarize(polls, phase_) for phase_ in (IDLE, RAMP, BUSY)]
    busy, limit = summary[2], args.bar_ms
    met = busy.get("p99") is not None and busy["p99"] <= limit and busy["failed"] == 0
    bar = {"p99_ms": busy.get("p99"), "limit_ms": limit, "failed": busy["failed"], "met": met}
    start, end = ram_at["the window's start"], ram_at["the window's end"]
    delta = {k: (end[k] or 0) - (start[k] or 0) for k in ("saves", "restores", "evictions")}
    if not (delta["saves"] and delta["restores"]):
        notes.append(
            f"the host tier was not busy in the window: {delta}; lower --cache-ram or raise --duration"
        )
    if (full := median(busy["slots_in_use"])) < args.clients:
        notes.append(f"/health saw a median of {full:g} slots in use in the window, not {args.clients}")
    notes += [f"turn {t['conv']}.{t['gen']}.{t['turn']}: {t['error']}" for t in turns if "error" in t][:20]
    notes += [] if drained is not None else ["the server did not drain within 30 s of the load"]
    window = [t - load_started for t in window]
    out_ = {
        "config": cfg,
        "summary": summary,
        "bar": bar,
        "ram": ram_at,
        "ram_delta": delta,
        "window": window,
    }
    out_ |= {"load_seconds": load_ended - load_started, "polls": polls, "turns": turns}
    return out_ | {"notes": notes}


def report(result: dict[str, Any], args: Any) -> None:
    cfg, bar, turns, (w0, w1) = result["config"], result["bar"], result["turns"], result["window"]
    what = f"trioserve --slots {cfg['slots']} --cache-ram {cfg['cache_ram']}, {cfg['clients']} streams"
    what += f" of {cfg['conversations']} conversations, {cfg['max_tokens']}-token replies"
    what += f", {cfg['threads']} threads; /health every {cfg['interval'] * 1e3:g} ms"
    print(cli.header(cfg, what))
    names = {IDLE: "idle server", RAMP: "ramp: every conversation's first turn"}
    names[BUSY] = f"{cfg['clients']} streams: the window"
    columns = [
        ("phase", lambda r: names[r["phase"]]),
        ("s", lambda r: f"{r['seconds']:.0f}"),
        ("polls", lambda r: str(r["polls"])),
        *[(f"{k} ms", lambda r, k=k: fmt(r.get(k))) for k in ("p50", "p99", "max")],
        ("failed", lambda r: str(r["failed"])),
        ("slots in use at the poll", lambda r: spread(r["slots_in_use"], ".0f")),
    ]
    print(rows_table(result["summary"], columns))
    verdict = "pass" if bar["met"] else "FAIL"
    figures = f"{fmt(bar['p99_ms'])} ms, {bar['failed']} failed"
    print(
        f"\nbar: /health p99 ≤ {bar['limit_ms']:g} ms in the window, no failed poll ({figures}): {verdict}\n"
    )
    mib = lambda r: f"{r['bytes'] / 2**20:.1f} / {r['budget_bytes'] / 2**20:.1f}" if "bytes" in r else ""  # noqa: E731
    rows = [*((k, v) for k, v in result["ram"].items() if k != "after the load")]
    rows.append(("in the window", result["ram_delta"]))
    columns = [("host tier (/health batch.cache.ram)", lambda r: r[0])]
    columns += [(k, lambda r, k=k: str(r[1][k])) for k in ("saves", "restores", "evictions")]
    columns += [("prefixes", lambda r: str(r[1].get("prefixes", "")))]
    columns += [("MiB held / budget", lambda r: mib(r[1]))]
    print(rows_table(rows, columns))
    ok = [t for t in turns if "error" not in t]
    inside = [t for t in ok if w0 <= t["sent"] < w1]
    restarts = len({(t["conv"], t["gen"]) for t in turns}) - cfg["conversations"]
    print(
        f"\nturns: {len(turns)} in {result['load_seconds']:.0f} s of load, {len(inside)} sent in the window"
    )
    again = f"conversations started again past {cfg['max_prompt']} tokens: {max(0, restarts)}"
    print(f"failed turns: {len(turns) - len(ok)}; {again}")
    rows_ = [
        ("prompt tokens", spread((t["prompt_tokens"] for t in inside), ".0f")),
        ("cached tokens", spread((t["cached"] for t in inside), ".0f")),
        ("turns with a cached prefix", f"{sum(bool(t['cached']) for t in inside)}/{len(inside)}"),
        ("TTFT ms", spread((t["ttft_ms"] for t in inside), ".0f")),
    ]
    print(
        "\n"
        + rows_table(
            rows_, [("turns sent in the window", lambda r: r[0]), ("median (min–max)", lambda r: r[1])]
        )
    )


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
