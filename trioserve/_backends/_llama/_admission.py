"""Admission: give a sequence its id and the cached prefix it starts after (the cache
policy's :class:`~.._cache._cache_policy.Placement`, made without the lock and committed
under it). What the placement asks of the cells — save the prefix being overwritten,
restore one from the host tier — the loop has :meth:`~._kv.KvCells.prepare` carry out."""

from __future__ import annotations

from .._cache import CachePolicy, PieceRule, switch_cuts
from ._inbox import Inbox
from ._sequence import Sequence

__all__ = ["Admission"]


class Admission:
    """Places admitted sequences on the context's ids (the scheduler thread only)."""

    def __init__(self, inbox: Inbox, policy: CachePolicy, rule: PieceRule) -> None:
        self.inbox = inbox
        self.policy = policy
        self.rule = rule

    def assign(self, sequence: Sequence) -> None:
        """Give ``sequence`` the free id whose cached prompt shares the longest prefix of
        whole chunks with its prompt (ties, and no prefix: the least recently used id),
        and start it after that prefix. The plan is computed without the lock; the
        commit takes it."""
        if sequence.saved is not None:
            self._assign_resumed(sequence)
            return
        prompt = sequence.asked.prompt
        cuts = self.rule.cuts(prompt)
        # (an aLoRA's switch is a cut: its adapter set changes there)
        sequence.cache.cuts = switch_cuts(cuts, sequence.asked.salt)
        cells = self.inbox.cells
        plan = self.policy.place(
            prompt,
            cuts,
            sequence.asked.cache_prompt,
            cells.free,
            sequence.asked.salt,
            whole=sequence.group is None,  # (a choice of n > 1 shares a prefill call)
        )
        with self.inbox.condition:
            cells.take(plan.seq_id)
            # (the id's cells now belong to this sequence)
            # (its window checkpoints up to the reused prefix stay; a restore replaces all)
            marks = plan.reused if plan.restore is None else 0
            self.policy.take(plan.seq_id, sequence.asked.salt, marks=marks)
            sequence.seq_id = plan.seq_id
        sequence.cache.window = plan.window
        sequence.cache.save, sequence.cache.restore = plan.save, plan.restore
        sequence.cache.save_salt = plan.save_salt
        sequence.cache.checkpoint = plan.checkpoint
        sequence.cache.whole = sequence.cache.row_kept = plan.whole
        sequence.prefilled = sequence.pos = plan.reused
        sequence.progress.cached_tokens = sequence.progress.prefilled_tokens = plan.reused

    def _take_least_recent_id(self, sequence: Sequence) -> None:
        """Give ``sequence`` the least recently used free id (the prefix cached there saved
        to host memory first, where the policy says so)."""
        cells = self.inbox.cells
        plan = self.policy.place_follower(cells.free)
        with self.inbox.condition:
            cells.take(plan.seq_id)
            self.policy.take(plan.seq_id, sequence.asked.salt)
            sequence.seq_id = plan.seq_id
        if plan.save is not None:
            sequence.cache.save, sequence.cache.save_salt = plan.save, plan.save_salt

    def _assign_resumed(self, sequence: Sequence) -> None:
        """A paused sequence comes back: the least recently used free id (its cached
        prefix saved to host memory first, as for a choice); its state is restored
        there (:meth:`~._kv.KvCells.unpark`) and it goes on where it stopped."""
        self._take_least_recent_id(sequence)

    def assign_follower(self, sequence: Sequence, leader: Sequence) -> None:
        """Give ``sequence`` (a later choice of ``leader``'s group) the least recently
        used free id; it gets a copy of the leader's cells once the prompt is evaluated."""
        self._take_least_recent_id(sequence)
        sequence.cache.cuts = (
            leader.cache.cuts
            if leader.cache.cuts
            else switch_cuts(self.rule.cuts(sequence.asked.prompt), sequence.asked.salt)
        )
        sequence.leader = leader
        leader.followers.append(sequence)
