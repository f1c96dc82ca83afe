"""Tracing (docs/operations.md, "Tracing"): a server span per generation request,
parented to the client's W3C ``traceparent``, with a child span per phase — loading its
model, queued, prefill, decode — exported over OTLP/HTTP by OpenTelemetry's SDK (the
``otel`` extra) in the SDK's own export thread.

Nothing is done per token: the server span starts when the request arrives (its context
is what goes upstream), and the phase spans are written when the request ends, from the
timestamps the request and its stream keep anyway. Without an OTLP endpoint no span is
made, and a client's ``traceparent`` is passed through to upstreams unchanged."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from ._exchange import _header
from ._request import InFlightRequest, Phase

if TYPE_CHECKING:
    from .._core._types import Usage

__all__ = ["Tracing"]

#: W3C trace context: version 00, a trace id, a parent id, flags (not all zero ids)
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def _valid(traceparent: str | None) -> str | None:
    if traceparent is None:
        return None
    found = _TRACEPARENT.match(traceparent.strip().lower())
    if found is None or found.group(1) == "0" * 32 or found.group(2) == "0" * 16:
        return None
    return found.group(0)


class Tracing:
    """The server's tracer: ``endpoint`` (an OTLP/HTTP traces URL, e.g.
    ``http://127.0.0.1:4318/v1/traces``) or ``None`` (no spans)."""

    def __init__(self, endpoint: str | None = None, *, service: str = "trioserve") -> None:
        self.endpoint = endpoint
        self._provider: Any = None
        self._tracer: Any = None
        if endpoint is None:
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:  # pragma: no cover - the extra is part of the test install
            raise RuntimeError(
                "--otlp-endpoint needs OpenTelemetry's SDK: pip install 'trioserve[otel]'"
            ) from exc
        # the server's own provider (not the process-global one: a library stays polite)
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
        self._provider = provider
        self._tracer = provider.get_tracer("trioserve")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def begin(self, request: InFlightRequest, path: str) -> None:
        """The request arrived: its server span (parented to its ``traceparent``), and
        the ``traceparent`` its upstream calls carry."""
        incoming = _valid(_header(request.asgi, b"traceparent"))
        if self._tracer is None:
            request.traceparent = incoming
            request.trace_id = incoming[3:35] if incoming is not None else None
            return
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        propagator = TraceContextTextMapPropagator()
        carrier = {"traceparent": incoming} if incoming is not None else {}
        state = _header(request.asgi, b"tracestate")
        if incoming is not None and state is not None:
            carrier["tracestate"] = state
        span = self._tracer.start_span(
            f"POST {path}",
            context=propagator.extract(carrier),
            kind=trace.SpanKind.SERVER,
            start_time=_ns(request, request.started),
            attributes={
                "http.request.method": "POST",
                "url.path": path,
                "trioserve.request_id": request.exchange.request_id,
            },
        )
        out: dict[str, str] = {}
        propagator.inject(out, context=trace.set_span_in_context(span))
        request.span = span
        request.traceparent = out.get("traceparent")
        request.trace_id = format(span.get_span_context().trace_id, "032x")

    def end(self, request: InFlightRequest, usage: Usage | None) -> None:
        """The request ended: its phase spans, from what it kept, and its server span's
        end with the outcome."""
        span = request.span
        if span is None or self._tracer is None:
            return
        from opentelemetry import trace

        now = time.perf_counter()
        parent = trace.set_span_in_context(span)
        loading = request.phase_at[Phase.LOADING]
        if loading and request.load_wait is not None:
            self._child("load model", parent, request, loading, loading + request.load_wait)
        events = request.events
        timings = events.timings if events is not None else None
        if timings is not None:
            admitted, first = timings.admitted, timings.first_token
            ended = timings.released or timings.finished or now
            self._child("queue", parent, request, timings.created, admitted or ended)
            if admitted is not None:
                self._child("prefill", parent, request, admitted, first or ended)
            if first is not None:
                self._child("decode", parent, request, first, max(first, ended))
        elif request.phase_at[Phase.QUEUED]:
            self._child("queue", parent, request, request.phase_at[Phase.QUEUED], now)
        span.set_attribute("http.response.status_code", request.exchange.status or 0)
        span.set_attribute("trioserve.end_cause", request.cause or "unknown")
        if request.model:
            span.set_attribute("gen_ai.request.model", request.model)
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            span.set_attribute("trioserve.cached_tokens", usage.cached_tokens)
        if request.cause == "error":
            span.set_status(trace.Status(trace.StatusCode.ERROR, request.error or "error"))
        span.end(end_time=_ns(request, now))

    def _child(self, name: str, parent: Any, request: InFlightRequest, start: float, end: float) -> None:
        assert self._tracer is not None
        child = self._tracer.start_span(name, context=parent, start_time=_ns(request, start))
        child.end(end_time=_ns(request, max(start, end)))

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: call it in a worker thread)."""
        if self._provider is not None:
            self._provider.shutdown()


def _ns(request: InFlightRequest, moment: float) -> int:
    """``time.perf_counter()`` ``moment`` of ``request``, as Unix nanoseconds."""
    return int((request.created_at + (moment - request.started)) * 1e9)
