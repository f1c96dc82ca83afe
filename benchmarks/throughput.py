"""Single-stream tokens/s and time to first token, against llama-cpp-python in process.

Contestants, one stream at a time, same GGUF, prompt, threads, context and ``max_tokens``,
greedy: ``raw`` (``llama_cpp.Llama(...).create_completion(stream=True)`` in this process,
``llm.reset()`` first so it prefills the whole prompt, as trioserve does), then the
servers over HTTP with httpx (``stream_options.include_usage``). One warm-up each (it
must reach ``max_tokens``: else pick another ``--prompt``), then ``--reps`` rounds, each
running every contestant once, the starting one rotating. Flash attention: trioserve and
llama-server take llama.cpp's default (auto: on, on CPU); ``--flash-attn on`` (default)
turns it on for ``raw`` and llama-cpp-python too, ``off`` leaves them at their default.
Metrics (TTFT, decode and end-to-end tok/s, tokens): docs/benchmarks.md, "Method".

    python benchmarks/throughput.py --markdown --json artifacts/throughput.json
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import Chunk, Timed, body, sse_chunks, timed_stream
from benchmarks.harness.stats import dict_table, median, rows_table, spread

RAW, SERVERS = "raw", (servers.TRIOSERVE, servers.LLAMA_CPP_PYTHON, servers.LLAMA_SERVER, servers.MATCHED)


def parse_args() -> Any:
    every, settings = (RAW, *SERVERS), {"threads": 2, "ctx_size": 2048, "max_tokens": 256, "reps": 5}
    p = cli.parser(__doc__, (every, every), **settings, prompt=cli.DEFAULT_PROMPT)
    p.add_argument("--flash-attn", choices=["on", "off"], default="on", help="for raw and llama-cpp-python")
    return p.parse_args()


def starters(args: Any, model: Path, running: list[servers.Server], client: httpx.Client) -> dict[str, Any]:
    """Per contestant, a function that makes the call and yields its chunks."""
    out: dict[str, Callable[[], Iterator[Chunk]]] = {}
    if RAW in args.contestants:
        import llama_cpp

        kw = {"n_ctx": args.ctx_size, "n_threads": args.threads, "n_threads_batch": args.threads}
        llm = llama_cpp.Llama(str(model), **kw, flash_attn=args.flash_attn == "on", verbose=False)

        def raw() -> Iterator[Chunk]:
            llm.reset()  # no prefix reuse: prefill the whole prompt, as trioserve does
            gen = llm.create_completion(args.prompt, max_tokens=args.max_tokens, temperature=0, stream=True)
            for event in gen:
                yield event["choices"][0]["text"], event["choices"][0]["finish_reason"], None

        out[RAW] = raw
    payload = body(args.prompt, args.max_tokens, stream_options={"include_usage": True})
    for server in running:
        out[server.name] = lambda url=server.url + "/v1/completions": sse_chunks(client, url, payload)
    return out


def run(args: Any) -> dict[str, Any]:
    model, settings = cli.resolve_model(args), {"threads": args.threads, "ctx_size": args.ctx_size}
    cfg = cli.environment(model, **settings, max_tokens=args.max_tokens, reps=args.reps, prompt=args.prompt)
    cfg["flash_attn_raw_and_llama_cpp_python"] = args.flash_attn
    samples, off = [], ("--flash_attn", "False") if args.flash_attn == "off" else ()
    client = httpx.Client(timeout=httpx.Timeout(10.0, read=60.0))
    with tempfile.TemporaryDirectory() as logs, client, servers.running([]) as running:
        for name in args.contestants[args.contestants[0] == RAW :]:
            extra = off if name == servers.LLAMA_CPP_PYTHON else ()
            running.append(servers.Server.start(name, model, Path(logs), **settings, extra=extra))
        starts = starters(args, model, running, client)  # loads raw while the servers load
        for server in running:
            server.wait_ready(args.ready_timeout)
        cfg["commands"] = {s.name: s.command for s in running}

        def one(name: str, round_: int) -> Timed:
            s = timed_stream(args.prompt, args.max_tokens, starts[name])
            samples.append({"contestant": name, "round": round_, **asdict(s)})
            rates = f"ttft {s.ttft_ms:6.1f} ms, decode {s.decode_tps:5.1f} tok/s"
            cli.log(f"round {round_:>2} {name:<20} {rates}, {s.tokens} tokens, {s.error or s.finish_reason}")
            return s

        warm = [(n, s) for n in args.contestants if (s := one(n, -1)).finish_reason != "length" or s.error]
        if short := "; ".join(f"{n}: {s.error or s.finish_reason}" for n, s in warm):
            raise SystemExit(f"not every warm-up reached --max-tokens ({short}): choose another --prompt")
        for round_ in range(args.reps):
            shift = round_ % len(args.contestants)
            for name in args.contestants[shift:] + args.contestants[:shift]:
                one(name, round_)
    return {"config": cfg, "samples": samples, "notes": notes(samples, args.contestants)}


def notes(samples: list[dict[str, Any]], names: list[str]) -> list[str]:
    out = []
    for s in (s for s in samples if s["error"] or s["finish_reason"] != "length"):
        why = f"{s['error'] or s['finish_reason']}, {s['tokens']} tokens"
        out.append(f"{s['contestant']} round {s['round']}: {why}")
    reference = samples[0]["text"]
    for name in names:
        mine = [s for s in samples if s["contestant"] == name]
        if any(s["text"] != reference for s in mine):
            out.append(f"{name}: generated text differs from {samples[0]['contestant']}'s")
        rates = [s["decode_tps"] for s in mine if s["round"] >= 0]
        if (high := max(rates)) - (low := min(rates)) > 0.2 * median(rates):
            out.append(f"{name}: decode tok/s ranged {low:.1f}–{high:.1f}: a busy machine; rerun")
    return out


def report(result: dict[str, Any], args: Any) -> None:
    cfg, samples = result["config"], [s for s in result["samples"] if s["round"] >= 0]
    for s in samples:
        s["e2e_tps"] = s["tokens"] / s["total_s"]
    if args.markdown:
        print(dict_table(samples, "round contestant ttft_ms decode_tps e2e_tps tokens finish_reason"))
    flash = cfg["flash_attn_raw_and_llama_cpp_python"]
    what = f"prompt {cfg['prompt']!r}, {cfg['max_tokens']} tokens, {cfg['threads']} threads"
    flash = f"{cfg['reps']} rounds, flash attention (raw, llama-cpp-python) {flash}"
    print(cli.header(cfg, f"{what}, ctx {cfg['ctx_size']}, {flash}"))
    names = list(dict.fromkeys(s["contestant"] for s in samples))
    by = {name: [s for s in samples if s["contestant"] == name] for name in names}
    decode = {n: median(s["decode_tps"] for s in by[n]) for n in names}
    ttft, ref = {n: median(s["ttft_ms"] for s in by[n]) for n in names}, names[0]
    sources = {n: sorted({f"{s['tokens']} ({s['token_source']})" for s in by[n]}) for n in names}
    columns: list[tuple[str, Any]] = [
        ("contestant", lambda n: servers.LABELS.get(n, n)),
        ("TTFT ms", lambda n: spread(s["ttft_ms"] for s in by[n])),
        ("decode tok/s", lambda n: spread(s["decode_tps"] for s in by[n])),
        ("end-to-end tok/s", lambda n: spread(s["e2e_tps"] for s in by[n])),
        (f"decode ÷ {ref}", lambda n: f"{decode[n] / decode[ref]:.3f}"),
        (f"TTFT − {ref} (ms)", lambda n: f"{ttft[n] - ttft[ref]:+.1f}"),
        ("tokens (source)", lambda n: ", ".join(sources[n])),
    ]
    print(rows_table(names, columns) + "\n\nmedian (min–max) over the rounds")


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
