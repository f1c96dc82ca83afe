"""What the HTTP layer shares with the server: :class:`ServerState` (the model registry, and every
:class:`~trioserve._http._request.InFlightRequest`, so that shutdown can reach each one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from .._core._admission import Admission
from .._core._engine import Engine
from .._core._exceptions import ConflictError, ServiceUnavailableError
from .._core._registry import Lease, ModelEntry, ModelRegistry, ModelSource
from .._core._types import EndCause
from .._wire import ChatFormat, chat_format_for
from ._accounts import Accounts
from ._detach import DetachedStreams
from ._metrics import Metrics
from ._request import InFlightRequest
from ._settings import HTTPSettings
from ._stored import StoredResponses
from ._tracing import Tracing

if TYPE_CHECKING:
    from ._speech_service import SpeechService

__all__ = ["ModelMaker", "ServerState"]

#: how a model added while the server runs (Ollama's ``/api/create``) is loaded: its
#: name, its GGUF, its preset (load settings: ``ctx_size``…) → its source. Given by the
#: composition root (``trioserve serve``: a llama source with the server's flags)
ModelMaker = Callable[[str, Path, Mapping[str, int]], ModelSource]


@dataclass(kw_only=True)
class ServerState:
    """What the HTTP layer shares with the server: the model registry, and the
    in-flight requests (so that shutdown can reach each one)."""

    settings: HTTPSettings = field(default_factory=HTTPSettings)
    registry: ModelRegistry | None = None
    shutting_down: bool = False
    #: the server's stall timeout: a send blocked this long ends the request (cause ``stall``)
    stall_timeout: float | None = None
    requests: set[InFlightRequest] = field(default_factory=set[InFlightRequest])
    #: the requests in flight by (owner, request id), and by (owner, session)
    by_id: dict[tuple[str, str], InFlightRequest] = field(
        default_factory=dict[tuple[str, str], InFlightRequest]
    )
    by_session: dict[tuple[str, str], InFlightRequest] = field(
        default_factory=dict[tuple[str, str], InFlightRequest]
    )
    metrics: Metrics = field(default_factory=Metrics)
    #: the stored Responses (``None``: the server stores none: ``--responses-db off``)
    responses: StoredResponses | None = None
    #: the detachable streams (``None``: none are kept, ``--detach-max 0``)
    detached: DetachedStreams | None = None
    #: the tracer (no spans unless an OTLP endpoint is configured)
    tracing: Tracing = field(default_factory=Tracing)
    #: the API keys' priorities, shares and limits (the keys file)
    accounts: Accounts = field(default_factory=Accounts)
    #: how ``/api/create`` loads a new model (``None``: this server adds none: 501)
    model_maker: ModelMaker | None = None
    #: the text-to-speech model (``None``: none is served; docs/audio.md, "Speech")
    speech: SpeechService | None = None
    _idle: trio.Event = field(default_factory=trio.Event)
    _formats: dict[int, tuple[Engine, ChatFormat]] = field(
        default_factory=dict[int, tuple[Engine, ChatFormat]]
    )
    _embeddings: dict[int, tuple[Engine, Admission]] = field(
        default_factory=dict[int, tuple[Engine, Admission]]
    )

    def add_request(self, request: InFlightRequest) -> None:
        """Track ``request`` (409 if its owner has one of the same id in flight); a
        request of a session supersedes the one of that session in flight (cancelled,
        cause ``superseded``)."""
        key = (request.owner, request.exchange.request_id)
        if key in self.by_id:
            raise ConflictError(
                f"a request with the id {key[1]!r} is in flight for this API key; send another "
                "X-Request-Id (or none: one is generated)",
                param="X-Request-Id",
            )
        self.by_id[key] = request
        if request.session is not None:
            session = (request.owner, request.session)
            previous = self.by_session.get(session)
            if previous is not None:
                previous.cancel("superseded")
            self.by_session[session] = request
        self.requests.add(request)
        if self._idle.is_set():
            self._idle = trio.Event()

    def remove_request(self, request: InFlightRequest) -> None:
        key = (request.owner, request.exchange.request_id)
        if self.by_id.get(key) is request:
            del self.by_id[key]
        if request.session is not None:
            session = (request.owner, request.session)
            if self.by_session.get(session) is request:
                del self.by_session[session]
        self.requests.discard(request)
        if not self.requests:
            self._idle.set()

    def find_requests(self, request_id: str, owner: str, *, admin: bool = False) -> list[InFlightRequest]:
        """The requests in flight with ``request_id``: ``owner``'s, or anyone's for an
        admin key."""
        if not admin:
            found = self.by_id.get((owner, request_id))
            return [found] if found is not None else []
        return [request for (_, rid), request in self.by_id.items() if rid == request_id]

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        if self.requests:
            await self._idle.wait()

    def set_engine(self, engine: Engine) -> None:
        """Serve one engine built by hand (a registry of it alone)."""
        self.registry = ModelRegistry.of_engine(engine, aliases=self.settings.model_aliases)
        self.metrics.bind_registry(self.registry)

    @property
    def engine(self) -> Engine | None:
        """The default model's engine, if it is loaded."""
        return None if self.registry is None else self.registry.default.engine

    def serving_registry(self) -> ModelRegistry:
        """The registry, or the 503 a request gets during shutdown."""
        if self.shutting_down:
            raise ServiceUnavailableError(
                "the server is shutting down; retry on another instance", retry_after=1
            )
        if self.registry is None:
            raise ServiceUnavailableError(
                "the model is still loading; retry shortly", retry_after=1, code="loading"
            )
        return self.registry

    def resolve(self, name: str | None) -> ModelEntry:
        """The model a request names (404 naming the models there are; 503 while the
        server's startup model loads or after it failed to)."""
        return self.serving_registry().resolve(name)

    def resolve_adapter(self, name: str | None) -> tuple[ModelEntry, str | None]:
        """The model a request names, and the LoRA adapter (docs/lora.md)."""
        return self.serving_registry().resolve_adapter(name)

    async def lease(self, entry: ModelEntry, request: InFlightRequest, keep_alive: float | None) -> Lease:
        """Hold ``entry``'s model loaded for ``request`` (waiting for its load inside the
        request's scope); an unload whose grace runs out ends the request with cause
        ``unload``. The caller releases it."""
        lease = await self.serving_registry().acquire(entry, keep_alive=keep_alive)
        lease.on_unload = lambda: request.cancel("unload")
        request.load_wait = lease.load_wait
        self.metrics.load_wait.labels(model=entry.name).observe(lease.load_wait)
        return lease

    def serving_engine(self, name: str | None = None) -> Engine:
        """A loaded model's engine, without waiting for a load: for the endpoints that
        do not queue (``/tokenize``…): 503 if it is not loaded."""
        entry = self.resolve(name)
        if entry.engine is None or entry.state != "loaded":
            if entry.state == "failed":
                raise ServiceUnavailableError(f"the model failed to load: {entry.error}")
            if entry.state == "loading":
                raise ServiceUnavailableError(
                    "the model is still loading; retry shortly", retry_after=1, code="loading"
                )
            raise ServiceUnavailableError(
                f"the model {entry.name!r} is not loaded; a generation request loads it "
                "(or POST /models/load)",
                code="model_not_loaded",
            )
        return entry.engine

    def chat_format(self, engine: Engine) -> ChatFormat:
        """The chat format of a loaded model's template (built once per load)."""
        cached = self._formats.get(id(engine))
        if cached is not None and cached[0] is engine:
            return cached[1]
        info = engine.backend.info
        chat_format = chat_format_for(
            template=info.chat_template,
            architecture=info.architecture,
            bos_token=info.bos_token,
            eos_token=info.eos_token,
        )
        self._formats[id(engine)] = (engine, chat_format)
        return chat_format

    def embeddings_admission(self, engine: Engine) -> Admission:
        """A loaded model's admission for ``/v1/embeddings`` (docs/embeddings.md): one
        request evaluates at a time, as many as generation's queue may wait (its
        ``--max-queue``), beyond that 429; its own, so embeddings and generation never
        take each other's places."""
        cached = self._embeddings.get(id(engine))
        if cached is None or cached[0] is not engine:
            cached = (engine, Admission(1, engine.admission.max_queue))
            self._embeddings[id(engine)] = cached
        return cached[1]

    def forget(self, engine: Engine) -> None:
        """An unloaded model's engine: drop its chat format and embeddings admission."""
        self._formats.pop(id(engine), None)
        self._embeddings.pop(id(engine), None)

    def model_names(self) -> tuple[str, ...]:
        if self.registry is None:
            return ()
        return tuple(self.registry.names())

    def cancel_all(self, cause: EndCause) -> None:
        for request in list(self.requests):
            request.cancel(cause)
