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

Why llguidance, by measurement: ``docs/grammar-engines.md``; the request fields and the
formats: ``docs/structured-output.md``.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy

from .._core._exceptions import InvalidRequestError
from .._core._types import Constraint

__all__ = ["GrammarCompiler", "TokenMask"]

#: JSON is generated compactly: no free whitespace (a small model under a schema that
#: allows it can loop on spaces and newlines until max_tokens)
_JSON_OPTIONS: Any = {"whitespace_flexible": False}

_PARAM = {"json_schema": "response_format", "lark": "grammar", "gbnf": "grammar"}


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
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
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
        return TokenMask(matcher, self.n_vocab)


#: byte → its 8 bits, least significant first (llguidance's bitmask order)
_BYTE_BITS = numpy.unpackbits(numpy.arange(256, dtype=numpy.uint8)[:, None], axis=1, bitorder="little")


class TokenMask:
    """One sequence's constraint state. Used by the scheduler thread only; its buffers
    are allocated once, so a token costs no allocation of vocabulary size."""

    __slots__ = ("_bits", "_forbidden", "_matcher", "_n_vocab", "_words")

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        words = (n_vocab + 31) // 32
        #: llguidance writes the mask here: bit i of the vocabulary = token i allowed
        self._words = numpy.full((1, words), -1, dtype=numpy.int32)
        self._bits = numpy.empty((words * 4, 8), dtype=numpy.uint8)
        self._forbidden = numpy.empty(n_vocab, dtype=bool)

    def copy(self) -> TokenMask:
        """An independent copy in the same state (for the other choices of ``n``)."""
        return TokenMask(self._matcher.deep_copy(), self._n_vocab)

    def apply(self, logits: numpy.ndarray) -> str | None:
        """Set the logits of every token the constraint forbids now to -inf (in place).
        Returns an error message if the matcher failed."""
        matcher = self._matcher
        row = self._words[0]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if matcher.is_error():
            return str(matcher.get_error())
        numpy.take(_BYTE_BITS, row.view(numpy.uint8), axis=0, out=self._bits)
        numpy.equal(self._bits.reshape(-1)[: self._n_vocab], 0, out=self._forbidden)
        numpy.copyto(logits, -numpy.inf, where=self._forbidden)
        return None

    def consume(self, token: int) -> str | None:
        """Advance past the sampled ``token``; an error message if it was not allowed."""
        if not self._matcher.consume_token(token):
            return self._matcher.get_error() or f"token {token} is not allowed by the constraint"
        return None
