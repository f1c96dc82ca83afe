"""Prompt-lookup drafting (``trioserve/_backends/_decoding/_speculation.py``), without a model."""

from __future__ import annotations

from trioserve._backends._decoding._speculation import (
    MAX_NGRAM,
    MIN_NGRAM,
    PATIENCE,
    SHORTEST_DRAFT,
    START_DRAFT,
    Drafter,
)


def test_it_proposes_what_followed_the_longest_match_in_the_prompt() -> None:
    # "1 2 3 4 5" appears; the context ends "… 1 2" and the token being decoded is 3
    drafter = Drafter([9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2], longest=4)
    assert drafter.propose(3, 4) == [4, 5, 6, 7]
    assert drafter.propose(3, 2) == [4, 5]  # the call's room limits it


def test_the_most_recent_occurrence_wins() -> None:
    drafter = Drafter([1, 2, 10, 11, 1, 2, 20, 21, 1], longest=6)
    assert drafter.propose(2, 2) == [20, 21]


def test_no_match_no_proposal() -> None:
    drafter = Drafter([1, 2, 3, 4, 5], longest=6)
    assert drafter.propose(99, 6) == []
    assert drafter.propose(3, 0) == []


def test_a_unigram_never_matches() -> None:
    # only the last token (3) and the one being decoded (7) — "3 7" never occurred
    drafter = Drafter([7, 8, 3], longest=6)
    assert MIN_NGRAM == 2
    assert drafter.propose(7, 6) == []


def test_accepted_tokens_extend_the_index() -> None:
    drafter = Drafter([5, 6], longest=6)
    assert drafter.propose(7, 6) == []
    drafter.extend([7, 8, 9, 5, 6])
    # the context is now 5 6 7 8 9 5 6: after "5 6" came 7, 8, 9 …
    assert drafter.propose(7, 3) == [8, 9, 5]


def test_a_copy_that_reaches_the_present_continues_with_the_current_token() -> None:
    # period 2: "4 5 4 5 4" + current 5: the longest match "4 5 4 5" was followed by
    # the last token (4), and then by the present: the current token (5)
    drafter = Drafter([4, 5, 4, 5, 4], longest=6)
    assert drafter.propose(5, 6) == [4, 5]


def test_the_draft_length_follows_acceptance() -> None:
    drafter = Drafter([1, 2, 3], longest=15)
    start = drafter.length
    assert start == START_DRAFT < 15
    drafter.settle(start, start)
    assert drafter.length == 15  # accepted whole: a copy is running, as far as a call holds
    drafter.settle(15, 9)
    assert drafter.length == 10  # what was accepted, plus one
    drafter.settle(10, 1)
    assert drafter.length == START_DRAFT  # never below the start length
    assert (drafter.proposed, drafter.accepted) == (start + 25, start + 10)
    # a call that holds fewer rows than the start length: no longer than it holds
    narrow = Drafter([1, 2, 3], longest=2)
    assert narrow.length == 2
    narrow.settle(2, 0)
    assert narrow.length == 2


def test_repeated_misses_ask_for_a_longer_match() -> None:
    # "1 2" occurred once, followed by 3 4: a two-token match
    drafter = Drafter([1, 2, 3, 4, 0, 1], longest=6)
    assert drafter.propose(2, 2) == [3, 4]
    for _ in range(PATIENCE):
        drafter.settle(2, 0)
    assert drafter.propose(2, 2) == []  # two tokens are no longer enough
    # a full acceptance resets it
    drafter.settle(2, 2)
    assert drafter.propose(2, 2) == [3, 4]


def test_a_single_guess_is_never_proposed() -> None:
    # a row costs what a one-token step does: one guess cannot pay for it
    drafter = Drafter([1, 2, 3, 0, 1], longest=6)
    assert SHORTEST_DRAFT == 2
    assert drafter.propose(2, 2) == [3, 0]
    assert drafter.propose(2, 1) == []  # the room for one guess only: none


def test_ngram_bounds_are_sane() -> None:
    assert 2 <= MIN_NGRAM <= MAX_NGRAM
