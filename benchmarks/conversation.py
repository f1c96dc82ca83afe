"""Conversations and the prompt cache (issues 14, 23): TTFT turn by turn, beside llama-server.

Contestants at their defaults (``--threads`` given): trioserve, llama-server (4 slots,
``cache_prompt`` on; trioserve's Gemma chat format as its ``--chat-template-file``:
the default model has no template), llama-cpp-python (it reuses its last prompt's
prefix; off by default). A turn is a streamed, greedy, 32-token request, nothing banned:
``completions`` — ``POST /v1/completions`` whose prompt this client renders in Gemma's
turn format, the same way for every server: the previous prompt + the server's reply +
the next user text (~180 tokens a turn); ``chat`` — ``POST /v1/chat/completions`` with
the messages so far. After each reply the user reads for each of ``--read-times``
seconds (2: a user reading; 0: an agent that sends the next turn at once). Phases, for
each endpoint and read time, each server in turn, all idle first: ``multi`` (one
conversation), ``interleaved`` (``--conversations`` round-robin); then ``retry`` (a
~1,500-word prompt cold; another closed at ``--close-at`` of the cold prefill's CPU, the
CPU idle after the close, then it again). Per turn: TTFT (send → first event with text),
prompt tokens evaluated (trioserve: ``trioserve_prompt_tokens_evaluated_total`` on
``/metrics``, before and after the turn; llama-server: its ``timings.prompt_n``) and
trioserve's tokens recomputed while the user read (``_idle_tokens_total``). Exactness,
after: every trioserve turn again on ``trioserve --no-prompt-cache``, every llama-server
turn with ``cache_prompt: false``. Method: docs/benchmarks.md, "Method"; results:
"Conversations and the prompt cache".

    python benchmarks/conversation.py --json artifacts/conversation.json
"""

from __future__ import annotations

import json
import math
import re
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
#: the bars (issue 23): with a pause, every turn from 2 on; without, the median and every turn
PAUSED_EVERY, AT_ONCE_MEDIAN, AT_ONCE_EVERY = 1.1, 1.1, 1.3


def parse_args() -> Any:
    p = cli.parser(__doc__, ((TS, LS, LCP), (TS, LS)), threads=2, ctx_size=4096, max_tokens=32)
    cli.option(p, "--turns", 8, "turns per conversation")
    cli.option(p, "--conversations", 3, "interleaved conversations")
    cli.option(p, "--read-times", "2,0", "seconds the user reads after each reply, one run each")
    cli.option(p, "--endpoints", "completions,chat", "completions and/or chat")
    cli.option(p, "--close-at", 0.4, "retry: close at this fraction of the cold prefill's server CPU")
    cli.option(p, "--idle-cap", 15.0, "seconds to wait for idle")
    p.add_argument("--no-retry", action="store_true", help="skip the retry phase")
    cli.option(p, "--trioserve-args", "", "more trioserve flags (e.g. '--piece-rule aligned')")
    return p.parse_args()


#: llama-server's chat template for the default model, which has none (trioserve's Gemma
#: fallback, as Jinja: this llama-server takes ``--chat-template gemma`` as a template text)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def user_text(conv: int, turn: int, words: int = 85, tag: str = "") -> str:
    """The user's text; ``tag`` names the run, so that no run reuses another's cells."""
    out, i = f"Conversation {tag}{conv}, question {turn}: tell me about the {TOPICS[(conv + turn) % 8]}.", 0
    while len(out.split()) < words:
        i += 1
        out += f" In {1400 + 37 * turn + 11 * i + conv} the people of the {TOPICS[(turn + i) % 8]} met again."
    return out


def metrics(client: httpx.Client, server: servers.Server) -> dict[str, float]:
    """trioserve's prompt-token counters (nothing for the others)."""
    if servers.kind(server.name) != TS:
        return {}
    text = client.get(server.url + "/metrics").text
    out = {}
    for name in ("prompt_tokens_evaluated_total", "prompt_cache_idle_tokens_total"):
        found = re.search(rf"^trioserve_{name} (\S+)$", text, re.M)
        out[name] = float(found.group(1)) if found else math.nan
    return out


def complete(client: httpx.Client, server: servers.Server, request: Any, tokens: int, **more: Any) -> Any:
    """One streamed completion (``request``: a prompt, or chat messages): TTFT ms, text,
    cached and prompt tokens (usage, or llama-server's timings), tokens evaluated."""
    out: dict[str, Any] = {"ttft_ms": math.nan, "text": "", "usage": {}, "timings": {}}
    chat = not isinstance(request, str)
    if chat:
        path, payload = "/v1/chat/completions", {"messages": request, "max_tokens": tokens, "temperature": 0}
        payload |= {"stream": True, **USAGE, **more}
    else:
        path, payload = "/v1/completions", body(request, tokens, **USAGE, **more)
    before, t0 = metrics(client, server), time.perf_counter()
    with client.stream("POST", server.url + path, json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if (text or choice.get("finish_reason")) and math.isnan(out["ttft_ms"]):
                    out["ttft_ms"] = (time.perf_counter() - t0) * 1e3
                out["text"] += text or ""
            out.update({k: event[k] for k in ("usage", "timings") if event.get(k)})
    after = metrics(client, server)
    key = "prompt_tokens_evaluated_total"
    give_up = time.perf_counter() + 2.0
    while after and after[key] <= before[key] and time.perf_counter() < give_up:
        time.sleep(0.005)  # (the counter moves once the request has ended: after its last byte)
        after = metrics(client, server)
    usage, timings = out.pop("usage"), out.pop("timings")
    out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    n = sum(timings.get(k, 0) for k in ("prompt_n", "cache_n"))
    out["prompt_tokens"] = usage.get("prompt_tokens") or n or None
    out["completion_tokens"] = usage.get("completion_tokens") or timings.get("predicted_n")
    out["evaluated"] = after[key] - before[key] if after else timings.get("prompt_n")
    out["idle_total"] = after.get("prompt_cache_idle_tokens_total")
    return out


def converse(
    client: httpx.Client, server: servers.Server, phase: str, endpoint: str, read: float, args: Any
) -> Any:
    convs = range(1, args.conversations + 1) if phase == "interleaved" else [0]
    prompts: dict[int, Any] = {c: "" if endpoint == "completions" else [] for c in convs}
    out: list[dict[str, Any]] = []
    idle_before: dict[int, float] = {}
    tag = f"{endpoint[:4]}-{read:g}-{phase}-"
    for turn in range(1, args.turns + 1):
        for c in convs:
            text = user_text(c, turn, tag=tag)
            if endpoint == "completions":
                prompts[c] += f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
            else:
                prompts[c] = [*prompts[c], {"role": "user", "content": text}]
            r = {"server": server.name, "phase": phase, "endpoint": endpoint, "read_time": read, "conv": c}
            r |= {"turn": turn, "prompt": prompts[c]}
            out.append(r | complete(client, server, prompts[c], args.max_tokens))
            last = out[-1]
            # tokens recomputed while the user read before this turn (all conversations')
            if last["idle_total"] is not None and out[-2:-1]:
                last["idle_before"] = last["idle_total"] - idle_before.get(0, last["idle_total"])
            idle_before[0] = last["idle_total"] if last["idle_total"] is not None else 0.0
            if endpoint == "completions":
                prompts[c] += last["text"] + "<end_of_turn>\n"
            else:
                prompts[c] = [*prompts[c], {"role": "assistant", "content": last["text"]}]
            figures = (
                f"{last['prompt_tokens']} tokens, {last['cached']} cached, {last['evaluated']} evaluated"
            )
            where = f"{endpoint} read {read:g} s {phase} {c} turn {turn}"
            cli.log(f"{server.name:<16} {where}: {figures}, TTFT {last['ttft_ms']:.0f} ms")
            time.sleep(read)
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
    args.read_times = [float(x) for x in str(args.read_times).split(",") if x.strip()]
    args.endpoints = [x.strip() for x in str(args.endpoints).split(",") if x.strip()]
    names = "contestants threads ctx_size max_tokens turns conversations read_times endpoints close_at"
    cfg, turns, retries, refs = cli.environment(model, **cli.pick(args, names)), [], [], []
    cfg["trioserve_args"] = args.trioserve_args
    wait, settings = httpx.Timeout(10.0, read=args.request_timeout), cli.pick(args, "threads ctx_size")
    client = httpx.Client(timeout=wait, headers={"Connection": "close"})  # (servers drop idle keep-alives)
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running, client:
        template = Path(logs) / "gemma.jinja"
        template.write_text(GEMMA_TEMPLATE)
        for name in args.contestants + [NO_CACHE] * (TS in args.contestants):
            extra = {
                TS: args.trioserve_args.split(),
                NO_CACHE: ["--no-prompt-cache", *args.trioserve_args.split()],
            }
            extra[LS] = ["--jinja", "--chat-template-file", str(template)]
            running.append(
                servers.Server.start(name, model, Path(logs), **settings, extra=extra.get(name, []))
            )
        by = {s.name: s for s in running}
        for server in running:
            server.wait_ready(args.ready_timeout)
            complete(client, server, cli.DEFAULT_PROMPT, 8)  # warm-up
        cfg["commands"] = {s.name: s.command for s in running}
        runs = [(e, r, p) for e in args.endpoints for r in args.read_times for p in ("multi", "interleaved")]
        for endpoint, read, phase in runs:
            for name in args.contestants:
                if endpoint == "chat" and name == LCP:
                    continue  # (its chat handler renders its own way: not comparable)
                wait_idle(running, args, args.warnings)
                turns += converse(client, by[name], phase, endpoint, read, args)
        for name in args.contestants * (not args.no_retry):
            wait_idle(running, args, args.warnings)
            retries.append(retry(client, by[name], running, args))
        wait_idle(running, args, args.warnings)
        for t in turns:  # the references: the same prompts, cache off
            ref, more = (by.get(NO_CACHE), {}) if t["server"] == TS else (by[LS], {"cache_prompt": False})
            if t["server"] != LCP and ref:
                again = complete(client, ref, t["prompt"], args.max_tokens, **more)
                refs.append(t | {"server": ref.name} | again)
                t["equal_cache_off"] = refs[-1]["text"] == t["text"]
    out = {"config": cfg, "turns": turns, "retries": retries, "references": refs}
    return out | {"notes": args.warnings}


def runs_of(result: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(endpoint, read time, phase) of every conversation run, in order."""
    return list(dict.fromkeys((t["endpoint"], t["read_time"], t["phase"]) for t in result["turns"]))


def rows_of(result: dict[str, Any], endpoint: str, read: float, phase: str) -> dict[Any, dict[str, Any]]:
    """``(turn, conversation) → server → turn`` for one run."""
    by: dict[Any, dict[str, Any]] = {}
    for t in result["turns"]:
        if (t["endpoint"], t["read_time"], t["phase"]) == (endpoint, read, phase):
            by.setdefault((t["turn"], t["conv"]), {})[t["server"]] = t
    return by


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run: the TTFT ratios from turn 2 on, the tokens evaluated against llama-server's
    (+ the previous reply's length without a pause), and whether the bars are met."""
    out = []
    for endpoint, read, phase in runs_of(result):
        by = rows_of(result, endpoint, read, phase)
        pairs = [(k, r) for k, r in by.items() if k[0] >= 2 and TS in r and LS in r]
        ratios = clean(r[TS]["ttft_ms"] / r[LS]["ttft_ms"] for _, r in pairs)
        allowance = {}  # the previous reply's length, per conversation
        tokens_ok = []
        for (turn, conv), r in sorted(by.items()):
            if turn >= 2 and TS in r and LS in r and r[LS]["evaluated"] is not None:
                extra = 0 if read > 0 else allowance.get(conv, 0)
                tokens_ok.append(r[TS]["evaluated"] <= r[LS]["evaluated"] + extra)
            if TS in r:
                allowance[conv] = r[TS].get("completion_tokens") or 0
        if read > 0:
            met = bool(ratios) and max(ratios) <= PAUSED_EVERY
        else:
            met = bool(ratios) and median(ratios) <= AT_ONCE_MEDIAN and max(ratios) <= AT_ONCE_EVERY
        out.append(
            {"endpoint": endpoint, "read_time": read, "phase": phase, "ratios": ratios, "met": met}
            | {"tokens_ok": tokens_ok, "tokens_met": all(tokens_ok) and bool(tokens_ok)}
        )
    return out


def report(result: dict[str, Any], args: Any) -> None:
    cfg, label, verdict = result["config"], servers.LABELS.get, lambda ok: "pass" if ok else "FAIL"
    names, what = cfg["contestants"], f"{cfg['threads']} threads, {cfg['max_tokens']}-token replies"
    what += "; Gemma turns rendered alike (completions) or by each server"
    what += " (chat; llama-server --chat-template-file: trioserve's Gemma format)"
    print(cli.header(cfg, what))
    for endpoint, read, phase in runs_of(result):
        by = rows_of(result, endpoint, read, phase)
        present = [n for n in names if any(n in r for r in by.values())]
        rows = [["turn", "conv", "prompt tokens", *(f"TTFT ms {label(n, n)}" for n in present)]]
        rows[0] += [
            "trioserve cached",
            "trioserve evaluated",
            "llama-server evaluated",
            "recomputed while reading",
        ]
        rows[0] += ["trioserve ÷ llama-server"]
        for (turn, conv), r in by.items():
            ratio = r[TS]["ttft_ms"] / r[LS]["ttft_ms"] if TS in r and LS in r else math.nan
            cells = [str(turn), str(conv), str(next(iter(r.values()))["prompt_tokens"])]
            cells += [fmt(r[n]["ttft_ms"], ".0f") for n in present]
            ts, ls = r.get(TS, {}), r.get(LS, {})
            cells += [str(ts.get("cached")), fmt(ts.get("evaluated"), ".0f"), fmt(ls.get("evaluated"), ".0f")]
            cells += [fmt(ts.get("idle_before"), ".0f"), fmt(ratio, ".2f")]
            rows.append(cells)
        later = [
            median(r[n]["ttft_ms"] for (turn, _), r in by.items() if turn >= 2 and n in r) for n in present
        ]
        ratios = clean(float(row[-1]) for row in rows[1:] if int(row[0]) >= 2 and row[-1] != "—")
        rows.append(
            ["median, ≥ 2", "", "", *(fmt(m, ".0f") for m in later), "", "", "", "", f"{median(ratios):.2f}"]
        )
        kind = "one conversation" if phase == "multi" else "interleaved"
        title = f"{endpoint}, the user reads {read:g} s, {kind}"
        print(f"\n{title}:\n\n" + table([[c.replace("None", "—") for c in row] for row in rows]))
    if result["retries"]:
        rows = [["server", "prompt tokens", "cold TTFT ms", "closed at CPU-s", "CPU idle after close ms"]]
        rows[0] += ["CPU after close ms", "retry TTFT ms", "retry ÷ cold", "retry cached"]
        for r in result["retries"]:
            cells = [
                label(r["server"], r["server"]),
                str(r["cold"]["prompt_tokens"]),
                fmt(r["cold"]["ttft_ms"]),
            ]
            cells += [
                fmt(r["close_cpu_s"], ".2f"),
                fmt(r["idle_ms"], ".0f"),
                fmt(1e3 * r["cpu_after_s"], ".0f"),
            ]
            rows.append(
                [*cells, fmt(r["retry"]["ttft_ms"]), fmt(r["ratio"], ".2f"), str(r["retry"]["cached"])]
            )
        print(
            "\nretry after leaving:\n\n" + table([[c.replace("None", "—") for c in row] for row in rows]),
            "\n",
        )
    eq = {
        n: [t["equal_cache_off"] for t in result["turns"] if t["server"] == n and "equal_cache_off" in t]
        for n in (TS, LS)
    }
    for n, text in ((TS, "trioserve = trioserve --no-prompt-cache"), (LS, "llama-server = cache_prompt off")):
        print(f"exactness: {text}: {sum(eq[n])}/{len(eq[n])} texts equal" * bool(eq[n]))
    print()
    for v in verdicts(result):
        where = f"{v['endpoint']}, read {v['read_time']:g} s, {v['phase']}"
        if v["read_time"] > 0:
            worst = max(v["ratios"], default=math.nan)
            bar = f"every turn ≥ 2 ≤ {PAUSED_EVERY}× llama-server (max {worst:.2f}×)"
            tokens = "evaluated ≤ llama-server's"
        else:
            figures = f"median {median(v['ratios']):.2f}×, max {max(v['ratios'], default=math.nan):.2f}×"
            bar = f"median ≤ {AT_ONCE_MEDIAN}×, every turn ≤ {AT_ONCE_EVERY}× ({figures})"
            tokens = "evaluated ≤ llama-server's + the reply"
        ok = f"{sum(v['tokens_ok'])}/{len(v['tokens_ok'])}"
        print(f"bar: {where}: TTFT {bar}: {verdict(v['met'])}; {tokens}: {ok}: {verdict(v['tokens_met'])}")
    if r := next((r for r in result["retries"] if r["server"] == TS), None):
        met, figures = r["ratio"] <= 0.7 and r["idle_ms"] <= 100, f"{r['ratio']:.2f}×, {fmt(r['idle_ms'])} ms"
        print(f"bar: retry ≤ 0.7 × cold, CPU idle ≤ 100 ms after the close ({figures}): {verdict(met)}")
    print(f"bar: every turn's text = the cache-off text: {sum(eq[TS])}/{len(eq[TS])}: {verdict(all(eq[TS]))}")


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
