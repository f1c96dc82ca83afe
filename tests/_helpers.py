"""Helpers shared by the test modules."""

from __future__ import annotations

import httpx
import trio

from trioserve import Backend, Engine, HTTPSettings, Server, ServerSettings


class RunningServer:
    def __init__(self, server: Server, url: str) -> None:
        self.server = server
        self.url = url

    @property
    def engine(self) -> Engine:
        assert self.server.engine is not None
        return self.server.engine

    def client(self, **kwargs: object) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60, **kwargs)  # type: ignore[arg-type]

    async def wait_idle(self, limit: float = 10.0) -> dict[str, object]:
        """Wait until the server reports no thread, slot or stream in use; return /health."""
        async with self.client() as client:
            with trio.fail_after(limit):
                while True:
                    health: dict[str, object] = (await client.get("/health")).json()
                    if (
                        health["inference_threads"] == 0
                        and health["slots_in_use"] == 0
                        and health["active_streams"] == 0
                        and health["requests_in_flight"] == 0
                        and health["queued"] == 0
                    ):
                        return health
                    await trio.sleep(0.005)


async def start_server(
    nursery: trio.Nursery, backend: Backend, *, close_backend: bool = False, **settings: object
) -> RunningServer:
    """Start a real hypercorn server on 127.0.0.1 (free port) around ``backend``."""
    http = settings.pop("http", HTTPSettings())

    async def load() -> Backend:
        return backend

    server = Server(
        load,
        ServerSettings(host="127.0.0.1", port=0, http=http, **settings),  # type: ignore[arg-type]
        close_backend=close_backend,
    )
    binds = await nursery.start(server.run)
    await server.ready.wait()
    return RunningServer(server, binds[0])


class RawStream:
    """A minimal HTTP/1.1 client on a raw trio socket, for tests that must control the
    connection exactly: read some events, then close, half-close or stop reading."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = b""

    @classmethod
    async def post(
        cls, url: str, path: str, body: dict[str, object], headers: dict[str, str] | None = None
    ) -> RawStream:
        import json
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            + "\r\n"
        )
        await stream.send_all(head.encode() + payload)
        return cls(stream)

    async def read_until(self, marker: bytes, count: int = 1) -> bytes:
        """Read until ``marker`` has been seen ``count`` times in the response."""
        while self.received.count(marker) < count:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                break
            self.received += chunk
        return self.received

    async def read_to_eof(self) -> bytes:
        while chunk := await self.stream.receive_some(65536):
            self.received += chunk
        return self.received

    async def aclose(self) -> None:
        await self.stream.aclose()


class ServerProcess:
    """``trioserve serve`` in a subprocess, the way a user runs it."""

    def __init__(self, *args: str) -> None:
        import subprocess
        import sys

        self.process = subprocess.Popen(
            [sys.executable, "-m", "trioserve", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        self.url = ""

    def wait_ready(self, timeout: float = 120.0) -> str:
        """Block until the log says the model is ready; return the URL."""
        import re
        import time

        assert self.process.stderr is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError("the server exited:\n" + "".join(self.log))
            self.log.append(line)
            if match := re.search(r"listening on (http://\S+)", line):
                self.url = match.group(1)
            if "ready:" in line:
                return self.url
        raise TimeoutError("the server did not get ready:\n" + "".join(self.log))

    def stop(self, signum: int | None = None, timeout: float = 30.0) -> int:
        import signal

        self.process.send_signal(signum or signal.SIGTERM)
        try:
            _, rest = self.process.communicate(timeout=timeout)
        except Exception:
            self.process.kill()
            self.process.wait()
            raise
        self.log.append(rest or "")
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
