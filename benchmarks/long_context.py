"""Long prompts beside llama-server (issue 49): cold, the same prompt again, the next turn.

trioserve (``--slots 1``) and llama.cpp's C++ llama-server (``-np 1``), the same GGUF,
``--threads`` each, one sequence of ``--ctx-size`` (32,768: the default model's training
context) each; llama-server gets trioserve's Gemma chat format as its
``--chat-template-file`` (the default model has none: benchmarks/conversation.py). Every
request is a streamed, greedy ``POST /v1/chat/completions`` of ``--max-tokens`` (16) with
the end of sequence and ``<end_of_turn>`` banned (``logit_bias`` 1, 106: -100), so every
reply has the same length. For each of ``--lengths`` (prompt tokens), each server in turn,
every server's CPU idle before each request (trioserve's idle recompute of the reply done):

- ``cold``: a fresh text of about that many tokens (random sentences, a new seed and tag
  per run: no cache anywhere holds it) as the one user message;
- ``again``: the same messages once more;
- ``next``: the conversation + the server's reply + a new ~40-token user message, sent
  once the CPU is idle (a user who reads: trioserve's idle recompute has run);
- ``next_at_once``: then the turn after that, sent the moment the reply ended (an agent).

Per request: TTFT (send → the first event with content), prompt tokens, tokens the server
evaluated (trioserve: ``trioserve_prompt_tokens_evaluated_total`` on ``/metrics``;
llama-server: ``timings.prompt_n``), cached tokens, the client's decode tokens/s
((tokens − 1) ÷ first → last content event) and trioserve's tokens recomputed while idle
before it. Exactness, after: every trioserve request again on a fresh
``trioserve --no-prompt-cache`` (``again``: also against its own ``cold`` text).

    python benchmarks/long_context.py --json artifacts/long_context.json
    python benchmarks/long_context.py --lengths 1024,2048     # a smoke run
"""

from __future__ import annotations

import json
import math
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cancel import wait_idle  # every server idle (trioserve's /health drained), then 0.1 s
from benchmarks.conversation import GEMMA_TEMPLATE, metrics
from benchmarks.harness import cli, servers
from benchmarks.harness.stats import fmt, median, table

TS, LS, NO_CACHE = servers.TRIOSERVE, servers.LLAMA_SERVER, "trioserve-nocache"
PHASES = ("cold", "again", "next", "next_at_once")
TITLES = {
    "cold": "cold TTFT",
    "again": "same prompt again",
    "next": "next turn (+40 tokens, after reading)",
    "next_at_once": "next turn (+40 tokens, at once)",
}
BAN = {"logit_bias": {"1": -100, "106": -100}}  # <eos>, <end_of_turn>: every reply max_tokens long
#: the chat format's tokens around one user message:
#: <bos><start_of_turn>user\n … <end_of_turn>\n<start_of_turn>model\n
WRAP_TOKENS = 9
#: the two next turns' user messages (~40 tokens each)
FOLLOW_UPS = (
    "Thank you. Now name three of the places in the record above, and for each one give the "
    "first year in which it appears and what happened there, as a short numbered list.",
    "Good. Which of those three places appears most often in the record, and which guild or "
    "trade is named with it most? Answer in two short sentences, without a list.",
)
PLACES = "harbour|river quay|winter market|north gate|old mill|salt warehouse|cathedral square|rope walk"
PEOPLE = (
    "the weavers|the dockers|the council|the brewers' guild|the printers|the carters|the masons|the fishers"
)
VERBS = "met at|rebuilt|taxed|defended|flooded|sold grain near|petitioned for|lit lamps along|paved"
THINGS = "a new bridge|the toll|a fire|the fair|twelve barrels|a charter|the bells|a strike|the ferry"
WORDS = {k: v.split("|") for k, v in {"p": PLACES, "w": PEOPLE, "v": VERBS, "t": THINGS}.items()}


def parse_args() -> Any:
    p = cli.parser(__doc__, ((TS, LS), (TS, LS)), threads=2, ctx_size=32768, max_tokens=16)
    cli.option(p, "--lengths", "4096,8192,16384,28672", "prompt lengths in tokens (the cold prompt's)")
    cli.option(p, "--idle-cap", 60.0, "seconds to wait for every server's CPU to be idle")
    cli.option(
        p,
        "--trioserve-flags",
        "",
        "more flags for trioserve and its cache-off reference (e.g. '--no-swa-full --cache-type-k q8_0')",
    )
    p.add_argument(
        "--no-exactness", action="store_true", help="skip the trioserve --no-prompt-cache references"
    )
    p.set_defaults(request_timeout=900.0)
    args = p.parse_args()
    args.lengths = cli.int_list(args.lengths)
    room = args.ctx_size - 4 * args.max_tokens - 200  # (the two next turns' text and replies)
    if not args.lengths or min(args.lengths) < 64 or max(args.lengths) > room:
        p.error(f"--lengths: each between 64 and {room} (--ctx-size {args.ctx_size} less the next turns)")
    return args


class Texts:
    """Fresh text of a given token count: random sentences (a seed and a tag new every
    run), cut to length with the model's own tokenizer (its vocabulary only)."""

    def __init__(self, model: Path) -> None:
        import llama_cpp

        self.vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
        self.tag, self.rng = uuid.uuid4().hex[:12], random.Random()

    def sentence(self) -> str:
        r, w = self.rng, WORDS
        year, count = r.randrange(1300, 1900), r.randrange(2, 400)
        place, who, verb, thing = r.choice(w["p"]), r.choice(w["w"]), r.choice(w["v"]), r.choice(w["t"])
        forms = (
            f"In {year} {who} {verb} the {place}, and {count} people came for {thing}.",
            f"By {year} the {place} held {thing}; {who} counted {count} of them.",
            f"{who.capitalize()} {verb} the {place} in {year} ({count} days after {thing}).",
        )
        return r.choice(forms)

    def text(self, tokens: int, name: str) -> str:
        """About ``tokens`` tokens of the chat prompt: a record of that length, then a question."""
        head, question = f"Record {self.tag}-{name}.", "\n\nSummarise the record above in one sentence."
        body_tokens = tokens - WRAP_TOKENS - self.count(head + question)
        words, have = [head], 0
        while have < body_tokens:  # (sentences of ~20 tokens: counted a batch at a time)
            batch = " ".join(self.sentence() for _ in range(max(1, (body_tokens - have) // 18)))
            words.append(batch)
            have += self.count(" " + batch)
        ids = self.vocab.tokenize(" ".join(words).encode(), add_bos=False, special=False)
        cut = self.vocab.detokenize(ids[: body_tokens + self.count(head)]).decode(errors="ignore")
        return cut.strip() + question

    def count(self, text: str) -> int:
        return len(self.vocab.tokenize(text.encode(), add_bos=False, special=False))


def chat(
    client: httpx.Client, server: servers.Server, messages: list[dict[str, str]], args: Any
) -> dict[str, Any]:
    """One streamed chat completion: TTFT, text, tokens (prompt, cached, evaluated,
    completion), decode tokens/s; trioserve's idle-recompute counter after it."""
    payload = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
    payload |= {"stream_options": {"include_usage": True}, **BAN}
    out: dict[str, Any] = {"ttft_ms": math.nan, "text": ""}
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    times: list[float] = []
    before = metrics(client, server)
    t0 = time.perf_counter()
    give_up = t0 + args.request_timeout
    with client.stream("POST", server.url + "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if time.perf_counter() > give_up:
                raise TimeoutError(f"{server.name}: no end after {args.request_timeout:g} s")
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                if text := (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
                    out["text"] += text
            usage, timings = event.get("usage") or usage, event.get("timings") or timings
    if times:
        out["ttft_ms"] = (times[0] - t0) * 1e3
    after = metrics(client, server)
    key = "prompt_tokens_evaluated_total"
    settle = time.perf_counter() + 2.0
    while after and after[key] <= before[key] and time.perf_counter() < settle:
        time.sleep(0.005)  # (the counter moves once the request has ended: after its last byte)
        after = metrics(client, server)
    out["prompt_tokens"] = usage.get("prompt_tokens") or (
        timings.get("prompt_n", 0) + timings.get("cache_n", 0)
    )
    out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    out["evaluated"] = after[key] - before[key] if after else timings.get("prompt_n")
    out["completion_tokens"] = n = usage.get("completion_tokens") or timings.get("predicted_n") or len(times)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    out["decode_tps"] = (n - 1) / span if span > 0 else math.nan
    out["server_decode_tps"] = timings.get("predicted_per_second")  # llama-server's own figure
    out["idle_at_send"] = before.get("prompt_cache_idle_tokens_total")
    return out


def measure(
    client: httpx.Client,
    server: servers.Server,
    text: str,
    length: int,
    running: list[servers.Server],
    args: Any,
) -> list[dict[str, Any]]:
    """The four requests of one length on one server, in order."""
    out: list[dict[str, Any]] = []
    idle_mark: list[float | None] = [metrics(client, server).get("prompt_cache_idle_tokens_total")]

    def send(phase: str, messages: list[dict[str, str]], wait: bool = True) -> dict[str, Any]:
        if wait:
            wait_idle(running, args, args.warnings)
        r: dict[str, Any] = {"server": server.name, "length": length, "phase": phase, "messages": messages}
        r |= chat(client, server, messages, args)
        if r["idle_at_send"] is not None and idle_mark[0] is not None:
            r["idle_before"] = r["idle_at_send"] - idle_mark[0]  # (recomputed since the last request ended)
        idle_mark[0] = metrics(client, server).get("prompt_cache_idle_tokens_total")
        figures = f"{r['prompt_tokens']} tokens, {r['cached']} cached, {fmt(r['evaluated'], '.0f')} evaluated"
        cli.log(f"{server.name:<14} {length:>6} {phase:<13}: {figures}, TTFT {r['ttft_ms']:.0f} ms")
        out.append(r)
        return r

    first = [{"role": "user", "content": text}]
    send("cold", first)
    again = send("again", first)
    talk = [
        *first,
        {"role": "assistant", "content": again["text"]},
        {"role": "user", "content": FOLLOW_UPS[0]},
    ]
    reply = send("next", talk)
    talk = [
        *talk,
        {"role": "assistant", "content": reply["text"]},
        {"role": "user", "content": FOLLOW_UPS[1]},
    ]
    send("next_at_once", talk, wait=False)
    return out


def start(name: str, model: Path, logs: Path, args: Any) -> servers.Server:
    template = logs / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    ours = args.trioserve_flags.split()
    extra = {
        TS: ["--slots", "1", *ours],
        NO_CACHE: ["--slots", "1", "--no-prompt-cache", *ours],
        LS: ["-np", "1", "-c", str(args.ctx_size), "--jinja", "--chat-template-file", str(template)],
    }[name]
    return servers.Server.start(name, model, logs, threads=args.threads, ctx_size=args.ctx_size, extra=extra)


def run(args: Any) -> dict[str, Any]:
    model, args.warnings = cli.resolve_model(args), []
    picked = cli.pick(args, "contestants threads ctx_size max_tokens lengths trioserve_flags")
    cfg = cli.environment(model, **picked)
    cfg["logit_bias"], cfg["commands"] = BAN["logit_bias"], {}
    requests: list[dict[str, Any]] = []
    prompts: dict[int, str] = {}  # (each length's first user message, once: the JSON keeps turns after it)
    texts = Texts(model)
    wait = httpx.Timeout(30.0, read=args.request_timeout)
    client = httpx.Client(timeout=wait, headers={"Connection": "close"})  # (servers drop idle keep-alives)
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running, client:
        for name in args.contestants:
            running.append(start(name, model, Path(logs), args))
        for server in running:
            server.wait_ready(args.ready_timeout)
            cfg["commands"][server.name] = server.command
            chat(client, server, [{"role": "user", "content": cli.DEFAULT_PROMPT}], args)  # warm-up
        for length in args.lengths:
            text = prompts[length] = texts.text(length, str(length))  # (the same for every server)
            for server in running:
                requests += measure(client, server, text, length, running, args)
        for server in list(running):  # (the reference alone on the machine)
            server.stop()
            running.remove(server)
        ours = [r for r in requests if r["server"] == TS]
        if ours and not args.no_exactness:
            running.append(ref := start(NO_CACHE, model, Path(logs), args))
            ref.wait_ready(args.ready_timeout)
            cfg["commands"][NO_CACHE] = ref.command
            fresh: dict[str, dict[str, Any]] = {}
            for r in ours:
                key = json.dumps(r["messages"])
                if key not in fresh:
                    wait_idle(running, args, args.warnings)
                    fresh[key] = chat(client, ref, r["messages"], args)
                r["reference_text"] = fresh[key]["text"]
                r["equal_fresh"] = r["text"] == fresh[key]["text"]
                cli.log(f"{NO_CACHE}: {r['length']} {r['phase']}: equal {r['equal_fresh']}")
    for r in requests:
        if r["phase"] == "again":
            cold = next(c for c in requests if c["server"] == r["server"] and c["length"] == r["length"])
            r["equal_cold"] = r["text"] == cold["text"]
    for r in requests:
        r["later_messages"] = r.pop("messages")[1:]  # (the first: ``prompts[length]``)
    return {"config": cfg, "prompts": prompts, "requests": requests, "notes": args.warnings}


def cell(ts: float, ls: float, seconds: bool) -> str:
    """``trioserve / llama-server (ratio)``, in s or ms."""
    scale, unit, spec = (1e-3, " s", ".2f") if seconds else (1.0, " ms", ".0f")
    ratio = f" ({ts / ls:.2f}×)" if ts == ts and ls == ls and ls > 0 else ""
    return f"{fmt(ts * scale, spec)} / {fmt(ls * scale, spec)}{unit}{ratio}"


def report(result: dict[str, Any], args: Any) -> None:
    cfg, reqs = result["config"], result["requests"]
    what = f"{cfg['threads']} threads, one slot of {cfg['ctx_size']} tokens each"
    what += f", {cfg['max_tokens']}-token greedy replies; POST /v1/chat/completions, streamed"
    print(cli.header(cfg, what))
    by = {(r["server"], r["length"], r["phase"]): r for r in reqs}
    lengths = list(dict.fromkeys(r["length"] for r in reqs))

    def get(server: str, length: int, phase: str, key: str) -> Any:
        return by.get((server, length, phase), {}).get(key, math.nan)

    head = [
        "prompt tokens",
        *(f"{TITLES[p]}, trioserve / llama-server" for p in PHASES),
        "decode tok/s, trioserve / llama-server",
    ]
    rows, ratios = [head], []
    for n in lengths:
        counts = [str(get(s, n, "cold", "prompt_tokens")).replace("nan", "—") for s in (TS, LS)]
        cells = [counts[0] if counts[0] == counts[1] else " / ".join(counts)]  # (trioserve / llama-server)
        for phase in PHASES:
            ts, ls = get(TS, n, phase, "ttft_ms"), get(LS, n, phase, "ttft_ms")
            cells.append(cell(ts, ls, phase == "cold"))
            ratios += [ts / ls] if ts == ts and ls == ls and ls > 0 else []
        tps = [median(get(s, n, p, "decode_tps") for p in PHASES) for s in (TS, LS)]
        rows.append([*cells, f"{fmt(tps[0])} / {fmt(tps[1])}"])
    print(table(rows))
    print("\nprompt tokens evaluated (cached), trioserve / llama-server;", end=" ")
    print("trioserve's tokens recomputed while idle before the request:\n")
    rows = [["prompt tokens", *(TITLES[p] for p in PHASES)]]
    for n in lengths:
        cells = [str(get(TS, n, "cold", "prompt_tokens"))]
        for phase in PHASES:
            ev = [fmt(get(s, n, phase, "evaluated"), ".0f") for s in (TS, LS)]
            cached = [fmt(get(s, n, phase, "cached"), ".0f") for s in (TS, LS)]
            idle = fmt(get(TS, n, phase, "idle_before"), ".0f")
            cells.append(f"{ev[0]} ({cached[0]}) / {ev[1]} ({cached[1]}); idle {idle}")
        rows.append(cells)
    print(table(rows))
    fresh = [r["equal_fresh"] for r in reqs if "equal_fresh" in r]
    again = [r["equal_cold"] for r in reqs if r["server"] == TS and "equal_cold" in r]
    print(
        f"\nexactness: trioserve = a fresh trioserve --no-prompt-cache: {sum(fresh)}/{len(fresh)} texts equal"
    )
    print(f"exactness: trioserve's same prompt again = its cold text: {sum(again)}/{len(again)}")

    def verdict(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    worst = max(ratios, default=math.nan)
    print(f"bar: every TTFT ratio ≤ 1.0 (max {worst:.2f}×): {verdict(bool(ratios) and worst <= 1.0)}")
    print(
        f"bar: every text equal to a fresh evaluation's: {verdict(bool(fresh) and all(fresh) and all(again))}"
    )


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
