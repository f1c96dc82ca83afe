"""Cancel latency: how soon a server stops computing once a request is abandoned.

Two servers on the same GGUF, thread count and context size, each a subprocess:

``trioserve``
    ``trioserve serve --threads T --ctx-size C --log-level info``. Its request log line
    carries ``cancel_latency_ms``: the server's own (white-box) figure, from the moment the
    cancel was requested (disconnect noticed, deadline passed) to the inference thread
    returning from llama.cpp. Requests carry ``X-Request-Id`` so log lines match them.
``llama-server``
    ``python -m llama_cpp.server --n_threads T --n_threads_batch T --n_ctx C``, with
    ``--flash_attn True`` (what trioserve gets from llama.cpp's defaults) and ``--logits_all
    False``, as in ``bench_throughput.py``. It logs nothing about cancels, and answers 400
    to an ``X-Request-Id`` that is not a UUID, so request ids are UUIDs.

Causes (each run is one streamed ``POST /v1/completions``, temperature 0, over a raw TCP
socket so the benchmark decides exactly when and how the connection ends):

``decode``, both servers
    prompt ``"Once upon a time"``, ``max_tokens`` 2000; read until ``--events`` SSE ``data:``
    events have arrived, then close the connection abruptly (``SO_LINGER`` 0: a TCP RST;
    ``--close fin`` for an orderly close). The instant ``close()`` returns is the cause.
``prefill``, both servers
    a prompt of about 1,700 tokens (``"The history of the city is long and varied. "``
    repeated ``--prefill-repeats`` times, behind a per-run tag so llama-server cannot reuse a
    cached prefix), ``max_tokens`` 5; the connection is closed ``--prefill-delay`` (0.3 s)
    after the request was sent — mid-prefill: the warm-up's time to first token for this
    prompt (second table) is the whole prefill, seconds on 2 cores. A run that did not
    cancel a prefill is left out of the summary, with a note: a token arrived before the
    close, trioserve logged a first token, or the server used under 50 ms of CPU both
    before and after the close (the disconnect came before the prefill started).
``deadline``, trioserve only
    the ``decode`` request with ``X-Request-Timeout: 0.5``, read to the end; measured: from
    sending the request to the ``[DONE]`` after the final event (whose ``finish_reason``
    must be ``"deadline"``), and the white-box ``cancel_latency_ms``.

Black-box cancel latency, the same for both servers: the server process's CPU time
(``utime + stime`` from ``/proc/<pid>/stat``, fields 14 and 15, all threads, in clock ticks
of 1/``SC_CLK_TCK`` s) is sampled every ``--sample-interval`` (5 ms), the first sample right
at the cause. Samples ``s_0, s_1, …`` are (time, CPU seconds). The **idle start** is the
first sample ``s_i`` whose following window is quiet: the first sample ``s_k`` taken at
least ``--window`` (100 ms) after ``s_i`` shows less than ``--idle-fraction`` (5 %) of one
core's time in that window (under 5 ms of CPU for 100 ms). With 10 ms ticks that means the
CPU-time counter did not move at all. And the process must not have been starved: its
threads' run-queue wait (time runnable but not running, summed from
``/proc/<pid>/task/*/schedstat``) must also grow by less than that in the window. Without
this guard, a busy server on a loaded machine can go 100+ ms without getting a core and
pass for idle (seen here while another benchmark ran). **Latency = t(s_i) − t(cause)**: 0
for a server that was already idle. If no quiet window starts within ``--idle-cap`` (15 s), the run reads
"> 15 s". Resolution: the kernel's counter is the exact run time truncated to whole ticks,
so the last tick can be counted up to one tick of CPU (10 ms ÷ busy threads) before the
work really ends — black-box figures can read low by that much — and high by up to one
sample interval. Background CPU of the server itself (none expected) would also delay the
idle start. Also recorded: CPU time burnt between the cause and the idle start.

Decode step: the median gap between consecutive ``data:`` events after the first, pooled over
a server's ``decode`` runs (client-side arrival times: the steady-state ms per token). The
bars: ``decode`` p99 ≤ that server's step + 10 ms; ``prefill`` p99 ≤ 100 ms; ``deadline``
p99 ≤ deadline + 100 ms from sending. Percentiles are nearest-rank (with 20 runs, p99 is
the maximum).

Procedure: start both servers; per server a warm-up (one short completion, one long-prompt
completion with ``max_tokens`` 1 whose time to first token is the reference prefill time);
then rounds, each running every (server, cause) job once, the starting job rotating per
round. Before every job all servers must be idle: trioserve's ``GET /health`` shows
``inference_threads`` 0 and ``slots_in_use`` 0, and each server's CPU passes the idle rule
(at most ``--idle-cap`` each; a server still busy then is noted), then a 0.1 s pause.
llama-server serializes requests behind a lock; an abandoned generation keeps its worker
thread computing until the current ``next()`` of the completion iterator returns (by its code, one
token in decode, the whole prefill plus one token mid-prefill), holding the lock, so a
request that arrives meanwhile waits. That tail is what the black-box figure sees. The HTTP
client runs in this process, on the same cores. Servers are terminated at the end, also on
error, Ctrl-C and SIGTERM.

Run ``python benchmarks/bench_cancel.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import socket
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CLK_TCK,
    LLAMA_SERVER,
    SERVERS,
    TRIOSERVE,
    ServerProcess,
    add_ready_timeout,
    add_threads,
    argument_parser,
    bench_main,
    completion_request,
    cpu_seconds,
    environment,
    log,
    markdown_table,
    resolve_model,
    start_servers,
    stopping,
    thread_ids,
)

DECODE, PREFILL, DEADLINE = "decode", "prefill", "deadline"
SCENARIOS = (DECODE, PREFILL, DEADLINE)
DECODE_PROMPT = "Once upon a time"
PREFILL_SENTENCE = "The history of the city is long and varied. "
PAUSE_S = 0.1  # after a server passed the idle checks, before the next job
LOG_WAIT_S = 5.0  # how long a trioserve log line may take to appear
NO_WORK_MS = 50.0  # a prefill run with less CPU than this before and after the close did no prefill

#: trioserve's request log line: ``request <id> <path> key=value ...`` (fields may be added)
LOG_LINE = re.compile(r"trioserve\.requests: request (?P<id>\S+) (?P<path>\S+) (?P<fields>.*)")
LOG_FIELD = re.compile(r"(\w+)=(\S+)")


# ---------------------------------------------------------------------- CPU time


def runqueue_wait_seconds(pid: int) -> float:
    """Time the process's live threads have spent runnable but not running (second field
    of ``/proc/<pid>/task/<tid>/schedstat``, ns); 0 where the kernel lacks schedstat."""
    total = 0
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # the thread exited meanwhile, or no schedstat
    return total / 1e9


@dataclass
class IdleResult:
    latency_s: float | None  # idle start − cause; None: no quiet window within the cap
    cpu_s: float  # CPU time from the cause to the idle start (to the cap on a timeout)
    samples: int
    cpu_at_cause: float  # the process's CPU time at the first sample


def wait_cpu_idle(pid: int, t_cause: float, args: argparse.Namespace) -> IdleResult:
    """Sample the CPU time from ``t_cause`` until a quiet window is found (module doc)."""
    quiet = args.idle_fraction * args.window  # CPU seconds allowed in one window
    times = [time.perf_counter()]
    cpus = [cpu_seconds(pid)]
    waits = [runqueue_wait_seconds(pid)]
    i = k = 0  # candidate idle start; first sample >= window after it
    next_t = times[0] + args.sample_interval
    while True:
        while True:  # settle every candidate whose window is complete
            while k < len(times) and times[k] < times[i] + args.window:
                k += 1
            if k == len(times):
                break
            if cpus[k] - cpus[i] < quiet and waits[k] - waits[i] < quiet:
                return IdleResult(max(0.0, times[i] - t_cause), cpus[i] - cpus[0], len(times), cpus[0])
            i += 1
        now = time.perf_counter()
        if now - t_cause > args.idle_cap + args.window:
            return IdleResult(None, cpus[-1] - cpus[0], len(times), cpus[0])
        time.sleep(max(0.0, next_t - now))
        next_t = max(next_t + args.sample_interval, time.perf_counter())
        times.append(time.perf_counter())
        cpus.append(cpu_seconds(pid))
        waits.append(runqueue_wait_seconds(pid))


# ---------------------------------------------------------------------- raw HTTP + SSE


class SSEStream:
    """One streamed HTTP/1.1 request on a plain socket: the benchmark decides exactly when
    and how the connection ends. Records every SSE ``data:`` line with its arrival time."""

    def __init__(self, base: tuple[str, int], body: dict[str, Any], headers: dict[str, str]) -> None:
        host, port = base
        request = completion_request(host, port, body, headers)
        self.sock = socket.create_connection((host, port), timeout=10.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(request)
        self.sent_at = time.perf_counter()
        self.status: int | None = None
        self.events: list[tuple[float, str]] = []  # (perf_counter at arrival, data)
        self.ended = False  # the last (zero-length) chunk arrived
        self.eof = False  # the server closed the connection
        self._raw = b""  # received, not yet de-chunked
        self._body = b""  # de-chunked, not yet split into lines
        self._chunked = False

    def read_until(self, done: Callable[[], bool], until: float) -> bool:
        """Receive until ``done()``, end of stream, or ``time.perf_counter() >= until``."""
        while not done():
            remaining = until - time.perf_counter()
            if self.eof or self.ended or remaining <= 0:
                return False
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            if not data:
                self.eof = True
                return done()
            self._feed(data, time.perf_counter())
        return True

    def data_events(self) -> int:
        return sum(1 for _, data in self.events if data != "[DONE]")

    def done(self) -> bool:
        return any(data == "[DONE]" for _, data in self.events)

    def check_status(self) -> None:
        """Raise on an HTTP error status (with as much of the body as arrives in 1 s)."""
        if self.status is not None and self.status != 200:
            self.read_until(lambda: False, time.perf_counter() + 1.0)
            raise RuntimeError(f"HTTP {self.status}: {(self._body + self._raw)[:500]!r}")

    def finish(self, until: float) -> None:
        """Read until the server closes the connection (``Connection: close``), so that
        closing this side cannot race the server's last send."""
        while not self.eof and (remaining := until - time.perf_counter()) > 0:
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return
            if not data:
                self.eof = True
            self._feed(data, time.perf_counter())

    def close(self, how: str = "rst") -> float:
        """Close the socket (``rst``: SO_LINGER 0, the kernel sends a reset); returns
        ``time.perf_counter()`` right after."""
        if how == "rst":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        return time.perf_counter()

    def _feed(self, data: bytes, now: float) -> None:
        self._raw += data
        if self.status is None:
            end = self._raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self._raw = self._raw[:end].decode("latin-1"), self._raw[end + 4 :]
            lines = head.split("\r\n")
            self.status = int(lines[0].split()[1])
            self._chunked = any(
                line.lower().startswith("transfer-encoding:") and "chunked" in line.lower() for line in lines
            )
        if self._chunked:
            while True:
                eol = self._raw.find(b"\r\n")
                if eol < 0:
                    break
                size = int(self._raw[:eol].split(b";")[0], 16)
                if len(self._raw) < eol + 2 + size + 2:
                    break
                self._body += self._raw[eol + 2 : eol + 2 + size]
                self._raw = self._raw[eol + 2 + size + 2 :]
                if size == 0:
                    self.ended = True
        else:
            self._body, self._raw = self._body + self._raw, b""
        while (eol := self._body.find(b"\n")) >= 0:
            line, self._body = self._body[:eol].rstrip(b"\r"), self._body[eol + 1 :]
            if line.startswith(b"data:"):
                self.events.append((now, line[5:].strip().decode()))


def step_gaps_ms(stream: SSEStream) -> list[float]:
    """Gaps between consecutive data events after the first (the first includes prefill)."""
    times = [t for t, data in stream.events if data != "[DONE]"]
    return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]


def last_finish_reason(stream: SSEStream) -> str | None:
    for _, data in reversed(stream.events):
        if data != "[DONE]":
            choices = json.loads(data).get("choices") or [{}]
            reason: str | None = choices[0].get("finish_reason")
            return reason
    return None


# ---------------------------------------------------------------------- servers


def trioserve_log_line(server: ServerProcess, request_id: str) -> dict[str, str]:
    """The request's log line (fields as strings), waiting up to ``LOG_WAIT_S`` for it."""
    give_up = time.monotonic() + LOG_WAIT_S
    while True:
        for match in LOG_LINE.finditer(server.log_text()):
            if match["id"] == request_id:
                return dict(LOG_FIELD.findall(match["fields"].split(" error=")[0]))
        if time.monotonic() > give_up:
            return {}
        time.sleep(0.02)


def wait_idle(
    servers: list[ServerProcess], client: httpx.Client, args: argparse.Namespace, warnings: list[str]
) -> None:
    """Before a job: trioserve's /health shows no inference thread and no slot in use, and
    every server's CPU passes the idle rule (each check capped at ``--idle-cap``; a server
    still busy then is noted in ``warnings``, and the job runs anyway)."""
    for server in servers:
        server.check_alive()
        if server.name == TRIOSERVE:
            give_up = time.monotonic() + args.idle_cap
            while True:
                health = client.get(server.base_url + "/health", timeout=2.0).json()
                if health.get("inference_threads") == 0 and health.get("slots_in_use") == 0:
                    break
                if time.monotonic() > give_up:
                    warnings.append(f"trioserve still busy after {args.idle_cap:g} s before a job: {health}")
                    log(f"warning: {warnings[-1]}")
                    break
                time.sleep(0.02)
        idle = wait_cpu_idle(server.pid, time.perf_counter(), args)
        if idle.latency_s is None:
            warnings.append(f"{server.name} CPU still busy after {args.idle_cap:g} s before a job")
            log(f"warning: {warnings[-1]}")
    time.sleep(PAUSE_S)


# ---------------------------------------------------------------------- runs


@dataclass
class Sample:
    server: str
    scenario: str
    round: int
    request_id: str
    idle_ms: float | None = None  # black-box; None: not idle within --idle-cap (or not measured)
    idle_timed_out: bool = False
    cpu_after_cause_ms: float | None = None
    cpu_before_cause_ms: float | None = None  # from sending the request to the cause
    excluded: str | None = None  # why the run is left out of the summary (see exclusion())
    events_before_cause: int = 0
    done_ms: float | None = None  # deadline: send → [DONE]
    finish_reason: str | None = None
    step_gaps_ms: list[float] = field(default_factory=list)
    # white-box, from trioserve's log line
    cancel_latency_ms: float | None = None
    log_cause: str | None = None
    log_status: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    log_ttft_ms: float | None = None


def _number(text: str | None) -> float | None:
    return None if text is None or text == "-" else float(text)


def decode_body(max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": DECODE_PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "repeat_penalty": 1.0,  # llama-server's default is 1.1; trioserve ignores it
    }


def prefill_body(tag: str, args: argparse.Namespace, max_tokens: int = 5) -> dict[str, Any]:
    prompt = f"Record {tag}. " + PREFILL_SENTENCE * args.prefill_repeats
    return {**decode_body(max_tokens), "prompt": prompt}


def run_job(server: ServerProcess, scenario: str, round_: int, args: argparse.Namespace) -> Sample:
    """One cancelled request and its measurements."""
    rid = str(uuid.uuid4())  # llama_cpp.server answers 400 to an X-Request-Id that is not a UUID
    sample = Sample(server.name, scenario, round_, rid)
    headers = {"X-Request-Id": rid}
    cpu_at_send = cpu_seconds(server.pid)
    if scenario == DECODE:
        stream = SSEStream(server.address, decode_body(2000), headers)
        got = stream.read_until(lambda: stream.data_events() >= args.events, stream.sent_at + 60)
        stream.check_status()
        if not got:
            stream.close()
            raise RuntimeError(f"{server.name} {rid}: {stream.data_events()} of {args.events} events in 60 s")
        t_cause = stream.close(args.close)
    elif scenario == PREFILL:
        stream = SSEStream(server.address, prefill_body(rid, args), headers)
        stream.read_until(lambda: False, stream.sent_at + args.prefill_delay)
        t_cause = stream.close(args.close)
        stream.check_status()
    else:
        headers["X-Request-Timeout"] = f"{args.deadline:g}"
        stream = SSEStream(server.address, decode_body(2000), headers)
        try:
            stream.read_until(stream.done, stream.sent_at + args.deadline + 10)
            stream.check_status()
            stream.finish(time.perf_counter() + 5)
        finally:
            stream.close("fin")
        if stream.done():
            sample.done_ms = (next(t for t, d in stream.events if d == "[DONE]") - stream.sent_at) * 1e3
        sample.finish_reason = last_finish_reason(stream)
        t_cause = None
    sample.events_before_cause = stream.data_events()
    sample.step_gaps_ms = step_gaps_ms(stream) if scenario == DECODE else []
    if t_cause is not None:
        idle = wait_cpu_idle(server.pid, t_cause, args)
        sample.idle_timed_out = idle.latency_s is None
        sample.idle_ms = None if idle.latency_s is None else idle.latency_s * 1e3
        sample.cpu_after_cause_ms = idle.cpu_s * 1e3
        sample.cpu_before_cause_ms = (idle.cpu_at_cause - cpu_at_send) * 1e3
    if server.name == TRIOSERVE:
        line = trioserve_log_line(server, rid)
        sample.cancel_latency_ms = _number(line.get("cancel_latency_ms"))
        sample.log_cause = line.get("cause")
        sample.log_status = line.get("status")
        prompt_tokens, completion_tokens = (
            _number(line.get("prompt_tokens")),
            _number(line.get("completion_tokens")),
        )
        sample.prompt_tokens = None if prompt_tokens is None else int(prompt_tokens)
        sample.completion_tokens = None if completion_tokens is None else int(completion_tokens)
        sample.log_ttft_ms = _number(line.get("ttft_ms"))
    sample.excluded = exclusion(sample)
    return sample


def warm_up(server: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """A short completion, then the long prompt with ``max_tokens`` 1 (its time to first
    token is the reference prefill time). Neither is cancelled or counted."""
    stream = SSEStream(server.address, decode_body(8), {"X-Request-Id": str(uuid.uuid4())})
    try:
        stream.read_until(stream.done, stream.sent_at + 60)
        stream.check_status()
        stream.finish(time.perf_counter() + 5)
    finally:
        stream.close("fin")
    rid = str(uuid.uuid4())
    stream = SSEStream(server.address, prefill_body(rid, args, max_tokens=1), {"X-Request-Id": rid})
    try:
        stream.read_until(stream.done, stream.sent_at + 120)
        stream.check_status()
        stream.finish(time.perf_counter() + 5)
    finally:
        stream.close("fin")
    if not stream.data_events():
        raise RuntimeError(f"{server.name}: the long-prompt warm-up returned no event")
    reference: dict[str, Any] = {"prefill_ttft_ms": (stream.events[0][0] - stream.sent_at) * 1e3}
    if server.name == TRIOSERVE:
        line = trioserve_log_line(server, rid)
        reference["prefill_prompt_tokens"] = int(line["prompt_tokens"]) if "prompt_tokens" in line else None
        reference["prefill_ttft_ms_server"] = _number(line.get("ttft_ms"))
    return reference


def plan_round(round_: int, args: argparse.Namespace) -> list[tuple[str, str]]:
    jobs: list[tuple[str, str]] = []
    if round_ < args.reps:
        jobs += [(TRIOSERVE, DECODE), (LLAMA_SERVER, DECODE), (TRIOSERVE, DEADLINE)]
    if round_ < args.prefill_reps:
        jobs += [(TRIOSERVE, PREFILL), (LLAMA_SERVER, PREFILL)]
    shift = round_ % len(jobs)
    return jobs[shift:] + jobs[:shift]


def describe(s: Sample) -> str:
    head = f"round {s.round:>3} {s.server:<12} {s.scenario:<8}: "
    parts = []
    if s.scenario == DEADLINE:
        parts.append(f"[DONE] after {_fmt(s.done_ms)} ms, finish {s.finish_reason}")
    else:
        idle = "timeout" if s.idle_timed_out else f"{_fmt(s.idle_ms)} ms"
        parts.append(
            f"CPU idle after {idle} (CPU {_fmt(s.cpu_after_cause_ms)} ms), {s.events_before_cause} events"
        )
    if s.server == TRIOSERVE:
        parts.append(f"log: cause={s.log_cause} cancel_latency_ms={_fmt(s.cancel_latency_ms, '.2f')}")
    return head + ", ".join(parts)


def run_rounds(
    servers: list[ServerProcess], client: httpx.Client, args: argparse.Namespace, warnings: list[str]
) -> tuple[list[Sample], dict[str, Any]]:
    by_name = {s.name: s for s in servers}
    reference = {}
    for server in servers:
        wait_idle(servers, client, args, warnings)
        reference[server.name] = warm_up(server, args)
        log(f"warm-up {server.name}: {reference[server.name]}")
    samples = []
    for round_ in range(max(args.reps, args.prefill_reps)):
        for name, scenario in plan_round(round_, args):
            wait_idle(servers, client, args, warnings)
            sample = run_job(by_name[name], scenario, round_, args)
            samples.append(sample)
            log(describe(sample))
    wait_idle(servers, client, args, warnings)
    return samples, reference


# ---------------------------------------------------------------------- summary


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _dist(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "p50": nearest_rank(values, 0.5),
        "p99": nearest_rank(values, 0.99),
        "max": max(values),
    }


def summarize(samples: list[Sample], args: argparse.Namespace) -> dict[str, Any]:
    """Per server and scenario: distributions (timeouts count as +inf) and the decode step."""
    summary: dict[str, Any] = {}
    for name in SERVERS:
        mine = [s for s in samples if s.server == name and not s.excluded]
        gaps = [g for s in mine if s.scenario == DECODE for g in s.step_gaps_ms]
        per: dict[str, Any] = {
            "decode_step_ms": statistics_median(gaps),
            "decode_step_gaps": len(gaps),
        }
        for scenario in SCENARIOS:
            runs = [s for s in mine if s.scenario == scenario]
            if not runs:
                continue
            measured = [s for s in runs if s.cpu_after_cause_ms is not None]  # the black-box ran
            per[scenario] = {
                "runs": len(runs),
                "idle_ms": _dist([math.inf if s.idle_ms is None else s.idle_ms for s in measured]),
                "cpu_after_cause_ms": _dist([s.cpu_after_cause_ms for s in measured]),  # type: ignore[misc]
                "cancel_latency_ms": _dist(
                    [s.cancel_latency_ms for s in runs if s.cancel_latency_ms is not None]
                ),
                "done_ms": _dist(
                    [math.inf if s.done_ms is None else s.done_ms for s in runs]
                    if scenario == DEADLINE
                    else []
                ),
            }
        summary[name] = per
    return summary


def statistics_median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _finite(value: Any) -> Any:
    """For JSON: infinities (timeouts) become null."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def exclusion(s: Sample) -> str | None:
    """Why a prefill run did not measure a cancel mid-prefill (``None``: it did)."""
    if s.scenario != PREFILL:
        return None
    if s.events_before_cause:
        return f"{s.events_before_cause} token(s) arrived before the close: the prefill was over"
    if s.log_ttft_ms is not None:
        return f"trioserve logged a first token (ttft {s.log_ttft_ms} ms): the prefill was over"
    before, after = s.cpu_before_cause_ms, s.cpu_after_cause_ms
    if before is not None and after is not None and before < NO_WORK_MS and after < NO_WORK_MS:
        return (
            f"the server used {before:.0f} ms of CPU before the close and {after:.0f} ms after: "
            "the prefill never started (the disconnect came first)"
        )
    return None


def result_notes(samples: list[Sample], args: argparse.Namespace) -> list[str]:
    """Runs that did not measure what they claim to."""
    notes = []
    for s in samples:
        where = f"{s.server} {s.scenario} round {s.round} ({s.request_id})"
        if s.excluded:
            notes.append(f"{where}: left out of the summary: {s.excluded}")
        if s.idle_timed_out:
            notes.append(f"{where}: CPU not idle within {args.idle_cap:g} s")
        if s.server == TRIOSERVE:
            expected = "deadline" if s.scenario == DEADLINE else "disconnect"
            if s.log_cause != expected:
                notes.append(f"{where}: log cause={s.log_cause}, expected {expected}")
            if s.cancel_latency_ms is None:
                notes.append(f"{where}: no cancel_latency_ms in the log line")
        if s.scenario == DEADLINE and s.finish_reason != "deadline":
            notes.append(f"{where}: final finish_reason={s.finish_reason!r}, not 'deadline'")
        if s.scenario == DEADLINE and s.done_ms is None:
            notes.append(f"{where}: no [DONE]")
    return notes


def _fmt(value: float | None, spec: str = ".1f", cap: float | None = None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return f"> {cap:g} s" if cap is not None else "timeout"
    return f"{value:{spec}}"


def summary_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    causes = {
        DECODE: "disconnect in decode",
        PREFILL: f"disconnect mid-prefill (+{args.prefill_delay * 1e3:.0f} ms)",
        DEADLINE: f"deadline {args.deadline:g} s in decode",
    }
    metrics = [
        ("idle_ms", "CPU idle − cause (black-box)"),
        ("cancel_latency_ms", "cancel_latency_ms (server log)"),
        ("done_ms", "send → [DONE]"),
    ]
    rows = [
        [
            "server",
            "cause",
            "metric",
            "n",
            "p50 ms",
            "p99 ms",
            "max ms",
            "CPU after cause ms p50 / max",
            "bar (p99)",
            "met",
        ]
    ]
    for scenario in SCENARIOS:
        for name in SERVERS:
            per = summary.get(name, {})
            stats = per.get(scenario)
            if not stats:
                continue
            step = per.get("decode_step_ms")
            for key, label in metrics:
                dist = stats.get(key)
                if not dist:
                    continue
                bar = None
                bar_text = "—"
                if scenario == DECODE and step is not None:
                    bar, bar_text = step + 10, f"≤ {step + 10:.1f} (step {step:.1f} + 10)"
                elif scenario == PREFILL and key == "idle_ms":
                    bar, bar_text = 100.0, "≤ 100"
                elif scenario == DEADLINE and key == "done_ms":
                    bar = args.deadline * 1e3 + 100
                    bar_text = f"≤ {bar:.0f}"
                cpu = stats.get("cpu_after_cause_ms") if key == "idle_ms" else None
                rows.append(
                    [
                        name,
                        causes[scenario],
                        label,
                        str(dist["n"]),
                        _fmt(dist["p50"], cap=args.idle_cap),
                        _fmt(dist["p99"], cap=args.idle_cap),
                        _fmt(dist["max"], cap=args.idle_cap),
                        f"{_fmt(cpu['p50'], '.0f')} / {_fmt(cpu['max'], '.0f')}" if cpu else "—",
                        bar_text,
                        "—" if bar is None else ("yes" if dist["p99"] <= bar else "no"),
                    ]
                )
    return markdown_table(rows)


def reference_table(summary: dict[str, Any], reference: dict[str, Any]) -> str:
    rows = [
        [
            "server",
            "decode step ms (median gap, n)",
            "long-prompt prefill ms (TTFT, warm-up)",
            "long prompt, tokens (trioserve log)",
        ]
    ]
    for name in SERVERS:
        per, ref = summary.get(name, {}), reference.get(name, {})
        rows.append(
            [
                name,
                f"{_fmt(per.get('decode_step_ms'))} ({per.get('decode_step_gaps', 0)})",
                _fmt(ref.get("prefill_ttft_ms"), ".0f"),
                str(ref.get("prefill_prompt_tokens", "—")),
            ]
        )
    return markdown_table(rows)


def samples_table(samples: list[Sample], args: argparse.Namespace) -> str:
    rows = [
        [
            "round",
            "server",
            "cause",
            "events",
            "step ms",
            "CPU before ms",
            "CPU idle ms",
            "CPU after ms",
            "log cancel ms",
            "[DONE] ms",
            "log cause",
            "finish",
            "counted",
        ]
    ]
    for s in samples:
        rows.append(
            [
                str(s.round),
                s.server,
                s.scenario,
                str(s.events_before_cause),
                _fmt(statistics_median(s.step_gaps_ms)),
                _fmt(s.cpu_before_cause_ms, ".0f"),
                f"> {args.idle_cap:g} s" if s.idle_timed_out else _fmt(s.idle_ms),
                _fmt(s.cpu_after_cause_ms, ".0f"),
                _fmt(s.cancel_latency_ms, ".2f"),
                _fmt(s.done_ms),
                str(s.log_cause or "—"),
                str(s.finish_reason or "—"),
                "no" if s.excluded else "yes",
            ]
        )
    return markdown_table(rows)


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_threads(p)
    p.add_argument("--ctx-size", type=int, default=4096, help="context size (default: 4096)")
    p.add_argument(
        "--trioserve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `trioserve serve`, repeatable (e.g. --trioserve-arg=--batch-invariant)",
    )
    p.add_argument("--reps", type=int, default=20, help="decode and deadline runs per server (default: 20)")
    p.add_argument(
        "--prefill-reps",
        type=int,
        default=None,
        help="mid-prefill runs per server (default: half of --reps, rounded up)",
    )
    p.add_argument(
        "--events", type=int, default=5, help="decode: SSE events read before the close (default: 5)"
    )
    p.add_argument(
        "--prefill-repeats",
        type=int,
        default=170,
        help="prefill: sentence repeats (default: 170, ~1,700 tokens)",
    )
    p.add_argument(
        "--prefill-delay", type=float, default=0.3, help="prefill: seconds from send to close (default: 0.3)"
    )
    p.add_argument(
        "--deadline", type=float, default=0.5, help="deadline: X-Request-Timeout seconds (default: 0.5)"
    )
    p.add_argument(
        "--close", choices=["rst", "fin"], default="rst", help="how the client leaves (default: rst)"
    )
    p.add_argument(
        "--sample-interval", type=float, default=0.005, help="CPU sampling period, s (default: 0.005)"
    )
    p.add_argument("--window", type=float, default=0.1, help="idle rule: window, s (default: 0.1)")
    p.add_argument(
        "--idle-fraction",
        type=float,
        default=0.05,
        help="idle rule: CPU share of one core allowed in the window (default: 0.05)",
    )
    p.add_argument(
        "--idle-cap", type=float, default=15.0, help="seconds to wait for idle per run (default: 15)"
    )
    p.add_argument("--out", type=Path, help="write config, every sample and the summary to this JSON file")
    p.add_argument("--markdown", action="store_true", help="also print every sample as a markdown table")
    add_ready_timeout(p)
    args = p.parse_args(argv)
    if args.prefill_reps is None:
        args.prefill_reps = (args.reps + 1) // 2
    if args.reps < 1 or args.prefill_reps < 0 or args.events < 2 or args.threads < 1:
        p.error("need --reps >= 1, --prefill-reps >= 0, --events >= 2, --threads >= 1")
    return args


def config(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "threads": args.threads,
        "ctx_size": args.ctx_size,
        "reps": args.reps,
        "prefill_reps": args.prefill_reps,
        "events": args.events,
        "prefill_repeats": args.prefill_repeats,
        "prefill_delay_s": args.prefill_delay,
        "deadline_s": args.deadline,
        "close": args.close,
        "sample_interval_s": args.sample_interval,
        "window_s": args.window,
        "idle_fraction": args.idle_fraction,
        "idle_cap_s": args.idle_cap,
        "clk_tck": CLK_TCK,
        **environment(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    cfg = config(args, model)
    log(f"config: {json.dumps(cfg)}")
    servers: list[ServerProcess] = []
    warnings: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-cancel-") as log_dir,
        httpx.Client() as client,
        stopping(servers),
    ):
        start_servers(
            servers,
            model,
            Path(log_dir),
            threads=args.threads,
            ctx_size=args.ctx_size,
            trioserve_extra=("--log-level", "info", *args.trioserve_arg),
        )
        for server in servers:
            server.wait_ready(client, args.ready_timeout)
        log("servers ready: " + ", ".join(f"{s.name} {s.base_url} pid {s.pid}" for s in servers))
        samples, reference = run_rounds(servers, client, args, warnings)
    cfg["loadavg_end"] = os.getloadavg()
    return {
        "config": cfg,
        "reference": reference,
        "notes": warnings + result_notes(samples, args),
        "samples": [asdict(s) for s in samples],
        "summary": summarize(samples, args),
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cfg = result["config"]
    if args.markdown:
        print(samples_table([Sample(**s) for s in result["samples"]], args) + "\n")
    print(
        f"{Path(cfg['model']).name}, {cfg['threads']} threads, ctx {cfg['ctx_size']}, "
        f"{cfg['reps']} decode/deadline runs and {cfg['prefill_reps']} prefill runs per server, "
        f"close={cfg['close']}, "
        f"llama-cpp-python {cfg['llama_cpp_python']}, {cfg['cpu_count']} CPUs, "
        f"load {cfg['loadavg_start'][0]:.2f}→{cfg['loadavg_end'][0]:.2f}; nearest-rank percentiles\n"
    )
    print(summary_table(result["summary"], args) + "\n")
    print(reference_table(result["summary"], result["reference"]))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, report, to_json=_finite)


if __name__ == "__main__":
    raise SystemExit(main())
