"""Prometheus metrics (prometheus-client), one registry per server.

Per-token cost is one histogram observation (inter-token latency); everything else is
observed once per request, and the gauges are read from the engine only when
``/metrics`` is scraped (per model, with a ``model`` label: ``trioserve_model_*``; those
collectors: :mod:`._metrics_collectors`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ._metrics_collectors import DetachedCollector, HostCacheCollector, ModelCollector

if TYPE_CHECKING:
    from .._core._admission import PauseBudget
    from .._core._engine import Engine
    from .._core._registry import ModelRegistry

__all__ = ["CANCEL_CAUSES", "END_CAUSES", "Metrics"]

# causes from outside the request (the server, a newer request, an eviction): both lists end so
_OUTSIDE_CAUSES = ("shutdown", "unload", "cancelled", "superseded", "detach_timeout", "evicted")
CANCEL_CAUSES = ("disconnect", "stall", "deadline", *_OUTSIDE_CAUSES)
END_CAUSES = ("stop", "length", "deadline", "disconnect", "stall", "overloaded", *_OUTSIDE_CAUSES, "error")

# Latency buckets (seconds): from sub-millisecond (cancel latency, inter-token on a fast
# model) to minutes (end-to-end of a long generation).
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The collectors, and the hooks the HTTP layer calls."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        self.time_to_first_token = histogram(
            "trioserve_time_to_first_token_seconds", "From request arrival to the first text sent.", _SLOW
        )
        self.inter_token_latency = histogram(
            "trioserve_inter_token_latency_seconds", "Between consecutive text deltas of one stream.", _FAST
        )
        self.request_duration = histogram(
            "trioserve_request_duration_seconds",
            "End-to-end: from request arrival to its last byte (or its end).",
            _SLOW,
        )
        self.queue_wait = histogram(
            "trioserve_queue_wait_seconds",
            "Time spent waiting for a slot.",
            _SLOW,
        )
        self.prefill = histogram(
            "trioserve_prefill_seconds",
            "Prompt processing time.",
            _SLOW,
        )
        self.cancel_latency = histogram(
            "trioserve_cancel_latency_seconds",
            "From a cancel's cause (disconnect noticed, deadline passed, shutdown) to the "
            "inference thread leaving the model.",
            _FAST,
            "cause",
        )
        self.load_wait = histogram(
            "trioserve_model_load_wait_seconds",
            "How long a request waited for its model to load (0: it was loaded).",
            _SLOW,
            "model",
        )
        self.requests = counter(
            "trioserve_requests",
            "HTTP generation requests by endpoint and status code.",
            "endpoint",
            "status",
        )
        self.stream_ends = counter(
            "trioserve_stream_ends",
            "Generation requests by why they ended: stop, length, deadline, disconnect, "
            "stall, overloaded, shutdown, error.",
            "cause",
        )
        self.prompt_tokens = counter(
            "trioserve_prompt_tokens",
            "Prompt tokens processed.",
        )
        self.completion_tokens = counter(
            "trioserve_completion_tokens",
            "Tokens generated.",
        )
        self.prompt_tokens_cached = counter(
            "trioserve_prompt_tokens_cached",
            "Prompt tokens whose evaluation was reused from the prompt cache.",
        )
        self.prompt_tokens_evaluated = counter(
            "trioserve_prompt_tokens_evaluated",
            "Prompt tokens evaluated (cancelled prompts count what they evaluated).",
        )
        self.draft_tokens_proposed = counter(
            "trioserve_draft_tokens_proposed",
            "Speculative decoding: tokens guessed from the context and verified (docs/speculation.md).",
        )
        self.draft_tokens_accepted = counter(
            "trioserve_draft_tokens_accepted",
            "Speculative decoding: guessed tokens the model agreed with (each one a decode step saved).",
        )
        self.wasted_tokens = counter(
            "trioserve_wasted_tokens",
            "Tokens generated after a cancel was requested (0 when cancellation reaches "
            "inference before the next token).",
        )
        self.active_streams = gauge(
            "trioserve_active_streams",
            "Streams admitted and not yet torn down.",
        )
        self.queued_requests = gauge(
            "trioserve_queued_requests",
            "Requests waiting for a slot.",
        )
        self.slots_in_use = gauge(
            "trioserve_slots_in_use",
            "Slots held.",
        )
        self.paused_requests = gauge(
            "trioserve_paused_requests",
            "Requests set aside for a better-ranked one (preemption), waiting for a slot again.",
        )
        self.preemptions = gauge(
            "trioserve_preemptions",
            "Running requests asked to pause for a better-ranked one since each model loaded.",
        )
        self.response_store_failures = counter(
            "trioserve_response_store_failures",
            "Stored responses that could not be written (reason: error, the database or its disk; "
            "full, no room within the key's quota and the total); their answers were sent.",
            "reason",
        )
        self.paused_state_bytes = gauge(
            "trioserve_paused_state_bytes",
            "Bytes of paused requests' saved states (their budget: --pause-ram).",
        )
        self.pauses_refused = gauge(
            "trioserve_pauses_refused",
            "Requests that waited instead of pausing a stream because the --pause-ram budget was "
            "spent (a counter read at scrape time).",
        )
        self.slots_total = gauge(
            "trioserve_slots",
            "Slots (capacity).",
        )
        self.batch_sequences = gauge(
            "trioserve_batch_sequences",
            "llama backend: sequences in the scheduler (submitted, not yet removed).",
        )
        self.batch_steps = gauge(
            "trioserve_batch_steps",
            "llama backend: decode steps run since start (a counter read at scrape time).",
        )
        self.batch_aborted_calls = gauge(
            "trioserve_batch_aborted_calls",
            "llama backend: llama_decode calls stopped by a cancel that owned most of the call.",
        )
        self.prompt_cache_tokens = gauge(
            "trioserve_prompt_cache_tokens",
            "llama backend: prompt tokens whose KV cells idle sequences keep for reuse.",
        )
        self.prompt_cache_bytes = gauge(
            "trioserve_prompt_cache_kv_bytes",
            "llama backend: bytes of KV cells idle sequences keep for reuse.",
        )
        # Every label value exists from the start, so dashboards see zeros, not gaps.
        for cause in CANCEL_CAUSES:
            self.cancel_latency.labels(cause=cause)
        for cause in END_CAUSES:
            self.stream_ends.labels(cause=cause)
        for reason in ("error", "full"):
            self.response_store_failures.labels(reason=reason)

    def bind_registry(self, models: ModelRegistry) -> None:
        """Gauges read the models' state at scrape time: no cost per request. The
        unlabelled gauges are sums over the loaded models; ``trioserve_model_*`` say
        each model's (label ``model``)."""
        from .._core._registry import ModelRegistry as _Registry

        assert isinstance(models, _Registry)

        def engines() -> list[Engine]:
            return [entry.engine for entry in models.entries if entry.engine is not None]

        def total(read: Callable[[Engine], float]) -> Callable[[], float]:
            return lambda: float(sum(read(engine) for engine in engines()))

        self.active_streams.set_function(total(lambda e: e.active_streams))
        self.queued_requests.set_function(total(lambda e: e.admission.queued))
        self.slots_in_use.set_function(total(lambda e: e.admission.in_use))
        self.paused_requests.set_function(total(lambda e: e.admission.paused))
        self.preemptions.set_function(total(lambda e: e.admission.preemptions))
        self.slots_total.set_function(total(lambda e: e.admission.slots))

        def budgets() -> list[PauseBudget]:
            # one budget shared by the registry's engines: counted once
            unique = {id(e.admission.pause_budget): e.admission.pause_budget for e in engines()}
            return list(unique.values())

        self.paused_state_bytes.set_function(lambda: float(sum(b.used for b in budgets())))
        self.pauses_refused.set_function(lambda: float(sum(b.refused for b in budgets())))

        def stat(name: str) -> Callable[[Engine], float]:
            return lambda e: float((e.backend.stats() or {}).get(name, 0))  # type: ignore[arg-type]

        def cache(name: str) -> Callable[[Engine], float]:
            def read(e: Engine) -> float:
                stats = e.backend.stats() or {}
                values = stats.get("cache")
                return float(values.get(name, 0)) if isinstance(values, dict) else 0.0

            return read

        self.batch_sequences.set_function(total(stat("sequences")))
        self.batch_steps.set_function(total(stat("steps")))
        self.batch_aborted_calls.set_function(total(stat("aborted_calls")))
        self.prompt_cache_tokens.set_function(total(cache("tokens")))
        self.prompt_cache_bytes.set_function(total(cache("kv_bytes")))
        self.registry.register(HostCacheCollector(engines, models))
        self.registry.register(ModelCollector(models))

    def bind_detached(self, counts: Callable[[], dict[str, int] | None]) -> None:
        """The resumable streams' gauges, read at scrape time (docs/resumable-streams.md):
        ``trioserve_detached_streams{state}`` and ``trioserve_detach_log_bytes``."""
        self.registry.register(DetachedCollector(counts))

    def render(self) -> bytes:
        return generate_latest(self.registry)
