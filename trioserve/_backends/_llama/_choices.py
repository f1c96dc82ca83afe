"""A choice of ``n`` > 1 given its leader's prompt cells (the scheduler thread only)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ._sequence import Sequence

if TYPE_CHECKING:
    from ._kv import KvCells

__all__ = ["share_prompt"]

logger = logging.getLogger("trioserve.llama")


def share_prompt(
    kv: KvCells, leader: Sequence, outputs: list[tuple[Sequence, int]]
) -> list[tuple[Sequence, int]]:
    """``leader``'s prompt is evaluated: copy its cells to each waiting choice of its
    group, which then draws its first token from the same logits.

    The copy is the leader's sequence state (``llama_state_seq_get_data``, then
    ``set_data`` into each follower: its prompt cells only, done when the call
    returns). Not ``llama_memory_seq_cp``: between sequences of a non-unified cache
    that copies the follower's whole stream, and only at the start of the next
    ``llama_decode`` — after a save to or restore from the host tier could already
    have read or written those cells (measured: logits off by up to 11.5)."""
    index = next(i for s, i in outputs if s is leader)
    waiting = [f for f in leader.followers if not f.cancelled]  # (the cancelled: dropped next step)
    leader.followers = []
    for follower in waiting:
        # detached first: if what follows fails, each evaluates the prompt itself
        # rather than waiting for a leader that has gone
        follower.leader = None
    if not waiting:
        return []
    whole = kv.whole_state(leader.seq_id)  # (unmapped when this returns)
    state, written = whole.array, whole.used
    floor = kv.window_floor_of(leader.seq_id)
    shared = []
    for follower in waiting:
        kv.trim(follower.seq_id, 0)
        if not written or kv.set_state(state, written, follower.seq_id, floor=floor) is None:
            # pragma: no cover - llama.cpp refused: this choice evaluates the prompt itself
            logger.warning("could not share a prompt's cells; a choice evaluates it again")
            kv.trim(follower.seq_id, 0)
            continue
        follower.prefilled = follower.pos = leader.prefilled
        follower.progress.prefill_seconds = leader.progress.prefill_seconds
        shared.append((follower, index))
    return shared
