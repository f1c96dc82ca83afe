"""Conversations and the prompt cache (issue 14): TTFT turn by turn, beside llama-server.

Contestants at their defaults (``--threads`` given): trioserve, llama-server (4 slots,
``cache_prompt`` on), llama-cpp-python (it reuses its last prompt's prefix). A turn is a
streamed ``POST /v1/completions`` (greedy, 32 tokens, nothing banned) whose prompt this
client renders in Gemma's turn format, the same way for every server: the previous
prompt + the server's reply + the next user text (~180 tokens a turn); the user reads
``--read-time`` s after each reply. Phases, each server in turn, all idle first: ``multi``
(one conversation), ``interleaved`` (``--conversations`` round-robin), ``retry`` (a
~1,500-word prompt cold; another closed at ``--close-at`` of the cold prefill's CPU, the
CPU idle after the close, then it again). Exactness, after: every trioserve prompt again
on ``trioserve --no-prompt-cache``, every llama-server prompt with ``cache_prompt: false``.
TTFT: send → first event with text. Method: docs/benchmarks.md, "Method"; results:
"Conversations and the prompt cache".

    python benchmarks/conversation.py --json artifacts/conversation.json
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cancel import wait_idle  # every server idle (trioserve's /health drained), then 0.1 s
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import RawStream, body
from benchmarks.harness.proc import cpu_seconds, wait_cpu_idle
from benchmarks.harness.stats import clean, fmt, median, table

TS, LS, LCP, NO_CACHE = servers.TRIOSERVE, servers.LLAMA_SERVER, servers.LLAMA_CPP_PYTHON, "trioserve-nocache"
TOPICS = ("harbour", "river trade", "winter market", "city walls", "press", "railway", "great fire", "guilds")
USAGE = {"stream_options": {"include_usage": True}}


def parse_args() -> Any:
    p = cli.parser(__doc__, ((TS, LS, LCP), (TS, LS, LCP)), threads=2, ctx_size=4096, max_tokens=32)
    cli.option(p, "--turns", 8, "turns per conversation")
    cli.option(p, "--conversations", 3, "interleaved conversations")
    cli.option(p, "--read-time", 1.0, "seconds the user reads after each reply")
    cli.option(p, "--close-at", 0.4, "retry: close at this fraction of the cold prefill's server CPU")
    cli.option(p, "--idle-cap", 15.0, "seconds to wait for idle")
    return p.parse_args()


def user_text(conv: int, turn: int, words: int = 85) -> str:
    out, i = f"Conversation {conv}, question {turn}: tell me about the {TOPICS[(conv + turn) % 8]}.", 0
    while len(out.split()) < words:
        i += 1
        out += f" In {1400 + 37 * turn + 11 * i + conv} the people of the {TOPICS[(turn + i) % 8]} met again."
    return out


def complete(client: httpx.Client, server: servers.Server, prompt: str, tokens: int, **more: Any) -> Any:
    """One streamed completion: TTFT ms, text, cached and prompt tokens (usage, or llama-server's timings)."""
    out: dict[str, Any] = {"ttft_ms": math.nan, "text": "", "usage": {}, "timings": {}}
    payload, t0 = body(prompt, tokens, **USAGE, **more), time.perf_counter()
    with client.stream("POST", server.url + "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                if (choice.get("text") or choice.get("finish_reason")) and math.isnan(out["ttft_ms"]):
                    out["ttft_ms"] = (time.perf_counter() - t0) * 1e3
                out["text"] += choice.get("text") or ""
            out.update({k: event[k] for k in ("usage", "timings") if event.get(k)})
    usage, timings = out.pop("usage"), out.pop("timings")
    out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    n = sum(timings.get(k, 0) for k in ("prompt_n", "cache_n"))
    out["prompt_tokens"] = usage.get("prompt_tokens") or n or None
    return out


def converse(client: httpx.Client, server: servers.Server, phase: str, args: Any) -> list[dict[str, Any]]:
    convs = range(1, args.conversations + 1) if phase == "interleaved" else [0]
    prompts, out = dict.fromkeys(convs, ""), []
    for turn in range(1, args.turns + 1):
        for c in convs:
            prompts[c] += f"<start_of_turn>user\n{user_text(c, turn)}<end_of_turn>\n"
            prompts[c] += "<start_of_turn>model\n"
            r = {"server": server.name, "phase": phase, "conv": c, "turn": turn, "prompt": prompts[c]}
            out.append(r | complete(client, server, prompts[c], args.max_tokens))
            prompts[c] += out[-1]["text"] + "<end_of_turn>\n"
            figures = f"{out[-1]['prompt_tokens']} tokens, {out[-1]['cached']} cached"
            cli.log(f"{server.name:<16} {phase} {c} turn {turn}: {figures}, TTFT {out[-1]['ttft_ms']:.0f} ms")
            time.sleep(args.read_time)
    return out


def retry(client: httpx.Client, server: servers.Server, running: list[servers.Server], args: Any) -> Any:
    """Cold; a same-length prompt closed at ``--close-at`` of the cold CPU; it again."""
    tag, prompt = uuid.uuid4(), lambda t: f"Record {t}. " + "The history of the city is long and rich. " * 167
    cpu0, cold = cpu_seconds(server.pid), complete(client, server, prompt(f"a{tag}"), 1)
    out = {"server": server.name, "cold": cold, "cold_cpu_s": cpu_seconds(server.pid) - cpu0}
    wait_idle(running, args, args.warnings)
    cpu0, stream = cpu_seconds(server.pid), RawStream(server.port, body(prompt(f"b{tag}"), 1, **USAGE))
    give_up, target = stream.sent_at + 60, args.close_at * out["cold_cpu_s"]
    while cpu_seconds(server.pid) - cpu0 < target and time.perf_counter() < give_up:
        time.sleep(0.001)
    stream.receive(time.perf_counter() + 0.001)
    out.update(close_cpu_s=cpu_seconds(server.pid) - cpu0, events_before_close=stream.data_events())
    idle = wait_cpu_idle(server.pid, stream.close("rst"), args.idle_cap)
    out.update(idle_ms=math.inf if idle.after_s is None else 1e3 * idle.after_s, cpu_after_s=idle.cpu_s)
    wait_idle(running, args, args.warnings)
    out["retry"] = complete(client, server, prompt(f"b{tag}"), 1)
    out["ratio"] = out["retry"]["ttft_ms"] / cold["ttft_ms"]
    cli.log(f"{server.name:<16} retry: {out['ratio']:.2f}× cold, CPU idle {fmt(out['idle_ms'])} ms")
    return out


def run(args: Any) -> dict[str, Any]:
    model, args.warnings = cli.resolve_model(args), []
    names = "contestants threads ctx_size max_tokens turns conversations read_time close_at"
    cfg, turns, retries, refs = cli.environment(model, **cli.pick(args, names)), [], [], []
    wait, settings = httpx.Timeout(10.0, read=args.request_timeout), cli.pick(args, "threads ctx_size")
    client = httpx.Client(timeout=wait, headers={"Connection": "close"})  # (servers drop idle keep-alives)
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running, client:
        for name in args.contestants + [NO_CACHE] * (TS in args.contestants):
            extra = ["--no-prompt-cache"] if name == NO_CACHE else []
            running.append(servers.Server.start(name, model, Path(logs), **settings, extra=extra))
        by = {s.name: s for s in running}
        for server in running:
            server.wait_ready(args.ready_timeout)
            complete(client, server, cli.DEFAULT_PROMPT, 8)  # warm-up
        cfg["commands"] = {s.name: s.command for s in running}
        for phase, name in ((p, n) for p in ("multi", "interleaved", "retry") for n in args.contestants):
            wait_idle(running, args, args.warnings)
            if phase == "retry":
                retries.append(retry(client, by[name], running, args))
            else:
                turns += converse(client, by[name], phase, args)
        wait_idle(running, args, args.warnings)
        for t in turns:  # the references: the same prompts, cache off
            ref, more = (by.get(NO_CACHE), {}) if t["server"] == TS else (by[LS], {"cache_prompt": False})
            if t["server"] != LCP and ref:
                again = complete(client, ref, t["prompt"], args.max_tokens, **more)
                refs.append(t | {"server": ref.name} | again)
                t["equal_cache_off"] = refs[-1]["text"] == t["text"]
    keys = {(t["phase"], t["conv"], t["turn"], t["prompt"]) for t in turns}
    differ = [f"{k[0]} {k[1]} turn {k[2]}" for k in keys if [x[:3] for x in keys].count(k[:3]) > 1]
    note = [f"replies differed, so prompts did: {', '.join(sorted(set(differ)))}"] * bool(differ)
    out = {"config": cfg, "turns": turns, "retries": retries, "references": refs}
    return out | {"notes": args.warnings + note}


def report(result: dict[str, Any], args: Any) -> None:
    cfg, ok, label, verdict = result["config"], [], servers.LABELS.get, lambda ok: "pass" if ok else "FAIL"
    names, what = cfg["contestants"], f"{cfg['threads']} threads, {cfg['max_tokens']}-token replies"
    what += f", the user reads {cfg['read_time']:g} s; /v1/completions, Gemma turns rendered alike"
    print(cli.header(cfg, what))
    for phase in ("multi", "interleaved"):
        by: dict[Any, dict[str, Any]] = {}
        for t in (t for t in result["turns"] if t["phase"] == phase):
            by.setdefault((t["turn"], t["conv"]), {})[t["server"]] = t
        rows = [["turn", "conversation", "prompt tokens", *(f"TTFT ms {label(n, n)}" for n in names)]]
        rows[0] += ["trioserve cached", "llama-server cached", "trioserve ÷ llama-server"]
        for (turn, conv), r in by.items():
            ratio = r[TS]["ttft_ms"] / r[LS]["ttft_ms"] if TS in r and LS in r else math.nan
            cells = [str(turn), str(conv), str(next(iter(r.values()))["prompt_tokens"])]
            cells += [fmt(r[n]["ttft_ms"], ".0f") for n in names]
            rows.append([*cells, *(str(r.get(n, {}).get("cached")) for n in (TS, LS)), fmt(ratio, ".2f")])
        later = [median(r[n]["ttft_ms"] for (turn, _), r in by.items() if turn >= 2) for n in names]
        ratios = clean(float(row[-1]) for row in rows[1:] if int(row[0]) >= 2 and row[-1] != "—")
        rows.append(["median, ≥ 2", "", "", *(fmt(m, ".0f") for m in later), "", "", f"{median(ratios):.2f}"])
        ok += [x <= 1.1 for x in ratios]
        print(f"\n{phase}:\n\n" + table([[c.replace("None", "—") for c in row] for row in rows]))
    rows = [["server", "prompt tokens", "cold TTFT ms", "closed at CPU-s", "CPU idle after close ms"]]
    rows[0] += ["CPU after close ms", "retry TTFT ms", "retry ÷ cold", "retry cached"]
    for r in result["retries"]:
        cells = [label(r["server"], r["server"]), str(r["cold"]["prompt_tokens"]), fmt(r["cold"]["ttft_ms"])]
        cells += [fmt(r["close_cpu_s"], ".2f"), fmt(r["idle_ms"], ".0f"), fmt(1e3 * r["cpu_after_s"], ".0f")]
        rows.append([*cells, fmt(r["retry"]["ttft_ms"]), fmt(r["ratio"], ".2f"), str(r["retry"]["cached"])])
    print("\nretry after leaving:\n\n" + table([[c.replace("None", "—") for c in row] for row in rows]), "\n")
    eq = {n: [t["equal_cache_off"] for t in result["turns"] if t["server"] == n] for n in (TS, LS)}
    for n, text in ((TS, "trioserve = trioserve --no-prompt-cache"), (LS, "llama-server = cache_prompt off")):
        print(f"exactness: {text}: {sum(eq[n])}/{len(eq[n])} texts equal" * bool(eq[n]))
    print(f"\nbar: trioserve TTFT ≤ 1.1 × llama-server's, turn ≥ 2: {sum(ok)}/{len(ok)}: {verdict(all(ok))}")
    if r := next((r for r in result["retries"] if r["server"] == TS), None):
        met, figures = r["ratio"] <= 0.7 and r["idle_ms"] <= 100, f"{r['ratio']:.2f}×, {fmt(r['idle_ms'])} ms"
        print(f"bar: retry ≤ 0.7 × cold, CPU idle ≤ 100 ms after the close ({figures}): {verdict(met)}")
    print(f"bar: every turn's text = the cache-off text: {sum(eq[TS])}/{len(eq[TS])}: {verdict(all(eq[TS]))}")


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
