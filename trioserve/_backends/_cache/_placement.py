"""Which free sequence id a new prompt takes, and how much of the prompt that id's cells
(or the host-memory tier) already hold: the placement half of the prompt cache's policy
(docs/prompt-cache.md). :class:`~._cache_policy.CachePolicy` owns a :class:`Placer` and
answers its questions about the ids; the placer decides, and changes nothing but the
host tier's recency.

Salts: a prompt reuses cells — or host-memory states — of its own ``cache_salt`` only
(an activated LoRA's, up to its switch, the base model's too: :mod:`._switch_salt`)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ._disk_cache import DiskEntry
from ._memory import StateBuffer
from ._pieces import PieceRule
from ._prompt_cache import HostCache, shared_prefix
from ._switch_salt import agreement, switch_cuts, switch_of, unswitched
from ._window_marks import WindowMark, WindowMarks

__all__ = ["SHORT_TAIL", "IdCells", "Placement", "Placer", "last_cut", "short_tail"]

#: the longest tail of an id's cells a request may overwrite without the id's longer
#: state being saved to host memory first (:func:`short_tail`)
SHORT_TAIL = 32


def short_tail(kept: int) -> int:
    """How many tokens past the ``kept`` cells a request may overwrite unsaved. Saving
    the state and restoring it later copies every cell twice (~3 µs a cell on this CPU);
    evaluating the tail again costs ~1 ms a token plus attention over ``kept`` (~0.6 µs
    a cell): below ~``kept`` / 170 tokens, and below ~10 at any depth, evaluating again is
    cheaper even when the old tail does come back — which after a regenerate (the same
    prompt asked again: only the last reply is lost) it rarely does. So: up to
    ``kept`` / 256 tokens, at most :data:`SHORT_TAIL` (docs/prompt-cache.md, "A short tail
    is not saved")."""
    return min(SHORT_TAIL, kept // 256)


def last_cut(cuts: list[int], limit: int) -> int:
    """The last of ``cuts`` (ascending) at most ``limit``; 0 if none."""
    i = bisect.bisect_right(cuts, limit)
    return cuts[i - 1] if i else 0


def _agreed(held: str, salt: str, limit: int) -> int:
    """How much of a prompt of ``salt`` cells of salt ``held`` may serve, at most
    ``limit`` (0: none — the salts differ from the first position)."""
    differ = agreement(held, salt)
    return limit if differ is None else min(limit, differ)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``limit``
    (binary search on slice equality: C-speed comparisons)."""
    low, high = 0, min(limit, len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # a[:low] == b[:low]; the answer is at most high
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new sequence goes: its id, the prompt tokens it starts after, and the
    host-memory work to do first (the scheduler thread does it, before the first call):
    ``save``, the prefix the id caches, to keep in host memory before it is overwritten
    (under ``save_salt``, the salt of the request that computed it);
    ``checkpoint``, a shorter prefix of ``save`` to keep too (0: none —
    :meth:`CachePolicy.checkpoint`); ``restore``, the host-memory state to load into the id."""

    seq_id: int
    reused: int = 0
    save: list[int] | None = None
    restore: StateBuffer | bytes | DiskEntry | None = None
    checkpoint: int = 0
    save_salt: str = ""
    #: the whole prompt is cached with its last token's logits (``reused`` is its
    #: length): its first token is drawn from the kept row, no call (a full hit)
    whole: bool = False
    #: the id's cells give back ``reused`` tokens only with this checkpoint of their
    #: window cells restored (``--no-swa-full``: :mod:`._window_marks`)
    window: WindowMark | None = None


class IdCells(Protocol):
    """What a :class:`Placer` asks of the ids' cells (the policy answers)."""

    rule: PieceRule
    host: HostCache
    marks: WindowMarks
    enabled: bool
    fast: bool

    def cached(self, seq_id: int) -> list[int]: ...
    def salt(self, seq_id: int) -> str: ...
    def logits_at(self, seq_id: int) -> int: ...
    def used_at(self, seq_id: int) -> int: ...
    def serves(self, seq_id: int, shared: int) -> bool: ...
    def savable(self, seq_id: int) -> bool: ...
    def checkpoint(self, seq_id: int, keep: int = 0) -> int: ...
    def host_cuts(self, tokens: list[int]) -> Sequence[int]: ...


class Placer:
    """The placement decisions over ``ids`` (the policy that owns the placer)."""

    __slots__ = ("_ids",)

    def __init__(self, ids: IdCells) -> None:
        self._ids = ids

    def place(
        self,
        prompt: list[int],
        cuts: list[int],
        cache_prompt: bool,
        free_ids: list[int],
        salt: str = "",
        *,
        whole: bool = True,
    ) -> Placement:
        """The free id whose cached prompt shares the longest prefix of whole pieces with
        ``prompt`` (``cuts``: its cuts; ties, and no prefix: the least recently used id),
        and how much of it is reused — or, when the host tier holds more of it, the
        least recently used id with that state to restore. An id holding all of
        ``prompt`` with its last logits comes first (a full hit: ``Placement.whole``;
        ``whole`` False: not looked for). Only cells and states of the prompt's ``salt``
        count: another salt's share nothing with it. Changes nothing but the host
        tier's recency; :meth:`CachePolicy.take` commits."""
        ids = self._ids
        limit = 0
        # ``cuts``: the canonical ones; ``own``: the prompt's, its switch added (where an
        # aLoRA turns on: the pieces another id computed end at the canonical cuts only)
        switch = switch_of(salt)
        own = switch_cuts(cuts, salt)
        if ids.enabled and cache_prompt:
            # at least the last piece (fast: token) is evaluated: its logits are needed
            limit = (
                ids.rule.image_floor(prompt, len(prompt) - 1) if ids.fast else last_cut(own, len(prompt) - 1)
            )
        # (an id's cells serve up to where its salt and the prompt's differ: an aLoRA's
        # prefix is the base model's — docs/lora.md, "Activated LoRA")
        agrees = {i: _agreed(ids.salt(i), salt, limit) for i in free_ids}
        if ids.fast:
            shared = {
                i: ids.rule.image_floor(prompt, _common_prefix(ids.cached(i), prompt, agrees[i]))
                if agrees[i]
                else 0
                for i in free_ids
            }
        else:
            shared = {
                i: shared_prefix(
                    ids.cached(i), prompt, own if switch_of(ids.salt(i)) == switch else cuts, agrees[i]
                )
                if agrees[i]
                else 0
                for i in free_ids
            }
        # (a longer prefix needs fewer window cells: if an id's cells cannot give back what
        # it shares, they give back nothing — but a checkpoint of its window cells at a
        # shorter cut may)
        marked: dict[int, WindowMark] = {}
        for i, n in shared.items():
            if n and not ids.serves(i, n):
                mark = ids.marks.serving(i, n, ids.host.window) if ids.marks.keep else None
                shared[i] = 0 if mark is None else mark.end
                if mark is not None:
                    marked[i] = mark
        hit = (
            self._whole_hit(prompt, free_ids, salt)
            if whole and ids.enabled and cache_prompt and not ids.fast
            else None
        )
        best = max(free_ids, key=lambda i: (shared[i], -ids.used_at(i))) if hit is None else hit
        reused = shared[best] if hit is None else len(prompt)
        restore = None
        host = ids.host
        found = self._host_best(prompt, limit, salt) if limit and host.keeps and hit is None else None
        if found is not None and found[0] > reused:
            # host memory holds more of it: restore into the least recently used id
            best = min(free_ids, key=lambda i: ids.used_at(i))
            reused, restore = found
        save = None
        checkpoint = 0
        if ids.savable(best) and (restore is not None or len(ids.cached(best)) - reused > short_tail(reused)):
            save = ids.cached(best)  # (some of) its cells are about to be overwritten
            # (a restore replaces every cell: the checkpoint may go below ``reused``)
            checkpoint = ids.checkpoint(best, 0 if restore is not None else reused)
        window = marked.get(best) if restore is None and hit is None else None
        return Placement(best, reused, save, restore, checkpoint, ids.salt(best), hit is not None, window)

    def _host_best(
        self, prompt: list[int], limit: int, salt: str
    ) -> tuple[int, StateBuffer | bytes | DiskEntry] | None:
        """The host (or disk) tier's entry sharing the most of ``prompt`` under ``salt`` —
        or, for an aLoRA's prompt, under its prefix salt up to its switch (the base
        model's entries)."""
        ids = self._ids
        cuts = ids.host_cuts(prompt)
        found = ids.host.best(prompt, cuts, limit, salt=salt)
        prefix, switch, _ = unswitched(salt)
        if switch and (found is None or found[0] < switch):
            base = ids.host.best(prompt, cuts, min(limit, switch), salt=prefix)
            if base is not None and (found is None or base[0] > found[0]):
                return base
        return found

    def _whole_hit(self, prompt: list[int], free_ids: list[int], salt: str) -> int | None:
        """A free id whose cells hold all of ``prompt`` and its last token's logits (the
        most recently used of them), if any."""
        ids = self._ids
        n = len(prompt)
        found = [
            i
            for i in free_ids
            if ids.logits_at(i) == n
            and ids.salt(i) == salt
            and ids.serves(i, n)
            and ids.cached(i)[:n] == prompt
        ]
        return max(found, key=lambda i: ids.used_at(i)) if found else None

    def place_follower(self, free_ids: list[int]) -> Placement:
        """A later choice of an ``n`` > 1 request: the least recently used free id (it
        gets a copy of its leader's cells once the prompt is evaluated)."""
        ids = self._ids
        best = min(free_ids, key=lambda i: ids.used_at(i))
        save = ids.cached(best) if ids.savable(best) else None
        return Placement(best, save=save, save_salt=ids.salt(best))
