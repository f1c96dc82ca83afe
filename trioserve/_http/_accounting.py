"""A request's one log line, and its metrics: a generation request's, and one that
counts what it served (embeddings, rerank, speech)."""

from __future__ import annotations

import logging
import time

from .._core._types import Usage
from ._metrics import Metrics
from ._request import InFlightRequest, Kind
from ._writing import usage_of

__all__ = ["ENDPOINTS", "log_request", "log_request_counts"]

request_logger = logging.getLogger("trioserve.requests")

#: each kind's endpoint, as the metrics label it (the route's own path, not the raw one)
ENDPOINTS: dict[Kind, str] = {
    "text": "/v1/completions",
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "infill": "/infill",
    "responses": "/v1/responses",
    "ollama_chat": "/api/chat",
    "ollama_generate": "/api/generate",
    "transcription": "/v1/audio/transcriptions",
}


def log_request_counts(
    metrics: Metrics, request: InFlightRequest, path: str, counts: str, *values: int
) -> None:
    """The one log line of a request served outside generation (embeddings, rerank,
    speech), and its count in the metrics: ``counts``, the format of what it served
    (``values``: inputs and tokens, say), between its cause and its duration."""
    exchange = request.exchange
    duration = time.perf_counter() - request.started
    metrics.requests.labels(endpoint=path, status=str(exchange.status or 0)).inc()
    request_logger.info(
        "request %s %s model=%s status=%s cause=%s " + counts + " duration_ms=%.1f%s",
        exchange.request_id,
        path,
        request.model or "-",
        exchange.status or "-",
        request.cause,
        *values,
        duration * 1000,
        f" error={request.error!r}" if request.error else "",
    )


def log_request(metrics: Metrics, request: InFlightRequest) -> Usage | None:
    """The request's one log line, and its metrics; its usage (``None``: it never
    reached inference)."""
    exchange = request.exchange
    duration = time.perf_counter() - request.started
    events = request.events
    usage = (usage_of(request.choices) if request.choices else events.usage) if events is not None else None
    timings = events.timings if events is not None else None
    ttft = timings.ttft_seconds if timings is not None else None
    cause = request.cause
    cancel_latency = None
    cut_short = not request.delivered  # (after the end, a "disconnect" is just the end)
    if cut_short and events is not None and request.cancelled_at is not None:
        ended = events.progress.inference_ended
        if ended is not None:
            # cause → inference thread out of the model (0 if it had already ended)
            cancel_latency = max(0.0, ended - request.cancelled_at)
            metrics.cancel_latency.labels(cause=cause or "unknown").observe(cancel_latency)
        if request.tokens_at_cancel is not None:
            metrics.wasted_tokens.inc(max(0, events.progress.completion_tokens - request.tokens_at_cancel))
    path = request.asgi["path"]
    # the endpoint's own path, not the raw one (``/v1/completions//``): bounded labels
    endpoint = ENDPOINTS[request.kind]
    metrics.requests.labels(endpoint=endpoint, status=str(exchange.status or 0)).inc()
    metrics.stream_ends.labels(cause=cause or "unknown").inc()
    metrics.request_duration.observe(duration)
    proposed = accepted = 0
    for choice in request.choices or ([events] if events is not None else []):
        # (the choices of n > 1 that shared the first one's prompt evaluated none of it)
        progress = choice.progress
        metrics.prompt_tokens_cached.inc(progress.cached_tokens)
        metrics.prompt_tokens_evaluated.inc(max(0, progress.prefilled_tokens - progress.cached_tokens))
        proposed += progress.draft_proposed
        accepted += progress.draft_accepted
    if proposed:
        metrics.draft_tokens_proposed.inc(proposed)
        metrics.draft_tokens_accepted.inc(accepted)
    if events is not None and usage is not None and timings is not None:
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.completion_tokens.inc(usage.completion_tokens)
        if timings.queue_seconds is not None:
            metrics.queue_wait.observe(timings.queue_seconds)
        if ttft is not None:
            metrics.time_to_first_token.observe(ttft)
        if events.progress.prefill_seconds:
            metrics.prefill.observe(events.progress.prefill_seconds)
    request_logger.info(
        "request %s %s model=%s status=%s cause=%s prompt_tokens=%s cached_tokens=%s "
        "completion_tokens=%s ttft_ms=%s duration_ms=%.1f%s%s%s%s%s%s",
        exchange.request_id,
        path,
        request.model or "-",
        exchange.status or "-",
        cause,
        usage.prompt_tokens if usage else "-",
        usage.cached_tokens if usage else "-",
        usage.completion_tokens if usage else "-",
        f"{ttft * 1000:.1f}" if ttft is not None else "-",
        duration * 1000,
        f" load_wait_ms={request.load_wait * 1000:.1f}" if request.load_wait else "",
        _cache_split(usage),
        f" draft_accepted={accepted}/{proposed}" if proposed else "",
        f" cancel_latency_ms={cancel_latency * 1000:.2f}" if cancel_latency is not None else "",
        f" error={request.error!r}" if request.error else "",
        f" trace_id={request.trace_id}" if request.trace_id else "",
    )
    return usage


def _cache_split(usage: Usage | None) -> str:
    """`` cached_from=cells:N,host:N,disk:N`` when a tier below the cells gave tokens."""
    split = usage.cache_split() if usage is not None else None
    if split is None:
        return ""
    return " cached_from=" + ",".join(f"{tier}:{n}" for tier, n in split.items())
