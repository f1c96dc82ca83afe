"""Activated LoRA (aLoRA, docs/lora.md "Activated LoRA"): an adapter that turns on
where its invocation tokens last occur in the prompt; the prompt before that is the
base model's. As llama-server decides it (``launch_slot_with_task``): the last
occurrence, searched from the prompt's end; absent, the request runs without the
adapter; one aLoRA a request. llama-server runs the adapter from the token *before*
the invocation tokens on (its ``alora_invocation_start - 1``): so does trioserve, for
the same text."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Sequence

from ..._core._backend import PreparedPrompt
from ..._core._exceptions import InvalidRequestError
from ._adapters import AdapterSet, LoraAdapter

__all__ = ["MULTIPLE", "activate", "activated", "find_invocation", "invocations"]

#: llama-server's refusal, word for word
MULTIPLE = "Cannot run multiple aLoRAs in a single request"


def find_invocation(tokens: Sequence[int], invocation: Sequence[int]) -> int:
    """Where the last occurrence of ``invocation`` starts in ``tokens`` (-1: none).
    On the bytes of the token ids (C speed: 2.5 ms for a 100,000-token prompt without
    it, measured — the ids' conversion most of that; tens of µs for a few thousand)."""
    if not invocation or len(invocation) > len(tokens):
        return -1
    haystack = array("q", tokens).tobytes()
    needle = array("q", invocation).tobytes()
    width = array("q").itemsize
    end = len(haystack)
    while (at := haystack.rfind(needle, 0, end)) >= 0:
        if at % width == 0:
            return at // width
        end = at + len(needle) - 1  # (a match across two ids: look before it)
    return -1


def activate(
    adapters: AdapterSet,
    tokens: Sequence[int],
    invocation: Callable[[str], tuple[int, ...]],
    n_vocab: int = 0,
) -> tuple[AdapterSet, tuple[str, int] | None]:
    """A request's adapter set with its aLoRA resolved against its prompt: ``(set,
    (its aLoRA, the position it applies from) or None)``. Its invocation absent: the
    set without it (llama-server: "requested, but not found. deactivating"). More than
    one aLoRA: 400 (llama-server's words). ``invocation(name)``: an adapter's tokens
    (empty: a plain LoRA). The token before the invocation an image's (an id from
    ``n_vocab`` up: a placeholder): the adapter applies from the invocation itself — an
    image is evaluated whole, in one call (docs/vision.md)."""
    activated = [(name, invocation(name)) for name, _ in adapters]
    activated = [(name, tokens_) for name, tokens_ in activated if tokens_]
    if not activated:
        return adapters, None
    if len(activated) > 1:
        raise InvalidRequestError(MULTIPLE, param="lora")
    name, invoked = activated[0]
    start = find_invocation(tokens, invoked)
    if start < 0:
        return tuple(pair for pair in adapters if pair[0] != name), None
    at = max(start - 1, 0)
    if at and n_vocab and tokens[at] >= n_vocab:
        at = start
    return adapters, ((name, at) if at else None)


def activated(
    prompt: PreparedPrompt, keyed: AdapterSet, invocation: Callable[[str], tuple[int, ...]], n_vocab: int
) -> PreparedPrompt:
    """``prompt`` run with ``keyed`` (its adapters bound to their files), its aLoRA
    resolved (:func:`activate`): ``PreparedPrompt.alora``."""
    adapters, alora = activate(keyed, prompt.tokens, invocation, n_vocab)
    return dataclasses.replace(prompt, adapters=adapters, alora=alora)


def invocations(
    listed: Sequence[LoraAdapter], piece: Callable[[int], bytes]
) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``ModelInfo.alora``: each aLoRA's name, invocation tokens and their text as
    llama-server shows it (each token's piece, control tokens as their text)."""
    return tuple(
        (a.name, a.invocation, b"".join(map(piece, a.invocation)).decode(errors="replace"))
        for a in listed
        if a.invocation
    )
