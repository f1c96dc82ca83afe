"""Prometheus metrics (prometheus-client), one registry per server.

Per-token cost is one histogram observation (inter-token latency); everything else is
observed once per request, and the gauges are read from the engine only when
``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .._core._backend import Backend
    from .._core._engine import Engine

__all__ = ["CANCEL_CAUSES", "END_CAUSES", "Metrics"]

CANCEL_CAUSES = ("disconnect", "stall", "deadline", "shutdown")
END_CAUSES = ("stop", "length", "deadline", "disconnect", "stall", "overloaded", "shutdown", "error")

# Latency buckets (seconds): from sub-millisecond (cancel latency, inter-token on a fast
# model) to minutes (end-to-end of a long generation).
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The collectors, and the hooks the HTTP layer calls."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.time_to_first_token = Histogram(
            "trioserve_time_to_first_token_seconds",
            "From request arrival to the first text sent.",
            buckets=_SLOW,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "trioserve_inter_token_latency_seconds",
            "Between consecutive text deltas of one stream.",
            buckets=_FAST,
            registry=registry,
        )
        self.request_duration = Histogram(
            "trioserve_request_duration_seconds",
            "End-to-end: from request arrival to its last byte (or its end).",
            buckets=_SLOW,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "trioserve_queue_wait_seconds",
            "Time spent waiting for a slot.",
            buckets=_SLOW,
            registry=registry,
        )
        self.prefill = Histogram(
            "trioserve_prefill_seconds",
            "Prompt processing time.",
            buckets=_SLOW,
            registry=registry,
        )
        self.cancel_latency = Histogram(
            "trioserve_cancel_latency_seconds",
            "From a cancel's cause (disconnect noticed, deadline passed, shutdown) to the "
            "inference thread leaving the model.",
            ["cause"],
            buckets=_FAST,
            registry=registry,
        )
        self.requests = Counter(
            "trioserve_requests",
            "HTTP generation requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.stream_ends = Counter(
            "trioserve_stream_ends",
            "Generation requests by why they ended: stop, length, deadline, disconnect, "
            "stall, overloaded, shutdown, error.",
            ["cause"],
            registry=registry,
        )
        self.prompt_tokens = Counter("trioserve_prompt_tokens", "Prompt tokens processed.", registry=registry)
        self.completion_tokens = Counter(
            "trioserve_completion_tokens", "Tokens generated.", registry=registry
        )
        self.prompt_tokens_cached = Counter(
            "trioserve_prompt_tokens_cached",
            "Prompt tokens whose evaluation was reused from the prompt cache.",
            registry=registry,
        )
        self.prompt_tokens_evaluated = Counter(
            "trioserve_prompt_tokens_evaluated",
            "Prompt tokens evaluated (cancelled prompts count what they evaluated).",
            registry=registry,
        )
        self.wasted_tokens = Counter(
            "trioserve_wasted_tokens",
            "Tokens generated after a cancel was requested (0 when cancellation reaches "
            "inference before the next token).",
            registry=registry,
        )
        self.active_streams = Gauge(
            "trioserve_active_streams", "Streams admitted and not yet torn down.", registry=registry
        )
        self.queued_requests = Gauge(
            "trioserve_queued_requests", "Requests waiting for a slot.", registry=registry
        )
        self.slots_in_use = Gauge("trioserve_slots_in_use", "Slots held.", registry=registry)
        self.slots_total = Gauge("trioserve_slots", "Slots (capacity).", registry=registry)
        self.batch_sequences = Gauge(
            "trioserve_batch_sequences",
            "llama backend: sequences in the scheduler (submitted, not yet removed).",
            registry=registry,
        )
        self.batch_steps = Gauge(
            "trioserve_batch_steps",
            "llama backend: decode steps run since start (a counter read at scrape time).",
            registry=registry,
        )
        self.batch_aborted_calls = Gauge(
            "trioserve_batch_aborted_calls",
            "llama backend: llama_decode calls stopped by a cancel that owned most of the call.",
            registry=registry,
        )
        self.prompt_cache_tokens = Gauge(
            "trioserve_prompt_cache_tokens",
            "llama backend: prompt tokens whose KV cells idle sequences keep for reuse.",
            registry=registry,
        )
        self.prompt_cache_bytes = Gauge(
            "trioserve_prompt_cache_kv_bytes",
            "llama backend: bytes of KV cells idle sequences keep for reuse.",
            registry=registry,
        )
        # Every label value exists from the start, so dashboards see zeros, not gaps.
        for cause in CANCEL_CAUSES:
            self.cancel_latency.labels(cause=cause)
        for cause in END_CAUSES:
            self.stream_ends.labels(cause=cause)

    def bind_engine(self, engine: Engine) -> None:
        """Gauges read the engine's state at scrape time: no cost per request."""
        admission = engine.admission
        self.active_streams.set_function(lambda: engine.active_streams)
        self.queued_requests.set_function(lambda: admission.queued)
        self.slots_in_use.set_function(lambda: admission.in_use)
        self.slots_total.set_function(lambda: admission.slots)
        backend = engine.backend
        if backend.stats() is not None:  # the llama backend

            def stat(name: str) -> Callable[[], float]:
                return lambda: float(backend.stats()[name])  # type: ignore[index, arg-type]

            self.batch_sequences.set_function(stat("sequences"))
            self.batch_steps.set_function(stat("steps"))
            self.batch_aborted_calls.set_function(stat("aborted_calls"))

            def cache(name: str) -> Callable[[], float]:
                return lambda: float(backend.stats()["cache"][name])  # type: ignore[index]

            self.prompt_cache_tokens.set_function(cache("tokens"))
            self.prompt_cache_bytes.set_function(cache("kv_bytes"))
            self.registry.register(_HostCacheCollector(backend))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HostCacheCollector(Collector):
    """The prompt cache's host-memory tier and idle recompute, read at scrape time:
    bytes held (a gauge) and the saves, restores, evictions and recomputed chunks since
    start (counters)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> Iterator[Metric]:
        return iter(())  # (collected on demand only: no describe-time backend call)

    def collect(self) -> Iterator[Metric]:
        stats = self._backend.stats()
        cache = stats.get("cache") if stats else None
        if not isinstance(cache, dict):
            return
        ram, idle = cache["ram"], cache["idle_recompute"]
        yield GaugeMetricFamily(
            "trioserve_prompt_cache_ram_bytes",
            "llama backend: bytes of prompt prefixes kept in host memory (--cache-ram).",
            value=ram["bytes"],
        )
        yield GaugeMetricFamily(
            "trioserve_prompt_cache_ram_budget_bytes",
            "llama backend: --cache-ram, in bytes.",
            value=ram["budget_bytes"],
        )
        for name, value, text in (
            ("trioserve_prompt_cache_saves", ram["saves"], "prefixes saved from KV cells to host memory"),
            ("trioserve_prompt_cache_restores", ram["restores"], "prefixes restored from host memory"),
            ("trioserve_prompt_cache_evictions", ram["evictions"], "prefixes dropped from host memory"),
            ("trioserve_prompt_cache_idle_chunks", idle["chunks"], "reply chunks recomputed while idle"),
        ):
            yield CounterMetricFamily(name, f"llama backend: {text}.", value=value)
