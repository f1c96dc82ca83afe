"""What the scheduler's state looks like from outside, as typed records read under its
lock: :class:`Snapshot` (what tests and tools observe: ``LlamaBackend.snapshot()``),
the prompt cache's :class:`~.._cache._cache_stats.CacheStats` (``/health``, ``/metrics``)
and the speculation counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._cache import CacheStats

if TYPE_CHECKING:
    from ._loop import Scheduler

__all__ = ["Snapshot", "cache_stats", "snapshot", "speculation_stats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The scheduler now (``LlamaBackend.snapshot()``): frozen, taken under its lock."""

    #: steps made and decode calls the abort flag stopped
    steps: int
    aborted_calls: int
    #: the measured limits (``Capabilities``)
    max_call_width: int
    shared_context_limit: int
    #: sequences queued, being admitted, admitted (holding ids)
    queued: int
    admitting: int
    active: int
    #: the sequences of the ``llama_decode`` call in flight (0: none)
    in_flight: int
    #: the free sequence ids, least recently freed first
    free_ids: tuple[int, ...]
    #: per sequence id, the prompt tokens its cells keep for the cache
    cached: tuple[tuple[int, ...], ...]
    #: the idle recompute: a call in flight and the tokens it completes, finished
    #: conversations with pieces left, and its counters
    idle_in_flight: bool
    idle_call_tokens: tuple[int, ...]
    idle_pending: int
    idle_chunks: int
    idle_tokens: int
    idle_aborted: int
    #: malloc trims made while idle (``_memory.trim_heap``)
    heap_trims: int
    #: the scheduler thread: started, still running; why it failed, if it did
    thread_started: bool
    thread_alive: bool
    failure: BaseException | None


def snapshot(scheduler: Scheduler) -> Snapshot:
    inbox = scheduler.inbox
    caps = scheduler.capabilities
    idle = scheduler.idle
    with inbox.condition:
        thread = inbox.thread
        return Snapshot(
            steps=scheduler.steps,
            aborted_calls=scheduler.aborted_calls,
            max_call_width=caps.max_call_width,
            shared_context_limit=caps.shared_context_limit,
            queued=len(inbox.queue),
            admitting=len(inbox.admitting),
            active=len(inbox.active),
            in_flight=len(inbox.in_flight),
            free_ids=tuple(inbox.cells.free),
            cached=tuple(tuple(scheduler.policy.cached(i)) for i in range(inbox.cells.slots)),
            idle_in_flight=inbox.idle_in_flight,
            idle_call_tokens=tuple(inbox.idle_tokens),
            idle_pending=scheduler.policy.pending,
            idle_chunks=idle.chunks,
            idle_tokens=idle.tokens,
            idle_aborted=idle.aborted,
            heap_trims=scheduler.heap_trims,
            thread_started=thread is not None,
            thread_alive=thread is not None and thread.is_alive(),
            failure=inbox.failure,
        )


def cache_stats(scheduler: Scheduler) -> CacheStats:
    """The prompt cache now: what each idle id keeps (read under the lock), the host
    tier and the idle recompute."""
    with scheduler.inbox.condition:
        held = scheduler.policy.held(scheduler.inbox.cells.free)
    host = scheduler.host
    kv = scheduler.kv
    idle = scheduler.idle
    return CacheStats(
        enabled=scheduler.cache_enabled,
        fast=scheduler.fast,
        chunk=scheduler.chunk,
        piece_rule=scheduler.policy.rule.kind,
        piece_rule_key=scheduler.policy.rule.key,
        deep_from=scheduler.policy.rule.deep_from,
        deep_piece=scheduler.policy.rule.deep_piece,
        sequences=tuple(held),
        kv_bytes_per_token=kv.kv_bytes_per_token,
        ram_budget_bytes=host.budget,
        ram_bytes=host.bytes,
        ram_prefixes=len(host),
        ram_saves=host.saves,
        ram_restores=host.restores,
        ram_evictions=host.evictions,
        ram_shared_bytes=host.pool.bytes,
        ram_shared_budget_bytes=host.pool.budget,
        ram_shared_models=host.pool.tiers,
        save_seconds=kv.save_seconds,
        restore_seconds=kv.restore_seconds,
        whole_hits=kv.whole_hits,
        idle_recompute=scheduler.policy.idle_recompute,
        idle_chunks=idle.chunks,
        idle_tokens=idle.tokens,
        idle_aborted=idle.aborted,
        idle_pending=scheduler.policy.pending,
        disk=host.disk.stats() if host.disk is not None else _disk_off(scheduler),
        window=scheduler.policy.marks.stats(kv.mark_seconds) if scheduler.policy.marks.keep else None,
        ring=kv.ring.stats() if kv.ring is not None else None,
    )


def _disk_off(scheduler: Scheduler) -> dict[str, object] | None:
    """A ``--cache-dir`` given and not used (not writable): that it is off, and why."""
    why = scheduler.host.disk_off
    return None if why is None else {"state": "off", "error": why}


def speculation_stats(scheduler: Scheduler) -> dict[str, object]:
    """Speculative decoding (docs/speculation.md): the mode, the verify call's measured
    width and context limit, and the guessed tokens verified and accepted."""
    caps = scheduler.capabilities
    stats = scheduler.outputs.stats
    return {
        "mode": caps.speculation,
        "verify_width": caps.verify_width,
        "context_limit": caps.verify_context_limit,
        # "exact": one-row steps past this context carry a pad row (null: none do)
        "pad_context": caps.pad_context,
        "padded_steps": scheduler.executor.padded_steps,
        "verify_calls": stats.verify_calls,
        "proposed": stats.proposed,
        "accepted": stats.accepted,
    }
