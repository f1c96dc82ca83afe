"""Activated LoRA (docs/lora.md, "Activated LoRA"): where the adapter turns on (as
llama-server decides it), and the salts that let the prefix before it be the base
model's in every cache while the cells after it serve only the same adapter."""

from __future__ import annotations

import pytest

from trioserve._backends._cache import CachePolicy, HostCache, PieceRule
from trioserve._backends._cache._switch_salt import (
    agreement,
    final_salt,
    switch_cuts,
    switched_salt,
    unswitched,
)
from trioserve._backends._llama._adapters import adapter_salt, adapters_of_salt
from trioserve._backends._llama._alora import MULTIPLE, activate, find_invocation
from trioserve._core._exceptions import InvalidRequestError

INVOKE = (105, 4368, 107)


def test_the_last_occurrence_of_the_invocation_is_found_and_only_whole_token_ids_match() -> None:
    prompt = [2, 105, 4368, 107, 9, 105, 4368, 107, 11]
    assert find_invocation(prompt, INVOKE) == 5  # the last one, as llama-server's backward scan
    assert find_invocation(prompt[:5], INVOKE) == 1
    assert find_invocation([2, 105, 4368, 9], INVOKE) == -1
    assert find_invocation([105, 4368], INVOKE) == -1  # (shorter than it)
    # 256's bytes hold 1's at a misaligned offset: not a token 1
    assert find_invocation([256, 0], (1,)) == -1
    assert find_invocation([256, 1, 0], (1,)) == 1


def _invocations(name: str) -> tuple[int, ...]:
    return INVOKE if name.startswith("al") else ()


def test_activate_mirrors_llama_server() -> None:
    prompt = [2, 7, 8, 105, 4368, 107]
    # found: the adapter runs from the token before the invocation (llama-server's start - 1)
    assert activate((("al", 1.0), ("b", 0.5)), prompt, _invocations) == ((("al", 1.0), ("b", 0.5)), ("al", 2))
    # absent: the request runs without it ("requested, but not found. deactivating")
    assert activate((("al", 1.0), ("b", 0.5)), prompt[:3], _invocations) == ((("b", 0.5),), None)
    # at the prompt's start: on for all of it (no prefix)
    assert activate((("al", 1.0),), [105, 4368, 107, 5], _invocations) == ((("al", 1.0),), None)
    assert activate((("al", 1.0),), [2, 105, 4368, 107, 5], _invocations) == ((("al", 1.0),), None)
    # an image just before it (its placeholders: ids from n_vocab up): from the invocation
    pictured = [2, 7, 5000, 5000, 105, 4368, 107]
    assert activate((("al", 1.0),), pictured, _invocations, 4096) == ((("al", 1.0),), ("al", 4))
    assert activate((("al", 1.0),), pictured, _invocations) == ((("al", 1.0),), ("al", 3))
    # plain LoRAs: unchanged
    assert activate((("b", 1.0),), prompt, _invocations) == ((("b", 1.0),), None)
    with pytest.raises(InvalidRequestError, match=MULTIPLE):
        activate((("al", 1.0), ("alt", 1.0)), prompt, _invocations)


def test_a_switched_salt_says_the_prefix_salt_before_its_switch_and_its_own_after() -> None:
    base = adapter_salt("key", ())
    full = adapter_salt("key", (("al@00", 1.0),))
    salt = switched_salt(base, 12, full)
    assert unswitched(salt) == (base, 12, full)
    assert unswitched(full) == (full, 0, full)
    assert final_salt(salt) == full
    assert adapters_of_salt(salt) == (("al@00", 1.0),)  # (its reply's set: the idle recompute's)
    assert switched_salt(base, 0, full) == full
    assert agreement(salt, salt) is None
    assert agreement(salt, base) == 12  # a base prompt: the same cells up to the switch
    assert agreement(base, salt) == 12
    assert agreement(salt, full) == 0  # the adapter all along: nothing in common
    assert agreement(salt, switched_salt(base, 8, full)) == 8  # switched elsewhere
    other = adapter_salt("key", (("al2@00", 1.0),))
    assert agreement(salt, switched_salt(base, 12, other)) == 12  # another aLoRA: its prefix
    assert agreement(salt, switched_salt("other key", 12, full)) == 0
    assert switch_cuts([4, 8, 16], salt) == [4, 8, 12, 16]
    assert switch_cuts([4, 12], salt) == [4, 12]
    assert switch_cuts([4, 8], base) == [4, 8]


def _policy(slots: int) -> CachePolicy:
    return CachePolicy(
        slots,
        rule=PieceRule(None, max_piece=4),
        host=HostCache(budget=10_000, rule="r"),
        enabled=True,
        fast=False,
        idle_recompute=False,
    )


def test_the_base_prefix_is_shared_and_the_cells_past_a_switch_serve_only_their_adapter() -> None:
    base = adapter_salt("", ())
    full = adapter_salt("", (("al@00", 1.0),))
    other = adapter_salt("", (("al2@00", 1.0),))
    prompt = list(range(20))
    cuts = list(range(4, 21, 4))  # (the canonical cuts: every 4)
    policy = _policy(1)
    # a base request's cells: an aLoRA switched at 10 reuses them up to the last
    # canonical cut before it (8: the base computed 8..12 as one piece, the aLoRA 8..10)
    policy.release(0, prompt, [], 20, finished=True)
    alora = switched_salt(base, 10, full)
    assert policy.place(prompt, cuts, True, [0], alora).reused == 8
    # switched on a canonical cut: up to it
    assert policy.place(prompt, cuts, True, [0], switched_salt(base, 12, full)).reused == 12
    # the aLoRA's own cells (pieces ..8, 8..10, 10..12, ...): another base prompt reuses
    # the base part only, never a cell past the switch
    policy.take(0, alora)
    policy.release(0, prompt, [], 20, finished=True)
    assert policy.place([*prompt, 1], cuts, True, [0], base).reused == 8
    # the same aLoRA switched at the same place: all of it (its own cut at 10 counts)
    longer = [*prompt, 1, 2, 3, 4]
    assert policy.place(longer, [*cuts, 24], True, [0], alora).reused == 20
    # another aLoRA switched at the same place: the prefix, to the switch
    assert policy.place(longer, [*cuts, 24], True, [0], switched_salt(base, 10, other)).reused == 10
    # the same aLoRA switched later (another invocation further on): the prefix only
    assert policy.place(longer, [*cuts, 24], True, [0], switched_salt(base, 22, full)).reused == 8
    # the adapter from the start: nothing
    assert policy.place(longer, [*cuts, 24], True, [0], full).reused == 0


def test_an_alora_prompt_restores_the_base_models_host_entry_up_to_its_switch() -> None:
    base = adapter_salt("", ())
    full = adapter_salt("", (("al@00", 1.0),))
    policy = _policy(1)
    prompt = list(range(20))
    cuts = list(range(4, 21, 4))
    policy.host.put(prompt, cuts, b"base state", salt=base)
    plan = policy.place(prompt, cuts, True, [0], switched_salt(base, 14, full))
    assert (plan.reused, plan.restore) == (12, b"base state")
    # an aLoRA's entry serves only its own salt
    policy.host.clear()
    policy.host.put(prompt, cuts, b"alora state", salt=switched_salt(base, 14, full))
    assert policy.place(prompt, cuts, True, [0], base).restore is None
    plan = policy.place([*prompt, 7], [*cuts], True, [0], switched_salt(base, 14, full))
    assert (plan.reused, plan.restore) == (20, b"alora state")
