"""Salts that change along a prompt (docs/lora.md, "Activated LoRA"): an activated LoRA
(aLoRA) request's cells before its adapter turns on are the base model's — computed
with the request's adapter set less the aLoRA, and cached under that set's salt — and
its cells from there on are the aLoRA's. Its salt says both: the *prefix salt*, the
position where the adapter turns on (the *switch*, a cut of the prompt), and the salt
of the cells from there on (``PREFIX\\0switch:N\\0SALT``; no salt holds a NUL
otherwise: ``cache_salt`` and a key's salt are text, an adapter set's part starts with
one).

Cells (and host or disk entries) of one salt serve a prompt of another only where the
two say the same salt at every position (:func:`agreement`): a base request reuses an
aLoRA request's cells up to its switch, an aLoRA request reuses the base's up to its
own, and the cells past a switch serve only the same adapter switched at the same
position. Pure string work: the cache policy and the scheduler use it."""

from __future__ import annotations

import bisect

__all__ = ["agreement", "final_salt", "switch_cuts", "switch_of", "switched_salt", "unswitched"]

_SWITCH = "\0switch:"


def switched_salt(prefix: str, at: int, salt: str) -> str:
    """The salt of a prompt whose cells before ``at`` are of ``prefix`` and from ``at``
    on of ``salt`` (``at`` 0: ``salt`` alone)."""
    if at <= 0 or prefix == salt:
        return salt
    return f"{prefix}{_SWITCH}{at}\0{salt}"


def unswitched(salt: str) -> tuple[str, int, str]:
    """``(prefix salt, switch, final salt)`` of ``salt`` (a plain salt: ``(salt, 0,
    salt)``)."""
    prefix, mark, rest = salt.partition(_SWITCH)
    if not mark:
        return salt, 0, salt
    at, _, final = rest.partition("\0")
    return prefix, int(at), final


def final_salt(salt: str) -> str:
    """The salt of the cells past the switch (what a conversation's reply is computed
    with)."""
    return unswitched(salt)[2]


def switch_of(salt: str) -> int:
    """Where the salt changes (0: nowhere)."""
    return unswitched(salt)[1]


def agreement(a: str, b: str) -> int | None:
    """The first position where cells of salt ``a`` and of salt ``b`` differ (``None``:
    nowhere — the same salt at every position)."""
    if a == b:
        return None
    pa, sa, fa = unswitched(a)
    pb, sb, fb = unswitched(b)
    for at in sorted({0, sa, sb}):
        if (pa if at < sa else fa) != (pb if at < sb else fb):
            return at
    return None


def switch_cuts(cuts: list[int], salt: str) -> list[int]:
    """``cuts`` (a prompt's canonical cuts, ascending) with its switch added: the
    adapter set changes there, so no call spans it."""
    at = switch_of(salt)
    if not at:
        return cuts
    i = bisect.bisect_left(cuts, at)
    if i < len(cuts) and cuts[i] == at:
        return cuts
    return [*cuts[:i], at, *cuts[i:]]
