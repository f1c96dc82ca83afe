"""Batched decoding: total tokens/s against the number of concurrent streams.

How much does ``trioserve serve`` (one llama.cpp context, every running request
decoded together in one ``llama_decode`` call per step) gain over one stream, and how close
does it get to what llama.cpp itself can do? Contestants, each measured alone (only one
server, or only the in-process context, exists while it is measured), on the same GGUF,
``--threads`` (default: all cores) and ``--ctx-size`` (2048 tokens per sequence):

``decode-only``
    the ceiling: llama-cpp-python's low-level API in this process, no server, no HTTP, no
    scheduler. ``llama_model_load_from_file`` (default model parameters), and for each N
    one context with ``n_seq_max = N``, ``kv_unified = false``, ``n_ctx = N × ctx-size``,
    ``n_batch = n_ubatch = 512``, ``n_threads = n_threads_batch = --threads`` (flash
    attention and the rest at llama.cpp's defaults, as trioserve takes them). Each stream's
    prompt is prefilled on its own (sequence id *i*, one ``llama_decode`` per prompt, then
    its first token sampled), then ``max_tokens − 1`` ``llama_decode`` calls follow, each
    with one token per sequence **listed in sequence-id order** (llama.cpp splits a batch
    whose sequence ids are out of order into several micro-batches: twice the step time),
    each followed by greedy sampling of every sequence (``llama_sampler_sample(chain, ctx,
    i)``, one chain with ``llama_sampler_init_greedy()`` per sequence). End-of-generation
    tokens do not end a sequence: the batch stays N wide (a note says when one came).
``trioserve``
    ``trioserve serve --slots 8 --threads T --ctx-size C`` (``--slots``; 8 is the default).
``trioserve-invariant``
    the same with ``--batch-invariant``: every stream's numerics independent of the others
    (decode steps split into calls no wider than the probed invariant width, prefill never
    mixed with other tokens).
``llama-server``
    ``python -m llama_cpp.server --n_threads T --n_threads_batch T --n_ctx C`` with
    ``--flash_attn True --logits_all False`` as in the other benchmarks, and
    ``--interrupt_requests False`` (its default ends a running stream when another request
    arrives; see ``bench_concurrency.py``). It serves one completion at a time behind a
    lock: its total tok/s cannot exceed one stream's, whatever N.

``llama.cpp``
    llama.cpp's own C++ ``llama-server`` (the server Ollama runs), built from the
    llama.cpp that llama-cpp-python vendors by ``scripts/build-llama-server`` (or
    ``$TRIOSERVE_LLAMA_SERVER``), with its defaults — context size, parallel slots,
    continuous batching, prompt cache — except ``--threads``/``--threads-batch T``. The
    prompts differ per stream, so its prompt cache has nothing to reuse.

``--contestants`` picks a subset (comma-separated names, in any order; they run in the
order above).

Requests (the three servers): ``POST /v1/completions`` with ``stream: true``,
``stream_options.include_usage``, ``temperature`` 0, ``max_tokens`` 128 (``--max-tokens``),
and ``repeat_penalty`` 1.0 for llama-server (its default is 1.1). Stream *i* uses prompt
*i* of ``--prompts`` (eight different plain-text beginnings for the default base model,
cycled when N exceeds them), so concurrent streams never share a prompt (nor a cached
prefix).

Procedure per server: start it, wait until it is ready, one warm-up completion (8 tokens,
not counted), then every prompt **solo** (one request at a time: the reference text),
then ``--reps`` rounds (3) over the N of ``--streams`` (1, 4, 8): N client threads, each
with its own ``httpx.Client``, released together by a barrier, each sending one request
and reading its stream to the end (``bench_concurrency.run_group``); then the server is
stopped. ``decode-only`` does the same in process: each context gets a 4-token warm-up
of all its sequences when it is created, every prompt is generated solo in the N = 1
context, then the same rounds.

Measured, with ``time.perf_counter``:

* **total tok/s** per group of N streams. Servers: the streams' completion tokens summed
  (``usage.completion_tokens``; else ``max_tokens`` on ``finish_reason == "length"``;
  else the text chunks) ÷ wall time from the first request sent to the last stream's end
  (TTFT, prefill and HTTP included). ``decode-only``: ``N × (max_tokens − 1)`` ÷ the time
  of the decode loop (prefill and the first token excluded). The table shows the median
  over the reps (min–max), its ratio to the same contestant's N = 1 (medians), and its
  ratio to ``decode-only`` at the same N.
* per stream: **TTFT** (request sent → first chunk with text; queueing included: a
  llama-server stream waits for the streams before it. ``decode-only``: start of the
  prefills → this stream's first token sampled, so stream *i* waits for the *i* prefills
  before it) and **decode tok/s** (``(tokens − 1) / (last − first text chunk)``;
  ``decode-only``: ``(max_tokens − 1) / decode loop time``, the same for every stream);
  the table shows median (min–max) over all streams of all reps.
* **= solo**: how many of the N streams' texts equal the same prompt's solo text on the
  same contestant (greedy decoding; without batch invariance llama.cpp's CPU kernels give
  a token decoded in a wide call different last bits than the same token alone, so texts
  can diverge). One ``k/N`` per rep when the reps differ; the notes show where the first
  mismatches begin.
* **CPU %** of one core over the group's wall time: the server process (``decode-only``:
  this process, over the decode loop), from ``/proc/<pid>/stat``; and everything else on
  the machine (``/proc/stat`` busy time minus the server and this process). Above
  ``--other-load-warn`` (20 %) a note says to rerun: llama.cpp's threads spin while they
  wait for each other, so other load slows every contestant down by far more than its
  share. The servers' runnable threads (sampled every 0.1 s) are in the JSON only.

Output: the summary table and the solo runs as Markdown on stdout (``--markdown``: every
stream too), progress on stderr; ``--json PATH``: configuration, summary, targets, every
group and every stream; ``--chart PATH`` (default ``docs/images/batched-throughput.png``;
``--no-chart``): total tok/s (median, min–max bars) against N, one line per contestant,
and the targets as dashed lines: 1.8× and 1.2× ``trioserve``'s N = 1 total (also
printed under the table). ``--replot JSON`` prints the tables and draws the chart from an
earlier ``--json`` file without measuring. Every wait is bounded (``--ready-timeout``,
``--request-timeout``); servers are terminated after their contestant, also on error,
Ctrl-C and SIGTERM.

Run ``python benchmarks/bench_batched.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    LLAMA_CPP,
    LLAMA_SERVER,
    READY_PATHS,
    TRIOSERVE,
    ServerProcess,
    add_ready_timeout,
    add_request_timeout,
    argument_parser,
    bench_main,
    cpu_seconds,
    environment,
    free_port,
    llama_cpp_server_command,
    llama_server_command,
    log,
    markdown_table,
    resolve_model,
    stopping,
    system_busy_seconds,
    trioserve_command,
)
from bench_concurrency import (
    Group,
    ServerConfig,
    StreamSample,
    _spread,
    describe,
    http_timeout,
    measure_stream,
    prompts_for,
    request_body,
    result_notes,
    run_group,
    solo_table,
    streams_table,
)

DECODE_ONLY = "decode-only"
BATCH = "trioserve"
BATCH_INVARIANT = "trioserve-invariant"
CONTESTANTS = (DECODE_ONLY, BATCH, BATCH_INVARIANT, LLAMA_SERVER, LLAMA_CPP)
#: the targets for the batched backend, × trioserve's N = 1 total tok/s
TARGETS = (1.8, 1.2)
DEFAULT_CHART = Path(__file__).resolve().parent.parent / "docs" / "images" / "batched-throughput.png"
DEFAULT_PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "In a distant galaxy",
    "The recipe begins with",
    "The three laws of robotics are",
    "In 1969, the first",
    "Water boils at",
    "The quick brown fox",
)
#: decode-only: prompt tokens per llama_decode (n_batch = n_ubatch, trioserve's default)
N_BATCH = 512
WARM_UP_TOKENS = 4


# ---------------------------------------------------------------------- decode-only

_LOG_CALLBACK: Any = None  # llama.cpp keeps the pointer: the ctypes object must stay alive


class LowLevel:
    """The model loaded with llama-cpp-python's low-level API, and one context per N."""

    def __init__(self, model: Path, args: argparse.Namespace) -> None:
        global _LOG_CALLBACK
        import llama_cpp as lib

        if _LOG_CALLBACK is None:
            _LOG_CALLBACK = lib.llama_log_callback(lambda _level, _text, _data: None)
        lib.llama_log_set(_LOG_CALLBACK, None)
        lib.llama_backend_init()
        self.lib = lib
        self.args = args
        self.contexts: dict[int, Any] = {}
        self.batch: Any = None
        self.model = lib.llama_model_load_from_file(str(model).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"{DECODE_ONLY}: llama.cpp could not load {model}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        for i in range(N_BATCH):
            self.batch.n_seq_id[i] = 1

    def close(self) -> None:
        lib = self.lib
        for ctx in self.contexts.values():
            lib.llama_free(ctx)
        self.contexts.clear()
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None

    def context(self, n: int) -> Any:
        """The context for ``n`` sequences (created, and warmed up, on first use)."""
        if n not in self.contexts:
            lib, args = self.lib, self.args
            params = lib.llama_context_default_params()
            params.n_ctx = n * args.ctx_size
            params.n_batch = N_BATCH
            params.n_ubatch = N_BATCH
            params.n_seq_max = n
            params.kv_unified = False
            params.n_threads = args.threads
            params.n_threads_batch = args.threads
            ctx = lib.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"{DECODE_ONLY}: no context for {n} sequences of {args.ctx_size} tokens")
            self.contexts[n] = ctx
            self.generate(ctx, prompts_for(n, args.prompt_list), WARM_UP_TOKENS)
        return self.contexts[n]

    def tokenize(self, text: str) -> list[int]:
        """As trioserve does: BOS added, special tokens parsed."""
        data = text.encode()
        capacity = len(data) + 8
        tokens = (self.lib.llama_token * capacity)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, capacity, True, True)
        if n < 0:
            tokens = (self.lib.llama_token * -n)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, -n, True, True)
        return list(tokens[:n])

    def piece(self, token: int) -> bytes:
        buffer = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buffer, 256, 0, False)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buffer, -n, 0, False)
        return buffer.raw[:n]

    def _decode(self, ctx: Any) -> None:
        result = self.lib.llama_decode(ctx, self.batch)
        if result != 0:
            raise RuntimeError(f"{DECODE_ONLY}: llama_decode returned {result}")

    def generate(self, ctx: Any, prompts: Sequence[str], max_tokens: int) -> dict[str, Any]:
        """Prefill each prompt as sequence i, then decode all together for ``max_tokens``
        tokens per sequence (the first sampled from the prefill). Times with perf_counter."""
        lib, batch = self.lib, self.batch
        n = len(prompts)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        chains = []
        for _ in range(n):
            chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            chains.append(chain)
        try:
            prompt_tokens = [self.tokenize(p) for p in prompts]
            outputs: list[list[int]] = []
            ttft: list[float] = []
            t_start = time.perf_counter()
            for seq, tokens in enumerate(prompt_tokens):
                for start in range(0, len(tokens), N_BATCH):
                    chunk = tokens[start : start + N_BATCH]
                    for i, token in enumerate(chunk):
                        batch.token[i] = token
                        batch.pos[i] = start + i
                        batch.seq_id[i][0] = seq
                        batch.logits[i] = 0
                    batch.n_tokens = len(chunk)
                    if start + len(chunk) == len(tokens):
                        batch.logits[len(chunk) - 1] = 1
                    self._decode(ctx)
                outputs.append([lib.llama_sampler_sample(chains[seq], ctx, len(chunk) - 1)])
                ttft.append(time.perf_counter() - t_start)
            positions = [len(t) for t in prompt_tokens]
            for i in range(n):  # one token per sequence, in sequence-id order, all with logits
                batch.seq_id[i][0] = i
                batch.logits[i] = 1
            batch.n_tokens = n
            decode, sample = lib.llama_decode, lib.llama_sampler_sample
            pid = os.getpid()
            cpu_before, busy_before = cpu_seconds(pid), system_busy_seconds()
            t_loop = time.perf_counter()
            for _ in range(max_tokens - 1):
                for i in range(n):
                    batch.token[i] = outputs[i][-1]
                    batch.pos[i] = positions[i]
                    positions[i] += 1
                result = decode(ctx, batch)
                if result != 0:
                    raise RuntimeError(f"{DECODE_ONLY}: llama_decode returned {result}")
                for i in range(n):
                    outputs[i].append(sample(chains[i], ctx, i))
            t_end = time.perf_counter()
            cpu_after, busy_after = cpu_seconds(pid), system_busy_seconds()
        finally:
            for chain in chains:
                lib.llama_sampler_free(chain)
        loop_s = t_end - t_loop
        own = cpu_after - cpu_before
        return {
            "ttft_s": ttft,
            "loop_s": loop_s,
            "total_s": t_end - t_start,
            "tokens": outputs,
            "cpu_pct": 100.0 * own / loop_s,
            "other_cpu_pct": max(0.0, 100.0 * (busy_after - busy_before - own) / loop_s),
        }

    def first_eog(self, tokens: Sequence[int]) -> int | None:
        return next((i for i, t in enumerate(tokens) if self.lib.llama_vocab_is_eog(self.vocab, t)), None)


def decode_only_samples(
    low: LowLevel, run: dict[str, Any], prompts: Sequence[str], group: str, rep: int, eogs: list[str]
) -> list[StreamSample]:
    max_tokens = len(run["tokens"][0])
    rate = (max_tokens - 1) / run["loop_s"] if run["loop_s"] > 0 else float("nan")
    samples = []
    for i, (prompt, tokens) in enumerate(zip(prompts, run["tokens"], strict=True)):
        at = low.first_eog(tokens)
        if at is not None and group == "solo":
            eogs.append(f"{DECODE_ONLY}: {prompt!r} yields an end-of-generation token at token {at}")
        samples.append(
            StreamSample(
                config=DECODE_ONLY,
                group=group,
                n=len(prompts) if group != "solo" else 1,
                rep=rep,
                index=i,
                prompt=prompt,
                start_offset_ms=0.0,
                ttft_ms=run["ttft_s"][i] * 1e3,
                decode_tps=rate,
                total_s=run["total_s"],
                tokens=max_tokens,
                token_source="decode loop",
                finish_reason="length",
                text=b"".join(low.piece(t) for t in tokens).decode(errors="replace"),
            )
        )
    return samples


def run_decode_only(
    model: Path, args: argparse.Namespace, notes: list[str]
) -> tuple[list[Group], list[StreamSample]]:
    log(f"{DECODE_ONLY}: loading {model.name} in this process")
    low = LowLevel(model, args)
    groups: list[Group] = []
    samples: list[StreamSample] = []
    eogs: list[str] = []
    try:
        solo_ctx = low.context(1)
        for i, prompt in enumerate(dict.fromkeys(prompts_for(max(args.stream_counts), args.prompt_list))):
            (s,) = decode_only_samples(
                low, low.generate(solo_ctx, [prompt], args.max_tokens), [prompt], "solo", 0, eogs
            )
            s.index = i
            samples.append(s)
            log(f"{DECODE_ONLY:<13} solo  {describe(s)}")
        solo_text = {s.prompt: s.text for s in samples}
        for rep in range(args.reps):
            for n in args.stream_counts:
                prompts = prompts_for(n, args.prompt_list)
                run = low.generate(low.context(n), prompts, args.max_tokens)
                mine = decode_only_samples(low, run, prompts, f"N={n}", rep, eogs)
                for s in mine:
                    s.matches_solo = s.text == solo_text[s.prompt]
                tokens = n * (args.max_tokens - 1)
                group = Group(
                    config=DECODE_ONLY,
                    n=n,
                    rep=rep,
                    wall_s=run["loop_s"],
                    tokens=tokens,
                    total_tps=tokens / run["loop_s"],
                    server_cpu_pct=run["cpu_pct"],
                    client_cpu_pct=0.0,
                    other_cpu_pct=run["other_cpu_pct"],
                    runnable_threads_mean=0.0,  # not sampled in process
                    runnable_threads_max=0,
                )
                log(
                    f"{DECODE_ONLY:<13} N={n:<3} decode loop {tokens} tokens in {run['loop_s']:.2f} s = "
                    f"{group.total_tps:.1f} tok/s, CPU {group.server_cpu_pct:.0f} %, "
                    f"= solo {sum(1 for s in mine if s.matches_solo)}/{n}"
                )
                groups.append(group)
                samples.extend(mine)
    finally:
        low.close()
    notes.extend(f"{e}; decoding went on past it (the batch stays N wide)" for e in eogs)
    return groups, samples


# ---------------------------------------------------------------------- servers


def server_config(name: str, args: argparse.Namespace) -> ServerConfig:
    if name == LLAMA_SERVER:
        return ServerConfig(LLAMA_SERVER, LLAMA_SERVER, args.threads, 1)
    if name == LLAMA_CPP:
        return ServerConfig(LLAMA_CPP, LLAMA_CPP, args.threads, 0)  # its own default slots
    return ServerConfig(name, TRIOSERVE, args.threads, args.slots)


def server_command(cfg: ServerConfig, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    if cfg.kind == LLAMA_SERVER:
        return llama_server_command(model, port, args.threads, args.ctx_size, "--interrupt_requests", "False")
    if cfg.kind == LLAMA_CPP:
        return llama_cpp_server_command(model, port, args.threads)
    extra = ["--slots", str(args.slots)]
    if cfg.name == BATCH_INVARIANT:
        extra.append("--batch-invariant")
    return trioserve_command(model, port, args.threads, args.ctx_size, *extra)


def run_server(
    cfg: ServerConfig, model: Path, args: argparse.Namespace, log_dir: Path
) -> tuple[list[Group], list[StreamSample]]:
    """Start the server, warm up, run every prompt solo, then the concurrent groups
    (as ``bench_concurrency.run_config``, with this script's command lines)."""
    port = free_port()
    server = ServerProcess(
        cfg.name, server_command(cfg, model, port, args), port, READY_PATHS[cfg.kind], log_dir
    )
    log(f"{cfg.name}: {' '.join(server.command)}")
    groups: list[Group] = []
    samples: list[StreamSample] = []
    with stopping([server]):
        with httpx.Client(timeout=http_timeout(args)) as client:
            server.wait_ready(client, args.ready_timeout)
            url = server.base_url + "/v1/completions"
            _, warm = measure_stream(client, url, request_body(cfg, args.prompt_list[0], 8), args)
            if warm.error:
                raise RuntimeError(f"{cfg.name}: warm-up failed: {warm.error}")
            needed = dict.fromkeys(prompts_for(max(args.stream_counts), args.prompt_list))
            for i, prompt in enumerate(needed):
                _, s = measure_stream(client, url, request_body(cfg, prompt, args.max_tokens), args)
                s.config, s.group, s.n, s.index = cfg.name, "solo", 1, i
                samples.append(s)
                log(f"{cfg.name:<13} solo  {describe(s)}")
        solo_text = {s.prompt: s.text for s in samples if s.error is None}
        for rep in range(args.reps):
            for n in args.stream_counts:
                group, mine = run_group(cfg, server, prompts_for(n, args.prompt_list), rep, args)
                for s in mine:
                    s.matches_solo = s.text == solo_text[s.prompt] if s.prompt in solo_text else None
                    log(f"{cfg.name:<13} N={n:<3} {describe(s)}")
                log(
                    f"{cfg.name:<13} N={n:<3} total {group.tokens} tokens in {group.wall_s:.2f} s = "
                    f"{group.total_tps:.1f} tok/s, server CPU {group.server_cpu_pct:.0f} %, "
                    f"= solo {sum(1 for s in mine if s.matches_solo)}/{n}"
                )
                groups.append(group)
                samples.extend(mine)
    return groups, samples


# ---------------------------------------------------------------------- summary


def _stats(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """Median, min, max, NaN dropped (median NaN and min/max None when none is left)."""
    values = [v for v in values if v == v]
    if not values:
        return float("nan"), None, None
    return statistics.median(values), min(values), max(values)


def summarize(
    groups: list[Group], samples: list[StreamSample], contestants: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per contestant and N: every number of the table, and the per-rep values."""
    medians = {}
    for name in contestants:
        for n in dict.fromkeys(g.n for g in groups if g.config == name):
            medians[name, n] = _stats([g.total_tps for g in groups if g.config == name and g.n == n])[0]
    rows = []
    for name, n in medians:
        gs = [g for g in groups if g.config == name and g.n == n]
        ss = [s for s in samples if s.config == name and s.group == f"N={n}"]
        ok = [s for s in ss if s.error is None]
        total = medians[name, n]
        base, ceiling = medians.get((name, 1)), medians.get((DECODE_ONLY, n))
        decode = _stats([s.decode_tps for s in ok])
        ttft = _stats([s.ttft_ms for s in ok])
        rows.append(
            {
                "contestant": name,
                "n": n,
                "total_tps": total,
                "total_tps_reps": [g.total_tps for g in gs],
                "vs_n1": total / base if base and base == base else None,
                "vs_decode_only": total / ceiling if ceiling and ceiling == ceiling else None,
                "decode_tps_median": decode[0],
                "decode_tps_min": decode[1],
                "decode_tps_max": decode[2],
                "ttft_ms_median": ttft[0],
                "ttft_ms_min": ttft[1],
                "ttft_ms_max": ttft[2],
                "equal_solo_reps": [
                    sum(1 for s in ss if s.rep == g.rep and s.matches_solo is True) for g in gs
                ],
                "cpu_pct_median": _stats([g.server_cpu_pct for g in gs])[0],
                "other_cpu_pct_max": max(g.other_cpu_pct for g in gs),
                "errors": len(ss) - len(ok),
            }
        )
    return rows


def targets(summary: list[dict[str, Any]]) -> dict[str, float] | None:
    base = next((r["total_tps"] for r in summary if r["contestant"] == BATCH and r["n"] == 1), None)
    if base is None or base != base:
        return None
    return {"base_tps": base, **{f"{factor}x": factor * base for factor in TARGETS}}


def _ratio(value: float | None) -> str:
    return "—" if value is None or value != value else f"{value:.2f}×"


def summary_table(summary: list[dict[str, Any]]) -> str:
    rows = [
        [
            "contestant",
            "N",
            "total tok/s",
            "÷ N=1",
            "÷ decode-only",
            "decode tok/s per stream",
            "TTFT ms",
            "= solo",
            "CPU %",
            "errors",
        ]
    ]
    for r in summary:
        reps = r["equal_solo_reps"]
        equal = f"{reps[0]}/{r['n']}" if len(set(reps)) == 1 else " ".join(f"{k}/{r['n']}" for k in reps)
        rows.append(
            [
                r["contestant"],
                str(r["n"]),
                _spread(r["total_tps_reps"], ".1f"),
                _ratio(r["vs_n1"]),
                _ratio(r["vs_decode_only"]),
                _range(r, "decode_tps", ".1f"),
                _range(r, "ttft_ms", ".0f"),
                equal,
                f"{r['cpu_pct_median']:.0f}",
                str(r["errors"]),
            ]
        )
    return markdown_table(rows)


def _range(r: dict[str, Any], key: str, fmt: str) -> str:
    median, low, high = r[f"{key}_median"], r[f"{key}_min"], r[f"{key}_max"]
    if median != median or low is None:
        return "—"
    if low == high:
        return f"{median:{fmt}}"
    return f"{median:{fmt}} ({low:{fmt}}–{high:{fmt}})"


def draw_chart(result: dict[str, Any], path: Path) -> None:
    """Median total tok/s against N (min–max over the reps as bars), one line per
    contestant; the targets as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary = result["config"], result["summary"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    styles = {DECODE_ONLY: ("k", ":", "s"), BATCH: ("C0", "-", "o"), BATCH_INVARIANT: ("C2", "-", "^")}
    for name in cfg["contestants"]:
        rows = sorted((r for r in summary if r["contestant"] == name), key=lambda r: r["n"])
        if not rows:
            continue
        color, line, marker = styles.get(name, ("C3", "-", "D"))
        xs = [r["n"] for r in rows]
        ys = [r["total_tps"] for r in rows]
        low = [y - min(r["total_tps_reps"]) for y, r in zip(ys, rows, strict=True)]
        high = [max(r["total_tps_reps"]) - y for y, r in zip(ys, rows, strict=True)]
        ax.errorbar(
            xs, ys, yerr=[low, high], color=color, linestyle=line, marker=marker, capsize=3, label=name
        )
    goal = targets(summary)
    if goal:
        for factor, dashes in zip(TARGETS, ((6, 3), (2, 2)), strict=True):
            ax.axhline(
                goal[f"{factor}x"],
                color="0.4",
                linestyle="--",
                dashes=dashes,
                linewidth=1,
                label=f"target: {factor}× {BATCH} N=1 ({goal[f'{factor}x']:.0f} tok/s)",
            )
    ax.set_xticks(cfg["streams"])
    ax.set_xlabel("concurrent streams (N)")
    ax.set_ylabel("total tokens/s")
    tops = [max(r["total_tps_reps"]) for r in summary if r["total_tps_reps"]]
    tops += [goal[f"{factor}x"] for factor in TARGETS] if goal else []
    ax.set_ylim(0, 1.1 * max(tops, default=1.0))  # room above the highest line or target
    ax.grid(alpha=0.3)
    ax.set_title(
        f"{Path(cfg['model']).name}: {cfg['max_tokens']} tokens per stream, {cfg['threads']} threads, "
        f"{cfg['cpu_count']} CPUs, median of {cfg['reps']}",
        fontsize=10,
    )
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("target"))  # contestants first
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    log(f"wrote {path}")


# ---------------------------------------------------------------------- main


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument(
        "--contestants",
        default=",".join(CONTESTANTS),
        help=f"comma-separated subset of {', '.join(CONTESTANTS)} (default: all; run in this order)",
    )
    p.add_argument("--streams", default="1,4,8", help="concurrent stream counts (default: 1,4,8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per completion (default: 128)")
    p.add_argument(
        "--reps", type=int, default=3, help="rounds over --streams; the median counts (default: 3)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help=f"threads for decode and prefill, every contestant (default: all cores, {os.cpu_count()})",
    )
    p.add_argument(
        "--ctx-size", type=int, default=2048, help="context size per sequence / per server (default: 2048)"
    )
    p.add_argument("--slots", type=int, default=8, help="trioserve --slots (default: 8, as the server)")
    p.add_argument(
        "--prompts",
        default="|".join(DEFAULT_PROMPTS),
        help="'|'-separated prompts, stream i gets prompt i (default: eight different ones)",
    )
    p.add_argument(
        "--other-load-warn",
        type=float,
        default=20.0,
        help="flag groups where other processes used more CPU %% (default: 20)",
    )
    p.add_argument("--json", dest="out", type=Path, help="write config, summary, groups and streams as JSON")
    p.add_argument(
        "--chart",
        type=Path,
        default=DEFAULT_CHART,
        help="PNG chart (default: docs/images/batched-throughput.png)",
    )
    p.add_argument("--no-chart", action="store_true", help="draw no chart")
    p.add_argument("--replot", type=Path, help="measure nothing: report (and chart) this earlier --json file")
    p.add_argument("--markdown", action="store_true", help="also print every stream as a markdown table")
    add_request_timeout(p)
    add_ready_timeout(p)
    args = p.parse_args(argv)
    args.stream_counts = _int_list(args.streams)
    args.prompt_list = [x for x in args.prompts.split("|") if x]
    chosen = [x.strip() for x in args.contestants.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(CONTESTANTS))
    if unknown or not chosen:
        p.error(
            f"--contestants: unknown {', '.join(unknown) or '(none given)'}; "
            f"pick from {', '.join(CONTESTANTS)}"
        )
    args.contestant_list = [c for c in CONTESTANTS if c in chosen]
    if not args.stream_counts or min(args.stream_counts) < 1 or args.max_tokens < 2 or args.reps < 1:
        p.error("need --streams >= 1 each, --max-tokens >= 2, --reps >= 1")
    if not args.prompt_list or args.threads < 1 or args.slots < 1 or args.ctx_size < 64:
        p.error("need a prompt, --threads >= 1, --slots >= 1, --ctx-size >= 64")
    return args


def config(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "contestants": args.contestant_list,
        "prompts": args.prompt_list,
        "streams": args.stream_counts,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "threads": args.threads,
        "ctx_size": args.ctx_size,
        "slots": args.slots,
        "targets_vs_batch_n1": list(TARGETS),
        **environment(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.replot:
        result: dict[str, Any] = json.loads(args.replot.read_text())
        return result
    model = resolve_model(args)
    cfg = config(args, model)
    log(f"config: {json.dumps(cfg)}")
    groups: list[Group] = []
    samples: list[StreamSample] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as log_dir:
        for name in args.contestant_list:
            if name == DECODE_ONLY:
                g, s = run_decode_only(model, args, notes)
            else:
                g, s = run_server(server_config(name, args), model, args, Path(log_dir))
            groups += g
            samples += s
    cfg["loadavg_end"] = os.getloadavg()
    summary = summarize(groups, samples, args.contestant_list)
    return {
        "config": cfg,
        "notes": result_notes(groups, samples, args) + notes,
        "summary": summary,
        "targets": targets(summary),
        "groups": [asdict(g) for g in groups],
        "streams": [asdict(s) for s in samples],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cfg = result["config"]
    samples = [StreamSample(**s) for s in result["streams"]]
    print(
        f"{Path(cfg['model']).name}, {cfg['max_tokens']} tokens per stream, {cfg['threads']} threads, "
        f"ctx {cfg['ctx_size']} per sequence, trioserve --slots {cfg['slots']}, {cfg['reps']} rep(s), "
        f"llama-cpp-python {cfg['llama_cpp_python']}, {cfg['cpu_count']} CPUs, "
        f"load {cfg['loadavg_start'][0]:.2f}→{cfg['loadavg_end'][0]:.2f}; "
        "total tok/s: median (min–max) over reps; per-stream columns: median (min–max) over all streams\n"
    )
    print(summary_table(result["summary"]))
    goal = result.get("targets")
    if goal:
        print(
            f"\ntargets: 1.8× {BATCH} N=1 = {goal['1.8x']:.1f} tok/s, "
            f"1.2× = {goal['1.2x']:.1f} tok/s (N=1: {goal['base_tps']:.1f} tok/s)"
        )
    print("\nsolo runs (one request at a time):\n")
    print(solo_table(samples))
    if args.markdown:
        print("\nevery stream:\n")
        print(streams_table(samples))
    if not args.no_chart:
        draw_chart(result, args.chart)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
