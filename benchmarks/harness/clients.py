"""Clients: :class:`RawStream` (a plain socket: the lightest client, the one that decides
how a connection ends, and the slow reader; OpenAI SSE, Anthropic Messages events with
``path="/v1/messages"``, or Ollama's NDJSON lines with ``path="/api/chat"``) and
:func:`timed_stream` (httpx, timed)."""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from .proc import unread_bytes

STATUS, FINISH = re.compile(rb"HTTP/1\.[01] (\d{3})"), re.compile(rb'"finish_reason": ?"(\w+)"')
OPEN = re.compile(rb'"finish_reason": ?null')
END_CAUSE = re.compile(rb'"end_cause": ?"(\w+)"')  # an event that carries a token
PROGRESS = b'"prompt_progress"'  # llama-server's event per prompt batch (return_progress): no token
COMPLETIONS, MESSAGES, OLLAMA_CHAT = "/v1/completions", "/v1/messages", "/api/chat"
#: Anthropic Messages events (``path`` MESSAGES): a token's, the last one, the stop reason
DELTA, MESSAGE_STOP = b"event: content_block_delta", b"event: message_stop"
STOP_REASON = re.compile(rb'"stop_reason": ?"(\w+)"')  # message_delta's (message_start's is null)
#: Ollama's NDJSON lines (``path`` OLLAMA_CHAT): a line in progress, the last one, its reason
#: (a heartbeat is a line in progress with empty content: no token)
LINE_OPEN, LINE_DONE, EMPTY = b'"done":false', b'"done":true', b'"content":""'
DONE_REASON = re.compile(rb'"done_reason": ?"(\w+)"')


def body(prompt: str, max_tokens: int, **more: Any) -> dict[str, Any]:
    """A streamed, greedy completion request. ``repeat_penalty`` 1.0 is llama-cpp-python's
    ``create_completion`` default (its server's is 1.1; llama-server's and trioserve's is 1.0)."""
    fields = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return {**fields, "repeat_penalty": 1.0, **more}


def messages_body(prompt: str, max_tokens: int, model: str, **more: Any) -> dict[str, Any]:
    """A streamed, greedy Anthropic Messages request: ``prompt`` as the one user message."""
    fields = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}
    return {**fields, "stream": True, "temperature": 0, **more}


def ollama_chat_body(prompt: str, max_tokens: int, model: str, **more: Any) -> dict[str, Any]:
    """A streamed (Ollama's default), greedy Ollama ``/api/chat`` request: ``prompt`` as the
    one user message."""
    options = {"temperature": 0, "num_predict": max_tokens, "repeat_penalty": 1.0}
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "options": options, **more}


def request_bytes(
    port: int, payload: dict[str, Any], headers: dict[str, str] | None = None, path: str = COMPLETIONS
) -> bytes:
    """One HTTP/1.1 ``POST path`` with ``Connection: close``, ``headers`` last."""
    data = json.dumps(payload).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    head += f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    return (head + "\r\n").encode() + data


class RawStream:
    """One streamed POST on a plain socket, sent on construction. Events are split on blank
    lines and never parsed (no de-chunking, no JSON: a chunk size may precede an event's
    ``data:``), so the client's CPU per token stays small and the caller decides exactly
    when and how the connection ends. ``rcvbuf``: ``SO_RCVBUF``, set before connecting.
    ``path`` :data:`MESSAGES`: Anthropic events: a token is a ``content_block_delta``, the
    end ``message_stop``, the finish reason ``message_delta``'s ``stop_reason``. ``path``
    :data:`OLLAMA_CHAT`: NDJSON lines, split on newlines: a token is a ``"done":false``
    line with content, the end the ``"done":true`` line, the reason its ``done_reason``."""

    def __init__(
        self,
        port: int,
        payload: dict[str, Any],
        headers: dict[str, str] | None = None,
        *,
        rcvbuf: int | None = None,
        timeout: float = 10.0,
        path: str = COMPLETIONS,
    ) -> None:
        self.path, self.anthropic = path, path.split("?")[0] == MESSAGES
        self.ollama = path.split("?")[0] == OLLAMA_CHAT
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(timeout)
            self.sock.connect(("127.0.0.1", port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(request_bytes(port, payload, headers, path))
        except BaseException:
            self.sock.close()
            raise
        self.sent_at = time.perf_counter()
        self.head = b""  # the response's first bytes
        self.received, self.eof, self._pending = 0, False, b""
        self.events: list[tuple[float, bytes]] = []  # (arrival, event)
        self.done_at: float | None = None  # when ``data: [DONE]`` (Anthropic: ``message_stop``) arrived
        self._done_marker = MESSAGE_STOP if self.anthropic else b"data: [DONE]"
        self._separator = b"\n\n"
        if self.ollama:
            self._done_marker, self._separator = LINE_DONE, b"\n"

    def feed(self, data: bytes, now: float) -> list[bytes]:
        """Take bytes read from the socket; return the events they completed."""
        if len(self.head) < 16:
            self.head += data[:16]
        self.received += len(data)
        *complete, self._pending = (self._pending + data).split(self._separator)
        for event in complete:
            self.events.append((now, event))
            if self.done_at is None and self._done_marker in event:
                self.done_at = now
        return complete

    def receive(self, until: float | None = None, size: int = 1 << 20) -> bool:
        """One read, waiting at most until ``until`` (``perf_counter``); False at the end of
        the stream (EOF, reset) or when the time is up."""
        if until is not None:
            if (remaining := until - time.perf_counter()) <= 0:
                return False
            self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(size)
        except TimeoutError:
            return False
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.feed(data, time.perf_counter())
        return True

    def read_until(self, done: Callable[[], bool], until: float) -> bool:
        """Read until ``done()``, the end of the stream or ``until``; ``done()`` at the end."""
        while not done() and self.receive(until):
            pass
        return done()

    def iter_events(self, timeout: float = 300.0) -> Iterator[tuple[float, bytes]]:
        """``(arrival, event)`` as they come, to the end of the stream."""
        self.sock.settimeout(timeout)
        while data := self.sock.recv(1 << 20):
            now = time.perf_counter()
            for event in self.feed(data, now):
                yield now, event
        self.eof = True

    def done(self) -> bool:
        return self.done_at is not None

    @property
    def status(self) -> int | None:
        match = STATUS.match(self.head)
        return int(match.group(1)) if match else None

    def token_times(self) -> list[float]:
        """Arrival times of the events that carry a token (``finish_reason`` null; Anthropic:
        ``content_block_delta``)."""
        if self.anthropic:
            return [t for t, event in self.events if DELTA in event]
        if self.ollama:
            return [t for t, event in self.events if LINE_OPEN in event and EMPTY not in event]
        return [t for t, event in self.events if OPEN.search(event) and PROGRESS not in event]

    def data_events(self) -> int:
        """The events with data, but ``[DONE]`` and llama-server's progress (Anthropic: the
        ``content_block_delta`` events only, not ``message_start``, ``ping``…)."""
        if self.anthropic:
            return sum(DELTA in e for _, e in self.events)
        if self.ollama:
            return sum(LINE_OPEN in e and EMPTY not in e for _, e in self.events)
        return sum(b"data: " in e and b"[DONE]" not in e and PROGRESS not in e for _, e in self.events)

    def finish_reason(self) -> str | None:
        """The last ``finish_reason`` (Anthropic: ``stop_reason``, e.g. ``max_tokens``)."""
        pattern = STOP_REASON if self.anthropic else DONE_REASON if self.ollama else FINISH
        found = [m for _, event in self.events for m in pattern.findall(event)]
        return found[-1].decode() if found else None

    def end_cause(self) -> str | None:
        """trioserve's ``trioserve.end_cause`` of a stream cut short (``deadline``…)."""
        found = [m for _, event in self.events for m in END_CAUSE.findall(event)]
        return found[-1].decode() if found else None

    def unread(self) -> int:
        return unread_bytes(self.sock)

    def close(self, how: str = "fin") -> float:
        """Close (``rst``: ``SO_LINGER`` 0, the kernel sends a reset); the time right after."""
        if how == "rst":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        return time.perf_counter()


def slow_read(stream: RawStream, read_bytes: int, interval: float, duration: float, tick: Any) -> Any:
    """The slow reader: from the send on, read ``read_bytes`` every ``interval`` s for
    ``duration`` s without blocking (a read with nothing there reads nothing); call
    ``tick(t)`` at t = 1, 2, … before the read due then. Returns when the server closed."""
    t0, reads = stream.sent_at, [(interval * k, 1) for k in range(1, round(duration / interval) + 1)]
    timeline = sorted([(float(s), 0) for s in range(1, int(duration) + 1)] + reads)
    stream.sock.setblocking(False)
    for at, is_read in timeline:
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        if not is_read:
            tick(time.perf_counter() - t0)
            continue
        try:
            data = stream.sock.recv(read_bytes)
        except BlockingIOError:
            continue  # nothing there yet (prefill)
        if not data:
            return time.perf_counter() - t0
        stream.feed(data, time.perf_counter())
    return None


@dataclass
class Timed:
    """One streamed completion as a client saw it (:func:`timed_stream`)."""

    prompt: str
    t_call: float
    ttft_ms: float = float("nan")  # call → first chunk with text
    decode_tps: float = float("nan")  # (tokens − 1) / (last − first text chunk)
    total_s: float = 0.0
    tokens: int = 0
    token_source: str = ""
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None


Chunk = tuple[str, str | None, int | None]  # text, finish_reason, usage.completion_tokens


def timed_stream(prompt: str, max_tokens: int, chunks: Callable[[], Iterable[Chunk]]) -> Timed:
    """Call ``chunks()`` and time what it yields. Tokens: ``usage.completion_tokens`` when
    the stream carries it, else ``max_tokens`` on ``finish_reason == "length"``, else the
    number of chunks with text. An error is recorded, not raised."""
    result, first, last = Timed(prompt, time.perf_counter()), None, None
    texts, usage = [], None
    try:
        for text, finish, completion_tokens in chunks():
            now = time.perf_counter()
            if text:
                first, last = first or now, now
                texts.append(text)
            result.finish_reason = finish or result.finish_reason
            usage = completion_tokens if completion_tokens is not None else usage
    except Exception as exc:  # one failed stream must not hide the others
        result.error = f"{type(exc).__name__}: {exc}"
    result.total_s, result.text = time.perf_counter() - result.t_call, "".join(texts)
    if usage is not None:
        result.tokens, result.token_source = usage, "usage"
    elif result.finish_reason == "length":
        result.tokens, result.token_source = max_tokens, "finish_reason=length"
    else:
        result.tokens, result.token_source = len(texts), "text chunks"
    if first is None or last is None:
        result.error = result.error or "the stream carried no text"
    else:
        result.ttft_ms = (first - result.t_call) * 1e3
        result.decode_tps = (result.tokens - 1) / (last - first) if last > first else float("nan")
    return result


def sse_chunks(client: httpx.Client, url: str, payload: dict[str, Any]) -> Iterator[Chunk]:
    """POST ``payload`` to ``url`` with httpx and yield its SSE ``data:`` chunks."""
    with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue  # blank separators, comments (heartbeats), the end
            event = json.loads(data)
            tokens = (event.get("usage") or {}).get("completion_tokens")
            for choice in event.get("choices") or [{}]:
                yield choice.get("text") or "", choice.get("finish_reason"), tokens
