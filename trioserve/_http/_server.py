"""Serving: hypercorn's trio worker, tuned sockets, model loading, and the shutdown
sequence.

:class:`Server` listens before the model loads and owns the shutdown trigger: on
:meth:`Server.shutdown` it refuses new requests (503), stops accepting, gives in-flight
requests ``shutdown_grace`` seconds, then cancels each with cause ``shutdown`` (the
client gets a final event) and closes the engine; a cancel of ``Server.run`` skips the
grace. Why the server, not hypercorn, owns it: ``docs/operations.md``, "Shutdown".
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import hypercorn
import trio
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from .._core._backend import Backend
from .._core._engine import Engine
from .._core._errors import unwrap_group
from .._core._registry import BackendSource, ModelEntry, ModelRegistry, ModelSpec
from ._access import AccessPolicy
from ._accounts import Account, Accounts, KeysFile, parse_keys_file
from ._detach import DetachedStreams, DetachSettings, keys_refusal, open_detached_streams
from ._generation import FINAL_EVENT_TIMEOUT
from ._hypercorn_patches import (
    patch_hypercorn_chunks,
    patch_hypercorn_connection_registry,
    patch_hypercorn_h2_backpressure,
    patch_hypercorn_send,
)
from ._routes import create_app
from ._settings import HTTPSettings
from ._speech_service import SpeechService, SpeechSource
from ._state import ModelMaker, ServerState
from ._stored import StoredResponses, open_stored_responses
from ._tracing import Tracing

__all__ = ["Server", "ServerSettings", "serve_until_signalled"]

logger = logging.getLogger("trioserve.server")

# Linux values; the socket module does not name them all
_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def tune_listening_socket(sock: socket.socket, settings: ServerSettings) -> None:
    """Socket options that accepted connections inherit from the listening socket.

    hypercorn's trio worker sends inside a *shielded* cancel scope, so no cancel can
    interrupt a send to a client that has stopped reading. trioserve's stall timer
    shuts such a connection down itself (``_http/_generation.py``); as a backstop,
    ``TCP_USER_TIMEOUT`` makes the kernel reset a connection whose peer accepts no data
    for four times the stall timeout (+ 10 s). ``TCP_NOTSENT_LOWAT`` bounds the bytes
    waiting in the kernel to be sent, so a slow reader pauses inference after a few KiB
    instead of after megabytes of autotuned send buffer.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, settings.send_buffer_bytes)
        if settings.stall_timeout is not None:
            # a backstop only: trioserve's own stall timer ends a stalled connection
            # stall_timeout after a send blocks (and records why). The kernel's clock
            # starts earlier — when the client's window closes, before the buffers fill
            # and a send blocks — so the backstop must be well behind ours.
            backstop = 4 * settings.stall_timeout + 10.0
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT, int(backstop * 1000))
    except OSError as exc:  # pragma: no cover - not Linux
        logger.warning("could not set flow-control socket options: %s", exc)


BackendLoader = Callable[[], Awaitable[Backend]]


@dataclass(kw_only=True)
class ServerSettings:
    """Where and how to serve.

    Attributes:
        host, port: the address to bind (port 0 picks a free port).
        max_queue: requests that may wait for a slot before new ones get 429 (paused
            requests wait too).
        pause_ram_bytes: bytes the saved states of paused requests may hold (one
            budget for the models of a server built from a loader); a pause beyond
            it is not asked: the better-ranked request waits in the queue.
        shutdown_grace: seconds in-flight requests get to finish after a shutdown
            request before they are cancelled.
        stall_timeout: a client that accepts no bytes for this long while the server
            has bytes for it is cut off (trioserve's stall timer resets the connection;
            the log says ``stall``); ``None``: never.
        backlog: connections the kernel queues for ``accept`` (``listen``'s backlog;
            the kernel caps it at ``net.core.somaxconn``). hypercorn's default, 100, made
            the 101st of a burst of connections wait for the client's SYN retransmit:
            a second (docs/benchmarks.md, "A second for the 101st connection").
        send_buffer_bytes: bound on bytes queued in the kernel, not yet sent, per
            connection (``TCP_NOTSENT_LOWAT``): past it, the server's send waits, the
            consumer waits, and so does inference.
        api_keys: bearer keys for ``/v1/*`` and ``/metrics`` (none: open).
        admin_keys: keys that are API keys and may also change a model's lifetime for
            everyone: ``POST /models/load``, ``POST /models/unload``, ``X-Keep-Alive``
            (with keys configured, other keys get 403 there; with none, anyone may).
        cors_origins: browser origins allowed to call the API (``*``: any; none: CORS off).
        keys_file: a TOML file of API keys with their priorities, fair-share weights
            and limits (docs/operations.md, "Keys, priorities and limits"); read again
            on ``SIGHUP`` (:meth:`Server.reload_keys`). Given, keys are always required,
            even while it holds none.
        allow_empty_keys_reload: let a reload leave no key where there are keys (every
            keyed request then gets 401); by default such a reload is refused.
        http: limits and defaults of the HTTP surface.
        detach: the bounds of resumable streams (``None``: none are kept;
            docs/resumable-streams.md).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 16
    pause_ram_bytes: int = 1 << 30
    shutdown_grace: float = 10.0
    stall_timeout: float | None = 30.0
    send_buffer_bytes: int = 16 * 1024
    backlog: int = 2048
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    keys_file: Path | None = None
    allow_empty_keys_reload: bool = False
    http: HTTPSettings = field(default_factory=HTTPSettings)
    detach: DetachSettings | None = field(default_factory=DetachSettings)


class Server:
    """A trioserve HTTP server. Run it with ``await nursery.start(server.run)``.

    Args:
        models: the models to serve — a :class:`~trioserve._core._registry.ModelRegistry`
            (docs/models.md), or an async function returning one backend (one model,
            loaded at startup, pinned: the single-model server).
        settings: address, queue and shutdown settings.
        close_backend: (with a loader) close the backend when the server stops (turn off
            to share one loaded backend between servers, as the tests do).
        model_maker: how a model added while it serves (Ollama's ``/api/create``) is
            loaded (``None``: ``/api/create`` answers 501).
        speech: the text-to-speech model (``POST /v1/audio/speech``; docs/audio.md,
            "Speech"): loaded in a worker thread at start (:attr:`ready` waits for it),
            closed at shutdown (``None``: the route answers 400 ``speech_not_supported``).
    """

    def __init__(
        self,
        models: BackendLoader | ModelRegistry,
        settings: ServerSettings | None = None,
        *,
        close_backend: bool = True,
        model_maker: ModelMaker | None = None,
        speech: SpeechSource | None = None,
    ) -> None:
        self.settings = settings or ServerSettings()
        stall = self.settings.stall_timeout
        if stall is not None and not stall > 0:
            raise ValueError(f"stall_timeout must be positive seconds or None (never), got {stall}")
        if isinstance(models, ModelRegistry):
            self.registry = models
        else:
            spec = ModelSpec(
                name="",
                source=BackendSource(models, description=""),
                aliases=self.settings.http.model_aliases,
                pinned=True,
                preload=True,
                ready_gate=True,
            )
            self.registry = ModelRegistry(
                [spec],
                max_queue=self.settings.max_queue,
                pause_ram=self.settings.pause_ram_bytes,
                close_backends=close_backend,
            )
        #: set once the startup models have loaded (or failed to: see ``/health``)
        self.ready = trio.Event()
        #: set when :meth:`run` has finished: every request and the backend are closed
        self.stopped = trio.Event()
        http = self.settings.http
        keys_file = self.settings.keys_file
        keys = parse_keys_file(keys_file.read_text()) if keys_file is not None else None
        refusal = None if keys is None else keys_refusal(keys, self.settings.detach)
        if refusal is not None:
            raise ValueError(refusal)
        accounts = Accounts(keys, keys_file)
        if keys is None and (self.settings.api_keys or self.settings.admin_keys):
            # keys without a file: each may lower its priority (0), never raise it
            accounts = Accounts(KeysFile(Account(min_priority=0)))
        self.state = ServerState(
            settings=http,
            stall_timeout=self.settings.stall_timeout,
            tracing=Tracing(http.otlp_endpoint, service=http.service_name),
            accounts=accounts,
            model_maker=model_maker,
            speech=None if speech is None else SpeechService(speech, max_queue=self.settings.max_queue),
        )
        self.state.metrics.bind_registry(self.registry)
        self.state.metrics.bind_detached(
            lambda: None if self.state.detached is None else self.state.detached.counts()
        )
        self.registry.on_unloaded.append(lambda _entry, engine: self.state.forget(engine))
        self._last_engine: Engine | None = None

        def loaded(entry: ModelEntry) -> None:
            if entry is self.registry.default:
                self._last_engine = entry.engine

        self.registry.on_loaded.append(loaded)
        self.access = AccessPolicy(
            self.settings.api_keys,
            self.settings.cors_origins,
            admin_keys=self.settings.admin_keys,
            keys_file=keys,
        )
        self.app = create_app(self.state, self.access)
        self._stop_accepting = trio.Event()
        self._shutdown_requested = trio.Event()

    @property
    def engine(self) -> Engine | None:
        """The default model's engine, once loaded (after the server stopped: the last
        one, closed, for what its counters say)."""
        return self.registry.default.engine or self._last_engine

    def reload_keys(self) -> bool:
        """Read the keys file again (what ``SIGHUP`` does): its keys, priorities,
        weights and limits hold for the requests to come. A file that fails to parse,
        or that would leave no key where there are keys (unless
        ``allow_empty_keys_reload``), or whose resumable streams' bounds are over the
        flags' (:func:`~._detach.keys_refusal`), is refused: logged, the keys in force stay.
        Whether it was replaced."""
        accounts = self.state.accounts
        allow_empty = self.settings.allow_empty_keys_reload
        detach = self.settings.detach

        def refusal(keys: KeysFile) -> str | None:
            return self.access.reload_refusal(keys, allow_empty=allow_empty) or keys_refusal(keys, detach)

        if not accounts.reload(refusal):
            return False
        self.access.use(accounts.file)
        return True

    def shutdown(self) -> None:
        """Begin a graceful shutdown (idempotent; safe from any Trio task)."""
        self._shutdown_requested.set()

    def _hypercorn_config(self) -> hypercorn.Config:
        config = hypercorn.Config()
        config.bind = [f"{self.settings.host}:{self.settings.port}"]
        config.accesslog = None  # one line per request comes from trioserve itself
        config.errorlog = logging.getLogger("trioserve.hypercorn")
        # hypercorn's own cancel must come after ours (grace + time for final events)
        config.graceful_timeout = self.settings.shutdown_grace + 2.0
        # hypercorn holds a closed-by-peer socket until its keep-alive timer ends;
        # keep it short (its default; httpx's pool expires idle connections at 5 s too)
        config.keep_alive_timeout = 5.0
        config.backlog = self.settings.backlog
        # hypercorn bounds what it buffers of a head; the app checks complete heads
        config.h11_max_incomplete_size = self.settings.http.max_header_bytes
        config.h2_max_header_list_size = self.settings.http.max_header_bytes
        return config

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`shutdown` is called (or this task is cancelled).

        ``task_status.started`` reports the bound URLs as soon as the socket listens;
        the startup models load afterwards. Cancellation: cancelling this task skips the
        grace period — in-flight requests are cancelled at once, loads are aborted and
        every model is closed.
        """
        try:
            with unwrap_group():
                await self._serve(task_status)
        finally:
            logger.info("stopped")
            self.stopped.set()

    async def _serve(self, task_status: trio.TaskStatus[list[str]]) -> None:
        async with trio.open_nursery() as nursery:
            patch_hypercorn_h2_backpressure()
            patch_hypercorn_connection_registry()
            patch_hypercorn_send()
            patch_hypercorn_chunks()
            config = self._hypercorn_config()
            sockets = config.create_sockets()
            for sock in sockets.insecure_sockets:
                tune_listening_socket(sock, self.settings)
                sock.listen(config.backlog)  # worker_serve listens only on sockets it made
            binds: list[str] = await nursery.start(
                lambda task_status: worker_serve(
                    wrap_app(self.app, config.wsgi_max_body_size, "asgi"),  # type: ignore[arg-type]
                    config,
                    sockets=sockets,
                    shutdown_trigger=self._stop_accepting.wait,
                    task_status=task_status,
                )
            )
            task_status.started(binds)
            try:
                # the registry closes (loads aborted, engines closed) after the drain;
                # one its owner already runs stays theirs
                running = contextlib.nullcontext() if self.registry.running else self.registry
                async with running, self._stored_responses() as responses, self._detached() as detached:
                    # (background responses run in its nursery, detached streams in
                    # theirs: the drain below ends them)
                    self.state.responses = responses
                    self.state.detached = detached
                    self.state.registry = self.registry
                    speech = self.state.speech
                    if speech is not None:
                        nursery.start_soon(speech.load)
                    nursery.start_soon(self._announce, binds)
                    try:
                        await self._shutdown_requested.wait()
                        # not shielded: a second signal (a cancel) cuts the grace period short
                        await self._drain(self.settings.shutdown_grace)
                    finally:
                        with trio.CancelScope(shield=True):
                            await self._drain(0.0)
                            if speech is not None:
                                await speech.aclose()
            finally:
                nursery.cancel_scope.cancel()
                if self.state.tracing.enabled:
                    with trio.CancelScope(shield=True):  # (what is left goes out; bounded)
                        await trio.to_thread.run_sync(self.state.tracing.shutdown)

    def _detached(self) -> contextlib.AbstractAsyncContextManager[DetachedStreams | None]:
        """The detachable streams, unless the settings keep none."""
        if self.settings.detach is None:
            return contextlib.nullcontext()
        return open_detached_streams(self.settings.detach, self.settings.http.heartbeat_interval)

    def _stored_responses(self) -> contextlib.AbstractAsyncContextManager[StoredResponses | None]:
        """The stored Responses, if the settings keep any (``responses_db``)."""
        http = self.settings.http
        if http.responses_db is None:
            return contextlib.nullcontext()
        failures = self.state.metrics.response_store_failures
        return open_stored_responses(
            http.responses_db,
            max_age=http.responses_max_age,
            max_bytes=http.responses_max_bytes,
            max_key_bytes=http.responses_max_key_bytes,
            on_failure=lambda kind: failures.labels(reason=kind).inc(),
        )

    async def _announce(self, binds: list[str]) -> None:
        """Set :attr:`ready` once every startup model has loaded or failed; log it."""
        preloads = [entry for entry in self.registry.entries if entry.spec.preload]
        while any(entry.state == "loading" for entry in preloads):
            await self.registry.changed()
        for entry in preloads:
            if entry.state == "loaded" and entry.engine is not None:
                backend = entry.engine.backend
                logger.info(
                    "ready: model %s (context %d, %d slot(s)) at %s",
                    entry.name,
                    backend.info.context_length,
                    backend.slots,
                    ", ".join(binds),
                )
            else:
                logger.error("the model %s failed to load: %s", entry.name or "", entry.error)
        speech = self.state.speech
        if speech is not None:
            await speech.settled.wait()
        if not preloads:
            names = ", ".join(entry.name for entry in self.registry.entries)
            count = len(self.registry.entries)
            logger.info("ready: %d model(s), loaded on demand (%s), at %s", count, names, ", ".join(binds))
        self.ready.set()

    async def _drain(self, grace: float) -> None:
        """Stop accepting, give in-flight requests ``grace`` seconds, then cancel them
        with cause ``shutdown`` and wait (bounded) for their final events to go out."""
        state = self.state
        if not state.shutting_down:
            state.shutting_down = True
            self._stop_accepting.set()
            logger.info("shutting down: %d request(s) in flight, grace %.1f s", len(state.requests), grace)
            if state.detached is not None:
                state.detached.cancel_unread("shutdown")  # (nobody waits for them)
        with trio.move_on_after(grace):
            await state.wait_idle()
        if state.requests:
            logger.info("cancelling %d request(s) still in flight", len(state.requests))
            state.cancel_all("shutdown")
            with trio.move_on_after(FINAL_EVENT_TIMEOUT + 1.0):
                await state.wait_idle()


async def serve_until_signalled(
    server: Server, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run ``server``; SIGINT or SIGTERM starts a graceful shutdown, a second signal
    cuts the grace period short; SIGHUP reads the keys file again."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
                await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # served out: stop listening for signals

            binds = await nursery.start(run_server)
            task_status.started(binds)
            received = 0
            async for signum in signals:
                if signum == signal.SIGHUP:
                    server.reload_keys()
                    continue
                received += 1
                if received == 1:
                    logger.info("%s: shutting down gracefully", signal.Signals(signum).name)
                    server.shutdown()
                else:
                    logger.warning("%s again: stopping now", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
