"""Sharing one server: fair shares between API keys, and a priority that pauses.

``fairness`` (issue 36's bar): key A keeps ``--a-streams`` (16) long streamed
completions in flight (each ``--a-tokens`` tokens, EOS banned; a thread per stream,
sending the next as soon as one ends); key B sends one short streamed chat request
(``--b-tokens``) every ``--b-interval`` s, ``--b-requests`` of them. Measured, per
contestant: B's time to first token alone (A idle) and under A's load, and A's
generated tokens/s alone and beside B over the same window. The bar: B's median TTFT
under load ≤ 1.5 × B alone, and A's throughput drop ≤ B's share of the tokens
generated. Contestants: ``trioserve`` with a keys file (A and B one key each, equal
weights: fair shares), ``trioserve-fcfs`` (no API keys: one account, first come first
served within a priority, as before issue 36), ``llama-server`` (first come,
first served; ``--parallel`` = slots, one context per slot as trioserve's). A's
tokens in a window: each request's tokens spread evenly over its time (requests of
400 tokens outlast a window).

``priority``: ``--slots`` (8) priority-5 streams decode; a priority-0 streamed
completion (``--urgent-tokens``) arrives, every ``--b-interval`` s, ``--b-requests`` of
them: its TTFT against the same request on the idle server. trioserve only (with and
without ``--batch-invariant``); llama-server has no priority.

``session`` (latest wins): ``--keystrokes`` (20) streamed completions of one
``X-Session-Id``, ``--keystroke-gap`` (50 ms) apart, as an editor sends one per
keystroke: how many completed (only the last should), and each superseded one's
``cancel_latency_ms`` (trioserve's log: its successor's arrival → its inference thread
out of the model). The bar: every one ≤ 50 ms. trioserve only.

    python benchmarks/fairness.py --json artifacts/fairness.json
    python benchmarks/fairness.py --scenarios priority,session
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.stats import fmt, median, rows_table

KEY_A, KEY_B = "sk-bench-a", "sk-bench-b"
TS, FCFS, LS = servers.TRIOSERVE, f"{servers.TRIOSERVE}-fcfs", servers.LLAMA_SERVER
TS_BI = f"{servers.TRIOSERVE}-batch-invariant"
#: Gemma 3's end of sequence: banned, so A's streams run to their token limit
NO_EOS = {"1": -100}
B_MESSAGES = [{"role": "user", "content": "Name three colours."}]
A_PROMPT = "Write a long story about a lighthouse keeper and the sea."
URGENT_PROMPT = "The capital of France is"
KEYS_FILE = f"""
[[key]]
name = "a"
key = "{KEY_A}"

[[key]]
name = "b"
key = "{KEY_B}"
"""


def parse_args() -> Any:
    p = cli.parser(__doc__, ((TS, FCFS, LS), (TS, FCFS, LS)), threads=2, ctx_size=2048, slots=8)
    p.add_argument(
        "--scenarios",
        default="fairness,priority,session",
        help="fairness, priority, session (comma-separated)",
    )
    cli.option(p, "--keystrokes", 20, "session: requests of one session")
    cli.option(p, "--keystroke-gap", 0.05, "session: seconds between them")
    cli.option(p, "--a-streams", 16, "key A's streams in flight")
    cli.option(p, "--a-tokens", 400, "tokens per A stream")
    cli.option(p, "--b-requests", 10, "B's requests (and urgent ones)")
    cli.option(p, "--b-interval", 2.0, "seconds between B's requests")
    cli.option(p, "--b-tokens", 16, "tokens per B request")
    cli.option(p, "--urgent-tokens", 16, "tokens per priority-0 request")
    return p.parse_args()


def stream(client: httpx.Client, url: str, path: str, payload: dict[str, Any], key: str) -> dict[str, Any]:
    """One streamed request: TTFT (first text), tokens (usage), seconds."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    chat = path.endswith("chat/completions")
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", url + path, json=body, headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if "timings" in event and not tokens:
                tokens = event["timings"].get("predicted_n", 0)
    return {"ttft_ms": (ttft or float("nan")) * 1e3, "tokens": tokens, "seconds": time.perf_counter() - t0}


class Load:
    """``count`` threads streaming one request after another until stopped; the tokens
    of each finished request with its end time."""

    def __init__(self, url: str, path: str, payload: dict[str, Any], key: str, count: int, timeout: float):
        self.stop = threading.Event()
        #: each finished request: (start, end, tokens)
        self.done: list[tuple[float, float, int]] = []
        self.errors: list[str] = []

        def worker() -> None:
            with httpx.Client(timeout=httpx.Timeout(10.0, read=timeout)) as client:
                while not self.stop.is_set():
                    try:
                        started = time.perf_counter()
                        got = stream(client, url, path, payload, key)
                        self.done.append((started, time.perf_counter(), got["tokens"]))
                    except Exception as exc:  # recorded; the thread goes on
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                        time.sleep(0.1)

        self.threads = [threading.Thread(target=worker, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def tokens_between(self, t0: float, t1: float) -> float:
        """Tokens generated in ``[t0, t1)``: each request's spread over its time."""
        total = 0.0
        for start, end, n in self.done:
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0 and end > start:
                total += n * overlap / (end - start)
        return total

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def paced(
    client: httpx.Client, url: str, path: str, payload: dict[str, Any], key: str, args: Any
) -> list[Any]:
    """``--b-requests`` requests, one every ``--b-interval`` s (each sent on time, or at
    once after a late one)."""
    out, next_at = [], time.perf_counter()
    for _ in range(args.b_requests):
        time.sleep(max(0.0, next_at - time.perf_counter()))
        next_at = time.perf_counter() + args.b_interval
        # a new connection each time (a person's requests seconds apart: measured here,
        # llama-server under load closes idle keep-alive connections unanswered)
        with httpx.Client(timeout=client.timeout) as fresh:
            try:
                out.append(stream(fresh, url, path, payload, key))
            except httpx.HTTPError as exc:
                out.append({"ttft_ms": float("nan"), "tokens": 0, "seconds": 0.0, "error": repr(exc)})
    return out


def start(name: str, model: Path, logs: Path, args: Any, keys: Path) -> servers.Server:
    settings = cli.pick(args, "threads ctx_size slots")
    if servers.kind(name) == LS:
        extra = [
            "--parallel",
            str(args.slots),
            "--ctx-size",
            str(args.ctx_size * args.slots),
            "--no-kv-unified",
        ]
        server = servers.Server.start(
            name, model, logs, **{**settings, "ctx_size": args.ctx_size, "extra": extra}
        )
    else:
        extra = ["--slots", str(args.slots), "--max-queue", "64"]
        if name != FCFS:
            extra += ["--api-key", KEY_A, "--api-key", KEY_B]
        if name == TS:
            extra += ["--keys-file", str(keys)]
        if name == TS_BI:
            extra += ["--batch-invariant"]
        server = servers.Server.start(name, model, logs, **{**settings, "extra": extra})
    server.wait_ready(args.ready_timeout)
    return server


def fairness(server: servers.Server, args: Any) -> dict[str, Any]:
    url, timeout = server.url, args.request_timeout
    a_payload = {"prompt": A_PROMPT, "max_tokens": args.a_tokens, "temperature": 0, "logit_bias": NO_EOS}
    b_payload = {"messages": B_MESSAGES, "max_tokens": args.b_tokens, "temperature": 0}
    with httpx.Client(timeout=httpx.Timeout(10.0, read=timeout)) as client:
        stream(client, url, "/v1/chat/completions", b_payload, KEY_B)  # warm-up
        b_alone = paced(client, url, "/v1/chat/completions", b_payload, KEY_B, args)
        window = args.b_requests * args.b_interval
        load = Load(url, "/v1/completions", a_payload, KEY_A, args.a_streams, timeout)
        try:
            time.sleep(window / 2)  # every A stream running, the queue full
            t0 = time.perf_counter()
            time.sleep(window)
            t1 = time.perf_counter()
            b_loaded = paced(client, url, "/v1/chat/completions", b_payload, KEY_B, args)
            t2 = time.perf_counter()
        finally:
            load.close()  # (every request in the windows has ended: counted whole)
    a_alone = load.tokens_between(t0, t1) / (t1 - t0)
    a_beside = load.tokens_between(t1, t2) / (t2 - t1)
    b_tokens = sum(r["tokens"] for r in b_loaded) / (t2 - t1)
    alone, loaded = median([r["ttft_ms"] for r in b_alone]), median([r["ttft_ms"] for r in b_loaded])
    drop = 1 - a_beside / a_alone if a_alone else float("nan")
    share = b_tokens / (b_tokens + a_beside) if a_beside else float("nan")
    return {
        "b_alone_ttft_ms": [r["ttft_ms"] for r in b_alone],
        "b_loaded_ttft_ms": [r["ttft_ms"] for r in b_loaded],
        "b_alone_median_ms": alone,
        "b_loaded_median_ms": loaded,
        "ratio": loaded / alone,
        "a_alone_tps": a_alone,
        "a_beside_tps": a_beside,
        "a_drop": drop,
        "b_share": share,
        "errors": load.errors[:5],
        "b_errors": [r["error"] for r in (*b_alone, *b_loaded) if "error" in r],
        "bar_ttft": loaded <= 1.5 * alone,
        "bar_throughput": drop <= share + 0.05,
    }


def _health(server: servers.Server) -> dict[str, Any]:
    """trioserve's ``/health`` in full (keys are required: with one)."""
    answer: dict[str, Any] = httpx.get(
        server.url + "/health", headers={"authorization": f"Bearer {KEY_A}"}, timeout=5.0
    ).json()
    return answer


def priority(server: servers.Server, args: Any) -> dict[str, Any]:
    url, timeout = server.url, args.request_timeout
    low = {
        "prompt": A_PROMPT,
        "max_tokens": args.a_tokens,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "priority": 5,
    }
    urgent = {"prompt": URGENT_PROMPT, "max_tokens": args.urgent_tokens, "temperature": 0, "priority": 0}
    with httpx.Client(timeout=httpx.Timeout(10.0, read=timeout)) as client:
        stream(client, url, "/v1/completions", urgent, KEY_B)  # warm-up
        idle = paced(client, url, "/v1/completions", urgent, KEY_B, args)
        load = Load(url, "/v1/completions", low, KEY_A, args.slots, timeout)
        try:
            deadline = time.perf_counter() + 60
            while _health(server).get("slots_in_use") != args.slots and time.perf_counter() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # every low stream decoding
            before = _health(server)["preemptions"]
            busy = paced(client, url, "/v1/completions", urgent, KEY_B, args)
            preemptions = _health(server)["preemptions"] - before
        finally:
            load.close()
    alone, loaded = median([r["ttft_ms"] for r in idle]), median([r["ttft_ms"] for r in busy])
    return {
        "idle_ttft_ms": [r["ttft_ms"] for r in idle],
        "busy_ttft_ms": [r["ttft_ms"] for r in busy],
        "idle_median_ms": alone,
        "busy_median_ms": loaded,
        "ratio": loaded / alone,
        "preemptions": preemptions,
        "errors": load.errors[:5],
        "bar": loaded <= 1.5 * alone,
    }


LATENCY = re.compile(r"request (k\d+) .*cause=(\w+).*?(?:cancel_latency_ms=([\d.]+))?$")


def session(server: servers.Server, args: Any) -> dict[str, Any]:
    """Keystrokes of one session: which completed, and the superseded ones' cancel latency."""
    statuses: dict[int, int] = {}
    payload = {"max_tokens": 64, "temperature": 0, "stream": True}

    def keystroke(i: int) -> None:
        body = {**payload, "prompt": f"# keystroke {i}\ndef fibonacci(n):"}
        headers = {"authorization": f"Bearer {KEY_A}", "X-Session-Id": "editor", "X-Request-Id": f"k{i}"}
        with (
            httpx.Client(timeout=httpx.Timeout(10.0, read=args.request_timeout)) as client,
            client.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r,
        ):
            statuses[i] = r.status_code
            for _ in r.iter_lines():
                pass

    threads = []
    for i in range(args.keystrokes):
        thread = threading.Thread(target=keystroke, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(args.keystroke_gap)
    for thread in threads:
        thread.join()
    server.wait_drained(30.0)
    time.sleep(0.5)  # (the log lines are written as each request ends)
    causes: dict[str, str] = {}
    latencies: list[float] = []
    for line in server.log_text().splitlines():
        found = LATENCY.search(line)
        if found is None:
            continue
        causes[found.group(1)] = found.group(2)
        if found.group(2) == "superseded" and found.group(3):
            latencies.append(float(found.group(3)))
    last = f"k{args.keystrokes - 1}"
    return {
        "statuses": statuses,
        "causes": causes,
        "completed": sorted(k for k, cause in causes.items() if cause in ("length", "stop")),
        "last_completed": causes.get(last) in ("length", "stop"),
        "superseded": sum(cause == "superseded" for cause in causes.values()),
        "cancel_latency_ms": latencies,
        "max_latency_ms": max(latencies) if latencies else float("nan"),
        "bar": bool(latencies) and max(latencies) <= 50.0 and causes.get(last) in ("length", "stop"),
    }


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    names = "threads ctx_size slots a_streams a_tokens b_requests b_interval b_tokens urgent_tokens"
    cfg = cli.environment(model, **cli.pick(args, names))
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    result: dict[str, Any] = {"config": cfg, "fairness": {}, "priority": {}, "session": {}, "notes": []}
    with tempfile.TemporaryDirectory() as logs_dir, servers.running([]) as running:
        logs = Path(logs_dir)
        keys = logs / "keys.toml"
        keys.write_text(KEYS_FILE)
        if "fairness" in scenarios:
            for name in args.contestants:
                cli.log(f"fairness: {name}")
                server = start(name, model, logs, args, keys)
                running.append(server)
                result["fairness"][name] = fairness(server, args)
                server.stop()
                running.remove(server)
        if "priority" in scenarios:
            for name in (TS, TS_BI):
                cli.log(f"priority: {name}")
                server = start(name, model, logs, args, keys)
                running.append(server)
                result["priority"][name] = priority(server, args)
                server.stop()
                running.remove(server)
        if "session" in scenarios:
            cli.log("session: trioserve")
            server = start(TS, model, logs, args, keys)
            running.append(server)
            result["session"][TS] = session(server, args)
            server.stop()
            running.remove(server)
    return result


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def report(result: dict[str, Any], args: Any) -> None:
    print(cli.header(result["config"], "sharing one server (issue 36)"))
    if result["fairness"]:
        print("fairness: B's TTFT alone and beside A's streams; A's tokens/s alone and beside B")
        rows = list(result["fairness"].items())
        columns = [
            ("contestant", lambda r: r[0]),
            ("B TTFT alone ms", lambda r: fmt(r[1]["b_alone_median_ms"], ".0f")),
            ("B TTFT loaded ms", lambda r: fmt(r[1]["b_loaded_median_ms"], ".0f")),
            ("× alone", lambda r: fmt(r[1]["ratio"], ".2f")),
            ("A tok/s alone", lambda r: fmt(r[1]["a_alone_tps"], ".1f")),
            ("A tok/s beside B", lambda r: fmt(r[1]["a_beside_tps"], ".1f")),
            ("A drop", lambda r: f"{r[1]['a_drop'] * 100:.1f} %"),
            ("B share", lambda r: f"{r[1]['b_share'] * 100:.1f} %"),
            (
                "bars",
                lambda r: f"{'✓' if r[1]['bar_ttft'] else '✗'} {'✓' if r[1]['bar_throughput'] else '✗'}",
            ),
        ]
        print(rows_table(rows, columns))
    if result["priority"]:
        print("\npriority: a priority-0 request while every slot decodes priority-5 streams")
        rows = list(result["priority"].items())
        columns = [
            ("server", lambda r: r[0]),
            ("TTFT idle ms", lambda r: fmt(r[1]["idle_median_ms"], ".0f")),
            ("TTFT busy ms", lambda r: fmt(r[1]["busy_median_ms"], ".0f")),
            ("× idle", lambda r: fmt(r[1]["ratio"], ".2f")),
            ("pauses", lambda r: str(r[1]["preemptions"])),
            ("bar ≤ 1.5×", lambda r: "✓" if r[1]["bar"] else "✗"),
        ]
        print(rows_table(rows, columns))
    if result["session"]:
        got = result["session"][TS]
        print(
            f"\nsession: {args.keystrokes} requests of one session, {args.keystroke_gap * 1000:.0f} ms apart"
        )
        print(
            f"completed: {', '.join(got['completed']) or 'none'} (the last: {_mark(got['last_completed'])}); "
            f"superseded: {got['superseded']}; cancel latency max {fmt(got['max_latency_ms'], '.1f')} ms "
            f"(median {fmt(median(got['cancel_latency_ms']), '.1f')}); bar ≤ 50 ms: {_mark(got['bar'])}"
        )


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
