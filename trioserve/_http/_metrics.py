"""Prometheus metrics (prometheus-client), one registry per server.

Per-token cost is one histogram observation (inter-token latency); everything else is
observed once per request, and the gauges are read from the engine only when
``/metrics`` is scraped (per model, with a ``model`` label: ``trioserve_model_*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .._core._admission import PauseBudget
    from .._core._engine import Engine
    from .._core._registry import ModelRegistry

__all__ = ["CANCEL_CAUSES", "END_CAUSES", "Metrics"]

CANCEL_CAUSES = (
    "disconnect",
    "stall",
    "deadline",
    "shutdown",
    "unload",
    "cancelled",
    "superseded",
    "detach_timeout",
    "evicted",
)
END_CAUSES = (
    "stop",
    "length",
    "deadline",
    "disconnect",
    "stall",
    "overloaded",
    "shutdown",
    "unload",
    "cancelled",
    "superseded",
    "detach_timeout",
    "evicted",
    "error",
)

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
        self.load_wait = Histogram(
            "trioserve_model_load_wait_seconds",
            "How long a request waited for its model to load (0: it was loaded).",
            ["model"],
            buckets=_SLOW,
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
        self.draft_tokens_proposed = Counter(
            "trioserve_draft_tokens_proposed",
            "Speculative decoding: tokens guessed from the context and verified (docs/speculation.md).",
            registry=registry,
        )
        self.draft_tokens_accepted = Counter(
            "trioserve_draft_tokens_accepted",
            "Speculative decoding: guessed tokens the model agreed with (each one a decode step saved).",
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
        self.paused_requests = Gauge(
            "trioserve_paused_requests",
            "Requests set aside for a better-ranked one (preemption), waiting for a slot again.",
            registry=registry,
        )
        self.preemptions = Gauge(
            "trioserve_preemptions",
            "Running requests asked to pause for a better-ranked one since each model loaded.",
            registry=registry,
        )
        self.response_store_failures = Counter(
            "trioserve_response_store_failures",
            "Stored responses that could not be written (reason: error, the database or its disk; "
            "full, no room within the key's quota and the total); their answers were sent.",
            ["reason"],
            registry=registry,
        )
        self.paused_state_bytes = Gauge(
            "trioserve_paused_state_bytes",
            "Bytes of paused requests' saved states (their budget: --pause-ram).",
            registry=registry,
        )
        self.pauses_refused = Gauge(
            "trioserve_pauses_refused",
            "Requests that waited instead of pausing a stream because the --pause-ram budget was "
            "spent (a counter read at scrape time).",
            registry=registry,
        )
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
        self.registry.register(_HostCacheCollector(engines, models))
        self.registry.register(_ModelCollector(models))

    def bind_detached(self, counts: Callable[[], dict[str, int] | None]) -> None:
        """The resumable streams' gauges, read at scrape time (docs/resumable-streams.md):
        ``trioserve_detached_streams{state}`` and ``trioserve_detach_log_bytes``."""
        self.registry.register(_DetachedCollector(counts))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DetachedCollector(Collector):
    STATES = ("running", "paused", "parked", "finished")

    def __init__(self, counts: Callable[[], dict[str, int] | None]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self.counts() or {}
        streams = GaugeMetricFamily(
            "trioserve_detached_streams",
            "Resumable streams (X-Conversation-Id, background Responses streams) by state: running, "
            "paused (a full log nobody reads), parked (its slot freed), finished (its log kept).",
            labels=["state"],
        )
        for state in self.STATES:
            streams.add_metric([state], float(counts.get(state, 0)))
        yield streams
        yield GaugeMetricFamily(
            "trioserve_detach_log_bytes",
            "Bytes the resumable streams' logs hold.",
            value=counts.get("log_bytes", 0),
        )
        yield GaugeMetricFamily(
            "trioserve_detached_readers",
            "Readers attached to resumable streams.",
            value=counts.get("readers", 0),
        )


class _HostCacheCollector(Collector):
    """The prompt cache's host-memory tier and idle recompute, read at scrape time:
    bytes held (a gauge) and the saves, restores, evictions and recomputed chunks since
    start (counters), summed over the loaded llama models; and the server's one
    host-memory budget (``--cache-ram``), with what every model's tier holds in it,
    loaded or not (``trioserve_prompt_cache_host_*``)."""

    def __init__(self, engines: Callable[[], list[Engine]], models: ModelRegistry) -> None:
        self._engines = engines
        self._models = models

    def describe(self) -> Iterator[Metric]:
        return iter(())  # (collected on demand only: no describe-time backend call)

    def _pools(self) -> list[Any]:
        """The host-memory budgets (``HostBudget``: ``bytes``, ``budget``) of the models'
        sources and loaded backends, each once (the models of a registry share one)."""
        pools: dict[int, Any] = {}
        for entry in self._models.entries:
            for owner in (entry.spec.source, entry.engine.backend if entry.engine is not None else None):
                pool = getattr(owner, "host_pool", None)
                if pool is not None:
                    pools[id(pool)] = pool
        return list(pools.values())

    def collect(self) -> Iterator[Metric]:
        pools = self._pools()
        if pools:
            yield GaugeMetricFamily(
                "trioserve_prompt_cache_host_bytes",
                "llama backend: bytes of prompt prefixes in host memory, every model's (loaded or not).",
                value=sum(pool.bytes for pool in pools),
            )
            yield GaugeMetricFamily(
                "trioserve_prompt_cache_host_budget_bytes",
                "llama backend: the server's one host-memory budget for them (--cache-ram), in bytes.",
                value=sum(pool.budget for pool in pools),
            )
        caches = []
        speculation = []
        for engine in self._engines():
            stats = engine.backend.stats()
            cache = stats.get("cache") if stats else None
            if isinstance(cache, dict):
                caches.append(cache)
            spec = stats.get("speculation") if stats else None
            if isinstance(spec, dict):
                speculation.append(spec)
        if speculation:
            # which path runs (docs/speculation.md, "Observability")
            modes = GaugeMetricFamily(
                "trioserve_speculation_models",
                "llama backend: loaded models by speculation mode (--speculate) and whether a "
                "one-row step past the split-KV context carries a pad row.",
                labels=["mode", "padded"],
            )
            counted: dict[tuple[str, str], int] = {}
            for spec in speculation:
                path = (str(spec["mode"]), "yes" if spec.get("pad_context") else "no")
                counted[path] = counted.get(path, 0) + 1
            for (mode, padded), n in sorted(counted.items()):
                modes.add_metric([mode, padded], n)
            yield modes
            for name, key, text in (
                ("trioserve_speculation_verify_calls", "verify_calls", "decode calls that verified guesses"),
                (
                    "trioserve_speculation_padded_steps",
                    "padded_steps",
                    "one-row steps that carried a pad row",
                ),
            ):
                value = sum(int(spec.get(key, 0)) for spec in speculation)
                yield CounterMetricFamily(name, f"llama backend: {text}.", value=value)
        if not caches:
            return
        keys = ("bytes", "budget_bytes", "saves", "restores", "evictions")
        ram = {k: sum(c["ram"][k] for c in caches) for k in keys}
        idle = {k: sum(c["idle_recompute"][k] for c in caches) for k in ("chunks", "tokens")}
        yield GaugeMetricFamily(
            "trioserve_prompt_cache_ram_bytes",
            "llama backend: bytes of prompt prefixes kept in host memory (--cache-ram).",
            value=ram["bytes"],
        )
        yield GaugeMetricFamily(
            "trioserve_prompt_cache_ram_budget_bytes",
            "llama backend: the loaded models' host-memory budgets (--cache-ram; a model's cache_ram).",
            value=ram["budget_bytes"],
        )
        for name, value, text in (
            ("trioserve_prompt_cache_saves", ram["saves"], "prefixes saved from KV cells to host memory"),
            ("trioserve_prompt_cache_restores", ram["restores"], "prefixes restored from host memory"),
            ("trioserve_prompt_cache_evictions", ram["evictions"], "prefixes dropped from host memory"),
            ("trioserve_prompt_cache_idle_chunks", idle["chunks"], "reply pieces recomputed while idle"),
            ("trioserve_prompt_cache_idle_tokens", idle["tokens"], "tokens recomputed while idle"),
        ):
            yield CounterMetricFamily(name, f"llama backend: {text}.", value=value)
        tiers = [c["disk"] for c in caches if isinstance(c.get("disk"), dict)]
        disks = [d for d in tiers if d.get("state") != "off"]
        if tiers:
            yield GaugeMetricFamily(
                "trioserve_prompt_cache_disk_off",
                "llama backend: loaded models whose disk tier (--cache-dir) is off: the directory "
                "is not writable (/health says why); they are served without it.",
                value=len(tiers) - len(disks),
            )
        if disks:
            # (the models of a server share one store: its bytes and budget once)
            stores = {d["directory"].rsplit("/", 1)[0]: d for d in disks}
            yield GaugeMetricFamily(
                "trioserve_prompt_cache_disk_failing",
                "llama backend: disk tiers whose last write failed (a full or broken disk; "
                "/health says why): requests are answered, prefixes are not kept on disk.",
                value=sum(d.get("state") == "failing" for d in stores.values()),
            )
            yield GaugeMetricFamily(
                "trioserve_prompt_cache_disk_bytes",
                "llama backend: bytes of prompt prefixes in the disk tier's directory (--cache-dir).",
                value=sum(d["bytes"] for d in stores.values()),
            )
            yield GaugeMetricFamily(
                "trioserve_prompt_cache_disk_budget_bytes",
                "llama backend: the disk tier's budget (--cache-disk), in bytes.",
                value=sum(d["budget_bytes"] for d in stores.values()),
            )
            for name, key, text in (
                ("trioserve_prompt_cache_disk_restores", "restores", "prefixes restored from disk"),
                (
                    "trioserve_prompt_cache_disk_restored_tokens",
                    "restored_tokens",
                    "tokens restored from disk",
                ),
                ("trioserve_prompt_cache_disk_misses", "misses", "disk entries found and not usable"),
            ):
                yield CounterMetricFamily(name, f"llama backend: {text}.", value=sum(d[key] for d in disks))
            for name, key, text in (
                ("trioserve_prompt_cache_disk_writes", "writes", "prefixes written to disk"),
                (
                    "trioserve_prompt_cache_disk_dropped_writes",
                    "dropped_writes",
                    "writes dropped (queue full)",
                ),
                (
                    "trioserve_prompt_cache_disk_failed_writes",
                    "failed_writes",
                    "writes that failed (a full or read-only disk, an I/O error); nothing left behind",
                ),
                ("trioserve_prompt_cache_disk_evictions", "evictions", "disk entries evicted for the budget"),
            ):
                value = sum(d[key] for d in stores.values())
                yield CounterMetricFamily(name, f"llama backend: {text}.", value=value)


class _ModelCollector(Collector):
    """Each known model's state (label ``model``), read at scrape time."""

    def __init__(self, models: ModelRegistry) -> None:
        self._models = models

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily(
            "trioserve_model_state",
            "1 for each model's current state (unloaded, loading, loaded, unloading, failed).",
            labels=["model", "state"],
        )
        progress = GaugeMetricFamily("trioserve_model_load_progress", "Load progress, 0…1.", labels=["model"])
        leases = GaugeMetricFamily(
            "trioserve_model_requests_in_flight", "Requests holding the model loaded.", labels=["model"]
        )
        label = ["model"]
        streams = GaugeMetricFamily("trioserve_model_active_streams", "Streams admitted.", labels=label)
        queued = GaugeMetricFamily(
            "trioserve_model_queued_requests", "Requests waiting for a slot.", labels=label
        )
        loads = CounterMetricFamily(
            "trioserve_model_loads", "Loads ended (loaded, failed, aborted).", labels=label
        )
        seconds = GaugeMetricFamily(
            "trioserve_model_load_seconds", "How long its last load took.", labels=label
        )
        footprint = GaugeMetricFamily(
            "trioserve_model_memory_bytes",
            "Bytes it takes (measured at its last load; before: the file size).",
            labels=["model"],
        )
        for entry in self._models.entries:
            name = entry.name
            for state in ("unloaded", "loading", "loaded", "unloading", "failed"):
                states.add_metric([name, state], 1.0 if entry.state == state else 0.0)
            progress.add_metric([name], entry.progress if entry.state == "loading" else 0.0)
            leases.add_metric([name], entry.leases)
            engine = entry.engine
            streams.add_metric([name], engine.active_streams if engine is not None else 0)
            queued.add_metric([name], engine.admission.queued if engine is not None else 0)
            loads.add_metric([name], entry.loads)
            seconds.add_metric([name], entry.load_seconds or 0.0)
            footprint.add_metric([name], entry.footprint())
        yield from (states, progress, leases, streams, queued, loads, seconds, footprint)
