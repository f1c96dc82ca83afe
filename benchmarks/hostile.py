"""One bystander stream beside a hostile request (issue 33's bar).

One ``trioserve serve --slots 8`` (``--threads``, the default model: it serves
``/v1/embeddings`` too). Each case is a pair, a hostile request and the same request made
harmless, sent again and again by ``--load-clients`` threads (1) on plain sockets, the
bodies encoded once:

* ``stop_sequences``: ``POST /v1/messages`` (streamed, greedy, ``--stop-tokens``) with
  ``--stop-count`` (100,000) distinct random 8–16-character stop sequences; harmless: one.
* ``logit_bias``: ``POST /v1/chat/completions`` (streamed, greedy, ``--bias-tokens``,
  ``logprobs: true, top_logprobs: 5, n: 4``) with a ``--bias-entries`` (200,000) entry
  ``logit_bias`` (token ids 1000…, +0.01 each); harmless: one entry.
* ``count_tokens``: ``POST /v1/messages/count_tokens`` with a ``--count-mib`` (3.5 MiB)
  body of many messages; harmless: one short message.
* ``embeddings``: ``POST /v1/embeddings`` with ``--embed-inputs`` (256) texts, those of
  benchmarks/embeddings.py; harmless: one.

A window: the load starts; ``--lead`` s later the bystander, one ``POST /v1/completions``
(greedy, ``cache_prompt: false``, ``--max-tokens``, ``--prompt``, streamed, the httpx
client) runs to its end; then the load stops (its sockets shut: a stream is cut, a
request being sent or answered is abandoned), the server drains and its CPU goes idle
(harness/proc.py's rule, at most ``--settle-cap`` s; no polls meanwhile). Decode tok/s of the
bystander: ``(tokens − 1) / (last − first text chunk)``. Meanwhile a separate process polls
``GET /health`` every ``--interval`` s (a new connection each), each poll labelled with
the window it was sent in (load start → bystander end). ``--reps`` rounds (3); each round
runs the bystander alone once, then every case's pair, the pair's order alternating
round by round. Each hostile answer's status is recorded (a 400's message too).

Reported per case: the hostile and harmless answers (statuses), the bystander's decode
tok/s beside each (median (min–max)), the ratio of the medians, ``/health`` p50, p99,
max (nearest rank) and failed polls in each variant's windows. The bar, per case: the
hostile request is refused (every answer a 400) or the bystander keeps ≥ ``--bar-ratio``
(0.8) × its rate beside the harmless one; and ``/health`` p99 ≤ ``--bar-ms`` (50 ms) with
no failed poll in the hostile windows. Exit status 1 when a case misses it.
Method: docs/benchmarks.md, "Method".

    python benchmarks/hostile.py --json artifacts/hostile.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import random
import re
import shlex
import socket
import string
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.embeddings import texts
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import STATUS, body, request_bytes, sse_chunks, timed_stream
from benchmarks.harness.proc import wait_cpu_idle
from benchmarks.harness.stats import dist, fmt, median, ratio, rows_table, spread

CASES = ("stop_sequences", "logit_bias", "count_tokens", "embeddings")
HOSTILE, HARMLESS, ALONE = "hostile", "harmless", "alone"
IDLE, BETWEEN, STOP = 0, -1, -2  # the poller's label besides a window's number (1, 2, …)
MESSAGE = re.compile(rb'"message"\s*:\s*"((?:[^"\\]|\\.)*)"')
STORY = "Write a long story about a lighthouse keeper and the ships she guides home."
WORDS = ["river", "stone", "light", "market", "violin", "engine", "garden", "winter", "letter", "bridge"]


def parse_args() -> Any:
    p = cli.parser(
        __doc__, threads=2, ctx_size=2048, slots=8, max_tokens=200, reps=3, prompt=cli.DEFAULT_PROMPT
    )
    p.add_argument(
        "--cases",
        type=case_list,
        default=list(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (default: all)",
    )
    cli.option(
        p, "--server-args", "", "extra trioserve serve flags, e.g. a limit raised: --max-logit-bias 300000"
    )
    cli.option(p, "--load-clients", 1, "threads sending the hostile (or harmless) request, each in a loop")
    cli.option(p, "--lead", 1.0, "seconds of load before the bystander is sent")
    cli.option(p, "--stop-count", 100_000, "stop sequences of the hostile Messages request")
    cli.option(p, "--stop-tokens", 256, "max_tokens of the stop_sequences requests")
    cli.option(p, "--bias-entries", 200_000, "logit_bias entries of the hostile chat request (ids 1000…)")
    cli.option(p, "--bias-tokens", 128, "max_tokens of the logit_bias requests")
    cli.option(p, "--count-mib", 3.5, "MiB of the hostile count_tokens body")
    cli.option(p, "--embed-inputs", 256, "inputs of the hostile embeddings request")
    cli.option(p, "--settle-cap", 60.0, "seconds the server may take to drain and idle after a window")
    cli.option(p, "--idle", 3.0, "seconds of polling the idle server first")
    cli.option(p, "--interval", 0.05, "seconds between /health polls")
    cli.option(p, "--poll-timeout", 5.0, "seconds a /health poll may take (then: failed)")
    cli.option(p, "--bar-ratio", 0.8, "the bar: bystander tok/s beside hostile ÷ beside harmless ≥ this")
    cli.option(p, "--bar-ms", 50.0, "the bar: /health p99 in the hostile windows ≤ this, ms")
    return p.parse_args()


def case_list(text: str) -> list[str]:
    """``--cases``: a comma-separated subset of :data:`CASES`, run in that order."""
    chosen = {x.strip() for x in text.split(",") if x.strip()}
    if not chosen or chosen - set(CASES):
        raise argparse.ArgumentTypeError(f"pick from {','.join(CASES)}")
    return [case for case in CASES if case in chosen]


def poller(port: int, interval: float, timeout: float, label: Any, ready: Any, out: Any) -> None:
    """In a child process: ``GET /health`` every ``interval`` s on a fresh connection, each
    record labelled with ``label`` at its send (none sent while it is :data:`BETWEEN`),
    until it is :data:`STOP`. Puts the records
    on ``out``. Times are ``perf_counter`` (CLOCK_MONOTONIC: the parent's clock)."""
    records: list[dict[str, Any]] = []
    t_next = time.perf_counter()
    ready.set()
    while (now := label.value) != STOP:
        time.sleep(max(0.0, t_next - time.perf_counter()))
        if (now := label.value) == BETWEEN:  # (no polls while the server settles between windows)
            t_next = time.perf_counter() + interval / 5
            continue
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
        record: dict[str, Any] = {"t": t0, "ms": (t1 - t0) * 1e3, "status": status, "window": now}
        try:
            health = json.loads(data)
            record |= {k: health.get(k) for k in ("slots_in_use", "generations_running", "queued")}
        except ValueError:
            record["error"] = data.decode(errors="replace")[:200]
        records.append(record)
        t_next = max(t_next + interval, time.perf_counter())  # (one that overran: the next at once)
    out.put(records)


# -- the requests ------------------------------------------------------------------------


def stop_sequences(count: int, seed: int = 33) -> list[str]:
    """``count`` distinct random letters-and-digits strings of 8–16 characters."""
    rng, alphabet, out = random.Random(seed), string.ascii_letters + string.digits, set[str]()
    while len(out) < count:
        out.add("".join(rng.choices(alphabet, k=rng.randint(8, 16))))
    return sorted(out)


def count_messages(target_bytes: int) -> list[dict[str, str]]:
    """Messages (user and assistant in turn, a user's last) whose JSON is ``target_bytes``."""
    rng, size, messages = random.Random(34), 0, list[dict[str, str]]()
    while not messages or size < target_bytes or messages[-1]["role"] != "user":
        text = " ".join(f"{rng.choice(WORDS)} {rng.randint(0, 9999)}" for _ in range(200))
        messages.append({"role": "assistant" if len(messages) % 2 else "user", "content": text})
        size += len(json.dumps(messages[-1])) + 2
    return messages


def requests(case: str, model: str, args: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """The case's ``{variant: (path, payload)}``."""
    if case == "stop_sequences":
        base = {"model": model, "max_tokens": args.stop_tokens, "stream": True, "temperature": 0}
        base["messages"] = [{"role": "user", "content": STORY}]
        stops = stop_sequences(args.stop_count)
        return {
            HOSTILE: ("/v1/messages", base | {"stop_sequences": stops}),
            HARMLESS: ("/v1/messages", base | {"stop_sequences": stops[:1]}),
        }
    if case == "logit_bias":
        base = {"model": model, "max_tokens": args.bias_tokens, "stream": True, "temperature": 0}
        base |= {
            "messages": [{"role": "user", "content": STORY}],
            "logprobs": True,
            "top_logprobs": 5,
            "n": 4,
        }
        bias = {str(token): 0.01 for token in range(1000, 1000 + args.bias_entries)}
        return {
            HOSTILE: ("/v1/chat/completions", base | {"logit_bias": bias}),
            HARMLESS: ("/v1/chat/completions", base | {"logit_bias": {"1000": 0.01}}),
        }
    if case == "count_tokens":
        big = count_messages(round(args.count_mib * 2**20) - 100)
        return {
            HOSTILE: ("/v1/messages/count_tokens", {"model": model, "messages": big}),
            HARMLESS: ("/v1/messages/count_tokens", {"model": model, "messages": [big[0]]}),
        }
    return {
        HOSTILE: ("/v1/embeddings", {"model": model, "input": texts(args.embed_inputs)}),
        HARMLESS: ("/v1/embeddings", {"model": model, "input": texts(1)}),
    }


class Framing:
    """Where an HTTP/1.1 response ends: its ``Content-Length``, the last chunk of a chunked
    body, else the connection's close. (Not every route closes after ``Connection:
    close``: the answer's end is read from its framing, then the client closes.)"""

    def __init__(self) -> None:
        self.head, self.body_bytes, self.tail = b"", 0, b""
        self.length: int | None = None
        self.chunked, self.done = False, False

    def feed(self, data: bytes) -> None:
        if not self.head:
            self.tail += data
            if (at := self.tail.find(b"\r\n\r\n")) < 0:
                return
            self.head, data, self.tail = self.tail[:at].lower(), self.tail[at + 4 :], b""
            if found := re.search(rb"\r\ncontent-length: *(\d+)", self.head):
                self.length = int(found.group(1))
            self.chunked = b"transfer-encoding: chunked" in self.head
        self.body_bytes += len(data)
        self.tail = (self.tail + data)[-7:]
        if self.length is not None:
            self.done = self.body_bytes >= self.length
        elif self.chunked:
            self.done = self.tail.endswith(b"\r\n0\r\n\r\n") or self.tail == b"0\r\n\r\n"


class Load:
    """``clients`` threads, each sending ``data`` (one HTTP/1.1 request, ``Connection:
    close``) and reading its answer to the end, again and again until :meth:`stop`, which
    shuts every socket: a request being sent or answered is abandoned (``cut``)."""

    def __init__(self, port: int, data: bytes, clients: int, timeout: float) -> None:
        self.port, self.data, self.timeout = port, data, timeout
        self.stopping, self.lock = threading.Event(), threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.answers: list[dict[str, Any]] = []
        self.threads = [threading.Thread(target=self.worker, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def worker(self) -> None:
        while not self.stopping.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
            except OSError as exc:
                now = time.perf_counter()
                error = f"connect: {type(exc).__name__}: {exc}"
                self.answers.append({"sent": now, "end": now, "status": None, "cut": False, "error": error})
                time.sleep(0.1)
                continue
            with self.lock:  # (connected first: stop() shuts only connected sockets, once stopping)
                if self.stopping.is_set():
                    sock.close()
                    return
                self.sockets.add(sock)
            self.answers.append(self.one(sock))

    def one(self, sock: socket.socket) -> dict[str, Any]:
        out: dict[str, Any] = {"sent": time.perf_counter(), "status": None, "bytes": 0, "cut": False}
        head = b""
        try:
            try:
                sock.sendall(self.data)
                out["sent_all"] = time.perf_counter()
            except OSError as exc:  # (a server that answers before reading it all: read the answer)
                out["send_error"] = f"{type(exc).__name__}: {exc}"
            framing = Framing()
            while not framing.done and (data := sock.recv(1 << 20)):
                out["first_byte"] = out.get("first_byte") or time.perf_counter()
                out["bytes"] += len(data)
                framing.feed(data)
                if len(head) < 65536:
                    head += data[: 65536 - len(head)]
            complete = framing.done or (not self.stopping.is_set() and bool(head))  # (or EOF)
        except OSError as exc:
            complete = False
            if not self.stopping.is_set():
                out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            with self.lock:
                self.sockets.discard(sock)
            sock.close()
        out["end"], out["cut"] = time.perf_counter(), self.stopping.is_set() and not complete
        if match := STATUS.match(head):
            out["status"] = int(match.group(1))
        if out["status"] != 200 and (found := MESSAGE.search(head)):
            try:
                out["message"] = json.loads(b'"' + found.group(1) + b'"')
            except ValueError:
                out["message"] = found.group(1).decode(errors="replace")
        if out["status"] is None and "error" not in out and not out["cut"]:
            out["error"] = out.get("send_error") or "the connection closed without an answer"
        return out

    def stop(self, cap: float = 10.0) -> int:
        """Stop sending, shut every socket; the threads still alive after ``cap`` s."""
        self.stopping.set()
        with self.lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):  # (already closed by the server)
                    sock.shutdown(socket.SHUT_RDWR)
        give_up = time.perf_counter() + cap
        for thread in self.threads:
            thread.join(timeout=max(0.1, give_up - time.perf_counter()))
        return sum(thread.is_alive() for thread in self.threads)


def answers_summary(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Statuses (a cut one counted as ``cut``), each status's first message, durations."""
    statuses = Counter("cut" if a["cut"] else str(a["status"]) for a in answers)
    messages: dict[str, str] = {}
    for a in answers:
        if a.get("message") or a.get("error"):
            messages.setdefault(str(a["status"]), a.get("message") or a["error"])
    whole = [(a["end"] - a["sent"]) * 1e3 for a in answers if not a["cut"]]
    return {"requests": len(answers), "statuses": dict(statuses), "messages": messages, "ms": dist(whole)}


# -- the run -----------------------------------------------------------------------------


def bystander(client: httpx.Client, server: servers.Server, args: Any) -> dict[str, Any]:
    payload = body(args.prompt, args.max_tokens, cache_prompt=False, stream_options={"include_usage": True})
    got = timed_stream(
        args.prompt, args.max_tokens, lambda: sse_chunks(client, server.url + "/v1/completions", payload)
    )
    keys = ("ttft_ms", "decode_tps", "total_s", "tokens", "token_source", "finish_reason", "error")
    return {k: getattr(got, k) for k in keys}


def window(
    server: servers.Server, client: httpx.Client, args: Any, label: Any, number: int, data: bytes | None
) -> dict[str, Any]:
    """The load (``data``; none: the bystander alone), ``--lead`` s, the bystander; then
    the load stopped, the server drained (``/health``) and its CPU idle (harness/proc.py's
    rule: a request its client left may still be computing)."""
    label.value = number
    started = time.perf_counter()
    load = Load(server.port, data, args.load_clients, args.request_timeout) if data else None
    if load:
        time.sleep(args.lead)
    sent = time.perf_counter()
    stream = bystander(client, server, args)
    ended = time.perf_counter()
    label.value = BETWEEN
    out: dict[str, Any] = {"window": number, "start": started, "sent": sent, "end": ended, **stream}
    if load:
        out["load_alive"] = load.stop()
        out["answers"] = answers_summary(load.answers)
        out["answered_in_window"] = sum(a["end"] <= ended for a in load.answers)
    out["drained_s"] = server.wait_drained(args.settle_cap)
    out["settled_s"] = wait_cpu_idle(server.pid, time.perf_counter(), args.settle_cap).after_s
    return out


def model_id(server: servers.Server) -> str:
    data = httpx.get(server.url + "/v1/models", timeout=10.0).json()["data"]
    return str(data[0]["id"])


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    names = "threads ctx_size slots max_tokens reps prompt cases server_args load_clients lead stop_count"
    names += " stop_tokens bias_entries bias_tokens count_mib embed_inputs settle_cap idle interval"
    names += " poll_timeout bar_ratio bar_ms"
    cfg = cli.environment(model, **cli.pick(args, names))
    mp, notes, windows = multiprocessing.get_context("spawn"), list[str](), list[dict[str, Any]]()
    polls: list[dict[str, Any]] = []
    label, ready, out = mp.Value("i", IDLE), mp.Event(), mp.Queue()
    timeout = httpx.Timeout(10.0, read=args.request_timeout)
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        settings = cli.pick(args, "threads ctx_size") | {"slots": args.slots}
        settings["extra"] = ["--slots", str(args.slots), *shlex.split(args.server_args)]
        running.append(server := servers.Server.start(servers.TRIOSERVE, model, Path(logs), **settings))
        server.wait_ready(args.ready_timeout)
        cfg["commands"] = {server.name: server.command}
        name = model_id(server)
        bodies: dict[str, dict[str, bytes]] = {}
        cfg["bodies"], harmless = {}, {}
        for case in args.cases:
            made = requests(case, name, args)
            harmless[case] = made[HARMLESS]
            bodies[case] = {v: request_bytes(server.port, p, path=path) for v, (path, p) in made.items()}
            cfg["bodies"][case] = {v: {"path": made[v][0], "bytes": len(b)} for v, b in bodies[case].items()}
            cli.log(f"{case}: " + ", ".join(f"{v} {len(b) / 2**20:.2f} MiB" for v, b in bodies[case].items()))
        with httpx.Client(timeout=timeout) as client:
            bystander(client, server, args)  # warm-up, and the harmless non-streamed requests once each
            for case in set(args.cases) & {"count_tokens", "embeddings"}:
                path, payload = harmless[case]
                client.post(server.url + path, json=payload).raise_for_status()
            child = mp.Process(
                target=poller, args=(server.port, args.interval, args.poll_timeout, label, ready, out)
            )
            try:
                child.start()
                if not ready.wait(60):
                    raise RuntimeError("the /health poller did not start in 60 s")
                cli.log(f"polling /health every {args.interval:g} s: {args.idle:g} s idle")
                time.sleep(args.idle)
                label.value = BETWEEN
                for rep in range(args.reps):
                    plan = [(ALONE, ALONE)]
                    for i, case in enumerate(args.cases):
                        pair = [(case, HOSTILE), (case, HARMLESS)]
                        plan += pair if (rep + i) % 2 == 0 else pair[::-1]
                    for case, variant in plan:
                        server.check_alive()
                        data = None if case == ALONE else bodies[case][variant]
                        got = window(server, client, args, label, len(windows) + 1, data)
                        windows.append({"rep": rep, "case": case, "variant": variant, **got})
                        answers = got.get("answers", {})
                        cli.log(
                            f"round {rep + 1}/{args.reps} {case} {variant}: "
                            f"{fmt(got['decode_tps'])} tok/s, {got['tokens']} tokens"
                            + (f"; {answers['requests']} requests {answers['statuses']}" if answers else "")
                            + (f"; error {got['error']}" if got["error"] else "")
                        )
                label.value = STOP
                polls = out.get(timeout=60)
            finally:
                label.value = STOP
                child.join(timeout=10)
                if child.is_alive():
                    child.terminate()
    t0 = windows[0]["start"] if windows else 0.0
    for record in [*polls, *windows]:
        for key in ("t", "start", "sent", "end"):
            if key in record:
                record[key] -= t0  # seconds since the first window started
    result = summarize(cfg, windows, polls, args)
    return result | {"windows": windows, "polls": polls, "notes": notes + result["notes"]}


def health_in(polls: list[dict[str, Any]], numbers: set[int]) -> dict[str, Any]:
    mine = [p for p in polls if p["window"] in numbers]
    ok = [p["ms"] for p in mine if p["status"] == 200]
    return {"polls": len(mine), "failed": len(mine) - len(ok), **(dist(ok) or {})}


def summarize(
    cfg: dict[str, Any], windows: list[dict[str, Any]], polls: list[dict[str, Any]], args: Any
) -> dict[str, Any]:
    rows, cases, problems, notes = [], [], [], []
    idle = {"case": "idle server", "variant": "", **health_in(polls, {IDLE})}
    for case, variant in [(ALONE, ALONE)] + [(c, v) for c in cfg["cases"] for v in (HOSTILE, HARMLESS)]:
        mine = [w for w in windows if w["case"] == case and w["variant"] == variant]
        statuses: Counter[str] = Counter()
        messages: dict[str, str] = {}
        for w in mine:
            statuses.update((w.get("answers") or {}).get("statuses", {}))
            for status, message in (w.get("answers") or {}).get("messages", {}).items():
                messages.setdefault(status, message)
        row = {"case": case, "variant": variant, "tps": [w["decode_tps"] for w in mine]}
        row |= {"ttft_ms": [w["ttft_ms"] for w in mine], "tokens": [w["tokens"] for w in mine]}
        row |= {
            "statuses": dict(statuses),
            "messages": messages,
            "health": health_in(polls, {w["window"] for w in mine}),
        }
        rows.append(row)
        for w in mine:
            if w["error"]:
                notes.append(f"round {w['rep'] + 1} {case} {variant}: the bystander: {w['error']}")
            if w.get("load_alive"):
                notes.append(
                    f"round {w['rep'] + 1} {case} {variant}: {w['load_alive']} load thread(s) still running"
                )
            if w["drained_s"] is None or w["settled_s"] is None:
                cap = f"--settle-cap {args.settle_cap:g} s"
                notes.append(
                    f"round {w['rep'] + 1} {case} {variant}: the server still busy {cap} after the load"
                )
    by = {(r["case"], r["variant"]): r for r in rows}
    for case in cfg["cases"]:
        hostile, harmless = by[(case, HOSTILE)], by[(case, HARMLESS)]
        answered = {s: n for s, n in hostile["statuses"].items() if s != "cut"}
        refused = bool(answered) and set(answered) == {"400"}
        tps_ratio = median(hostile["tps"]) / median(harmless["tps"]) if harmless["tps"] else float("nan")
        health = hostile["health"]
        health_ok = health.get("p99") is not None and health["p99"] <= args.bar_ms and health["failed"] == 0
        rate_ok = tps_ratio == tps_ratio and tps_ratio >= args.bar_ratio
        verdict = {"case": case, "refused": refused, "ratio": tps_ratio, "rate_ok": rate_ok}
        verdict |= {
            "health_p99": health.get("p99"),
            "health_failed": health["failed"],
            "health_ok": health_ok,
        }
        verdict["met"] = (refused or rate_ok) and health_ok
        if refused:
            verdict["message"] = hostile["messages"].get("400", "")
        cases.append(verdict)
        if not verdict["met"]:
            problems.append(f"{case}: the bar is missed")
        bad = {s: n for s, n in harmless["statuses"].items() if s not in ("200", "cut")}
        if bad:
            notes.append(f"{case}: the harmless request was answered {bad}: {harmless['messages']}")
        if not answered:
            notes.append(
                f"{case}: no hostile request was answered within a window (all cut): raise --max-tokens"
            )
    return {"config": cfg, "idle": idle, "rows": rows, "cases": cases, "problems": problems, "notes": notes}


def report(result: dict[str, Any], args: Any) -> None:
    cfg = result["config"]
    what = f"trioserve --slots {cfg['slots']} {cfg['server_args']}".rstrip() + f", {cfg['threads']} threads"
    what += "; one bystander stream"
    what += f" ({cfg['max_tokens']} tokens, greedy, cache_prompt false) beside {cfg['load_clients']}"
    what += f" client(s) sending a hostile or harmless request in a loop; {cfg['reps']} rounds"
    what += f"; /health every {cfg['interval'] * 1e3:g} ms"
    print(cli.header(cfg, what))
    alone = median(next(r for r in result["rows"] if r["case"] == ALONE)["tps"])

    def statuses(row: dict[str, Any]) -> str:
        return ", ".join(f"{s} ×{n}" for s, n in sorted(row["statuses"].items())) or "—"

    columns = [
        ("case", lambda r: r["case"]),
        ("beside", lambda r: r["variant"]),
        ("answers", statuses),
        ("bystander tok/s", lambda r: spread(r["tps"])),
        ("÷ alone", lambda r: ratio(median(r["tps"]) / alone) if r["tps"] else "—"),
        ("TTFT ms", lambda r: spread(r["ttft_ms"], ".0f")),
        *[(f"/health {k} ms", lambda r, k=k: fmt(r["health"].get(k))) for k in ("p50", "p99", "max")],
        ("failed", lambda r: str(r["health"]["failed"])),
    ]
    idle = {**result["idle"]}
    print(
        f"/health on the idle server: p50 {fmt(idle.get('p50'))} ms, p99 {fmt(idle.get('p99'))} ms, "
        f"max {fmt(idle.get('max'))} ms, {idle['failed']} failed of {idle['polls']}\n"
    )
    print(rows_table(result["rows"], columns))
    print()
    for v in result["cases"]:
        health = f"/health p99 {fmt(v['health_p99'])} ms, {v['health_failed']} failed"
        health += f" (≤ {cfg['bar_ms']:g} ms: {'pass' if v['health_ok'] else 'FAIL'})"
        if v["refused"]:
            first = f"refused (400: {v['message'][:160]})"
        else:
            first = (
                f"ratio {ratio(v['ratio'])} (≥ {cfg['bar_ratio']:g}: {'pass' if v['rate_ok'] else 'FAIL'})"
            )
        print(f"- {v['case']}: {first}; {health}: {'pass' if v['met'] else 'FAIL'}")
    messages = [(r, s, m) for r in result["rows"] for s, m in r["messages"].items()]
    if messages:
        print()
        columns_ = [("case", lambda x: x[0]["case"]), ("beside", lambda x: x[0]["variant"])]
        columns_ += [
            ("status", lambda x: x[1]),
            ("message (the first)", lambda x: x[2][:200].replace("|", "\\|")),
        ]
        print(rows_table(messages, columns_))
    if args.markdown:
        print()
        columns_ = [
            ("round", lambda w: str(w["rep"] + 1)),
            ("case", lambda w: w["case"]),
            ("beside", lambda w: w["variant"]),
            ("tok/s", lambda w: fmt(w["decode_tps"])),
            ("tokens", lambda w: str(w["tokens"])),
            ("TTFT ms", lambda w: fmt(w["ttft_ms"], ".0f")),
            ("answers", lambda w: str((w.get("answers") or {}).get("statuses", "—"))),
            ("answer ms p50", lambda w: fmt(((w.get("answers") or {}).get("ms") or {}).get("p50"), ".0f")),
        ]
        print(rows_table(result["windows"], columns_))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
