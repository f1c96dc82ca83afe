"""Constrained decoding, logprobs and n through the real server (issue 15).

Parts: ``cost`` (one chat stream, greedy, max_tokens 200: none / json_object / nested
json_schema / logprobs+top_logprobs 5; decode tok/s after the first token, interleaved
rounds), ``concurrent`` (4 streams at once on --slots 4: none vs all under the schema) and
``n`` (n=4 vs 4 concurrent single requests, ~1,000-token prompt, cache_prompt false, with
the /metrics prompt_tokens_evaluated delta). ``--print-extra``: the response_format with
the nested schema as JSON (for benchmarks/cancel.py's --request-extra).

    flock /tmp/trioserve-cpu.lock .venv/bin/python scripts/probes/constrained_cost.py --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import servers

STR = {"type": "string", "maxLength": 24}


def obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


EMPLOYEE = obj(
    {
        "name": STR,
        "age": {"type": "integer", "minimum": 18, "maximum": 70},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "remote": {"type": "boolean"},
    }
)
DEPT = obj(
    {
        "name": STR,
        "budget": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "employees": {"type": "array", "items": EMPLOYEE, "minItems": 3, "maxItems": 6},
    }
)
SCHEMA = obj(
    {
        "company": STR,
        "founded": {"type": "integer", "minimum": 1800, "maximum": 2025},
        "departments": {"type": "array", "items": DEPT, "minItems": 4, "maxItems": 8},
    }
)
NESTED = {"response_format": {"type": "json_schema", "json_schema": {"name": "company", "schema": SCHEMA}}}
VARIANTS = {
    "none": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": NESTED,
    "logprobs": {"logprobs": True, "top_logprobs": 5},
}
ASK = (
    "Describe a fictional company as JSON: its name, the year it was founded, and a list of at least "
    "six departments, each with a name, a budget and a list of at least five employees (name, age, role, "
    "whether they work remotely). Be thorough."
)


def stream(port: int, path: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """One streamed POST; every ``data:`` line's arrival time, parsed after the stream ends."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    sent = time.perf_counter()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp, lines = conn.getresponse(), []
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    while line := resp.readline():
        if line.startswith(b"data: "):
            lines.append((time.perf_counter(), line[6:]))
    conn.close()
    text_times, finish, usage, choices, texts = [], {}, None, {}, []
    for at, raw in lines:
        if raw.strip() == b"[DONE]":
            continue
        event = json.loads(raw)
        usage = event.get("usage") or usage
        for c in event["choices"]:
            part = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if part:
                text_times.append(at)
                choices.setdefault(c["index"], at)
                texts += [part] if c["index"] == 0 else []
            finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
    tokens = usage["completion_tokens"]
    span = text_times[-1] - text_times[0]
    return {
        "sent": sent,
        "end": lines[-1][0],
        "ttft_ms": (text_times[0] - sent) * 1e3,
        "first_per_choice_ms": sorted((t - sent) * 1e3 for t in choices.values()),
        "total_ms": (lines[-1][0] - sent) * 1e3,
        "tokens": tokens,
        "finish": sorted(set(finish.values())),
        "prompt_tokens": usage["prompt_tokens"],
        "first": text_times[0],
        "last": text_times[-1],
        "decode_tps": (tokens - 1) / span if span and len(choices) == 1 else None,
        "text": "".join(texts),
        "gap_ms": statistics.median(b - a for a, b in itertools.pairwise(text_times)) * 1e3 if span else None,
    }


def chat(tag: str, variant: str, max_tokens: int) -> dict[str, Any]:
    msg = [{"role": "user", "content": f"{tag}{ASK}"}]
    return {"messages": msg, "max_tokens": max_tokens, "temperature": 0, **VARIANTS[variant]}


def together(port: int, path: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bodies as concurrent streams, released together by a barrier."""
    out: list[Any] = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = stream(port, path, bodies[i])
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors := [r for r in out if isinstance(r, Exception)]:
        raise errors[0]
    return out


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def part_cost(port: int, args: Any) -> dict[str, Any]:
    runs: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for v in names:  # warm-up, not counted
        stream(port, "/v1/chat/completions", chat("", v, 8))
    for r in range(args.reps):
        for v in names[r % 4 :] + names[: r % 4]:
            runs[v].append(s := stream(port, "/v1/chat/completions", chat("", v, args.max_tokens)))
            print(
                f"cost {r} {v:<12} {s['decode_tps']:.1f} tok/s ttft {s['ttft_ms']:.0f} {s['finish']}",
                file=sys.stderr,
            )
    base = 1e3 / statistics.median(s["decode_tps"] for s in runs["none"])
    out = {}
    for v, rows in runs.items():
        ms = 1e3 / statistics.median(s["decode_tps"] for s in rows)
        out[v] = {
            "decode_tps": [round(s["decode_tps"], 2) for s in rows],
            "ms_per_token": round(ms, 2),
            "diff_ms": round(ms - base, 2),
            "fraction": round((ms - base) / base, 3),
            "ttft_ms": round(med(rows, "ttft_ms"), 1),
            "gap_ms": round(med(rows, "gap_ms"), 2),  # (median of each stream's median token gap)
            "gap_diff_ms": round(med(rows, "gap_ms") - med(runs["none"], "gap_ms"), 2),
            "tokens": sorted({s["tokens"] for s in rows}),
            "finish": sorted({f for s in rows for f in s["finish"]}),
            "texts_equal": len({s["text"] for s in rows}) == 1,
            "text": rows[0]["text"],
        }
    return out


def part_concurrent(port: int, args: Any) -> dict[str, Any]:
    out: dict[str, list[Any]] = {"none": [], "json_schema": []}
    for v in out:
        together(port, "/v1/chat/completions", [chat(f"({i}) ", v, 8) for i in range(4)])
    for r in range(args.reps):
        for v in list(out)[r % 2 :] + list(out)[: r % 2]:
            bodies = [{**chat(f"({i}) ", v, args.max_tokens), "cache_prompt": False} for i in range(4)]
            rows = together(port, "/v1/chat/completions", bodies)
            wall = max(s["end"] for s in rows) - min(s["sent"] for s in rows)
            rec = {
                "total_tps": sum(s["tokens"] for s in rows) / wall,
                "decode_tps": sum(s["decode_tps"] for s in rows),  # (the streams overlap)
                "per_stream": [round(s["decode_tps"], 2) for s in rows],
                "gap_ms": statistics.median(s["gap_ms"] for s in rows),
                "tokens": [s["tokens"] for s in rows],
                "finish": sorted({f for s in rows for f in s["finish"]}),
            }
            out[v].append(rec)
            print(
                f"concurrent {r} {v:<12} total {rec['total_tps']:.1f} tok/s {rec['finish']}", file=sys.stderr
            )
    return out


def serve(args: Any, parts: dict[str, tuple[list[str], Any]]) -> dict[str, Any]:
    """Each part on a fresh ``trioserve serve --threads 2`` with its options; the results."""
    model = ["--model", str(args.model)] if args.model else []
    results: dict[str, Any] = {"commands": {}}
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        for part, (options, measure) in parts.items():
            port = servers.free_port()
            argv = servers.trioserve_command(port, *model, "--threads", "2", *options)
            running.append(srv := servers.Server(f"trioserve-{part}", argv, port, Path(logs)))
            srv.wait_ready(120)
            results["commands"][part] = argv
            results[part] = measure(port, args)
            running.remove(srv)
            srv.stop()
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="GGUF (default: trioserve's default model)")
    p.add_argument("--parts", default="cost,concurrent", help="comma-separated: cost, concurrent")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--print-extra", action="store_true", help="print the schema's request extra; exit")
    args = p.parse_args()
    if args.print_extra:
        print(json.dumps(NESTED, separators=(",", ":")))
        return 0
    every = {"cost": ([], part_cost), "concurrent": (["--slots", "4"], part_concurrent)}
    serve(args, {k: every[k] for k in args.parts.split(",")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
