"""Helpers shared by the test modules."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, TRIOSERVE, command, free_port, trioserve_command
from benchmarks.harness.servers import Server as HarnessServer
from trioserve import Backend, Engine, HTTPSettings, LlamaBackend, LlamaSettings, Server, ServerSettings

from . import _openai_validation as openai_validation


async def wait_for(predicate: Callable[[], object], limit: float = 10.0, step: float = 0.005) -> None:
    """Wait until ``predicate()`` is true. Tests observe the server's state from the
    outside, so they poll it; the server itself never polls."""
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - see the docstring
            await trio.sleep(step)


def verifying(
    backend: LlamaBackend, fast: LlamaSettings, describe: Callable[[LlamaBackend], str] = repr
) -> Iterator[LlamaBackend]:
    """A fixture's body: ``backend`` where a verify call is exact on this CPU (``--speculate
    auto`` speculates there); on a CPU where none is (measured width 1: auto never
    speculates), a backend loaded from ``fast`` (settings with ``speculate="fast"``, which
    verifies several tokens a call on any CPU) — a verify call is reached either way."""
    if backend.speculation_stats()["verify_width"] != 1:
        yield backend
        return
    assert fast.speculate == "fast"
    loaded = LlamaBackend.load(fast)
    print(f"\nno verify call is exact on this CPU: verify calls run on --speculate fast ({describe(loaded)})")
    try:
        yield loaded
    finally:
        loaded.close()


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
                        health["generations_running"] == 0
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
        cls,
        url: str,
        path: str,
        body: dict[str, object],
        headers: dict[str, str] | None = None,
        *,
        receive_buffer: int | None = None,
    ) -> RawStream:
        """Send a POST. ``receive_buffer``: a small SO_RCVBUF, set before connecting so
        the advertised window stays small (a client that reads slowly or not at all)."""
        import json
        import socket
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((parts.hostname, parts.port))
        stream = trio.SocketStream(sock)
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

    async def read_to_eof_or(self, end: bytes) -> bytes:
        """Read until the connection closes or the data ends with ``end``."""
        while not self.received.endswith(end):
            try:
                chunk = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:  # reset by the server
                break
            if not chunk:
                break
            self.received += chunk
        return self.received

    async def aclose(self) -> None:
        await self.stream.aclose()


async def read_events_and_close(raw: RawStream, events: int) -> tuple[Any, bytes]:
    """Read the response on ``raw`` (its body de-chunked, by h11) until ``events`` SSE
    events have come or the body ended, then close the connection: a client that
    drops a stream. Returns the response's head (an ``h11.Response``) and the body
    bytes received."""
    import h11

    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    parser.send(h11.EndOfMessage())
    head: Any = None
    received = b""
    try:
        while received.count(b"\n\n") < events:
            chunk = await raw.stream.receive_some(65536)
            assert chunk, (head, received)
            parser.receive_data(chunk)
            while (event := parser.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    received += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return head, received
    finally:
        await raw.aclose()
    return head, received


class ServerProcess:
    """``trioserve serve`` in a subprocess, the way a user runs it: the benchmarks'
    launcher (:class:`benchmarks.harness.servers.Server`) on a free port of 127.0.0.1,
    stdout and stderr in a log file that outlives the process (:attr:`log`)."""

    def __init__(self, *args: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="trioserve-test-"))
        port = free_port()
        # run through tests/_openai_validation.py: every generation response it sends is
        # checked against the openai SDK's types, into a file the running test reads
        self._checks = openai_validation.ProcessLog(self._dir / "openai-validation.jsonl")
        command = trioserve_command(port, *args)
        assert command[:3] == [sys.executable, "-m", "trioserve"], command
        command = [*openai_validation.script_command(self._checks.path), *command[3:]]
        self.server = HarnessServer(TRIOSERVE, command, port, self._dir)
        openai_validation.process_logs.append(self._checks)
        self.url = self.server.url
        self._log: str | None = None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.server.proc

    @property
    def log(self) -> list[str]:
        """The server's output so far, as lines (each with its newline)."""
        return (self._log if self._log is not None else self.server.log_text()).splitlines(keepends=True)

    def wait_ready(self, timeout: float = 120.0) -> str:
        """Block until ``/health`` answers 200 (the model is loaded); return the URL."""
        self.server.wait_ready(timeout)
        return self.url

    def stop(self, signum: int | None = None, timeout: float = 30.0) -> int:
        """Send ``signum`` (SIGTERM), wait ``timeout`` s for the exit (else kill and raise)."""
        self.process.send_signal(signum or signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.server.stop()  # (closes the log)
        self._log = self.server.log_text()
        openai_validation.process_logs.remove(self._checks)
        responses, violations = self._checks.drain()
        shutil.rmtree(self._dir, ignore_errors=True)
        collector = openai_validation.current
        if collector is not None:  # inside a test: its teardown reports them
            collector.responses += responses
            collector.violations += violations
        elif violations and exc_info[0] is None:  # a module's server: fail its last test
            last = openai_validation.Collector("the server process's last responses", violations=violations)
            raise AssertionError(last.failure())


class H2Stream:
    """One request on an HTTP/2 (prior knowledge, cleartext) connection, driven by the
    ``h2`` state machine over a raw trio socket, so a test can reset the stream."""

    def __init__(self, stream: trio.SocketStream, connection: object, stream_id: int) -> None:
        self.stream = stream
        self.connection = connection
        self.stream_id = stream_id
        self.data = b""
        self.headers: dict[bytes, bytes] = {}
        self.ended = False

    @classmethod
    async def post(
        cls,
        url: str,
        path: str,
        body: dict[str, object],
        headers: dict[str, str] | None = None,
        window: int | None = None,
    ) -> H2Stream:
        """Send the request. ``window``: the flow-control window the client grants
        (a small one makes the server block once it is full)."""
        import json
        from urllib.parse import urlsplit

        import h2.config
        import h2.connection
        import h2.settings

        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        connection.initiate_connection()
        if window is not None:
            connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        payload = json.dumps(body).encode()
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":path", path),
                (":scheme", "http"),
                (":authority", parts.netloc),
                ("content-type", "application/json"),
                ("content-length", str(len(payload))),
                *((k.lower(), v) for k, v in (headers or {}).items()),
            ],
        )
        connection.send_data(stream_id, payload, end_stream=True)
        await stream.send_all(connection.data_to_send())
        return cls(stream, connection, stream_id)

    async def read_until(self, marker: bytes, count: int = 1, *, acknowledge: bool = True) -> bytes:
        """Read until ``marker`` appears ``count`` times in the body (or the stream ends).
        ``acknowledge=False`` withholds WINDOW_UPDATEs, like a client that stops reading."""
        import h2.events

        connection: Any = self.connection
        while self.data.count(marker) < count and not self.ended:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                break
            for event in connection.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    self.headers = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived) and event.stream_id == self.stream_id:
                    self.data += event.data
                    if acknowledge:
                        connection.acknowledge_received_data(event.flow_controlled_length, self.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    self.ended = True
            await self.stream.send_all(connection.data_to_send())
        return self.data

    async def reset(self) -> None:
        """RST_STREAM (CANCEL) for this request; the connection stays open."""
        import h2.errors

        connection: Any = self.connection
        connection.reset_stream(self.stream_id, h2.errors.ErrorCodes.CANCEL)
        await self.stream.send_all(connection.data_to_send())

    async def aclose(self) -> None:
        await self.stream.aclose()


async def leave_during_the_first_embedding_call(
    url: str, embedder: Any, inputs: list[str]
) -> tuple[int, float]:
    """POST ``inputs`` to ``url``/v1/embeddings on a raw socket, close it once the
    embedding context's first call of the request is running, and wait until the
    embedder's lock is free: ``(llama_decode calls made, seconds from the close)``."""
    before = embedder.context.calls if embedder.context is not None else 0
    client = await RawStream.post(url, "/v1/embeddings", {"input": inputs})
    await wait_for(lambda: embedder.context is not None and embedder.context.calls > before, limit=60)
    await client.aclose()
    left = trio.current_time()
    await wait_for(lambda: not embedder.busy, limit=5)
    stopped_after = trio.current_time() - left
    assert embedder.context is not None
    return embedder.context.calls - before, stopped_after


def llama_server_command(model: Path, port: int, extra: list[str]) -> list[str]:
    """The harness's llama-server command line. Its binary: ``$TRIOSERVE_LLAMA_SERVER``,
    else the path that ``scripts/build-llama-server`` prints (building it if it is not
    cached). Fails the test, saying how to get the binary, if neither works."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "build-llama-server"
    try:
        argv = command(LLAMA_SERVER, model, port, threads=2, ctx_size=4096, extra=extra)
    except subprocess.CalledProcessError as exc:
        pytest.fail(
            f"llama.cpp's llama-server is missing and {script} could not build it "
            f"(exit {exc.returncode}); run it by hand (needs cmake and a C++ compiler) or set "
            f"TRIOSERVE_LLAMA_SERVER:\n{(exc.stderr or '')[-3000:]}"
        )
    except (OSError, IndexError) as exc:  # (IndexError: it printed nothing)
        pytest.fail(f"could not run {script} to get llama.cpp's llama-server: {exc!r}")
    if not os.access(argv[0], os.X_OK):
        given = "TRIOSERVE_LLAMA_SERVER=" if os.environ.get("TRIOSERVE_LLAMA_SERVER") else f"{script} gave "
        pytest.fail(f"{given}{argv[0]} is not an executable file")
    return argv
