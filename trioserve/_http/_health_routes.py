"""The health routes: ``GET /health`` (the server's and each model's state; the status
alone for a caller without a valid key where keys are required) and a gateway's load poll
(``GET /v1/loads``, ``/loads``)."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, cast

from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import TrioserveError
from .._core._registry import ModelEntry
from ._access import AccessPolicy
from ._exchange import Scope
from ._generation import presented_key
from ._route_io import error_response, json_response
from ._state import ServerState

if TYPE_CHECKING:
    from .._core._engine import Engine

__all__ = ["add_health_routes"]


def _health(
    body: dict[str, object], status: int = 200, headers: dict[str, str] | None = None
) -> tuple[dict[str, object], int, dict[str, str] | None]:
    return body, status, headers


def _load_figures(engine: Engine, *, parked: bool = False) -> dict[str, object]:
    """A model's slots, queue and streams as ``/health`` says them (``parked``: the
    top-level figures say it too, each model's do not)."""
    admission = engine.admission
    figures: dict[str, object] = {
        "slots": admission.slots,
        "slots_in_use": admission.in_use,
        "queued": admission.queued,
        "paused": admission.paused,
    }
    if parked:
        figures["parked"] = admission.parked
    figures.update(
        preemptions=admission.preemptions,
        active_streams=engine.active_streams,
        generations_running=engine.backend.generations.running,
    )
    return figures


def add_health_routes(app: QuartTrio, state: ServerState, access: AccessPolicy | None) -> None:
    """Add ``/health``, ``/v1/loads`` and ``/loads`` to ``app``."""

    def model_health(entry: ModelEntry) -> dict[str, object]:
        body: dict[str, object] = {"model": entry.name, **entry.describe()}
        engine = entry.engine
        if engine is None:
            return body
        backend = engine.backend
        failure = backend.failure
        if failure is not None:  # e.g. the llama backend's scheduler thread died
            body["state"] = "error"
            body["error"] = str(failure)
            return body
        stats = backend.stats()
        if stats is not None:
            body["batch"] = stats
        body.update(_load_figures(engine))
        return body

    @app.get("/health")
    async def health() -> Response:
        """The server's health: ``ok`` once the startup model has loaded (503 while it
        loads, or after it failed), with each model's state (``models``); the default
        model's figures at the top level, as before there were several. Where API keys
        are required, a request without a valid one gets the status alone (open for
        load balancers: no models, paths, errors, slots or cache figures)."""
        from quart import request

        body, status, headers = full_health()
        if access is not None and access.requires_key:
            key = presented_key(cast("Scope", request.scope))
            if key is None or not access.key_is_valid(key):
                body = {"status": body["status"]}
        return json_response(body, status, headers)

    def full_health() -> tuple[dict[str, object], int, dict[str, str] | None]:
        if state.shutting_down:
            return _health({"status": "shutting_down"}, 503, {"Retry-After": "1"})
        registry = state.registry
        if registry is None:
            return _health({"status": "loading", "error": None}, 503, {"Retry-After": "1"})
        default = registry.default
        models = {entry.name or "(loading)": model_health(entry) for entry in registry.entries}
        if default.spec.ready_gate and default.state != "loaded":
            if default.state == "failed":
                return _health(
                    {"status": "error", "error": default.error, "models": models}, 503, {"Retry-After": "1"}
                )
            if default.loads == 0:
                return _health(
                    {"status": "loading", "error": None, "models": models}, 503, {"Retry-After": "1"}
                )
        for entry in registry.entries:
            failure = entry.engine.backend.failure if entry.engine is not None else None
            if failure is not None:  # e.g. the llama backend's scheduler thread died
                return _health({"status": "error", "error": str(failure), "models": models}, 503)
        body: dict[str, object] = {}
        engine = default.engine
        if engine is not None:
            stats = engine.backend.stats()
            if stats is not None:
                body["batch"] = stats
            platform = engine.backend.platform()
            if platform is not None:
                body["platform"] = platform
            body["model"] = default.name
            body.update(_load_figures(engine, parked=True))
        if state.responses is not None:
            # a store that cannot write is degraded, not down: answers are still sent
            body["responses_store"] = state.responses.health()
        if state.detached is not None:
            body["detached"] = state.detached.counts()
        return _health({**body, "status": "ok", "requests_in_flight": len(state.requests), "models": models})

    @app.get("/v1/loads")
    @app.get("/loads")
    async def loads() -> Response:
        """A gateway's load poll (the Shepherd Model Gateway's ``/v1/loads`` schema,
        sglang's: docs/deployment.md, "Many workers behind a gateway"): one rank with
        the named model's (``?model=``; default: the default model's) running and
        queued requests and its slots, from the admission state itself. 503 while
        shutting down (a gateway then takes no load figure from a draining worker)."""
        from quart import request

        if state.shutting_down or state.registry is None:
            return json_response({"error": "not serving"}, 503, {"Retry-After": "1"})
        registry = state.registry
        name = request.args.get("model")
        try:
            entry = state.resolve(name) if name else registry.default
        except TrioserveError as exc:
            return error_response(exc)
        engine = entry.engine
        running = waiting = in_use = used = 0
        slots = total = 1
        if engine is not None:
            admission = engine.admission
            running, waiting, in_use, slots = (
                engine.backend.generations.running,
                admission.queued,
                admission.in_use,
                admission.slots,
            )
            kv_usage = getattr(engine.backend, "kv_usage", None)
            if kv_usage is not None:
                used, total = kv_usage()
        rank = {
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            # KV cells the running requests hold, of every slot's (a busy slot is not a
            # full cache: a request beyond the slots queues, it is not refused)
            "num_used_tokens": used,
            "max_total_num_tokens": total,
            "token_usage": used / total,
            "utilization": in_use / slots,
            "max_running_requests": slots,
        }
        stamp = datetime.datetime.now(datetime.UTC).isoformat()
        return json_response({"timestamp": stamp, "dp_rank_count": 1, "loads": [rank]})
