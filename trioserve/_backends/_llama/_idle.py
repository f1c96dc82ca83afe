"""The idle recompute (docs/prompt-cache.md): while nothing else runs, evaluate the
next piece of the most recently finished conversation (its reply, decoded a token at a
time, is not reusable as it is), so its next turn reuses it. Any request or resumed
stream aborts it (``Inbox.submit``, ``Inbox.wake``)."""

from __future__ import annotations

import logging

from .._cache import CachePolicy
from ._adapters import adapters_of_salt
from ._executor import Executor
from ._inbox import Inbox
from ._kv import KvCells

__all__ = ["IdleRecompute"]

logger = logging.getLogger("trioserve.llama")


class IdleRecompute:
    """Runs on the scheduler thread, between requests."""

    def __init__(self, inbox: Inbox, policy: CachePolicy, kv: KvCells, executor: Executor) -> None:
        self.inbox = inbox
        self.policy = policy
        self.kv = kv
        self.executor = executor
        self.chunks = 0
        self.tokens = 0
        self.aborted = 0

    def run_safely(self) -> None:
        try:
            self.run()
        except Exception:
            logger.exception("the idle recompute failed; its conversation is dropped from the cache")
            for seq_id in self.policy.drop_histories():
                if self.inbox.cells.is_free(seq_id):
                    self.kv.forget(seq_id)

    def persist_safely(self) -> None:
        """No request and no reply to recompute: write one free id's cached prefix to
        the disk tier (``KvCells.persist``), so a crash loses only what came since."""
        inbox = self.inbox
        with inbox.condition:
            if inbox.active or inbox.queue or inbox.stopping:
                return
            seq_id = self.kv.persist_pending(inbox.cells.free)
        if seq_id is None:
            return
        try:
            self.kv.persist(seq_id)
        except Exception:  # an optimisation: without it, a crash loses this prefix
            logger.exception("could not write a cached prefix to the disk tier")

    def run(self) -> None:
        """Evaluate one piece (aborted: tried again when idle)."""
        job = self.policy.next_recompute()
        if job is None:  # (nothing left whole: done)
            return
        seq_id, history, start, end = job.seq_id, job.history, job.start, job.end
        if max(history[start:end], default=0) >= self.executor.n_vocab:
            # (an image past the cached cells: not recomputed — its encode is a request's)
            self.policy.drop_history(seq_id)
            return
        # (its conversation's adapter set, from its salt: docs/lora.md; an adapter
        # unloaded since: not recomputed)
        adapters = adapters_of_salt(self.policy.salt(seq_id))
        if adapters and not self.executor.has_adapters(adapters):
            self.policy.drop_history(seq_id)
            return
        self.executor.fill_chunk(seq_id, history, start, end, adapters)
        tokens = history[:end]
        inbox = self.inbox
        with inbox.condition:
            if inbox.stopping or inbox.active or inbox.queue:
                return
            inbox.abort_flag.value = 0
            inbox.idle_in_flight = True
            inbox.idle_tokens = tokens
            inbox.idle_salt = self.policy.salt(seq_id)
        outcome = self.executor.decode()  # (the cores, shared with embeddings)
        with inbox.condition:
            inbox.idle_in_flight = False
            inbox.idle_tokens = []
        if not outcome.ok:
            if self.kv.ring is not None:
                self.kv.ring.note(seq_id, end)  # (an aborted chunk's holes: _ring_layout.py)
            if (
                self.kv.trim(seq_id, start) != start
            ):  # pragma: no cover - (partial removal is always possible here)
                self.kv.forget(seq_id)
            if outcome.aborted:
                self.aborted += 1  # tried again when idle
            else:  # pragma: no cover - llama.cpp failed: leave this conversation
                self.policy.drop_history(seq_id)
            return
        self.chunks += 1
        self.tokens += end - start
        # (window layers kept to their window: the piece moved the first window cell on)
        floor = None if self.kv.swa_full else self.kv.window_start(seq_id, end)
        self.policy.recomputed(job, floor)
