"""The soak's traffic and checks: mixed, hostile traffic against ``trioserve serve``, then
proof that nothing leaked and that every request ended with a recorded cause.

:func:`run_soak` starts the server (``benchmarks.harness.servers.Server``, the way a user
runs it, ``--log-level info``), takes a baseline of the process (threads, descriptors, RSS:
``benchmarks.harness.proc``) once Trio's idle worker threads have exited, sends the
planned jobs (:func:`make_plan`: each kind drawn with ``seed``), and checks: ``/health``
gauges back to 0, threads and descriptors back to the baseline (sockets closed by their
client only counted apart: hypercorn closes an idle keep-alive connection at its
keep-alive timeout, so ``linger`` waits for them), RSS growth, exactly one log line per
request with a cause that agrees with what the client saw and with
``trioserve_stream_ends_total``, no ERROR line, exit code 0 after SIGTERM. The kinds, the
checks and the warnings: docs/benchmarks.md, "Soak". Used by ``tests/e2e/test_soak.py``
(small) and ``benchmarks/soak.py`` (the benchmark, thousands of requests).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import re
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio

from benchmarks.harness import proc
from benchmarks.harness.servers import TRIOSERVE, Server, free_port, trioserve_command

KINDS = ("normal", "disconnect", "deadline", "bad", "overload", "slow", "conversation", "interleaved")
#: relative weights per job (an ``overload`` job is a burst of many requests)
DEFAULT_MIX = {
    "normal": 50.0,
    "disconnect": 20.0,
    "deadline": 12.0,
    "bad": 12.0,
    "overload": 0.6,
    "slow": 5.0,
    "conversation": 6.0,  # one conversation of 2-6 turns, back to back
    "interleaved": 1.5,  # slots + 1 conversations, turn by turn: each resume finds its cells taken
}
HEALTH_GAUGES = ("slots_in_use", "queued", "active_streams", "generations_running", "requests_in_flight")
PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "Write a haiku about rivers.",
    "def fibonacci(n):",
    "In the beginning",
)
#: the client's receive buffer for slow readers (the kernel doubles it)
SLOW_READER_RCVBUF = 4096
#: the server's request-body limit during the soak (a ``bad`` case sends more)
MAX_BODY_BYTES = 65536
REQUEST_LINE = re.compile(
    r"trioserve\.requests: request (?P<id>\S+) (?P<path>\S+) model=(?P<model>\S+) "
    r"status=(?P<status>\S+) cause=(?P<cause>\S+)"
)
FINISH_REASON = re.compile(rb'"finish_reason":\s*"(\w+)"')
END_CAUSE = re.compile(rb'"end_cause":\s*"(\w+)"')
ERROR_EVENT = re.compile(rb'data: \{"error":')
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})")
#: words of the conversations' text (each a token or so)
WORDS = (  # noqa: SIM905
    "the river city house light stone winter garden market road music paper story "
    "island window forest morning evening friend teacher letter mountain harbor bridge lamp field "
    "quiet old small bright long warm cold green blue early late slow careful"
).split()
#: RSS growth allowed beyond the host-memory tier's budget (what the tier holds is
#: resident by design): the grammar engine's vocabulary is built in the warm-up, saved
#: states live in mappings of their own and the heap is trimmed when the scheduler goes
#: idle (trioserve/_backends/_cache/_memory.py), docs/benchmarks.md "Soak"
RSS_SLACK_MIB = 48.0
#: the exactness check after the traffic: turns per conversation (slots + 1 conversations)
EXACT_TURNS = 3


# ---------------------------------------------------------------------- configuration


@dataclass(kw_only=True)
class SoakConfig:
    """One soak run. ``None`` fields take the backend's default (:func:`defaults`)."""

    scripted: bool = True
    model: Path | None = None
    requests: int | None = None
    concurrency: int | None = None
    seed: int = 1
    slots: int | None = None
    max_queue: int = 8
    stall_timeout: float = 2.0
    scripted_interval: float = 0.002
    threads: int = 2
    max_slow: int | None = None
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    settle: float = 15.0
    linger: float = 90.0
    #: RSS growth allowed beyond what the host tier holds at the end (MiB)
    max_rss_growth_mib: float | None = None
    ready_timeout: float = 180.0
    log_file: Path | None = None
    oversized_headers: bool = False
    cache_ram: int | None = None  # server --cache-ram MiB (None: the server's default)
    exact_check: bool = True  # after the traffic: cached turns equal cache_prompt false reruns
    verbose: bool = True


def defaults(scripted: bool) -> dict[str, Any]:
    """Defaults that depend on the backend: thousands of requests on the scripted one,
    a few hundred on a real model (one slot, short completions)."""
    if scripted:
        return {"requests": 3000, "concurrency": 8, "slots": 4, "max_slow": 8, "max_rss_growth_mib": 64.0}
    return {"requests": 300, "concurrency": 4, "slots": 1, "max_slow": 3, "max_rss_growth_mib": 64.0}


@dataclass(frozen=True)
class Profile:
    """What the requests look like on one backend."""

    normal_max_tokens: int  # normal requests: 1..this
    long_max_tokens: int  # disconnect and deadline requests: never finished in time
    slow_max_tokens: int  # slow readers: enough SSE to fill every buffer on the way
    burst_max_tokens: int
    deadline_range: tuple[float, float]  # X-Request-Timeout, seconds
    disconnect_delay_max: float  # seconds
    request_timeout: float  # the client gives up on one request after this long
    natural: frozenset[str]  # how a generation can end on its own
    first_words: tuple[int, int]  # a conversation's first text (after its unique prefix)
    more_words: tuple[int, int]  # each later turn's new text
    prefill_cut_max: float  # seconds after the headers at most, for a cut before the reply

    @classmethod
    def of(cls, scripted: bool) -> Profile:
        if scripted:  # the default script never ends: only max_tokens stops it
            # (the scripted backend's tokens are bytes: 4096 of context)
            return cls(
                32, 3000, 4000, 40, (0.05, 0.5), 0.3, 60.0, frozenset({"length"}), (20, 60), (5, 30), 0.05
            )
        return cls(
            16,
            400,
            2000,
            8,
            (0.1, 0.8),
            1.0,
            180.0,
            frozenset({"stop", "length"}),
            (140, 260),
            (30, 120),
            0.8,
        )


# ---------------------------------------------------------------------- records


@dataclass
class Record:
    """One request: what was sent, what the client saw, what the server logged."""

    id: str
    kind: str
    variant: str
    expected: list[str]  # causes this request may end with
    status: int | None = None  # as the client saw it (None: it left before the status line)
    finish: str | None = None  # the finish_reason the client saw
    problem: str | None = None  # what the client found wrong
    note: str = ""
    seconds: float = 0.0
    server_status: str | None = None  # from the log line
    cause: str | None = None
    lines: int = 0


@dataclass
class Job:
    index: int
    kind: str
    size: int  # requests in the job (a burst has many)
    turns: tuple[int, ...] = ()  # conversation kinds: turns of each conversation
    records: list[Record] = field(default_factory=list)


def conversation_turns(rng: random.Random, kind: str, slots: int, left: int) -> tuple[int, ...]:
    """Turns (2-6) of each conversation of a job, at most ``left`` in all."""
    turns = [rng.randint(2, 6) for _ in range(1 if kind == "conversation" else slots + 1)]
    i = 0
    while sum(turns) > left:  # (the plan stops at cfg.requests exactly)
        if turns[i % len(turns)] > 2:
            turns[i % len(turns)] -= 1
        i += 1
    return tuple(turns)


def make_plan(cfg: SoakConfig) -> list[Job]:
    """The jobs, drawn with ``cfg.seed``: ``cfg.requests`` requests in all."""
    assert cfg.requests is not None
    assert cfg.slots is not None
    assert cfg.max_slow is not None
    rng = random.Random(cfg.seed)
    jobs: list[Job] = []
    planned = slow = 0
    burst_base = cfg.slots + cfg.max_queue + 2
    while planned < cfg.requests:
        left = cfg.requests - planned
        weights = {
            kind: weight
            for kind, weight in cfg.mix.items()
            if weight > 0
            and not (kind == "slow" and slow >= cfg.max_slow)
            and not (kind == "overload" and left < burst_base + 4)
            and not (kind == "conversation" and left < 2)
            and not (kind == "interleaved" and left < 2 * (cfg.slots + 1))
        }
        kind = rng.choices(list(weights), list(weights.values()))[0] if weights else "normal"
        size = burst_base + rng.randint(0, 4) if kind == "overload" else 1
        turns = (
            conversation_turns(rng, kind, cfg.slots, left) if kind in ("conversation", "interleaved") else ()
        )
        size = sum(turns) or size
        slow += kind == "slow"
        jobs.append(Job(len(jobs), kind, size, turns))
        planned += size
    return jobs


# ---------------------------------------------------------------------- the server process


def idle_trio_threads(names: list[str]) -> int:
    """Threads idle in Trio's thread cache (a running job renames its thread)."""
    return sum(name.startswith("Trio thread") for name in names)


@dataclass
class Snapshot:
    """The server process at one moment."""

    threads: int
    idle_trio_threads: int
    fds: int
    rss_mib: float
    thread_names: list[str]
    fd_targets: list[str]  # with a socket's state: "socket:[123] CLOSE_WAIT"

    @property
    def busy_threads(self) -> int:
        """Threads other than idle ones in Trio's cache."""
        return self.threads - self.idle_trio_threads

    @classmethod
    def take(cls, pid: int) -> Snapshot:
        names, fds = proc.thread_names(pid), proc.fd_targets(pid)
        return cls(len(names), idle_trio_threads(names), len(fds), proc.rss_kib(pid) / 1024, names, fds)

    @property
    def connections(self) -> list[str]:
        """TCP sockets other than the listening one."""
        return [
            fd for fd in self.fd_targets if fd.startswith("socket:") and not fd.endswith((" LISTEN", " UNIX"))
        ]

    def extra_fds(self, baseline: Snapshot) -> list[str]:
        """Descriptors open now that were not open at the baseline."""
        return sorted((Counter(self.fd_targets) - Counter(baseline.fd_targets)).elements())

    def peer_closed(self, baseline: Snapshot) -> int:
        """Extra sockets whose client has closed (CLOSE_WAIT) or reset them (GONE: in no
        kernel table any more), that the server has not closed yet."""
        return sum(peer_closed(fd) for fd in self.extra_fds(baseline))


def peer_closed(fd: str) -> bool:
    return fd.endswith((" CLOSE_WAIT", " GONE"))


class LogWatcher:
    """The request ids the server has logged so far (reads only what is new)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.ids: set[str] = set()

    def seen(self, request_id: str) -> bool:
        if request_id in self.ids:
            return True
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            if match := REQUEST_LINE.search(line.decode(errors="replace")):
                self.ids.add(match["id"])
        return request_id in self.ids


def server_options(cfg: SoakConfig) -> list[str]:
    assert cfg.slots is not None
    options = ["--log-level", "info", "--slots", str(cfg.slots), "--max-queue", str(cfg.max_queue)]
    options += ["--stall-timeout", str(cfg.stall_timeout), "--max-body-bytes", str(MAX_BODY_BYTES)]
    options += ["--shutdown-grace", "5"]
    if cfg.cache_ram is not None and not cfg.scripted:
        options += ["--cache-ram", str(cfg.cache_ram)]
    if cfg.scripted:
        return [*options, "--scripted", "--scripted-interval", str(cfg.scripted_interval)]
    return [*options, "--threads", str(cfg.threads), *(["--model", str(cfg.model)] if cfg.model else [])]


# ---------------------------------------------------------------------- raw HTTP/1.1


class RawConnection:
    """One HTTP/1.1 exchange on a raw Trio socket, so the client decides exactly when and
    how the connection ends (FIN, RST, or not reading at all)."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.received = b""
        self.eof = False

    @classmethod
    async def open(cls, url: str, receive_buffer: int | None = None) -> RawConnection:
        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if receive_buffer is not None:  # before connecting: the window stays small
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            await sock.connect((parts.hostname, parts.port))
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    @staticmethod
    def request_bytes(
        path: str, body: bytes, request_id: str, *, headers: dict[str, str] | None = None
    ) -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-Id: {request_id}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            + "\r\n"
        )
        return head.encode() + body

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            sent = await self.sock.send(view)
            view = view[sent:]

    async def receive(self) -> bool:
        """Read what is there; False at the end of the stream (EOF or reset)."""
        try:
            chunk = await self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.received += chunk
        return True

    async def read_until(self, done: Any) -> None:
        while not done(self.received) and await self.receive():
            pass

    @property
    def status(self) -> int | None:
        match = STATUS_LINE.match(self.received)
        return int(match.group(1)) if match else None

    def close(self, *, reset: bool = False) -> None:
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def complete(data: bytes) -> bool:
    """The response is all there (by its Content-Length, or its chunked body's end)."""
    head, separator, body = data.partition(b"\r\n\r\n")
    if not separator:
        return False
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if length is not None:
        return len(body) >= int(length.group(1))
    return body.endswith(b"0\r\n\r\n")


def ended(data: bytes) -> bool:
    """The response is a refusal (its status is not 200), or its stream has ended."""
    match = STATUS_LINE.match(data)
    return (match is not None and match.group(1) != b"200") or b"data: [DONE]" in data


def finish_reason(data: bytes) -> str | None:
    """Why a response body (JSON or SSE) says it ended: ``error`` for an error event
    (a failure after the stream started), the ``trioserve.end_cause`` of a stream cut
    short (its ``finish_reason`` is OpenAI's ``length``), else the last non-null
    ``finish_reason``."""
    if ERROR_EVENT.search(data):
        return "error"
    cause = END_CAUSE.findall(data)
    if cause:
        return cause[-1].decode()
    found = FINISH_REASON.findall(data)
    return found[-1].decode() if found else None


# ---------------------------------------------------------------------- the traffic


#: the bad cases refused by the full parse, which comes after the key's limits and the
#: queue (docs/scheduling.md, "The order of checks"): at capacity they are a 429
#: ``overloaded`` — a true answer, and the one that keeps a flood of malformed requests
#: from costing a parse each. (Tests of each 400 on an idle server:
#: tests/unit/wire/test_openai_validation.py.) ``invalid-utf8`` is one of them: the peek decodes only
#: ``model`` and ``priority``, and msgspec skips the other fields' strings unread.
PAST_ADMISSION = frozenset(
    {
        "invalid-utf8",
        "missing-prompt",
        "prompt-type",
        "max-tokens-type",
        "empty-prompt",
        "max-tokens-zero",
        "n-17",
        "echo",
        "prompt-too-long",
        "max-tokens-beyond-context",
        "empty-messages",
        "invalid-role",
    }
)


def bad_cases(oversized_headers: bool) -> list[tuple[str, str, str, dict[str, Any], int]]:
    """(name, method, path, httpx request arguments, expected status): malformed
    requests that reach the generation endpoints."""
    json_type = {"content-type": "application/json"}
    comp, chat = "/v1/completions", "/v1/chat/completions"
    cases: list[tuple[str, str, str, dict[str, Any], int]] = [
        ("not-json", "POST", comp, {"content": b"{prompt: hi", "headers": json_type}, 400),
        ("not-object", "POST", comp, {"json": ["hi"]}, 400),
        ("invalid-utf8", "POST", comp, {"content": b'{"prompt": "\xff"}', "headers": json_type}, 400),
        ("missing-prompt", "POST", comp, {"json": {"max_tokens": 5}}, 400),
        ("prompt-type", "POST", comp, {"json": {"prompt": 5}}, 400),
        ("max-tokens-type", "POST", comp, {"json": {"prompt": "hi", "max_tokens": "many"}}, 400),
        ("empty-prompt", "POST", comp, {"json": {"prompt": ""}}, 400),
        ("max-tokens-zero", "POST", comp, {"json": {"prompt": "hi", "max_tokens": 0}}, 400),
        ("n-17", "POST", comp, {"json": {"prompt": "hi", "n": 17}}, 400),
        ("echo", "POST", comp, {"json": {"prompt": "hi", "echo": True}}, 400),
        ("unknown-model", "POST", comp, {"json": {"prompt": "hi", "model": "no-such-model"}}, 404),
        ("prompt-too-long", "POST", comp, {"json": {"prompt": "word " * 5000, "max_tokens": 4}}, 400),
        ("max-tokens-beyond-context", "POST", comp, {"json": {"prompt": "hi", "max_tokens": 100_000}}, 400),
        ("empty-messages", "POST", chat, {"json": {"messages": []}}, 400),
        ("invalid-role", "POST", chat, {"json": {"messages": [{"role": "wizard", "content": "hi"}]}}, 400),
        (
            "timeout-header",
            "POST",
            comp,
            {"json": {"prompt": "hi"}, "headers": {"X-Request-Timeout": "soon"}},
            400,
        ),
        (
            "content-type",
            "POST",
            comp,
            {"content": b'{"prompt": "hi"}', "headers": {"content-type": "text/plain"}},
            415,
        ),
        ("body-too-large", "POST", comp, {"json": {"prompt": "x" * (MAX_BODY_BYTES + 5000)}}, 413),
        ("wrong-method", "GET", comp, {}, 405),
    ]
    if oversized_headers:
        cases.append(
            (
                "headers-too-large",
                "POST",
                comp,
                {"json": {"prompt": "hi"}, "headers": {"X-Big": "x" * 20_000}},
                431,
            )
        )
    return cases


class Traffic:
    """Sends the requests of each job and records what happened."""

    def __init__(self, cfg: SoakConfig, url: str, client: httpx.AsyncClient, server_log: LogWatcher) -> None:
        self.cfg = cfg
        self.url = url
        self.client = client
        self.server_log = server_log
        self.profile = Profile.of(cfg.scripted)
        self.bad_inputs = bad_cases(cfg.oversized_headers)
        self.records: list[Record] = []
        self.slow_gate = trio.Semaphore(1)  # one slow reader at a time
        self.chunk: int | None = None  # the prompt cache's chunk (None: no prompt cache)
        #: the exactness check: (conversation, turn, cached tokens, text equal to the rerun's)
        self.exact_turns: list[tuple[str, int, int, bool]] = []

    def expect(self, *causes: str, natural: bool = False) -> list[str]:
        allowed = {"overloaded", *causes}  # any request may meet a full queue
        if natural or not self.cfg.scripted:  # a model may stop (EOS) before any cut
            allowed |= self.profile.natural
        return sorted(allowed)

    def new(self, job: Job, sub: int, variant: str, expected: list[str]) -> Record:
        record = Record(
            f"soak{self.cfg.seed}-{job.index:05d}-{sub:02d}-{job.kind}", job.kind, variant, expected
        )
        self.records.append(record)
        job.records.append(record)
        return record

    @staticmethod
    def body(
        rng: random.Random, *, chat: bool, max_tokens: int, stream: bool, greedy: bool
    ) -> dict[str, Any]:
        prompt = rng.choice(PROMPTS)
        body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body["temperature"] = 0.0 if greedy else rng.choice([0.0, 0.7, 1.0])
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    async def run(self, job: Job) -> None:
        rng = random.Random(f"{self.cfg.seed}/{job.index}")
        gate = self.slow_gate if job.kind == "slow" else contextlib.nullcontext()
        async with gate:
            started = time.perf_counter()
            try:
                with trio.move_on_after(
                    self.profile.request_timeout + 3 * self.cfg.stall_timeout + 30
                ) as scope:
                    await getattr(self, job.kind)(job, rng)
                if scope.cancelled_caught:
                    for record in job.records:
                        record.problem = record.problem or "the job did not finish in time"
            except (OSError, httpx.HTTPError) as exc:
                for record in job.records:
                    record.problem = record.problem or f"client error: {exc!r}"
        for record in job.records:
            record.seconds = time.perf_counter() - started

    # -- normal and deadline: httpx

    async def exchange(
        self, record: Record, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> bytes:
        """One request through httpx; records the status and finish_reason."""
        headers = {"X-Request-Id": record.id, **(headers or {})}
        data = b""
        with trio.move_on_after(self.profile.request_timeout) as scope:
            async with self.client.stream(method, path, headers=headers, **kwargs) as response:
                record.status = response.status_code
                data = await response.aread()
        if scope.cancelled_caught:
            record.problem = f"no complete response after {self.profile.request_timeout:.0f} s"
        record.finish = finish_reason(data) if record.status == 200 else None
        return data

    def check_response(self, record: Record, data: bytes, stream: bool, allowed: set[int]) -> None:
        if record.problem or record.status is None:
            return
        if record.status not in allowed | {429}:
            record.problem = (
                f"status {record.status}, expected one of {sorted(allowed | {429})}: {data[:200]!r}"
            )
        elif record.status == 200 and stream and not data.endswith(b"data: [DONE]\n\n"):
            record.problem = f"the stream did not end with [DONE]: ...{data[-200:]!r}"
        elif record.status == 200 and record.finish is None:
            record.problem = f"no finish_reason in the response: {data[-200:]!r}"
        elif (
            record.status == 429
            and b'"code":"overloaded"' not in data
            and b"deadline_unreachable" not in data
        ):
            record.problem = f"a 429 without an overload code: {data[:200]!r}"

    def extras(self, rng: random.Random, chat: bool) -> tuple[str, dict[str, Any]]:
        """Now and then what issue 15 added: n > 1 (every backend), and with the model
        a JSON constraint or logprobs (the scripted backend refuses those)."""
        options: list[tuple[str, dict[str, Any]]] = [("", {})] * 6
        if (self.cfg.slots or 1) >= 2:
            options.append(("-n2", {"n": 2}))
        if not self.cfg.scripted:
            options.append(("-json", {"response_format": {"type": "json_object"}}))
            options.append(("-logprobs", {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}))
        return rng.choice(options)

    async def normal(self, job: Job, rng: random.Random) -> None:
        chat, stream = rng.random() < 0.3, rng.random() < 0.5
        max_tokens = rng.randint(1, self.profile.normal_max_tokens)
        suffix, extra = self.extras(rng, chat)
        variant = f"{'chat' if chat else 'text'}-{'stream' if stream else 'json'}{suffix}"
        record = self.new(job, 0, variant, self.expect(natural=True))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = self.body(rng, chat=chat, max_tokens=max_tokens, stream=stream, greedy=False) | extra
        data = await self.exchange(record, "POST", path, json=body)
        self.check_response(record, data, stream, {200})

    async def deadline(self, job: Job, rng: random.Random) -> None:
        stream = rng.random() < 0.6
        timeout = round(rng.uniform(*self.profile.deadline_range), 3)
        record = self.new(job, 0, f"{'stream' if stream else 'json'}", self.expect("deadline"))
        record.note = f"timeout {timeout} s"
        body = self.body(rng, chat=False, max_tokens=self.profile.long_max_tokens, stream=stream, greedy=True)
        headers = {"X-Request-Timeout": str(timeout)}
        data = await self.exchange(record, "POST", "/v1/completions", headers=headers, json=body)
        self.check_response(record, data, stream, {200} if stream else {200, 504})
        if record.status == 504:
            record.finish = "deadline"  # (what the 504 says)

    async def bad(self, job: Job, rng: random.Random) -> None:
        name, method, path, kwargs, status = rng.choice(self.bad_inputs)
        past_admission = name in PAST_ADMISSION
        record = self.new(job, 0, name, ["error", "overloaded"] if past_admission else ["error"])
        data = await self.exchange(record, method, path, **kwargs)
        if past_admission and record.status == 429 and b'"code":"overloaded"' in data:
            pass  # a full queue answered before the parse (PAST_ADMISSION)
        elif record.status is not None and record.status != status and not record.problem:
            record.problem = f"status {record.status}, expected {status}: {data[:200]!r}"
        elif b'"error"' not in data and not record.problem:
            record.problem = f"no error body: {data[:200]!r}"

    # -- disconnect, overload, slow: raw sockets

    async def disconnect(self, job: Job, rng: random.Random) -> None:
        mode = rng.choice(["mid-body", "after-delay", "after-bytes", "after-events"])
        stream = mode in ("after-bytes", "after-events") or rng.random() < 0.7
        body = self.body(
            rng, chat=rng.random() < 0.3, max_tokens=self.profile.long_max_tokens, stream=stream, greedy=True
        )
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        record = self.new(job, 0, mode, self.expect("disconnect"))
        request = RawConnection.request_bytes(path, json.dumps(body).encode(), record.id)
        conn = await RawConnection.open(self.url)
        try:
            if mode == "mid-body":
                await conn.send(request[: len(request) - rng.randint(1, 20)])
                await trio.sleep(rng.uniform(0, 0.05))
            else:
                await conn.send(request)
                if mode == "after-delay":
                    await trio.sleep(rng.uniform(0, self.profile.disconnect_delay_max))
                elif mode == "after-bytes":
                    target = rng.randint(1, 6000)
                    await conn.read_until(lambda data: len(data) >= target or ended(data))
                    record.note = f"{target} bytes"
                else:
                    events = rng.randint(1, 20)
                    await conn.read_until(lambda data: data.count(b"data: ") >= events or ended(data))
                    record.note = f"{events} events"
        finally:
            # An RST only once the response has begun: the server has then read the
            # request (an RST that overtakes it could drop it unseen).
            reset = bool(conn.received) and rng.random() < 0.5
            conn.close(reset=reset)
        record.variant += "-rst" if reset else "-fin"
        record.status = conn.status
        if conn.status == 429:
            record.finish = "overloaded"

    async def overload(self, job: Job, rng: random.Random) -> None:
        """A burst: open every connection, then send every request back to back."""
        conns: list[RawConnection] = []
        records: list[Record] = []
        requests: list[bytes] = []
        try:
            for sub in range(job.size):
                stream = rng.random() < 0.5
                max_tokens = self.profile.burst_max_tokens
                body = self.body(rng, chat=False, max_tokens=max_tokens, stream=stream, greedy=True)
                record = self.new(job, sub, "stream" if stream else "json", self.expect(natural=True))
                records.append(record)
                requests.append(
                    RawConnection.request_bytes("/v1/completions", json.dumps(body).encode(), record.id)
                )
                conns.append(await RawConnection.open(self.url))
            for conn, request in zip(conns, requests, strict=True):  # back to back
                await conn.send(request)
            async with trio.open_nursery() as nursery:
                for conn in conns:
                    nursery.start_soon(conn.read_until, complete)
        finally:
            for conn in conns:
                conn.close()
        for record, conn in zip(records, conns, strict=True):
            stream = record.variant == "stream"
            record.status = conn.status
            data = conn.received.partition(b"\r\n\r\n")[2]
            record.finish = finish_reason(data) if record.status == 200 else None
            if record.status is None:
                record.problem = f"no status line: {conn.received[:200]!r}"
            else:
                self.check_response(record, data, False, {200})  # (chunked: [DONE] checked below)
            if stream and record.status == 200 and b"data: [DONE]" not in data:
                record.problem = record.problem or "the stream did not end with [DONE]"

    async def slow(self, job: Job, rng: random.Random) -> None:
        """Read a little, stop reading, and wait for the server to cut the connection
        (one at a time: ``run`` holds the gate)."""
        body = self.body(rng, chat=False, max_tokens=self.profile.slow_max_tokens, stream=True, greedy=True)
        body["prompt"] = "Once upon a time"
        record = self.new(job, 0, "small-rcvbuf", self.expect("stall"))
        conn = await RawConnection.open(self.url, receive_buffer=SLOW_READER_RCVBUF)
        try:
            await conn.send(
                RawConnection.request_bytes("/v1/completions", json.dumps(body).encode(), record.id)
            )
            target = rng.randint(1, 4000)
            await conn.read_until(lambda data: len(data) >= target or ended(data))
            # Not reading any more. The kernel's reset on the server's side is
            # silent (no RST reaches this socket), so the server's log line for this
            # request is the sign that it has let go.
            stopped = time.perf_counter()
            limit = 3 * self.cfg.stall_timeout + 20
            with trio.move_on_after(limit):
                while not self.server_log.seen(record.id):  # noqa: ASYNC110 - polls a file
                    await trio.sleep(0.05)
            waited = time.perf_counter() - stopped
            if self.server_log.seen(record.id):
                record.note = f"read {len(conn.received)} bytes; the server let go after {waited:.1f} s"
            else:
                record.note = f"read {len(conn.received)} bytes; the server held on for {limit:.0f} s"
        finally:
            conn.close()
        record.status = conn.status
        if conn.status == 429:
            record.finish = "overloaded"

    # -- conversations: httpx, and a raw socket for a turn the client cuts

    async def conversation(self, job: Job, rng: random.Random) -> None:
        await self.interleaved(job, rng)

    async def interleaved(self, job: Job, rng: random.Random) -> None:
        """The job's conversations turn by turn (one after another when there is one):
        with slots + 1 of them, each resume finds its cells taken by the others, so
        its prefix comes back from host memory, or is evaluated again."""
        convs = [
            Conversation.start(f"soak{self.cfg.seed}-c{job.index}-{i}", rng, self.profile)
            for i in range(len(job.turns))
        ]
        order = [(c, t) for t in range(max(job.turns)) for c in range(len(convs)) if t < job.turns[c]]
        for sub, (c, t) in enumerate(order):
            await self.turn(job, sub, convs[c], t, rng)

    async def turn(self, job: Job, sub: int, conv: Conversation, index: int, rng: random.Random) -> None:
        """One turn: maybe cut (mid-prefill: within a random time after the headers and
        before the first token; mid-decode: after a random number of tokens), maybe with
        ``cache_prompt: false``; the next turn extends the prompt with what came back."""
        max_tokens = rng.randint(2, self.profile.normal_max_tokens)
        cut = rng.choices(["none", "prefill", "decode"], [0.64, 0.18, 0.18])[0]
        stream = cut != "none" or rng.random() < 0.5
        cache = rng.random() >= 0.15
        variant = f"{'chat' if conv.chat else 'text'}-{'stream' if stream else 'json'}"
        variant += ("" if cut == "none" else f"-cut-{cut}") + ("" if cache else "-nocache")
        expected = self.expect(*(["disconnect"] if cut != "none" else []), natural=True)
        record = self.new(job, sub, variant, expected)
        record.note = f"{conv.tag} turn {index + 1}"
        body = conv.body(max_tokens=max_tokens, stream=stream, temperature=rng.choice([0.0, 0.0, 0.7]))
        if not cache:
            body["cache_prompt"] = False
        if cut == "none":
            reply, usage = await self.full_turn(record, conv.path, body)
        else:
            target = rng.randint(1, max_tokens - 1) if cut == "decode" else 0
            reply, usage = await self.cut_turn(record, conv.path, body, target, rng)
        self.check_usage(record, usage, cache)
        conv.extend(reply, words(rng, self.profile.more_words))

    async def full_turn(
        self, record: Record, path: str, body: dict[str, Any]
    ) -> tuple[str, dict[str, Any] | None]:
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        data = await self.exchange(record, "POST", path, json=body)
        self.check_response(record, data, body["stream"], {200})
        if record.status != 200 or record.problem:
            return "", None
        if body["stream"]:
            parts, usage = parse_sse(data.decode(errors="replace").splitlines())
            return "".join(parts), usage
        response = json.loads(data)
        choice = response["choices"][0]
        return (choice["message"]["content"] if "message" in choice else choice["text"]), response.get(
            "usage"
        )

    async def cut_turn(
        self, record: Record, path: str, body: dict[str, Any], target: int, rng: random.Random
    ) -> tuple[str, None]:
        """A streamed turn the client closes (a raw socket, FIN): after ``target``
        tokens, or (``target`` 0) before the first one, within a random time after the
        headers. A reply that ends first is read to its end."""
        window = rng.uniform(0, self.profile.prefill_cut_max) if target == 0 else math.inf

        def enough(data: bytes) -> bool:
            lines = sse_lines(data)
            if ended(data) or (lines and finish_reason("\n".join(lines).encode())):
                return ended(data)  # (a reply that has ended is read to its [DONE])
            return len(parse_sse(lines)[0]) >= max(target, 1)

        conn = await RawConnection.open(self.url)
        try:
            await conn.send(RawConnection.request_bytes(path, json.dumps(body).encode(), record.id))
            await conn.read_until(lambda data: STATUS_LINE.match(data) is not None)
            with trio.move_on_after(window):
                await conn.read_until(enough)
            if conn.status not in (None, 200):
                await conn.read_until(complete)
        finally:
            conn.close()
        record.status = conn.status
        if conn.status != 200:
            self.check_response(record, conn.received.partition(b"\r\n\r\n")[2], False, {200})
            return "", None
        lines = sse_lines(conn.received)
        parts, _ = parse_sse(lines)
        cut = "data: [DONE]" not in lines
        record.note += f", cut after {len(parts)} token event(s)" if cut else ", ended before the cut"
        record.finish = None if cut else finish_reason("\n".join(lines).encode())
        return "".join(parts), None

    def check_usage(self, record: Record, usage: dict[str, Any] | None, cache: bool) -> None:
        """With a prompt cache: what a turn reused is whole chunks, short of its prompt,
        and nothing with ``cache_prompt: false``."""
        details = (usage or {}).get("prompt_tokens_details") or {}
        if self.chunk is None or record.problem or "cached_tokens" not in details:
            return
        cached, prompt_tokens = details["cached_tokens"], usage["prompt_tokens"]  # type: ignore[index]
        # (whole pieces of the canonical cut: any length since issue 23, never the whole prompt)
        if cached >= prompt_tokens or (cached and not cache):
            record.problem = (
                f"cached_tokens {cached} of {prompt_tokens} (chunk {self.chunk}, cache_prompt {cache})"
            )

    async def exact(self, job: Job, rng: random.Random) -> None:
        """The exactness check, alone on the server after the traffic: slots + 1
        greedy conversations turn by turn (each resume from host memory or evaluated
        again), each turn's text compared with its rerun with ``cache_prompt: false``
        (a fresh server's answer: nothing reused, nothing left)."""
        convs = [
            Conversation.start(f"soak{self.cfg.seed}-exact-{i}", rng, self.profile)
            for i in range(len(job.turns))
        ]
        sub = 0
        for t in range(EXACT_TURNS):
            for conv in convs:
                stream = rng.random() < 0.5
                body = conv.body(max_tokens=self.profile.normal_max_tokens, stream=stream, temperature=0.0)
                record = self.new(
                    job, sub, f"{'chat' if conv.chat else 'text'}-cached", self.expect(natural=True)
                )
                reference = self.new(
                    job, sub + 1, f"{'chat' if conv.chat else 'text'}-rerun", self.expect(natural=True)
                )
                record.note = reference.note = f"{conv.tag} turn {t + 1}"
                sub += 2
                text, usage = await self.full_turn(record, conv.path, dict(body))
                again, _ = await self.full_turn(reference, conv.path, {**body, "cache_prompt": False})
                self.check_usage(record, usage, True)
                if record.status == reference.status == 200 and not (record.problem or reference.problem):
                    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    self.exact_turns.append((conv.tag, t + 1, cached, text == again))
                    if text != again:
                        record.problem = f"text {text!r} differs from its cache_prompt false rerun {again!r}"
                conv.extend(text, words(rng, self.profile.more_words))


def words(rng: random.Random, count: tuple[int, int]) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*count))) + "."


def sse_lines(data: bytes) -> list[str]:
    """The whole lines of a chunked response's body so far (after its head)."""
    rest, body = data.partition(b"\r\n\r\n")[2], b""
    while (size_end := rest.find(b"\r\n")) > 0:
        size = int(rest[:size_end], 16)
        if not size or len(rest) < size_end + 2 + size:
            break
        body += rest[size_end + 2 : size_end + 2 + size]
        rest = rest[size_end + 4 + size :]
    return body.decode(errors="replace").split("\n")[:-1]


def parse_sse(lines: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """The text pieces (completions' ``text``, chat's ``delta.content``) and the usage
    of an SSE stream's ``data:`` lines."""
    parts: list[str] = []
    usage = None
    for line in lines:
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if piece:
                parts.append(piece)
    return parts, usage


@dataclass
class Conversation:
    """A conversation's prompt (completions) or messages (chat), grown turn by turn;
    its tag, first, makes its prefix unique."""

    tag: str
    chat: bool
    prompt: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, tag: str, rng: random.Random, profile: Profile) -> Conversation:
        conv = cls(tag, rng.random() < 0.5)
        conv.extend("", f"[{tag}] {words(rng, profile.first_words)}")
        return conv

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def extend(self, reply: str, text: str) -> None:
        if not self.chat:
            self.prompt += f"{reply}\n{text}\n"
        elif reply:
            self.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": text}]
        elif self.messages:  # (no reply: the roles must alternate)
            self.messages[-1] = {"role": "user", "content": f"{self.messages[-1]['content']} {text}"}
        else:
            self.messages.append({"role": "user", "content": text})

    def body(self, **fields: Any) -> dict[str, Any]:
        return {"messages": list(self.messages), **fields} if self.chat else {"prompt": self.prompt, **fields}


# ---------------------------------------------------------------------- checks


@dataclass
class Linger:
    """Sockets closed by their client, not by the server, after the settle time, and
    when the server closed them (None:
    not waited for, or still open)."""

    peer_closed: int = 0
    waited: float = 0.0
    released_after: float | None = None


@dataclass
class Result:
    config: dict[str, Any]
    records: list[Record]
    baseline: Snapshot
    after: Snapshot
    rss_peak_mib: float
    health: dict[str, Any]
    stream_ends: dict[str, float]
    log_causes: dict[str, int]
    error_lines: list[str]
    unknown_lines: list[str]
    exit_code: int
    traffic_seconds: float
    total_seconds: float
    linger: Linger = field(default_factory=Linger)
    cache: dict[str, Any] = field(default_factory=dict)  # the prompt cache's figures (a model only)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def leaks(self) -> dict[str, int]:
        """What did not come back to the baseline (all 0 when nothing leaked)."""
        extra = self.after.extra_fds(self.baseline)
        leaks = {
            "threads": max(0, self.after.threads - self.baseline.busy_threads),
            "busy_threads": max(0, self.after.busy_threads - self.baseline.busy_threads),
            # sockets that the client closed are counted apart: hypercorn closes them
            # at its keep-alive timeout (see ``settle``)
            "fds": sum(not peer_closed(fd) for fd in extra),
            "peer_closed": sum(peer_closed(fd) for fd in extra),
        }
        for gauge in HEALTH_GAUGES:
            value = self.health.get(gauge)
            leaks[gauge] = value if isinstance(value, int) else -1
        return leaks

    @property
    def rss_growth_mib(self) -> float:
        return self.after.rss_mib - self.baseline.rss_mib

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "ok": not self.problems,
            "problems": self.problems,
            "warnings": self.warnings,
            "linger": asdict(self.linger),
            "leaks": self.leaks,
            "baseline": asdict(self.baseline),
            "after": asdict(self.after),
            "rss_mib": {
                "before": self.baseline.rss_mib,
                "peak": self.rss_peak_mib,
                "after": self.after.rss_mib,
                "growth": self.rss_growth_mib,
            },
            "health": self.health,
            "cache": self.cache,
            "stream_ends_total": self.stream_ends,
            "log_causes": self.log_causes,
            "error_lines": self.error_lines,
            "unknown_lines": self.unknown_lines,
            "exit_code": self.exit_code,
            "traffic_seconds": self.traffic_seconds,
            "total_seconds": self.total_seconds,
            "records": [asdict(r) for r in self.records],
        }


def parse_log(text: str, records: list[Record]) -> tuple[Counter[str], list[str], list[str]]:
    """Match the log's request lines to the records; return the causes of every line,
    the ERROR lines, and the request lines of ids that were never sent."""
    by_id = {r.id: r for r in records}
    causes: Counter[str] = Counter()
    errors, unknown = [], []
    for line in text.splitlines():
        if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback"):
            errors.append(line)
        match = REQUEST_LINE.search(line)
        if match is None:
            continue
        causes[match["cause"]] += 1
        record = by_id.get(match["id"])
        if record is None:
            unknown.append(line)
            continue
        record.lines += 1
        record.server_status = match["status"]
        record.cause = match["cause"]
    return causes, errors, unknown


def check_records(records: list[Record]) -> tuple[list[str], list[str]]:
    """The problems found in the records, and the ids of streams refused after they had
    started (a known race, reported apart)."""
    problems, raced = [], []
    for r in records:
        where = f"{r.id} ({r.variant}{', ' + r.note if r.note else ''})"
        if r.problem:
            problems.append(f"{where}: {r.problem}")
        if r.lines != 1:
            problems.append(f"{where}: {r.lines} log lines, expected exactly 1")
            continue
        if r.cause in (None, "None", "unknown"):
            problems.append(f"{where}: no cause recorded (cause={r.cause})")
        elif r.cause not in r.expected:
            problems.append(f"{where}: cause {r.cause}, expected one of {r.expected}")
        if r.status is not None and r.server_status != str(r.status):
            problems.append(f"{where}: the client saw {r.status}, the log says status={r.server_status}")
        if r.finish == "error" and r.cause == "overloaded" and r.status == 200:
            # admission.check() let the stream start, then the last queue place went
            # to another request while the headers were sent: the client sees
            # finish_reason "error", the log and metrics say "overloaded"
            raced.append(r.id)
        elif r.finish is not None and r.cause != r.finish:
            problems.append(f"{where}: the client saw finish_reason {r.finish}, the log says cause={r.cause}")
    return problems, raced


async def scrape_stream_ends(client: httpx.AsyncClient) -> tuple[dict[str, float], float]:
    """``trioserve_stream_ends_total`` by cause, and the sum of ``trioserve_requests_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get("/metrics")
    response.raise_for_status()
    ends: dict[str, float] = {}
    requests = 0.0
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "trioserve_stream_ends_total" and sample.value:
                ends[sample.labels["cause"]] = sample.value
            elif sample.name == "trioserve_requests_total":
                requests += sample.value
    return ends, requests


@dataclass
class CacheWatch:
    """``/health``'s ``batch.cache``, sampled during the run: the host-memory tier
    must never hold more than its budget."""

    samples: int = 0
    max_ram_bytes: int = 0
    budget_bytes: int = 0
    over_budget: list[tuple[int, int]] = field(default_factory=list)  # (bytes, budget)

    def sample(self, health: dict[str, Any]) -> None:
        ram = health.get("batch", {}).get("cache", {}).get("ram")
        if not ram:
            return
        self.samples += 1
        self.max_ram_bytes = max(self.max_ram_bytes, ram["bytes"])
        self.budget_bytes = ram["budget_bytes"]
        if ram["bytes"] > ram["budget_bytes"]:
            self.over_budget.append((ram["bytes"], ram["budget_bytes"]))

    def rss_bound_mib(self) -> float:
        return self.budget_bytes / 2**20 + RSS_SLACK_MIB

    def problems(self, health: dict[str, Any], rss_growth_mib: float) -> list[str]:
        found = []
        if self.over_budget:
            found.append(
                f"/health ram bytes over budget in {len(self.over_budget)} sample(s): {self.over_budget[:3]}"
            )
        if not self.samples:
            found.append("no /health sample of batch.cache.ram")
        if None in health.get("batch", {}).get("cache", {}).get("sequences", [None]):
            found.append(
                f"a sequence still runs a request at the end: {health['batch']['cache']['sequences']}"
            )
        if rss_growth_mib > self.rss_bound_mib():
            found.append(
                f"RSS grew {rss_growth_mib:.1f} MiB, more than the RAM budget + {RSS_SLACK_MIB:.0f} MiB "
                f"({self.rss_bound_mib():.0f} MiB)"
            )
        return found

    def summary(
        self, plan: list[Job], traffic: Traffic, health: dict[str, Any], rss_growth_mib: float
    ) -> dict[str, Any]:
        turns = [r for r in traffic.records if r.kind in ("conversation", "interleaved")]
        return {
            "conversations": sum(len(job.turns) for job in plan),
            "turns": len(turns),
            "cuts": Counter(
                r.variant.partition("-cut-")[2].partition("-")[0] for r in turns if "-cut-" in r.variant
            ),
            "cut_causes": Counter(r.cause for r in turns if "-cut-" in r.variant),
            "no_cache_turns": sum(r.variant.endswith("-nocache") for r in turns),
            "samples": self.samples,
            "max_ram_bytes": self.max_ram_bytes,
            "budget_bytes": self.budget_bytes,
            "over_budget_samples": len(self.over_budget),
            "rss_growth_mib": rss_growth_mib,
            "rss_bound_mib": self.rss_bound_mib(),
            "exact": {
                "turns": len(traffic.exact_turns),
                "equal": sum(equal for *_, equal in traffic.exact_turns),
                "cached_tokens": [cached for _, _, cached, _ in traffic.exact_turns],
            },
            "end": health.get("batch", {}).get("cache", {}),
        }


# ---------------------------------------------------------------------- the run


def log(cfg: SoakConfig, message: str) -> None:
    if cfg.verbose:
        print(f"soak: {message}", file=sys.stderr, flush=True)


def resolved(cfg: SoakConfig) -> SoakConfig:
    """A copy with every ``None`` field set to the backend's default."""
    values = asdict(cfg)
    for key, value in defaults(cfg.scripted).items():
        if values.get(key) is None:
            values[key] = value
    values["mix"] = dict(cfg.mix)
    return SoakConfig(**values)


async def wait_health_idle(client: httpx.AsyncClient, limit: float) -> dict[str, Any]:
    """Poll ``/health`` until every gauge is 0 and no sequence runs a request (or
    ``limit`` passes); return the last."""
    health: dict[str, Any] = {}
    with trio.move_on_after(limit):
        while True:
            health = (await client.get("/health")).json()
            sequences = health.get("batch", {}).get("cache", {}).get("sequences", [])
            if all(health.get(gauge) == 0 for gauge in HEALTH_GAUGES) and None not in sequences:
                break
            await trio.sleep(0.05)
    return health


async def settle(pid: int, baseline: Snapshot, limit: float, linger: float) -> tuple[Snapshot, Linger]:
    """Wait (up to ``limit``) until threads — Trio's idle cache included — and fds are
    back to the baseline. If sockets are left over that their client has closed (CLOSE_WAIT)
    or reset (GONE) but the server has not — hypercorn closes an idle keep-alive
    connection only at its keep-alive timeout, 75 s — wait up to ``linger`` more for
    them. Return the last snapshot and what lingered."""
    deadline = trio.current_time() + limit
    while True:
        now = Snapshot.take(pid)
        if (
            now.threads <= baseline.busy_threads and now.fds <= baseline.fds
        ) or trio.current_time() > deadline:
            break
        await trio.sleep(0.1)
    linger_state = Linger(peer_closed=now.peer_closed(baseline))
    if linger_state.peer_closed and linger > 0:
        started = trio.current_time()
        with trio.move_on_after(linger):
            while now.peer_closed(baseline):
                await trio.sleep(0.5)
                now = Snapshot.take(pid)
        linger_state.waited = trio.current_time() - started
        if not now.peer_closed(baseline):
            linger_state.released_after = linger_state.waited + limit
    return now, linger_state


async def warm_up(cfg: SoakConfig, url: str, records: list[Record]) -> None:
    """A few ordinary requests, so that what the server creates once (the inference
    thread pool, a first connection's state, the grammar engine's vocabulary) is in
    the baseline."""
    natural = sorted(Profile.of(cfg.scripted).natural)
    bodies = [
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "stream": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
        ),
    ]
    if not cfg.scripted:
        # The grammar engine's view of the vocabulary (llguidance's tokenizer: ~100 MiB
        # for Gemma 3's 262k tokens), built once per model on its first constrained
        # request: a one-time cost that belongs in the baseline, not in the growth
        bodies.append(
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "response_format": {"type": "json_object"},
                },
            )
        )
        # Each sequence's KV cells as far as the longest conversation reaches (~1,200
        # tokens), touched once here, so that RSS growth measures what the cache keeps
        # (LRU: each request takes another sequence; cache_prompt false: none kept)
        assert cfg.slots is not None
        rng = random.Random(cfg.seed)
        for i in range(cfg.slots):
            prompt = f"[soak{cfg.seed}-warmup-{i}] {words(rng, (1400, 1400))}"
            bodies.append(("/v1/completions", {"prompt": prompt, "max_tokens": 4, "cache_prompt": False}))
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        for i, (path, body) in enumerate(bodies):
            record = Record(f"soak{cfg.seed}-warmup-{i}", "warmup", path, natural)
            records.append(record)
            started = time.perf_counter()
            response = await client.post(path, json=body, headers={"X-Request-Id": record.id})
            record.seconds = time.perf_counter() - started
            record.status = response.status_code
            record.finish = finish_reason(response.content)
            if response.status_code != 200:
                raise RuntimeError(f"warm-up request failed: {response.status_code} {response.text[:300]}")


async def run_soak(config: SoakConfig) -> Result:
    """Start the server, run the traffic, check for leaks and causes; the result lists
    every problem found (``result.problems`` empty: nothing leaked, every cause known).
    Cancelled, it stops the server (SIGTERM, bounded) on the way out."""
    cfg = resolved(config)
    started = time.perf_counter()
    plan = make_plan(cfg)
    port = free_port()
    argv = trioserve_command(port, *server_options(cfg))
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        log_path = cfg.log_file or Path(tmp) / "server.log"
        server = await trio.to_thread.run_sync(
            lambda: Server(TRIOSERVE, argv, port, log_path.parent, log_path)
        )
        try:
            await trio.to_thread.run_sync(server.wait_ready, cfg.ready_timeout, abandon_on_cancel=True)
            log(cfg, f"server pid {server.pid} at {server.url}: {' '.join(server.command[1:])}")
            return await _soak(cfg, server, plan, started)
        except BaseException:
            log(cfg, f"--- server log (tail) ---\n{server.log_tail(30)}")
            raise
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(server.stop)


async def _soak(cfg: SoakConfig, server: Server, plan: list[Job], started: float) -> Result:
    assert cfg.concurrency is not None
    assert cfg.requests is not None
    assert cfg.max_rss_growth_mib is not None
    records: list[Record] = []
    await warm_up(cfg, server.url, records)
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        cache = (await wait_health_idle(client, 30.0)).get("batch", {}).get("cache") or {}
    chunk = cache["chunk"] if cache.get("enabled") else None  # (the scripted backend has none)
    # The baseline: the server has no connection open (the warm-up's are closed), and
    # Trio's idle worker threads have exited (after 10 s), with any thread they started
    # (llama.cpp's OpenMP workers belong to the thread that ran the decode), so that the
    # same threads are counted here as after the traffic.
    log(cfg, "warm-up done; waiting for Trio's idle worker threads to exit (10 s) for the baseline")
    with trio.move_on_after(cfg.settle):
        while True:
            now = Snapshot.take(server.pid)
            if not now.connections and not now.idle_trio_threads:
                break
            await trio.sleep(0.1)
    await trio.sleep(0.3)
    baseline = Snapshot.take(server.pid)
    log(
        cfg,
        f"baseline: {baseline.busy_threads} threads (+{baseline.idle_trio_threads} idle in Trio's cache), "
        f"{baseline.fds} fds, RSS {baseline.rss_mib:.1f} MiB; {len(plan)} jobs, {cfg.requests} requests",
    )

    peak = baseline.rss_mib
    traffic_started = time.perf_counter()
    limits = httpx.Limits(max_connections=2 * cfg.concurrency, max_keepalive_connections=2 * cfg.concurrency)
    timeout = httpx.Timeout(30.0, read=Profile.of(cfg.scripted).request_timeout)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as client:
        traffic = Traffic(cfg, server.url, client, LogWatcher(server.log_path))
        traffic.chunk = chunk
        watch = CacheWatch()
        jobs = iter(plan)
        done = 0
        step = max(1, cfg.requests // 10)
        next_report = step

        async def worker() -> None:
            nonlocal done, next_report
            for job in jobs:  # (one Trio thread: the shared iterator needs no lock)
                await traffic.run(job)
                done += job.size
                if done >= next_report:
                    next_report += step
                    elapsed = time.perf_counter() - traffic_started
                    log(cfg, f"{done}/{cfg.requests} requests, {elapsed:.0f} s")

        async def sample_rss(cancel: trio.CancelScope) -> None:
            nonlocal peak
            with cancel:
                while True:
                    peak = max(peak, proc.rss_kib(server.pid) / 1024)
                    await trio.sleep(0.5)

        async def sample_health(cancel: trio.CancelScope) -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as health_client:
                with cancel:
                    while True:
                        watch.sample((await health_client.get("/health")).json())
                        await trio.sleep(0.25)

        samplers = [trio.CancelScope(), trio.CancelScope()]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_rss, samplers[0])
            if chunk is not None:
                nursery.start_soon(sample_health, samplers[1])
            async with trio.open_nursery() as workers:
                for _ in range(cfg.concurrency):
                    workers.start_soon(worker)
            traffic_seconds = time.perf_counter() - traffic_started
            if chunk is not None and cfg.exact_check:
                assert cfg.slots is not None
                await wait_health_idle(client, 10.0 + 3 * cfg.stall_timeout)  # alone from here on
                exact = Job(
                    len(plan), "exact", 2 * EXACT_TURNS * (cfg.slots + 1), (EXACT_TURNS,) * (cfg.slots + 1)
                )
                log(cfg, f"exactness check: {exact.size} requests")
                await traffic.run(exact)
            for sampler in samplers:
                sampler.cancel()
    records += traffic.records
    log(cfg, f"traffic done: {len(traffic.records)} requests in {traffic_seconds:.1f} s; checking")

    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        health = await wait_health_idle(client, 10.0 + 3 * cfg.stall_timeout)
        if chunk is not None:
            watch.sample(health)
    after, linger = await settle(server.pid, baseline, cfg.settle, cfg.linger)
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        stream_ends, requests_total = await scrape_stream_ends(client)
    exit_code = await trio.to_thread.run_sync(server.stop)
    causes, error_lines, unknown_lines = parse_log(server.log_text(), records)

    result = Result(
        config={
            **asdict(cfg),
            "model": str(cfg.model) if cfg.model else None,
            "log_file": str(cfg.log_file) if cfg.log_file else None,
            "server": server.command,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        records=records,
        baseline=baseline,
        after=after,
        rss_peak_mib=peak,
        health=health,
        stream_ends=stream_ends,
        log_causes=dict(causes),
        error_lines=error_lines,
        unknown_lines=unknown_lines,
        exit_code=exit_code,
        traffic_seconds=traffic_seconds,
        total_seconds=time.perf_counter() - started,
        linger=linger,
    )
    problems = result.problems
    if chunk is not None:
        result.cache = watch.summary(plan, traffic, health, result.rss_growth_mib)
        problems += watch.problems(health, result.rss_growth_mib)
    for name, leaked in result.leaks.items():
        if leaked and name != "peer_closed":
            problems.append(f"leak: {name} {leaked} (see 'after' in the result)")
    if linger.peer_closed:
        lingered = (
            f"{linger.peer_closed} server socket(s) still open {cfg.settle:.0f} s after the traffic, "
            "their clients gone (CLOSE_WAIT or reset; hypercorn closes an idle keep-alive "
            "connection only at its keep-alive timeout, 75 s in trioserve)"
        )
        if linger.released_after is not None:
            result.warnings.append(f"{lingered}; all closed {linger.released_after:.0f} s after the traffic")
        elif cfg.linger > 0:
            problems.append(
                f"leak: {lingered}; still open {cfg.settle + linger.waited:.0f} s after the traffic"
            )
        else:
            result.warnings.append(f"{lingered}; not waited for (linger 0)")
    if result.leaks["threads"]:
        extra = Counter(after.thread_names) - Counter(baseline.thread_names)
        problems.append(f"threads not back to the baseline after {cfg.settle:.0f} s: {dict(extra)}")
    if result.leaks["fds"] or (result.leaks["peer_closed"] and cfg.linger > 0):
        problems.append(f"fds not back to the baseline: {after.extra_fds(baseline)}")
    # what the host tier holds at the end is resident by design (its budget bounds it);
    # the bound is on the rest
    tier_mib = (result.cache or {}).get("end", {}).get("ram", {}).get("bytes", 0) / 2**20
    if result.rss_growth_mib - tier_mib > cfg.max_rss_growth_mib:
        problems.append(
            f"RSS grew {result.rss_growth_mib:.1f} MiB, {result.rss_growth_mib - tier_mib:.1f} MiB beyond "
            f"the {tier_mib:.1f} MiB the host tier holds (bound {cfg.max_rss_growth_mib:.0f} MiB)"
        )
    record_problems, raced = check_records(records)
    problems += record_problems
    if raced:
        result.warnings.append(
            f"{len(raced)} streamed request(s) refused after their stream had started: admission.check() "
            "let them in, the last queue place went to another request while their headers were "
            'sent, and the client saw 200 with finish_reason "error" where the log and metrics '
            f"say cause=overloaded (e.g. {', '.join(raced[:3])})"
        )
    if unknown_lines:
        problems.append(
            f"{len(unknown_lines)} request line(s) with an id never sent, e.g. {unknown_lines[0]}"
        )
    if dict(causes) != {cause: int(count) for cause, count in stream_ends.items()}:
        problems.append(
            f"trioserve_stream_ends_total {stream_ends} differs from the log's causes {dict(causes)}"
        )
    if requests_total != sum(causes.values()):
        problems.append(
            f"trioserve_requests_total is {requests_total:.0f}, the log has {sum(causes.values())} lines"
        )
    if error_lines:
        problems.append(f"{len(error_lines)} ERROR line(s) in the server log, e.g. {error_lines[0]}")
    if exit_code != 0:
        problems.append(f"the server exited with {exit_code} after SIGTERM")
    bursts = [r for r in records if r.kind == "overload"]
    if bursts and not any(r.status == 429 for r in bursts):
        problems.append("no overload burst got a 429")
    return result
