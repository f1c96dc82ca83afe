"""The trace context a request carries to the servers behind it: its W3C
``traceparent`` (docs/operations.md, "Tracing"), in a context variable that the HTTP
layer sets for the request's task (its child tasks — the producers, an upstream relay —
inherit it) and an upstream client reads. No OpenTelemetry here: the spans are the HTTP
layer's."""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["TRACEPARENT"]

#: the ``traceparent`` to send upstream: the request's server span when tracing is on,
#: else the one the client sent (passed through); ``None``: none
TRACEPARENT: ContextVar[str | None] = ContextVar("trioserve_traceparent", default=None)
