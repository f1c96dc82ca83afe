"""Helpers for testing your own code against trioserve, in pytest-trio suites.

``async with open_test_server(...) as server`` runs a real server (hypercorn on
127.0.0.1, a free port; ``server.url``, ``server.engine``) for the body of the block,
with the scripted backend unless you pass another: fast and deterministic. An exception
raised in the body comes out as itself; a backend that fails to load raises
``RuntimeError`` with the reason. Example: ``docs/embedding.md``, "Testing your code
against trioserve".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from ._backends import Backend, ScriptedBackend
from ._core._engine import Engine
from ._core._errors import unwrap_group
from ._http._server import Server, ServerSettings

__all__ = ["TestServer", "open_test_server"]


@dataclass(frozen=True, kw_only=True)
class TestServer:
    """A running test server: ``url`` (``http://127.0.0.1:PORT``), the ``server`` and
    its ``engine`` (for assertions on slots, queue and streams)."""

    __test__ = False  # not a pytest test class

    url: str
    server: Server
    engine: Engine


@asynccontextmanager
async def open_test_server(
    backend: Backend | None = None,
    *,
    script: Sequence[bytes] | None = None,
    token_interval: float = 0.0,
    settings: ServerSettings | None = None,
) -> AsyncIterator[TestServer]:
    """Serve ``backend`` (default: a :class:`ScriptedBackend` emitting ``script``, one
    piece per ``token_interval`` seconds) on a free port for the body of the block.

    Cancellation: leaving the block — normally or by a cancel — shuts the server down
    with no grace period: in-flight requests are cancelled and get their final event.
    """
    chosen = backend or ScriptedBackend(script, token_interval=token_interval)

    async def load() -> Backend:
        return chosen

    settings = settings or ServerSettings()
    settings.host, settings.port, settings.shutdown_grace = "127.0.0.1", 0, 0.0
    server = Server(load, settings)
    with unwrap_group():  # an exception in the body comes out as itself
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(server.run)
            await server.ready.wait()
            if server.engine is None:
                raise RuntimeError(
                    f"the test server's backend failed to load: {server.registry.default.error}"
                )
            try:
                yield TestServer(url=binds[0], server=server, engine=server.engine)
            finally:
                server.shutdown()
