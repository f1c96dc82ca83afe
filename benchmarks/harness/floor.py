"""The floor of a streamed event: a bare ASGI app on hypercorn's Trio worker that writes
the same OpenAI-shaped ``chat.completion.chunk`` SSE events as ``trioserve serve
--scripted`` at the same pace, with no server logic (no engine, no thread, no dialect,
no metrics): what Trio + hypercorn + the socket cost (docs/benchmarks.md, "The cost of a
streamed event").

    python benchmarks/harness/floor.py --port 8123 [--interval 0.02] [--threaded]

``POST`` any path with a JSON body ``{"max_tokens": N, ...}``: a role chunk, ``N`` content
chunks (`` tok0``, `` tok1``, …) one per ``--interval`` s (0: as fast as the socket takes
them), a finish chunk, ``[DONE]``. ``GET /health``: 200.

``--threaded`` (paced only): each stream's events are made in a worker thread of its own
that waits out the interval and wakes the stream's task — with an eventfd the task parks
on (Linux; ``run_sync_soon`` elsewhere), the cheapest wake measured
(``scripts/probes/thread_wake.py``) and the one trioserve's ``PieceChannel`` uses — the least
a token made outside the event loop costs to reach it (trioserve's producers are worker
threads by design: one wake of the loop from another thread per event when the events
come at distinct moments). The floor of a server whose tokens come from a thread.

``--patched``: hypercorn with trioserve's two send patches (``_http/_hypercorn_patches``:
a send written at once once the request was read, a streamed chunk straight from the
ASGI send) — the floor as cheap as trioserve makes hypercorn. Without it, stock
hypercorn (the floor issue 53 defines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_encode = msgspec.json.Encoder().encode


class _ThreadPace:
    """A stream's events, paced in a worker thread: each one wakes the stream's task
    (parked in :meth:`next`) from the thread, as a producer thread wakes its consumer."""

    def __init__(self, tokens: int, interval: float) -> None:
        self.tokens = tokens
        self.interval = interval
        self.ready: deque[int] = deque()
        self.lock = threading.Lock()
        self.parked: Any = None
        self.stopped = False  # (the stream was cancelled: the thread stops at its next step)
        self.token = trio.lowlevel.current_trio_token()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if hasattr(os, "eventfd") else -1

    def close(self) -> None:
        """Once the thread has ended."""
        if self.fd >= 0:
            os.close(self.fd)

    def _wake(self) -> None:
        task, self.parked = self.parked, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def produce(self) -> None:
        next_at = time.monotonic()
        for i in range(self.tokens):
            if self.stopped:
                return
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))
            with self.lock:
                self.ready.append(i)
            if self.fd >= 0:
                os.eventfd_write(self.fd, 1)
            else:
                self.token.run_sync_soon(self._wake)

    async def next(self) -> list[int]:
        while True:
            with self.lock:
                if self.ready:
                    batch = list(self.ready)
                    self.ready.clear()
                    return batch
            if self.fd >= 0:
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.Cancelled:
                    self.stopped = True
                    raise
                os.eventfd_read(self.fd)
                continue
            self.parked = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self.parked = None
                self.stopped = True
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)


_THREADS = trio.CapacityLimiter(4096)


def app_for(interval: float, threaded: bool = False) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        tokens = int(json.loads(body).get("max_tokens", 16))
        head = b'{"id":"chatcmpl-' + uuid.uuid4().hex.encode() + b'","object":"chat.completion.chunk",'
        head += b'"created":' + str(int(time.time())).encode() + b',"model":"scripted"'
        prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
        suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        role = b"data: " + head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        await send(
            {
                "type": "http.response.body",
                "body": role + b'"logprobs":null,"finish_reason":null}]}\n\n',
                "more_body": True,
            }
        )
        if threaded and interval:
            pace = _ThreadPace(tokens, interval)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(trio.to_thread.run_sync, pace.produce, limiter=_THREADS))
                    sent = 0
                    while sent < tokens:
                        for i in await pace.next():
                            data = prefix + _encode(f" tok{i}") + suffix
                            await send({"type": "http.response.body", "body": data, "more_body": True})
                            sent += 1
            finally:
                pace.close()
        else:
            next_at = trio.current_time()
            for i in range(tokens):
                if interval:
                    next_at += interval
                    await trio.sleep_until(next_at)
                data = prefix + _encode(f" tok{i}") + suffix
                await send({"type": "http.response.body", "body": data, "more_body": True})
        finish = (
            b"data: "
            + head
            + b',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n'
        )
        await send({"type": "http.response.body", "body": finish + b"data: [DONE]\n\n", "more_body": False})

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval", type=float, default=0.02, help="seconds per event (0: full speed)")
    p.add_argument("--threaded", action="store_true", help="pace each stream in a worker thread")
    p.add_argument("--patched", action="store_true", help="hypercorn with trioserve's send patches")
    args = p.parse_args()
    if args.patched:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from trioserve._http._hypercorn_patches import patch_hypercorn_chunks, patch_hypercorn_send

        if not (patch_hypercorn_send() and patch_hypercorn_chunks()):
            raise SystemExit("trioserve's hypercorn patches did not apply")
    config = Config()
    config.bind = [f"127.0.0.1:{args.port}"]
    config.accesslog = None
    config.backlog = 1024
    trio.run(serve, app_for(args.interval, args.threaded), config)


if __name__ == "__main__":
    main()
