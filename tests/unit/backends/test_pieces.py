"""The canonical cut (``_pieces.PieceRule``): causal, following turn headers, lines and
sentences, never longer than the longest piece; and the guess of the next turn's start.

Tokens here are small ints with a made-up vocabulary: the rule only sees their classes."""

from __future__ import annotations

import itertools
import random

import pytest

from trioserve._backends._cache._pieces import END, NL, SENT, START, WS, PieceRule, classify_piece, host_rule

# a vocabulary: 0-49 words, 50 ".", 51 "\n", 52 "<start_of_turn>", 53 "<end_of_turn>",
# 54 "user", 55 "model", 56 " " (whitespace), 57 ".\n" (ends a line)
WORD, DOT, LF, SOT, EOT, USER, MODEL, SPACE, DOTLF = 1, 50, 51, 52, 53, 54, 55, 56, 57
CLASSES = {DOT: SENT, LF: NL | WS, SOT: START, EOT: END, SPACE: WS, DOTLF: NL}


def rule(**kwargs: int) -> PieceRule:
    settings = {"max_piece": 16, "min_line": 6, "min_sentence": 10} | kwargs
    return PieceRule(lambda t: CLASSES.get(t, 0), n_vocab=64, **settings)


def turn(role: int, words: int) -> list[int]:
    return [SOT, role, LF, *([WORD] * words), EOT, LF]


def test_the_classes_come_from_the_text_and_the_control_attributes() -> None:
    assert classify_piece(b"\n", control=False, end=False) == NL | WS
    assert classify_piece(b" again.", control=False, end=False) == SENT
    assert classify_piece(b".\n", control=False, end=False) == NL
    assert classify_piece(b"word", control=False, end=False) == 0
    assert classify_piece(b"", control=True, end=False) == START
    assert classify_piece(b"", control=True, end=True) == END
    assert classify_piece("。".encode(), control=False, end=False) == SENT


def test_the_aligned_rule_cuts_every_max_piece_tokens() -> None:
    aligned = PieceRule(None, max_piece=4)
    assert aligned.cuts(list(range(10))) == [4, 8]
    assert aligned.cuts(list(range(8))) == [4, 8]
    assert aligned.kind == "aligned"
    assert aligned.continuation([SOT, MODEL, LF]) == []


def test_text_without_structure_is_cut_as_the_aligned_rule_cuts_it() -> None:
    assert rule().cuts([WORD] * 40) == [16, 32]


def test_a_turn_header_closes_a_piece_of_any_length() -> None:
    prompt = [*turn(USER, 3), SOT, MODEL, LF]
    # "<sot>user\n" | "w w w <eot>\n <sot>model\n" — the header lines end the pieces
    assert rule().cuts(prompt) == [3, len(prompt)]
    # and the prompt ends on a cut: its last piece is whole, reusable by the next turn


def test_a_control_tokens_own_line_is_not_a_header() -> None:
    # "<eot>\n" holds only an end-of-generation token: not a header, not a line of text
    r = rule(min_line=1)
    assert r.cuts([WORD] * 5 + [EOT, LF]) == []
    assert r.cuts([WORD] * 5 + [DOTLF]) == [6]  # a line of text, long enough


def test_lines_and_sentences_close_a_piece_once_it_is_long_enough() -> None:
    r = rule()
    assert r.cuts([WORD] * 3 + [DOTLF] + [WORD] * 3) == []  # a 4-token line: too short
    assert r.cuts([WORD] * 6 + [DOTLF] + [WORD] * 3) == [7]
    assert r.cuts([WORD] * 5 + [DOT] + [WORD] * 3) == []  # a 6-token sentence: too short
    assert r.cuts([WORD] * 9 + [DOT] + [WORD] * 3) == [10]


def test_no_piece_is_longer_than_max_piece() -> None:
    rng = random.Random(5)
    r = rule()
    for _ in range(200):
        tokens = [
            rng.choice([WORD] * 8 + [DOT, LF, SOT, EOT, USER, MODEL, DOTLF]) for _ in range(rng.randrange(80))
        ]
        cuts = r.cuts(tokens)
        edges = [0, *cuts, len(tokens)]
        assert all(0 < b - a <= 16 for a, b in itertools.pairwise(edges) if b != a)
        assert cuts == sorted(set(cuts))


@pytest.mark.parametrize("deep", [{}, {"deep_from": 30, "deep_piece": 40}])
def test_the_rule_is_causal_every_cut_of_a_prefix_is_a_cut_of_the_whole(deep: dict[str, int]) -> None:
    rng = random.Random(7)
    r = rule(**deep)
    for _ in range(200):
        tokens = [rng.choice([WORD] * 6 + [DOT, LF, SOT, EOT, USER, MODEL, SPACE, DOTLF]) for _ in range(120)]
        whole = r.cuts(tokens)
        for n in range(len(tokens) + 1):
            assert r.cuts(tokens[:n]) == [c for c in whole if c <= n]


@pytest.mark.parametrize("deep", [{}, {"deep_from": 4, "deep_piece": 64}])
def test_a_conversation_turn_ends_on_a_cut_that_the_next_turn_shares(deep: dict[str, int]) -> None:
    r = rule(max_piece=64, **deep)
    first = [0, *turn(USER, 20), SOT, MODEL, LF]
    reply = [WORD] * 7
    second = [*first, *reply, EOT, LF, *turn(USER, 12)[:-2], EOT, LF, SOT, MODEL, LF]
    assert len(first) in r.cuts(first)  # the first prompt's last piece is whole
    assert len(first) in r.cuts(second)  # and the next prompt makes the same cut
    # the guess of what follows the reply: the end of a turn and the user's header
    guess = r.continuation(first)
    assert guess == [EOT, LF, SOT, USER, LF]
    history = first + reply + guess
    assert history == second[: len(history)]
    assert len(history) in r.cuts(history)  # the recomputed reply ends on a cut
    assert len(history) in r.cuts(second)  # that the next prompt shares


def test_a_deep_piece_ends_only_at_a_turn_header_or_at_its_length() -> None:
    r = rule(deep_from=32, deep_piece=40)
    text = ([WORD] * 9 + [DOT] + [WORD] * 5 + [DOTLF]) * 10  # a sentence and a line every 16
    cuts = r.cuts(text)
    # shallow: the sentences and lines close pieces (10, then 16 each); from 32 on, 40 each
    assert cuts == [10, 16, 26, 32, 72, 112, 152]
    # a turn header still closes a deep piece of any length
    prompt = [*text[:50], EOT, LF, SOT, USER, LF, *([WORD] * 45)]
    assert r.cuts(prompt) == [10, 16, 26, 32, len(text[:50]) + 5, len(text[:50]) + 5 + 40]
    # every piece past the shallow part is a deep one: never longer, and whole where no
    # header closes it
    edges = [0, *cuts]
    assert all(b - a == 40 for a, b in itertools.pairwise(edges) if a >= 32)


def test_the_aligned_rule_takes_deep_pieces_too() -> None:
    aligned = PieceRule(None, max_piece=4, deep_from=8, deep_piece=16)
    assert aligned.cuts(list(range(45))) == [4, 8, 24, 40]
    # deep_from inside a piece: the piece that starts past it is the first deep one
    assert PieceRule(None, max_piece=4, deep_from=6, deep_piece=16).cuts(list(range(30))) == [4, 8, 24]


def test_no_deep_piece_is_shorter_than_the_longest_shallow_one() -> None:
    with pytest.raises(ValueError, match="deep_piece"):
        PieceRule(None, max_piece=16, deep_from=32, deep_piece=8)


def test_there_is_no_guess_without_a_header_at_the_end() -> None:
    r = rule()
    assert r.continuation([WORD] * 10) == []
    assert r.continuation([SOT, MODEL, LF]) == []  # no header before it to copy


def test_the_host_rule_key_names_the_cut() -> None:
    assert host_rule("text", 128, fast=True) == "token"
    assert host_rule("text", 128, fast=False) != host_rule("aligned", 128, fast=False)
    assert host_rule("text", 128, fast=False) != host_rule("text", 64, fast=False)
    assert host_rule("text", 128, fast=False) == PieceRule(lambda t: 0, max_piece=128).key
    deep = host_rule("text", 128, fast=False, deep_from=1024, deep_piece=512)
    assert deep != host_rule("text", 128, fast=False)
    assert deep != host_rule("text", 128, fast=False, deep_from=2048, deep_piece=512)
    assert deep != host_rule("text", 128, fast=False, deep_from=1024, deep_piece=256)


@pytest.mark.parametrize("max_piece", [0, -1])
def test_a_piece_has_at_least_one_token(max_piece: int) -> None:
    with pytest.raises(ValueError, match="max_piece"):
        PieceRule(None, max_piece=max_piece)
