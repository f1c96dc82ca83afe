"""Concurrent streams: per-stream and total tokens/s with N streamed completions at once.

Server configurations, each a subprocess on the same GGUF and context size, started one at
a time (only one server exists while it is measured):

``trioserve``
    ``trioserve serve --slots 4 --max-queue 8 --threads 2 --ctx-size C``: up to 4
    generations at once, each in its own llama.cpp context with its own 2 threads — on a
    2-core machine, 4 streams mean 8 compute threads for 2 cores.
``trioserve-t1``
    the same with ``--threads 1``: 4 streams, 4 threads (``--trioserve-threads 2,1``, the
    default, runs both; ``--trioserve-threads 2`` only the first).
``llama-server``
    ``python -m llama_cpp.server --n_threads 2 --n_threads_batch 2 --n_ctx C``, with
    ``--flash_attn True`` and ``--logits_all False`` as in ``bench_throughput.py``, and
    ``--interrupt_requests False``. It has one model and serves one completion at a time
    behind a lock; the others wait. Its default, ``--interrupt_requests True``, instead ends
    the running stream (a bare ``[DONE]``) as soon as another request arrives, so with
    concurrent clients every stream but the last would be cut short
    (``--llama-interrupt-requests true`` measures that).

Requests: ``POST /v1/completions`` with ``stream: true``, ``stream_options.include_usage``,
``temperature`` 0, ``max_tokens`` 128 (``--max-tokens``), and ``repeat_penalty`` 1.0 for
llama-server (its default is 1.1). Stream *i* uses prompt *i* of ``--prompts``
("Once upon a time", "The capital of France is", "In a distant galaxy", "The recipe begins
with"; cycled when N exceeds them), so concurrent streams never share a prompt.

Procedure per configuration: start the server, wait for it to be ready, one warm-up
completion (not counted); then every prompt **solo** (one request at a time: the reference
text and the single-stream rates); then for each N in ``--streams`` (1, 2, 4), ``--reps``
times: N client threads, each with its own ``httpx.Client``, released together by a barrier,
each sending one request and reading its stream to the end; then the server is stopped.

Measured per stream, with ``time.perf_counter`` in its own thread:

* **TTFT**: request sent → first chunk with non-empty text (queueing included: a stream
  waiting for llama-server's lock has a TTFT of the streams before it);
* **tokens**: ``usage.completion_tokens`` when the stream carries it; else ``max_tokens``
  when ``finish_reason`` is ``"length"``; else the number of chunks with text;
* **decode tok/s**: ``(tokens - 1) / (last text chunk - first text chunk)``: the rate the
  client saw once its stream was running;
* **text = solo?**: whether its text equals the same prompt's solo text. Greedy decoding of
  the same prompt should not depend on what else runs; a mismatch is reported.

Per group of N: **total tok/s** = the streams' tokens summed ÷ wall time (first request
sent → last stream ended), and its ratio to N = 1 of the same configuration. Over the same
wall time, CPU use in % of one core (200 % = both cores of a 2-core machine): the
**server**'s (``utime + stime`` of all its threads, ``/proc/<pid>/stat`` fields 14 and 15),
the **client**'s (this process: the stream threads, on the same cores, so their parsing
cost is part of the numbers) and **other** (``/proc/stat`` busy time minus both: everything
else on the machine; above ``--other-load-warn``, 20 %, a note says to rerun). And the
server's **runnable threads**: threads in state R in ``/proc/<pid>/task/*/stat``, sampled
every 0.1 s, mean and max — llama.cpp's compute threads spin while they wait for each
other, so with 4 slots × 2 threads up to 8 want the 2 cores at once. Servers are
terminated after their configuration, also on error, Ctrl-C and SIGTERM.

Run ``python benchmarks/bench_concurrency.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    LLAMA_SERVER,
    READY_PATHS,
    TRIOSERVE,
    ServerProcess,
    TimedStream,
    add_ready_timeout,
    add_request_timeout,
    argument_parser,
    bench_main,
    cpu_seconds,
    environment,
    free_port,
    http_stream,
    llama_server_command,
    log,
    markdown_table,
    resolve_model,
    stopping,
    system_busy_seconds,
    thread_ids,
    trioserve_command,
)

DEFAULT_PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "In a distant galaxy",
    "The recipe begins with",
)


# ---------------------------------------------------------------------- streaming


@dataclass
class StreamSample:
    config: str
    group: str  # "solo" or "N=<n>"
    n: int
    rep: int
    index: int  # stream number within the group
    prompt: str
    start_offset_ms: float  # request sent, relative to the group's first
    ttft_ms: float
    decode_tps: float
    total_s: float
    tokens: int
    token_source: str
    finish_reason: str | None
    text: str
    matches_solo: bool | None = None
    error: str | None = None


def measure_stream(
    client: httpx.Client, url: str, body: dict[str, Any], args: argparse.Namespace
) -> tuple[float, StreamSample]:
    """Run one stream; return its start time and its sample (``config``, ``group`` etc. blank)."""
    error = None
    stream = TimedStream()
    try:
        stream.read(http_stream(client, url, body, args.request_timeout, where="", body_chars=300))
    except Exception as exc:  # recorded per stream: one failure must not hide the others
        error = f"{type(exc).__name__}: {exc}"
    stream.end()
    t_call, t_first, t_last, t_end = stream.t_call, stream.t_first, stream.t_last, stream.t_end
    tokens, source = stream.tokens(body["max_tokens"])
    if t_first is None and error is None:
        error = "the stream carried no text"
    span = (t_last - t_first) if t_first is not None and t_last is not None else 0.0
    nan = float("nan")
    sample = StreamSample(
        config="",
        group="",
        n=0,
        rep=0,
        index=0,
        prompt=body["prompt"],
        start_offset_ms=0.0,
        ttft_ms=(t_first - t_call) * 1e3 if t_first is not None else nan,
        decode_tps=(tokens - 1) / span if span > 0 else nan,
        total_s=t_end - t_call,
        tokens=tokens,
        token_source=source,
        finish_reason=stream.finish_reason,
        text="".join(stream.texts),
        error=error,
    )
    return t_call, sample


# ---------------------------------------------------------------------- /proc


def cpu_snapshot(server_pid: int) -> tuple[float, float, float]:
    """CPU seconds so far: the server, this process (the clients), everything else."""
    server, me = cpu_seconds(server_pid), cpu_seconds(os.getpid())
    return server, me, system_busy_seconds() - server - me


def runnable_threads(pid: int) -> int:
    count = 0
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        if stat[stat.rindex(")") + 2] == "R":
            count += 1
    return count


class ThreadSampler:
    """Counts the server's runnable threads every ``interval`` s in a background thread."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.counts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.counts.append(runnable_threads(self.pid))

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------- servers


@dataclass
class ServerConfig:
    name: str  # label in the tables
    kind: str  # TRIOSERVE or LLAMA_SERVER
    threads: int
    slots: int


def server_command(cfg: ServerConfig, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    if cfg.kind == TRIOSERVE:
        slots = ("--slots", str(cfg.slots), "--max-queue", str(args.max_queue))
        return trioserve_command(model, port, cfg.threads, args.ctx_size, *slots)
    interrupt = ("--interrupt_requests", str(args.llama_interrupt_requests == "true"))
    return llama_server_command(model, port, cfg.threads, args.ctx_size, *interrupt)


# ---------------------------------------------------------------------- groups


def request_body(cfg: ServerConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.kind == LLAMA_SERVER:
        body["repeat_penalty"] = 1.0  # its default is 1.1
    return body


def http_timeout(args: argparse.Namespace) -> httpx.Timeout:
    # read: the longest gap between two chunks; a stream queued behind others waits that long
    return httpx.Timeout(10.0, read=args.request_timeout)


@dataclass
class Group:
    config: str
    n: int
    rep: int
    wall_s: float
    tokens: int
    total_tps: float
    server_cpu_pct: float
    client_cpu_pct: float  # this process: the client threads
    other_cpu_pct: float  # everything else on the machine
    runnable_threads_mean: float
    runnable_threads_max: int


def run_group(
    cfg: ServerConfig, server: ServerProcess, prompts: list[str], rep: int, args: argparse.Namespace
) -> tuple[Group, list[StreamSample]]:
    """Start ``len(prompts)`` streams at once (a barrier releases the threads together)."""
    n = len(prompts)
    url = server.base_url + "/v1/completions"
    barrier = threading.Barrier(n + 1)
    results: list[tuple[float, StreamSample] | None] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def worker(i: int) -> None:
        try:
            with httpx.Client(timeout=http_timeout(args)) as client:
                barrier.wait(timeout=30)
                results[i] = measure_stream(client, url, request_body(cfg, prompts[i], args.max_tokens), args)
        except BaseException as exc:  # surfaced by the main thread
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    pid = server.proc.pid
    cpu_before = cpu_snapshot(pid)
    with ThreadSampler(pid) as sampler:
        barrier.wait(timeout=30)
        give_up = time.monotonic() + args.request_timeout + 30
        for t in threads:
            while t.is_alive() and time.monotonic() < give_up:
                t.join(timeout=0.5)  # short joins: Ctrl-C gets through
    cpu_after = cpu_snapshot(pid)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(
            f"{cfg.name}: N={n}: streams still running after {args.request_timeout + 30:.0f} s"
        )
    for exc in errors:
        if exc is not None:
            raise exc
    done = [r for r in results if r is not None]
    t0 = min(t for t, _ in done)
    t_end = max(t + s.total_s for t, s in done)
    samples = []
    for i, (t_call, s) in enumerate(done):
        s.config, s.group, s.n, s.rep, s.index = cfg.name, f"N={n}", n, rep, i
        s.start_offset_ms = (t_call - t0) * 1e3
        samples.append(s)
    wall = t_end - t0
    tokens = sum(s.tokens for s in samples if s.error is None)
    counts = sampler.counts or [0]
    group = Group(
        config=cfg.name,
        n=n,
        rep=rep,
        wall_s=wall,
        tokens=tokens,
        total_tps=tokens / wall,
        server_cpu_pct=100.0 * (cpu_after[0] - cpu_before[0]) / wall,
        client_cpu_pct=100.0 * (cpu_after[1] - cpu_before[1]) / wall,
        # three counters rounded to ticks: "other" can come out a little below 0
        other_cpu_pct=max(0.0, 100.0 * (cpu_after[2] - cpu_before[2]) / wall),
        runnable_threads_mean=statistics.mean(counts),
        runnable_threads_max=max(counts),
    )
    return group, samples


def prompts_for(n: int, prompts: list[str]) -> list[str]:
    return [prompts[i % len(prompts)] for i in range(n)]


def run_config(
    cfg: ServerConfig, model: Path, args: argparse.Namespace, log_dir: Path
) -> tuple[list[Group], list[StreamSample]]:
    """Start the server, warm up, run every prompt solo, then the concurrent groups."""
    port = free_port()
    command = server_command(cfg, model, port, args)
    server = ServerProcess(cfg.name, command, port, READY_PATHS[cfg.kind], log_dir)
    groups: list[Group] = []
    samples: list[StreamSample] = []
    with stopping([server]):
        with httpx.Client(timeout=http_timeout(args)) as client:
            server.wait_ready(client, args.ready_timeout)
            url = server.base_url + "/v1/completions"
            _, warm = measure_stream(client, url, request_body(cfg, args.prompt_list[0], 8), args)
            if warm.error:
                raise RuntimeError(f"{cfg.name}: warm-up failed: {warm.error}")
            needed = list(dict.fromkeys(prompts_for(max(args.stream_counts), args.prompt_list)))
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
                    f"{group.total_tps:.1f} tok/s, server CPU {group.server_cpu_pct:.0f} %, runnable threads "
                    f"{group.runnable_threads_mean:.1f} (max {group.runnable_threads_max})"
                )
                groups.append(group)
                samples.extend(mine)
    return groups, samples


def describe(s: StreamSample) -> str:
    if s.error:
        return f"#{s.index} {s.prompt!r}: ERROR {s.error}"
    same = "" if s.matches_solo is None else (", text = solo" if s.matches_solo else ", TEXT ≠ SOLO")
    return (
        f"#{s.index} {s.prompt!r}: ttft {s.ttft_ms:7.1f} ms, decode {s.decode_tps:6.1f} tok/s, "
        f"{s.tokens} tokens ({s.token_source}), {s.finish_reason}{same}"
    )


# ---------------------------------------------------------------------- summary


def _spread(values: list[float], fmt: str) -> str:
    values = [v for v in values if v == v]  # drop NaN
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def summary_table(configs: list[ServerConfig], groups: list[Group], samples: list[StreamSample]) -> str:
    rows = [
        [
            "server",
            "slots × threads",
            "N",
            "TTFT ms",
            "decode tok/s per stream",
            "tokens",
            "wall s",
            "total tok/s",
            "÷ N=1",
            "server CPU %",
            "client CPU %",
            "other CPU %",
            "runnable threads",
            "text ≠ solo",
            "errors",
        ]
    ]
    for cfg in configs:
        mine = [g for g in groups if g.config == cfg.name]
        base = [g.total_tps for g in mine if g.n == 1]
        base_tps = statistics.median(base) if base else float("nan")
        for n in dict.fromkeys(g.n for g in mine):
            gs = [g for g in mine if g.n == n]
            ss = [s for s in samples if s.config == cfg.name and s.group == f"N={n}"]
            ok = [s for s in ss if s.error is None]
            total = statistics.median(g.total_tps for g in gs)
            rows.append(
                [
                    cfg.name,
                    f"{cfg.slots} × {cfg.threads}",
                    str(n),
                    _spread([s.ttft_ms for s in ok], ".0f"),
                    _spread([s.decode_tps for s in ok], ".1f"),
                    "/".join(str(g.tokens) for g in gs),
                    "/".join(f"{g.wall_s:.2f}" for g in gs),
                    _spread([g.total_tps for g in gs], ".1f"),
                    f"{total / base_tps:.2f}" if base else "—",
                    _spread([g.server_cpu_pct for g in gs], ".0f"),
                    _spread([g.client_cpu_pct for g in gs], ".0f"),
                    _spread([g.other_cpu_pct for g in gs], ".0f"),
                    f"{statistics.mean(g.runnable_threads_mean for g in gs):.1f} "
                    f"(max {max(g.runnable_threads_max for g in gs)})",
                    str(sum(1 for s in ok if s.matches_solo is False)),
                    str(len(ss) - len(ok)),
                ]
            )
    return markdown_table(rows)


def solo_table(samples: list[StreamSample]) -> str:
    rows = [["server", "prompt", "TTFT ms", "decode tok/s", "tokens", "finish"]]
    for s in samples:
        if s.group == "solo":
            rows.append(
                [
                    s.config,
                    repr(s.prompt),
                    f"{s.ttft_ms:.0f}",
                    f"{s.decode_tps:.1f}",
                    str(s.tokens),
                    str(s.finish_reason),
                ]
            )
    return markdown_table(rows)


def streams_table(samples: list[StreamSample]) -> str:
    rows = [
        [
            "server",
            "N",
            "rep",
            "#",
            "prompt",
            "start ms",
            "TTFT ms",
            "decode tok/s",
            "total s",
            "tokens",
            "= solo",
        ]
    ]
    for s in samples:
        if s.group != "solo":
            rows.append(
                [
                    s.config,
                    str(s.n),
                    str(s.rep),
                    str(s.index),
                    repr(s.prompt),
                    f"{s.start_offset_ms:.1f}",
                    f"{s.ttft_ms:.0f}",
                    f"{s.decode_tps:.1f}",
                    f"{s.total_s:.2f}",
                    str(s.tokens),
                    "error" if s.error else str(s.matches_solo),
                ]
            )
    return markdown_table(rows)


def result_notes(groups: list[Group], samples: list[StreamSample], args: argparse.Namespace) -> list[str]:
    notes = []
    for g in groups:
        if g.other_cpu_pct > args.other_load_warn:
            notes.append(
                f"{g.config} N={g.n} rep {g.rep}: other processes used {g.other_cpu_pct:.0f} % of a core: "
                "the server competed for the cores; rerun on an idle machine"
            )
    for s in samples:
        where = f"{s.config} {s.group} rep {s.rep} #{s.index} {s.prompt!r}"
        if s.error:
            notes.append(f"{where}: {s.error}")
        elif s.finish_reason != "length":
            notes.append(f"{where}: finish_reason {s.finish_reason}, {s.tokens} tokens")
        if s.matches_solo is False:
            solo = next(
                x.text for x in samples if x.config == s.config and x.group == "solo" and x.prompt == s.prompt
            )
            at = next(
                (i for i, (a, b) in enumerate(zip(s.text, solo, strict=False)) if a != b),
                min(len(s.text), len(solo)),
            )
            notes.append(
                f"{where}: text differs from solo from character {at}: "
                f"{s.text[at : at + 40]!r} vs {solo[at : at + 40]!r}"
            )
    return notes


# ---------------------------------------------------------------------- main


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--streams", default="1,2,4", help="concurrent stream counts (default: 1,2,4)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per completion (default: 128)")
    p.add_argument(
        "--ctx-size", type=int, default=2048, help="context size (per slot for trioserve; default: 2048)"
    )
    p.add_argument("--slots", type=int, default=4, help="trioserve --slots (default: 4)")
    p.add_argument("--max-queue", type=int, default=8, help="trioserve --max-queue (default: 8)")
    p.add_argument(
        "--trioserve-threads",
        default="2,1",
        help="trioserve --threads per slot, one configuration each (default: 2,1); empty: no trioserve",
    )
    p.add_argument(
        "--llama-threads", type=int, default=2, help="llama-server --n_threads (default: 2; 0: skip it)"
    )
    p.add_argument(
        "--llama-interrupt-requests",
        choices=["false", "true"],
        default="false",
        help="llama-server --interrupt_requests (default: false, so it serializes; its own default is true)",
    )
    p.add_argument(
        "--prompts",
        default="|".join(DEFAULT_PROMPTS),
        help="'|'-separated prompts, stream i gets prompt i (default: four different ones)",
    )
    p.add_argument(
        "--other-load-warn",
        type=float,
        default=20.0,
        help="flag groups where other processes used more CPU %% (default: 20)",
    )
    p.add_argument("--reps", type=int, default=1, help="rounds over --streams (default: 1)")
    p.add_argument("--out", type=Path, help="write config, groups and every stream to this JSON file")
    p.add_argument("--markdown", action="store_true", help="also print every stream as a markdown table")
    add_request_timeout(p)
    add_ready_timeout(p)
    args = p.parse_args(argv)
    args.stream_counts = _int_list(args.streams)
    args.trioserve_thread_list = _int_list(args.trioserve_threads)
    args.prompt_list = [x for x in args.prompts.split("|") if x]
    if not args.stream_counts or min(args.stream_counts) < 1 or args.max_tokens < 2 or args.reps < 1:
        p.error("need --streams >= 1 each, --max-tokens >= 2, --reps >= 1")
    if not args.prompt_list or min(args.trioserve_thread_list, default=1) < 1 or args.llama_threads < 0:
        p.error("need a prompt, --trioserve-threads >= 1 each, --llama-threads >= 0")
    return args


def server_configs(args: argparse.Namespace) -> list[ServerConfig]:
    configs = []
    for threads in args.trioserve_thread_list:
        name = TRIOSERVE if threads == 2 else f"{TRIOSERVE}-t{threads}"
        configs.append(ServerConfig(name, TRIOSERVE, threads, args.slots))
    if args.llama_threads:
        configs.append(ServerConfig(LLAMA_SERVER, LLAMA_SERVER, args.llama_threads, 1))
    return configs


def config(args: argparse.Namespace, model: Path, configs: list[ServerConfig]) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": args.prompt_list,
        "streams": args.stream_counts,
        "max_tokens": args.max_tokens,
        "ctx_size": args.ctx_size,
        "max_queue": args.max_queue,
        "reps": args.reps,
        "servers": [asdict(c) for c in configs],
        "llama_interrupt_requests": args.llama_interrupt_requests,
        **environment(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    configs = server_configs(args)
    if not configs:
        raise SystemExit("no server to measure")
    cfg = config(args, model, configs)
    log(f"config: {json.dumps(cfg)}")
    groups: list[Group] = []
    samples: list[StreamSample] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as log_dir:
        for server_cfg in configs:
            g, s = run_config(server_cfg, model, args, Path(log_dir))
            groups += g
            samples += s
    cfg["loadavg_end"] = os.getloadavg()
    return {
        "config": cfg,
        "notes": result_notes(groups, samples, args),
        "groups": [asdict(g) for g in groups],
        "streams": [asdict(s) for s in samples],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cfg = result["config"]
    configs = [ServerConfig(**c) for c in cfg["servers"]]
    groups = [Group(**g) for g in result["groups"]]
    samples = [StreamSample(**s) for s in result["streams"]]
    print(
        f"{Path(cfg['model']).name}, {cfg['max_tokens']} tokens per stream, ctx {cfg['ctx_size']}, "
        f"trioserve --max-queue {cfg['max_queue']}, llama-server --interrupt_requests "
        f"{cfg['llama_interrupt_requests']}, {cfg['reps']} rep(s), "
        f"llama-cpp-python {cfg['llama_cpp_python']}, "
        f"{cfg['cpu_count']} CPUs, load {cfg['loadavg_start'][0]:.2f}→{cfg['loadavg_end'][0]:.2f}; "
        "per-stream columns: median (min–max)\n"
    )
    print(summary_table(configs, groups, samples))
    print("\nsolo runs (one request at a time):\n")
    print(solo_table(samples))
    if args.markdown:
        print("\nevery stream:\n")
        print(streams_table(samples))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
