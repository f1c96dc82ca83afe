"""Constrained decoding with llguidance: a :class:`~trioserve._core._types.Constraint`
compiled against the model's vocabulary, and one :class:`TokenMask` per sequence that
masks the logits before each token is sampled.

Promises:

* **Never fail open.** A schema keyword the engine cannot enforce is an
  :class:`InvalidRequestError` naming it, at prepare time; a matcher that errs while
  decoding ends its sequence with an error.
* **Bounded work per token.** llguidance's parser limits (``LLParserLimits``: lexer fuel
  and Earley items per step) cap every mask computation, so a pathological grammar
  cannot hold the scheduler thread — and a cancel — for longer than one bounded step.
* **Bounded numbers.** Under a JSON Schema every JSON number is written with at most
  16 digits before the point, 16 after it and 2 in the exponent (llama.cpp's converter
  bounds both parts to 16 digits), so a small model cannot fill a number until
  ``max_tokens``; explicit bounds in the schema widen it (:func:`digit_bound`). The
  bound is a second matcher whose mask is intersected with the schema's: it only ever
  forbids more, and where it would leave nothing allowed (a schema that needs a longer
  number) it gives way to the schema for that number. ``docs/structured-output.md``,
  "The digit bound".

Why llguidance, by measurement: ``docs/grammar-engines.md``; the request fields and the
formats: ``docs/structured-output.md``.
"""

from __future__ import annotations

import ctypes
import decimal
import json
import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy

from ..._core._exceptions import InvalidRequestError
from ..._core._types import Constraint

__all__ = ["DigitBound", "GrammarCompiler", "TokenMask", "digit_bound"]

logger = logging.getLogger("trioserve.grammar")

#: JSON is generated compactly: no free whitespace (a small model under a schema that
#: allows it can loop on spaces and newlines until max_tokens)
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
#: applied after a schema's own ``x-guidance`` options: llguidance's ``lenient`` (ignore
#: the keywords it cannot enforce) and ``coerce_one_of`` (read oneOf as anyOf) would let
#: a request turn a refusal into a schema that is not enforced
_JSON_OVERRIDES: Any = {"lenient": False, "coerce_one_of": False}


class DigitBound(NamedTuple):
    """The most digits a JSON number may have."""

    #: before the point
    integral: int
    #: after the point
    fraction: int
    #: in the exponent
    exponent: int

    def regex(self, *, resume: bool = False) -> str:
        """The JSON texts whose numbers keep the bound, as one regex: outside strings,
        JSON's punctuation, whitespace, ``true``, ``false``, ``null`` and numbers of at
        most ``integral`` digits before the point, ``fraction`` after it and
        ``exponent`` in the exponent, each followed by what can follow a number; any
        string. It says nothing else about the text (the schema's grammar does). Kept
        this tight outside strings so that llguidance's walk of the vocabulary stops
        early there (measured on Gemma's 262,144 tokens: 3-40 µs a mask; with any
        character allowed outside strings, 3-7 ms).

        ``resume``: the same texts, continued from inside a number that is allowed any
        length — where the bound gave way to a schema that needs a longer number, it
        resumes with the next one (:class:`TokenMask`)."""
        number = (
            rf"-?(?:0|[1-9][0-9]{{0,{self.integral - 1}}})"
            rf"(?:\.[0-9]{{1,{self.fraction}}})?(?:[eE][+-]?[0-9]{{1,{self.exponent}}})?"
        )
        punctuation = r"[{}\[\],:\x20\t\n\r]"
        string = r'"(?:[^"\\]|\\(?s:.))*"'
        texts = rf"(?:{punctuation}|true|false|null|{string}|{number}{punctuation})*(?:{number})?"
        return rf"[0-9.eE+\-]*(?:{punctuation}{texts})?" if resume else texts


#: the bound of a JSON number when the schema names no longer one: 16 digits before the
#: point and 16 after it, as llama.cpp's JSON-Schema converter (``integral-part``,
#: ``decimal-part``); an exponent of at most 2 digits, so every number is a finite double
#: (llama.cpp allows 16 exponent digits: ``1e999`` is Infinity in JavaScript and Python)
DEFAULT_DIGIT_BOUND = DigitBound(16, 16, 2)

#: the keywords whose numbers a JSON value must reach: a bound the schema names is
#: widened to fit them (``exclusive*``: one digit more, the next value may need it)
_LIMITS = {"minimum": 0, "maximum": 0, "exclusiveMinimum": 1, "exclusiveMaximum": 1}
#: the keywords that name values: every number inside them
_VALUES = ("const", "enum")


def _numbers(value: Any) -> Iterator[int | float]:
    """Every JSON number in a ``const`` or ``enum`` value, at any depth (a stack, not
    recursion: a value nested deeper than Python recurses is still read)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if isinstance(node, int | float):
            yield node
        elif isinstance(node, dict):
            stack.extend(reversed(node.values()))
        elif isinstance(node, list):
            stack.extend(reversed(node))


def _literals(schema: Any) -> Iterator[tuple[str, int | float]]:
    """``(keyword, number)`` for each number a keyword of ``schema`` names, at any depth:
    the bounds, ``multipleOf``, and the numbers in ``const`` and ``enum``."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _LIMITS or key == "multipleOf":
                if isinstance(value, int | float) and not isinstance(value, bool):
                    yield key, value
            elif key in _VALUES:
                for number in _numbers(value):
                    yield key, number
            if isinstance(value, dict | list):
                stack.append(value)


def _digits(number: int | float, extra: int) -> tuple[int, int]:
    """The digits ``number`` needs before and after the point, written in plain decimal
    (as llguidance writes the numbers a schema names), each plus ``extra``."""
    if isinstance(number, float) and not math.isfinite(number):
        return 0, 0
    exact = decimal.Decimal(repr(number) if isinstance(number, float) else number)
    _, digits, exponent = exact.as_tuple()
    assert isinstance(exponent, int)
    return max(1, len(digits) + exponent) + extra, max(0, -exponent) + extra


def digit_bound(schema: Any) -> DigitBound:
    """The digit bound of every JSON number under ``schema``: the default (16, 16, 2),
    its integral and fraction parts widened to fit each number the schema says a value
    may or must reach — ``minimum``, ``maximum``, ``exclusiveMinimum``,
    ``exclusiveMaximum``, and the numbers in ``const`` and ``enum`` — wherever they
    appear. An explicit bound is kept: a schema with ``"maximum": 1e18`` can still write
    1000000000000000000. (The exponent needs no widening: llguidance writes those
    numbers without one.)"""
    integral, fraction, exponent = DEFAULT_DIGIT_BOUND
    for key, number in _literals(schema):
        if key != "multipleOf":
            before, after = _digits(number, _LIMITS.get(key, 0))
            integral, fraction = max(integral, before), max(fraction, after)
    return DigitBound(integral, fraction, exponent)


def _inexact(schema: Any) -> tuple[str, int] | None:
    """A keyword's integer that a double cannot hold (beyond 2**53): llguidance reads
    every number of a schema as a double, so it would enforce another value —
    ``{"const": 9007199254740993}`` would write 9007199254740992."""
    for key, number in _literals(schema):
        if isinstance(number, int) and abs(number) > 2**53:
            try:
                exact = int(float(number)) == number
            except OverflowError:  # beyond any double
                exact = False
            if not exact:
                return key, number
    return None


_PARAM = {"json_schema": "response_format", "lark": "grammar", "gbnf": "grammar"}

#: digit-bound matchers a compiler keeps (each bound twice: from the start, resumed)
_BOUNDS_KEPT = 16


class GrammarCompiler:
    """Compiles constraints for one model. The llguidance tokenizer (built from the
    llama.cpp vocabulary, about 2.5 s for 262,144 tokens) is built on first use."""

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, token_bytes: Callable[..., bytes]) -> None:
        self._lib = lib
        #: ``token_bytes(token, special=True)``: the model's ``llama_token_to_piece``
        self._token_bytes = token_bytes
        self._vocab = vocab
        self.n_vocab = n_vocab
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        #: compiles running (worker threads a cancel may have abandoned): the model must
        #: outlive them, they read its vocabulary (:meth:`wait_idle`)
        self._running = 0
        self._idle = threading.Condition()
        #: a fresh matcher per digit bound, compiled once, each mask gets a copy (at most
        #: ``_BOUNDS_KEPT``: a bound widened by a schema's own numbers is seldom seen twice)
        self._bounds: dict[tuple[DigitBound, bool], Any] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> GrammarCompiler:
        """A compiler around an llguidance ``LLTokenizer`` built elsewhere (tests)."""
        compiler = cls(None, None, tokenizer.vocab_size, lambda token, special=True: b"")
        compiler._tokenizer = tokenizer
        return compiler

    def wait_idle(self) -> None:
        """Block until no compile is running (before the model is freed)."""
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build_tokenizer()
            return self._tokenizer

    def _build_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary: every token's bytes, control tokens
        marked with a leading 0xFF (as ``llguidance.llamacpp.lltokenizer_from_vocab``
        does, with llama.cpp's current attribute call), and llama.cpp's tokenizer."""
        import llguidance

        lib, vocab = self._lib, self._vocab
        control = lib.LLAMA_TOKEN_ATTR_CONTROL
        user_defined = lib.LLAMA_TOKEN_ATTR_USER_DEFINED
        tokens: list[bytes] = []
        for token in range(self.n_vocab):
            piece = self._token_bytes(token, special=True)
            attr = lib.llama_vocab_get_attr(vocab, token)
            if attr & control or (attr & user_defined and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            tokens.append(piece)
        tokenize = ctypes.cast(lib.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
            tokens=tokens,
            vocab_ptr=vocab,
            tokenize_fptr=tokenize,
            eos_token=lib.llama_vocab_eos(vocab),
            slices=None,
        )

    def compile(self, constraint: Constraint, *, param: str | None = None) -> TokenMask:
        """A fresh mask for ``constraint`` (blocking: call it from a worker thread).

        Raises:
            InvalidRequestError: the grammar is invalid, or uses a feature that cannot
                be enforced (the message names it).
        """
        with self._idle:
            self._running += 1
        try:
            return self._compile(constraint, param)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _compile(self, constraint: Constraint, param: str | None) -> TokenMask:
        import llguidance

        param = param or _PARAM[constraint.kind]
        if constraint.kind == "json_schema":
            try:
                schema = json.loads(constraint.source)
            except ValueError as exc:  # pragma: no cover - the wire layer sends valid JSON
                raise InvalidRequestError(f"the JSON Schema is not valid JSON: {exc}", param=param) from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("the JSON Schema must be an object", param=param)
            inexact = _inexact(schema)
            if inexact is not None:
                try:
                    written = f"it would write {int(float(inexact[1]))}"
                except OverflowError:
                    written = "this one is beyond any double"
                raise InvalidRequestError(
                    f"the JSON Schema cannot be enforced: the integer {str(inexact[1])[:40]} in "
                    f"{inexact[0]!r} is beyond 2**53, and the grammar engine reads numbers as doubles "
                    f"({written})",
                    param=param,
                )
            # (the text, not the dict: llguidance cannot take a Python int beyond 64 bits)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                constraint.source, defaults=_JSON_OPTIONS, overrides=_JSON_OVERRIDES
            )
        elif constraint.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(constraint.source)
            except Exception as exc:
                raise InvalidRequestError(f"the GBNF grammar is not valid: {exc}", param=param) from None
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(constraint.source)
        tokenizer = self.tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            what = "JSON Schema" if constraint.kind == "json_schema" else "grammar"
            detail = messages[0] if messages else "invalid"
            raise InvalidRequestError(
                f"the {what} cannot be enforced: {detail}"
                + (" (these keywords are not supported; remove them)" if "Unimplemented" in detail else ""),
                param=param,
            )
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():  # pragma: no cover - validated above
            raise InvalidRequestError(f"the grammar cannot be enforced: {matcher.get_error()}", param=param)
        # a grammar the client wrote (Lark, GBNF) says itself how long its numbers are
        if constraint.kind != "json_schema":
            return TokenMask(matcher, self.n_vocab)
        limits = digit_bound(schema)
        return TokenMask(
            matcher,
            self.n_vocab,
            self.bound_matcher(limits),
            resume=self.bound_matcher(limits, resume=True),
        )

    def bound_matcher(self, bound: DigitBound, *, resume: bool = False) -> Any:
        """A fresh matcher of ``bound``'s texts (:meth:`DigitBound.regex`), from the start
        or (``resume``) from inside a number."""
        import llguidance

        key = (bound, resume)
        with self._lock:
            template = self._bounds.get(key)
        if template is None:
            grammar = llguidance.LLMatcher.grammar_from_regex(bound.regex(resume=resume))
            template = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
            if template.is_error():  # pragma: no cover - the regex is ours
                raise RuntimeError(f"the digit bound {bound} does not compile: {template.get_error()}")
            with self._lock:
                # the default bound is always kept (most schemas use it); widened ones
                # up to _BOUNDS_KEPT
                if bound == DEFAULT_DIGIT_BOUND or len(self._bounds) < _BOUNDS_KEPT:
                    template = self._bounds.setdefault(key, template)
        return template.deep_copy()


#: byte → its 8 bits, least significant first (llguidance's bitmask order)
_BYTE_BITS = numpy.unpackbits(numpy.arange(256, dtype=numpy.uint8)[:, None], axis=1, bitorder="little")


class TokenMask:
    """One sequence's constraint state. Used by the scheduler thread only; its buffers
    are allocated once, so a token costs no allocation of vocabulary size.

    ``bound``, when given, is a second matcher (the digit bound of a JSON Schema's
    numbers, :class:`DigitBound`) whose mask is intersected with the constraint's: a
    token must keep both valid. It only ever forbids more than the constraint, so it
    cannot fail open. Where the intersection would be empty — a schema that needs a
    longer number than the bound allows (``multipleOf``, a number the bound's widening
    did not foresee) — the bound gives way to the constraint for that number: a copy of
    ``resume`` (the bound's texts from inside a number of any length) takes over, and
    bounds the numbers after it. If that leaves nothing either, the constraint goes on
    alone. So the bound cannot leave a sequence without a valid continuation."""

    __slots__ = ("_bits", "_bound", "_bound_words", "_forbidden", "_matcher", "_n_vocab", "_resume", "_words")

    def __init__(self, matcher: Any, n_vocab: int, bound: Any = None, *, resume: Any = None) -> None:
        self._matcher = matcher
        self._bound = bound
        #: a fresh matcher to copy where the bound gives way inside a number (never consumed)
        self._resume = resume
        self._n_vocab = n_vocab
        words = (n_vocab + 31) // 32
        #: llguidance writes the mask here: bit i of the vocabulary = token i allowed
        self._words = numpy.full((1, words), -1, dtype=numpy.int32)
        #: the bound's mask, then the intersection of the two
        self._bound_words = numpy.full((1, words), -1, dtype=numpy.int32)
        self._bits = numpy.empty((words * 4, 8), dtype=numpy.uint8)
        self._forbidden = numpy.empty(n_vocab, dtype=bool)

    @property
    def bounded(self) -> bool:
        """Whether the digit bound is still applied."""
        return self._bound is not None

    def copy(self) -> TokenMask:
        """An independent copy in the same state (for the other choices of ``n``)."""
        bound = self._bound.deep_copy() if self._bound is not None else None
        return TokenMask(self._matcher.deep_copy(), self._n_vocab, bound, resume=self._resume)

    def allowed(self) -> numpy.ndarray:
        """The allowed tokens now, as llguidance's bitmask (bit i of the vocabulary =
        token i allowed): the constraint's, intersected with the digit bound's. Returns
        a view of an internal buffer, valid until the next call. Raises ``RuntimeError``
        if the matcher failed."""
        matcher = self._matcher
        row: numpy.ndarray = self._words[0]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if matcher.is_error():
            raise RuntimeError(str(matcher.get_error()))
        if self._bound is None:
            return row
        both: numpy.ndarray = self._bound_words[0]
        if self._intersect(self._bound, row, both):
            return both
        # the schema needs more than the bound allows here: inside a number, the
        # number goes on unbounded and the bound resumes after it
        if self._resume is not None:
            resumed = self._resume.deep_copy()
            if self._intersect(resumed, row, both):
                logger.debug("the digit bound gives way to the constraint for one number")
                self._bound = resumed
                return both
        logger.debug("the digit bound gives way to the constraint for the rest of the text")
        self._bound = None
        return row

    @staticmethod
    def _intersect(bound: Any, row: numpy.ndarray, out: numpy.ndarray) -> bool:
        """``out`` = ``row`` & ``bound``'s mask; whether any token is left."""
        bound.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if bound.is_error():  # pragma: no cover - the bound's regex reaches no limit
            return False
        numpy.bitwise_and(out, row, out=out)
        return bool(out.any())

    def apply(self, logits: numpy.ndarray) -> str | None:
        """Set the logits of every token the constraint forbids now to -inf (in place).
        Returns an error message if the matcher failed."""
        try:
            row = self.allowed()
        except RuntimeError as exc:
            return str(exc)
        numpy.take(_BYTE_BITS, row.view(numpy.uint8), axis=0, out=self._bits)
        numpy.equal(self._bits.reshape(-1)[: self._n_vocab], 0, out=self._forbidden)
        numpy.copyto(logits, -numpy.inf, where=self._forbidden)
        return None

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the start, the constraint accepts now (without
        consuming them): a speculative guess is cut there. The digit bound is not
        consulted — a guess it forbids is rejected by the masked draw."""
        try:
            return int(self._matcher.validate_tokens(tokens))
        except Exception:  # pragma: no cover - a matcher in error: propose nothing
            return 0

    def consume(self, token: int) -> str | None:
        """Advance past the sampled ``token``; an error message if it was not allowed."""
        if not self._matcher.consume_token(token):
            return self._matcher.get_error() or f"token {token} is not allowed by the constraint"
        if self._bound is not None and not self._bound.consume_token(token):
            # a token the mask did not offer (a caller that skipped it): the bound is a
            # help to the constraint, never a second constraint
            logger.debug("the digit bound gives way: token %d breaks it", token)
            self._bound = None
        return None
