"""Single-stream throughput and time-to-first-token: trioserve vs. llama-cpp-python.

Three contestants generate the same completion — same GGUF, prompt, thread count,
context size and ``max_tokens``, greedy (temperature 0) — one at a time, on one machine:

``raw``
    llama-cpp-python in this process: ``Llama(...).create_completion(prompt,
    max_tokens=N, temperature=0, stream=True)``. ``llm.reset()`` before each call, so it
    prefills the whole prompt like trioserve (which clears the KV cache per request).
``trioserve``
    ``trioserve serve`` as a subprocess, streamed over HTTP (``POST /v1/completions``,
    ``stream: true``, ``stream_options.include_usage``).
``llama-server``
    ``python -m llama_cpp.server`` as a subprocess, the same HTTP request. Two settings
    are aligned with ``raw`` rather than left at the server's own defaults: ``--logits_all
    False`` (the server keeps every position's logits by default) and ``repeat_penalty: 1.0``
    in the body (its default is 1.1; ``create_completion``'s is 1.0). It reuses the cached
    prompt prefix between requests; with a prompt of a few tokens that changes little.

Flash attention: trioserve takes llama.cpp's context defaults, where flash attention is
"auto" (on, on CPU), while ``Llama(...)`` turns it off unless asked. ``--flash-attn on``
(the default) gives ``raw`` and ``llama-server`` flash attention too, so all three run
the same kernels and — being greedy — produce the same text; ``--flash-attn off``
measures llama-cpp-python with its own default (trioserve cannot turn it off).

What is measured, per request, with ``time.perf_counter``:

* **TTFT**: from the call (``create_completion`` / sending the HTTP request) to the first
  chunk with non-empty text.
* **decode tok/s**: ``(tokens - 1) / (t_last_text - t_first_text)`` — the steady-state
  rate; ``tokens - 1`` because the first token's time is already the TTFT.
* **end-to-end tok/s**: ``tokens / (t_end - t_call)``, TTFT and stream teardown included.

Tokens are ``usage.completion_tokens`` when the stream carries it (trioserve); otherwise
``max_tokens`` when ``finish_reason`` is ``"length"`` (exact by definition), else the number
of chunks with text. Every run must end with ``finish_reason == "length"`` so all three
generate the same number of tokens; the default prompt does (the default model is a base
model that rarely emits EOS on it); pick another prompt if the warm-up reports otherwise.

Procedure: start both servers and load ``raw``; warm each contestant up once (not
counted); then ``--reps`` rounds, each running every contestant once, the starting
contestant rotating per round so drift (thermal, other load) hits all alike. Only one
contestant generates at a time; the servers sit idle meanwhile. The HTTP client runs in
this process, on the same cores, so its parsing cost is part of the server numbers.
Servers are terminated at the end, also on error or Ctrl-C.

Run ``python benchmarks/bench_throughput.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_PROMPT,
    LLAMA_SERVER,
    TRIOSERVE,
    Chunk,
    ServerProcess,
    TimedStream,
    add_ready_timeout,
    add_request_timeout,
    add_threads,
    argument_parser,
    bench_main,
    environment,
    http_stream,
    log,
    markdown_table,
    resolve_model,
    start_servers,
    stopping,
)

RAW = "raw"
CONTESTANTS = (RAW, TRIOSERVE, LLAMA_SERVER)
METRICS = ("ttft_ms", "decode_tps", "e2e_tps")


# ---------------------------------------------------------------------- measuring


@dataclass
class Sample:
    contestant: str
    round: int  # -1: warm-up
    ttft_ms: float
    decode_tps: float
    e2e_tps: float
    total_s: float
    tokens: int
    token_source: str  # "usage", "finish_reason=length" or "text chunks"
    text_chunks: int
    finish_reason: str | None
    text: str


def measure(contestant: str, round_: int, max_tokens: int, start: Callable[[], Iterator[Chunk]]) -> Sample:
    """Time one streamed completion; ``start`` makes the call and yields its chunks."""
    stream = TimedStream()
    stream.read(start())
    stream.end()
    t_call, t_first, t_last, t_end = stream.t_call, stream.t_first, stream.t_last, stream.t_end
    if t_first is None or t_last is None:
        raise RuntimeError(f"{contestant}: the stream carried no text")
    tokens, source = stream.tokens(max_tokens)
    texts = stream.texts
    decode_span = t_last - t_first
    return Sample(
        contestant=contestant,
        round=round_,
        ttft_ms=(t_first - t_call) * 1e3,
        decode_tps=(tokens - 1) / decode_span if decode_span > 0 else float("nan"),
        e2e_tps=tokens / (t_end - t_call),
        total_s=t_end - t_call,
        tokens=tokens,
        token_source=source,
        text_chunks=len(texts),
        finish_reason=stream.finish_reason,
        text="".join(texts),
    )


# ---------------------------------------------------------------------- contestants


def raw_stream(llm: Any, prompt: str, max_tokens: int) -> Iterator[Chunk]:
    llm.reset()  # no prefix reuse: prefill the whole prompt, as trioserve does
    for event in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, stream=True):
        choice = event["choices"][0]
        yield Chunk(text=choice.get("text") or "", finish_reason=choice.get("finish_reason"))


# ---------------------------------------------------------------------- summary


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Median/min/max per metric per contestant, and ratios against ``raw``."""
    summary: dict[str, Any] = {}
    for name in CONTESTANTS:
        mine = [s for s in samples if s.contestant == name and s.round >= 0]
        if not mine:
            continue
        stats: dict[str, Any] = {m: _stats([getattr(s, m) for s in mine]) for m in METRICS}
        stats["tokens"] = sorted({s.tokens for s in mine})
        stats["token_source"] = sorted({s.token_source for s in mine})
        stats["finish_reasons"] = sorted({str(s.finish_reason) for s in mine})
        summary[name] = stats
    raw = summary.get(RAW)
    if raw:
        for stats in summary.values():
            stats["decode_tps_vs_raw"] = stats["decode_tps"]["median"] / raw["decode_tps"]["median"]
            stats["e2e_tps_vs_raw"] = stats["e2e_tps"]["median"] / raw["e2e_tps"]["median"]
            stats["ttft_ms_minus_raw"] = stats["ttft_ms"]["median"] - raw["ttft_ms"]["median"]
    return summary


def result_notes(samples: list[Sample]) -> list[str]:
    """Caveats worth printing under the table: runs that stopped early, texts that differ
    from raw's (greedy decoding on the same kernels should agree), and noisy contestants
    (decode rate spread over 20 % of the median: the machine was busy; rerun)."""
    notes = []
    short = [s for s in samples if s.finish_reason != "length"]
    if short:
        notes.append(f"{len(short)} sample(s) ended before max_tokens")
    raw_text = next(s.text for s in samples if s.contestant == RAW)
    for name in CONTESTANTS:
        mine = [s for s in samples if s.contestant == name]
        if any(s.text != raw_text for s in mine):
            notes.append(f"{name}: generated text differs from raw's")
        rates = [s.decode_tps for s in mine if s.round >= 0]
        median = statistics.median(rates)
        if max(rates) - min(rates) > 0.2 * median:
            notes.append(
                f"{name}: decode tok/s ranged {min(rates):.1f}–{max(rates):.1f} (median {median:.1f}): noisy"
            )
    return notes


def _spread(stat: dict[str, float], fmt: str) -> str:
    return f"{stat['median']:{fmt}} ({stat['min']:{fmt}}–{stat['max']:{fmt}})"


def summary_table(summary: dict[str, Any]) -> str:
    rows = [
        [
            "contestant",
            "TTFT ms",
            "decode tok/s",
            "end-to-end tok/s",
            "decode ÷ raw",
            "e2e ÷ raw",
            "TTFT − raw (ms)",
            "tokens (source)",
        ]
    ]
    for name, s in summary.items():
        rows.append(
            [
                name,
                _spread(s["ttft_ms"], ".1f"),
                _spread(s["decode_tps"], ".1f"),
                _spread(s["e2e_tps"], ".1f"),
                f"{s.get('decode_tps_vs_raw', float('nan')):.3f}",
                f"{s.get('e2e_tps_vs_raw', float('nan')):.3f}",
                f"{s.get('ttft_ms_minus_raw', float('nan')):+.1f}",
                f"{','.join(map(str, s['tokens']))} ({', '.join(s['token_source'])})",
            ]
        )
    return markdown_table(rows)


def samples_table(samples: list[Sample]) -> str:
    rows = [["round", "contestant", "TTFT ms", "decode tok/s", "e2e tok/s", "total s", "tokens", "finish"]]
    for s in samples:
        rows.append(
            [
                "warm-up" if s.round < 0 else str(s.round),
                s.contestant,
                f"{s.ttft_ms:.1f}",
                f"{s.decode_tps:.1f}",
                f"{s.e2e_tps:.1f}",
                f"{s.total_s:.2f}",
                str(s.tokens),
                str(s.finish_reason),
            ]
        )
    return markdown_table(rows)


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_threads(p)
    p.add_argument("--ctx-size", type=int, default=2048, help="context size (default: 2048)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per completion (default: 256)")
    p.add_argument("--reps", type=int, default=5, help="measured rounds after the warm-up (default: 5)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--out", type=Path, help="write config, every sample and the summary to this JSON file")
    p.add_argument("--markdown", action="store_true", help="also print every sample as a markdown table")
    p.add_argument(
        "--flash-attn",
        choices=["on", "off"],
        default="on",
        help="flash attention for raw and llama-server (default: on, as trioserve's llama.cpp default)",
    )
    add_request_timeout(p)
    add_ready_timeout(p)
    args = p.parse_args(argv)
    if args.max_tokens < 2 or args.reps < 1 or args.threads < 1:
        p.error("need --max-tokens >= 2, --reps >= 1, --threads >= 1")
    return args


def config(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompt": args.prompt,
        "threads": args.threads,
        "ctx_size": args.ctx_size,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "flash_attn_raw_and_llama_server": args.flash_attn,
        **environment(),
    }


def check_warmup(warm: dict[str, Sample], max_tokens: int) -> None:
    """Refuse to go on when a contestant stops before ``max_tokens`` (EOS)."""
    short = [f"{n}: finish_reason={s.finish_reason}" for n, s in warm.items() if s.finish_reason != "length"]
    if short:
        raise SystemExit(
            f"not every contestant ran to --max-tokens {max_tokens} ({'; '.join(short)}): "
            "choose another --prompt (or fewer --max-tokens) so none of them hits EOS"
        )


def load_raw(model: Path, args: argparse.Namespace) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(model),
        n_ctx=args.ctx_size,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=args.flash_attn == "on",
        verbose=False,
    )


def stream_starters(
    llm: Any, servers: dict[str, ServerProcess], client: httpx.Client, args: argparse.Namespace
) -> dict[str, Callable[[], Iterator[Chunk]]]:
    """For each contestant, a function that makes the call and yields its chunks."""
    body = {
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ts_url = servers[TRIOSERVE].base_url + "/v1/completions"
    ls_url = servers[LLAMA_SERVER].base_url + "/v1/completions"
    ls_body = {**body, "repeat_penalty": 1.0}  # its default is 1.1; raw's (and greedy's) is 1.0
    return {
        RAW: lambda: raw_stream(llm, args.prompt, args.max_tokens),
        TRIOSERVE: lambda: http_stream(client, ts_url, body, args.request_timeout),
        LLAMA_SERVER: lambda: http_stream(client, ls_url, ls_body, args.request_timeout),
    }


def run_rounds(starts: dict[str, Callable[[], Iterator[Chunk]]], args: argparse.Namespace) -> list[Sample]:
    """One warm-up per contestant, then ``--reps`` rounds with a rotating start."""
    samples: list[Sample] = []

    def one(name: str, round_: int) -> Sample:
        s = measure(name, round_, args.max_tokens, starts[name])
        samples.append(s)
        log(
            f"round {'warm-up' if round_ < 0 else round_:>7} {name:<12} ttft {s.ttft_ms:7.1f} ms  "
            f"decode {s.decode_tps:6.1f} tok/s  e2e {s.e2e_tps:6.1f} tok/s  "
            f"{s.tokens} tokens, {s.finish_reason}"
        )
        return s

    warm = {name: one(name, -1) for name in CONTESTANTS}
    check_warmup(warm, args.max_tokens)
    for round_ in range(args.reps):
        shift = round_ % len(CONTESTANTS)
        for name in CONTESTANTS[shift:] + CONTESTANTS[:shift]:
            one(name, round_)
    return samples


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    cfg = config(args, model)
    log(f"config: {json.dumps(cfg)}")
    timeout = httpx.Timeout(10.0, read=60.0)  # read: the longest gap allowed between two chunks
    servers: list[ServerProcess] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-") as log_dir,
        httpx.Client(timeout=timeout) as client,
        stopping(servers),
    ):
        start_servers(
            servers,
            model,
            Path(log_dir),
            threads=args.threads,
            ctx_size=args.ctx_size,
            flash_attn=args.flash_attn == "on",
        )
        llm = load_raw(model, args)  # while the servers load
        for server in servers:
            server.wait_ready(client, args.ready_timeout)
        log("servers ready: " + ", ".join(f"{s.name} {s.base_url}" for s in servers))
        starts = stream_starters(llm, {s.name: s for s in servers}, client, args)
        samples = run_rounds(starts, args)
    cfg["loadavg_end"] = os.getloadavg()
    return {
        "config": cfg,
        "notes": result_notes(samples),
        "samples": [asdict(s) for s in samples],
        "summary": summarize(samples),
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cfg = result["config"]
    if args.markdown:
        print(samples_table([Sample(**s) for s in result["samples"]]) + "\n")
    print(
        f"{Path(cfg['model']).name}, prompt {cfg['prompt']!r}, {cfg['max_tokens']} tokens, "
        f"{cfg['threads']} threads, ctx {cfg['ctx_size']}, {cfg['reps']} rounds, flash attention "
        f"(raw, llama-server) {cfg['flash_attn_raw_and_llama_server']}, llama-cpp-python "
        f"{cfg['llama_cpp_python']}, {cfg['cpu_count']} CPUs, load {cfg['loadavg_start'][0]:.2f}"
        f"→{cfg['loadavg_end'][0]:.2f}; median (min–max)\n"
    )
    print(summary_table(result["summary"]))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
