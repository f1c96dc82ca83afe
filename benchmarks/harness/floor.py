"""The floor of a streamed event: a bare ASGI app on hypercorn's Trio worker that writes
the same OpenAI-shaped ``chat.completion.chunk`` SSE events as ``trioserve serve
--scripted`` at the same pace, with no server logic (no engine, no thread, no dialect,
no metrics): what Trio + hypercorn + the socket cost (docs/benchmarks.md, "The cost of a
streamed event").

    python benchmarks/harness/floor.py --port 8123 [--interval 0.02]

``POST`` any path with a JSON body ``{"max_tokens": N, ...}``: a role chunk, ``N`` content
chunks (`` tok0``, `` tok1``, …) one per ``--interval`` s (0: as fast as the socket takes
them), a finish chunk, ``[DONE]``. ``GET /health``: 200.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_encode = msgspec.json.Encoder().encode


def app_for(interval: float) -> Any:
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
    args = p.parse_args()
    config = Config()
    config.bind = [f"127.0.0.1:{args.port}"]
    config.accesslog = None
    config.backlog = 1024
    trio.run(serve, app_for(args.interval), config)


if __name__ == "__main__":
    main()
