"""The collectors read when ``/metrics`` is scraped, each from the live state: every
model's gauges with a ``model`` label (``trioserve_model_*``), the prompt cache's
host-memory tier and the one ``--cache-ram`` budget, and the resumable streams. Bound
by :class:`~trioserve._http._metrics.Metrics`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .._core._engine import Engine
    from .._core._registry import ModelRegistry

__all__ = ["DetachedCollector", "HostCacheCollector", "ModelCollector"]


class DetachedCollector(Collector):
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


class HostCacheCollector(Collector):
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


class ModelCollector(Collector):
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
