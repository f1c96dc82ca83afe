"""Embed trioserve's HTTP API in your own Trio program, next to your own tasks and your
own quart-trio routes.

    python examples/embed_server.py

One hypercorn server serves both your app (here ``GET /hello``) and trioserve's API
(``/v1/...``, ``/health``, ``/metrics``, ``/``), dispatched by path. A task of yours runs
beside it — here, a client that asks the API for a completion through the official
``openai`` SDK and then shuts everything down. Cancelling the nursery (Ctrl-C, or your
own logic) cancels the server and every request in flight.
"""

from __future__ import annotations

import httpx
import hypercorn
import hypercorn.trio
import trio
from openai import AsyncOpenAI
from quart_trio import QuartTrio

from trioserve import Engine, ScriptedBackend, ServerState, create_app


def build_app(state: ServerState) -> object:
    mine = QuartTrio(__name__)

    @mine.get("/hello")
    async def hello() -> str:
        return "hello from your own app"

    llm = create_app(state)

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if (scope["type"] == "http" and scope["path"] == "/hello") or scope["type"] == "lifespan":
            await mine(scope, receive, send)
        else:
            await llm(scope, receive, send)

    return app


async def my_task(url: str, cancel_scope: trio.CancelScope) -> None:
    # openai's async client runs on Trio through anyio
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused") as client:
        completion = await client.completions.create(model="scripted", prompt="Say hi", max_tokens=5)
        print("completion:", completion.choices[0].text.strip())
    cancel_scope.cancel()  # done: stop the server too


async def main() -> None:
    # The scripted backend keeps the example fast; use LlamaBackend.aload(...) for a model.
    engine = Engine(ScriptedBackend([b" hi", b" there", b"!"]))
    state = ServerState()
    state.set_engine(engine)
    config = hypercorn.Config()
    config.bind = ["127.0.0.1:0"]
    async with engine, trio.open_nursery() as nursery:
        binds = await nursery.start(hypercorn.trio.serve, build_app(state), config)
        print("serving on", binds[0])
        async with httpx.AsyncClient(base_url=binds[0]) as client:
            print("your route:", (await client.get("/hello")).text)
            print("trioserve health:", (await client.get("/health")).json()["status"])
        await my_task(binds[0], nursery.cancel_scope)
    print("stopped cleanly")


if __name__ == "__main__":
    trio.run(main)
