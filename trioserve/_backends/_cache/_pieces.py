"""Where a prompt is cut into ``llama_decode`` calls (docs/prompt-cache.md, "The cut").

A prompt's KV cells depend on how it was cut into calls, so the exact prompt cache
reuses only cells computed in the calls a fresh server would make for the same tokens.
:class:`PieceRule` is that canonical cut: a function of the tokens alone, and *causal* —
whether the rule cuts at position ``p`` depends only on ``tokens[:p]`` — so every cut of
a prompt is a cut of every longer prompt that starts with it, and a cached prefix that
ends on a cut is a whole number of the longer prompt's own pieces.

The rule follows the text: it cuts after a turn header (a line that holds a control
token that is not an end of generation: ``<start_of_turn>model\\n``,
``<|im_start|>assistant\\n``, ``<|start_header_id|>user<|end_header_id|>\\n\\n``), after a
line of text or a sentence once the piece is long enough to be efficient, and never
lets a piece grow past ``max_piece`` tokens. A prompt with no structure at all is cut
every ``max_piece`` tokens from its start (deep pieces aside): the absolute alignment of
before, exactly.

**Deep pieces** (issue 49, docs/prompt-cache.md "Deep pieces"): a piece that starts at
``deep_from`` tokens or later ignores lines and sentences: it ends at a turn header or
after exactly ``deep_piece`` tokens. A CPU's kernels compute rows in tiles (128 on the
machines measured): a piece that ends at a sentence (~100 rows) pays for a whole tile,
and past the first thousand tokens a prompt's cost is in its long text, not in where
the next request may part from it. Still a function of the tokens alone (the piece's
start is), so still causal.

An image in a prompt (docs/vision.md) is a run of placeholder ids ≥ ``n_vocab``, the
first of each image's at an even offset from ``n_vocab`` and the rest at odd ones
(``_media/_layout.py``): an image is evaluated in one call, so the cut never falls inside
one, and falls at each image's start and end (its cells are then a whole piece: a later
turn about the same image reuses them). That rule needs the token after a cut, so it
is causal only for prompts that do not end inside an image, which no prompt does.

Pure Python and numpy: the scheduler thread computes cuts; a token's class is looked up
once per token id (lazily: the vocabulary has up to 262,144 entries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy

__all__ = [
    "END",
    "NL",
    "SENT",
    "START",
    "WS",
    "PieceRule",
    "classify_piece",
    "host_rule",
    "image_runs",
    "make_rule",
]

#: token classes (bits)
NL = 1  #: its text ends with a newline
SENT = 2  #: its text ends a sentence (``.``, ``!``, ``?``, ``;``, ``:`` and CJK stops)
WS = 4  #: its text is whitespace only
START = 8  #: a control token that is not an end of generation (``<start_of_turn>``)
END = 16  #: a control token that ends generation (``<end_of_turn>``, ``<|im_end|>``)
_UNKNOWN = 255

_SENTENCE_ENDS = tuple(s.encode() for s in (".", "!", "?", ";", ":", "。", "！", "？", "；"))


def image_runs(tokens: Sequence[int], n_vocab: int) -> list[tuple[int, int]]:
    """Each image's ``(start, end)`` in ``tokens`` (placeholder ids ≥ ``n_vocab``; an
    even offset from ``n_vocab`` starts an image), in order."""
    if not n_vocab or not len(tokens):
        return []
    ids = numpy.asarray(tokens, dtype=numpy.int64)
    image = ids >= n_vocab
    if not image.any():
        return []
    starts = image & (((ids - n_vocab) % 2 == 0) | ~numpy.concatenate(([False], image[:-1])))
    start_at = numpy.flatnonzero(starts).tolist()
    out = []
    for i, start in enumerate(start_at):
        end = start + 1
        limit = start_at[i + 1] if i + 1 < len(start_at) else len(tokens)
        while end < limit and image[end]:
            end += 1
        out.append((start, end))
    return out


def classify_piece(piece: bytes, *, control: bool, end: bool) -> int:
    """The class bits of one token, from its text and its control attributes."""
    if control:
        return END if end else START
    cls = 0
    if piece.endswith(b"\n"):
        cls |= NL
    if piece and not piece.strip():
        cls |= WS
    elif piece.rstrip().endswith(_SENTENCE_ENDS) and not cls & NL:
        cls |= SENT
    return cls


class PieceRule:
    """The canonical cut of token sequences into prefill calls.

    ``classify(token) -> bits`` gives a token's class; ``None`` makes the rule
    ``aligned``: every ``max_piece`` tokens from position 0, whatever the text (every
    ``deep_piece`` from the first cut at or past ``deep_from``).
    ``min_line`` / ``min_sentence``: the shortest piece a line end / a sentence end
    closes (shorter pieces cost more per token: docs/prompt-cache.md); a turn header
    closes a piece of any length. ``window``: the most tokens a header line holds.
    ``deep_from`` / ``deep_piece``: a piece that starts at ``deep_from`` or later is
    closed only by a turn header or at ``deep_piece`` tokens (0: no deep pieces)."""

    def __init__(
        self,
        classify: Callable[[int], int] | None,
        *,
        n_vocab: int = 0,
        max_piece: int = 128,
        min_line: int = 96,
        min_sentence: int = 96,
        window: int = 8,
        deep_from: int = 0,
        deep_piece: int = 0,
    ) -> None:
        if max_piece < 1:
            raise ValueError(f"max_piece must be at least 1, got {max_piece}")
        if deep_piece and deep_piece < max_piece:
            raise ValueError(f"deep_piece must be 0 or at least max_piece={max_piece}, got {deep_piece}")
        if deep_from < 0:
            raise ValueError(f"deep_from must be at least 0, got {deep_from}")
        self.deep_from = deep_from if deep_piece else 0
        self.deep_piece = deep_piece
        self.max_piece = max_piece
        self.min_line = min_line
        self.min_sentence = min_sentence
        self.window = window
        self._classify = classify
        self._table = numpy.full(n_vocab, _UNKNOWN, dtype=numpy.uint8) if classify is not None else None
        #: ids from here up are images' placeholders (0: the rule knows no vocabulary)
        self.n_vocab = n_vocab
        self.kind: Literal["text", "aligned"] = "aligned" if classify is None else "text"
        #: identifies the rule: a host tier of cached prefixes is valid only under it
        self.key = f"{self.kind}/{max_piece}/{min_line}/{min_sentence}/{window}"
        if deep_piece:
            self.key += f"/deep{self.deep_from}:{deep_piece}"

    # ------------------------------------------------------------------ classes

    def classes(self, tokens: Sequence[int]) -> list[int]:
        """Each token's class bits (looked up; unseen token ids classified once)."""
        table = self._table
        if table is None:
            return [0] * len(tokens)
        ids = numpy.asarray(tokens, dtype=numpy.int64)
        image = ids >= len(table)
        if image.any():
            ids = numpy.where(image, 0, ids)  # (an image's placeholders: looked up as id 0…)
        found = table[ids]
        unknown = found == _UNKNOWN
        if unknown.any():
            assert self._classify is not None
            for token in numpy.unique(ids[unknown]).tolist():
                table[token] = self._classify(token)
            found = table[ids]
        if image.any():
            found = numpy.where(image, 0, found)  # (…and classed as plain text)
        classes: list[int] = found.tolist()
        return classes

    # --------------------------------------------------------------------- cuts

    def cuts(self, tokens: Sequence[int]) -> list[int]:
        """The positions ``p`` (``0 < p <= len(tokens)``) where the rule cuts, in order.
        The end of ``tokens`` is listed only if the rule cuts there (a prompt's last
        call always ends there; it is a *cut* — reusable by a longer prompt — only then)."""
        out = self._text_cuts(tokens)
        runs = image_runs(tokens, self.n_vocab)
        return self.around_images(out, runs) if runs else out

    @staticmethod
    def around_images(cuts: Sequence[int], runs: list[tuple[int, int]]) -> list[int]:
        """``cuts`` with none inside an image, and one at each image's start and end."""
        kept = set(cuts)
        for start, end in runs:
            kept.difference_update(range(start + 1, end))
            if start:
                kept.add(start)
            kept.add(end)
        return sorted(kept)

    def image_floor(self, tokens: Sequence[int], n: int) -> int:
        """``n``, or the start of the image it falls inside (a prefix never ends there)."""
        if 0 < n < len(tokens) and tokens[n] >= self.n_vocab > 0 and (tokens[n] - self.n_vocab) % 2:
            while n > 0 and tokens[n] >= self.n_vocab and (tokens[n] - self.n_vocab) % 2:
                n -= 1
        return n

    def after_header(self, tokens: Sequence[int], end: int) -> bool:
        """Whether ``tokens[:end]`` ends with a turn header's line (a new turn starts at
        ``end``)."""
        if self._table is None or end <= 0:
            return False
        start = max(0, end - self.window - 1)
        cls = self.classes(tokens[start:end])
        return bool(cls[-1] & NL) and self._header_start(cls, len(cls) - 1, 0) >= 0

    def deep(self, start: int) -> bool:
        """Whether a piece that starts at ``start`` is a deep one."""
        return bool(self.deep_piece) and start >= self.deep_from

    def limit(self, start: int) -> int:
        """The longest piece that starts at ``start``."""
        return self.deep_piece if self.deep(start) else self.max_piece

    def _text_cuts(self, tokens: Sequence[int]) -> list[int]:
        n = len(tokens)
        out: list[int] = []
        b = 0
        if self._table is None:
            while n - b >= (limit := self.limit(b)):
                b += limit
                out.append(b)
            return out
        cls = self.classes(tokens)
        limit = self.limit(0)
        for i, c in enumerate(cls):
            if not c & (NL | SENT):
                continue
            p = i + 1
            while p - b > limit:
                b += limit
                out.append(b)
                limit = self.limit(b)
            if p - b == limit or self._closes(cls, i, b, c, deep=self.deep(b)):
                out.append(p)
                b = p
                limit = self.limit(b)
        while n - b >= limit:
            b += limit
            out.append(b)
            limit = self.limit(b)
        return out

    def _closes(self, cls: list[int], i: int, b: int, c: int, *, deep: bool) -> bool:
        """Whether token ``i`` (a line or sentence end) closes the piece that started at
        ``b`` (the rule for cuts other than the length limit; a deep piece: a turn header
        only)."""
        if c & NL:
            if self._header_start(cls, i, b) >= 0:
                return True
            if deep:
                return False
            # a line of text (not a control token's own line: ``<end_of_turn>\n``)
            return i + 1 - b >= self.min_line and i > 0 and not cls[i - 1] & (START | END)
        return not deep and i + 1 - b >= self.min_sentence

    def _header_start(self, cls: list[int], i: int, b: int) -> int:
        """If the line that token ``i`` (a newline) ends is a turn header — a short line,
        within the piece, holding a control token that does not end generation — the
        index of that line's first such token; else -1."""
        start = -1
        j = i - 1
        low = max(b, i - self.window)
        while j >= low:
            c = cls[j]
            if c & NL:
                break
            if c & START:
                start = j
            j -= 1
        return start

    # ------------------------------------------------------------- continuation

    def continuation(self, prompt: Sequence[int]) -> list[int]:
        """The tokens a conversation's next prompt most likely holds right after the
        reply to ``prompt``: the end of a turn and the next turn's header as ``prompt``
        itself wrote them (``<end_of_turn>\\n<start_of_turn>user\\n``). Empty when
        ``prompt`` does not end with a turn header. The idle recompute evaluates the reply
        with this guess, so that the reply's last piece ends on the cut the next prompt
        makes; a wrong guess only wastes idle time (its cells match nothing)."""
        n = len(prompt)
        if n < 2:
            return []
        cls = self.classes(prompt)
        if not cls[-1] & NL:
            return []
        header = self._header_start(cls, n - 1, 0)
        if header < 0:
            return []
        # the end of the turn before the header: end-of-generation tokens and whitespace
        closer = header
        while (
            closer > 0
            and header - closer < 4
            and cls[closer - 1] & (END | WS)
            and not cls[closer - 1] & START
        ):
            closer -= 1
        # the turn header before that one (the user's, as a rule)
        for i in range(closer - 1, 0, -1):
            if cls[i] & NL:
                start = self._header_start(cls, i, 0)
                if start >= 0:
                    return list(prompt[closer:header]) + list(prompt[start : i + 1])
        return []


def make_rule(
    kind: Literal["text", "aligned"],
    max_piece: int,
    *,
    classify: Callable[[int], int],
    n_vocab: int,
    deep_from: int = 0,
    deep_piece: int = 0,
) -> PieceRule:
    """The rule a backend cuts prompts with (``LlamaSettings.piece_rule``)."""
    return PieceRule(
        classify if kind == "text" else None,
        n_vocab=n_vocab,
        max_piece=max_piece,
        deep_from=deep_from,
        deep_piece=deep_piece,
    )


def host_rule(
    kind: Literal["text", "aligned"], max_piece: int, *, fast: bool, deep_from: int = 0, deep_piece: int = 0
) -> str:
    """What a host tier made under these settings is indexed by (:attr:`PieceRule.key`,
    or ``"token"`` in fast mode), without loading the model."""
    if fast:
        return "token"
    classify = None if kind == "aligned" else _no_class
    return PieceRule(classify, max_piece=max_piece, deep_from=deep_from, deep_piece=deep_piece).key


def _no_class(token: int) -> int:  # pragma: no cover - never called (a key only)
    return 0
