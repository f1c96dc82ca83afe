"""The digit bound of JSON numbers under a JSON Schema (docs/structured-output.md, "The
digit bound"), checked on the masks themselves: what a token mask allows after a given
text, whatever a model would sample. Most tests run on a byte vocabulary (every byte a
token, plus a few multi-digit ones); one runs on the default model's."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import numpy
import pytest

from trioserve import LlamaBackend
from trioserve._backends._decoding._grammar import (
    DEFAULT_DIGIT_BOUND,
    DigitBound,
    GrammarCompiler,
    TokenMask,
    digit_bound,
)
from trioserve._core._exceptions import InvalidRequestError
from trioserve._core._types import Constraint

#: multi-byte tokens: a mask must refuse one that would carry a number past the bound
MULTI = [b"12", b"34567", b"0000000000", b"99999999999999999999", b'"}', b'":', b".5", b"e1"]


class _ByteVocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: the 256 bytes, ``MULTI``, then EOS."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + MULTI + [b"<eos>"]
        self.eos_token_id = len(self.tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


VOCABULARY = _ByteVocabulary()
EOS = VOCABULARY.eos_token_id
DIGITS = {ord(d) for d in "0123456789"} | {
    i for i, t in enumerate(VOCABULARY.tokens) if i != EOS and t[:1].isdigit()
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(llguidance.LLTokenizer(llguidance.TokenizerWrapper(VOCABULARY)))


def _schema_mask(compiler: GrammarCompiler, schema: dict[str, Any]) -> TokenMask:
    return compiler.compile(Constraint(kind="json_schema", source=json.dumps(schema)))


def _allowed(mask: TokenMask) -> set[int]:
    bits = numpy.unpackbits(mask.allowed().view(numpy.uint8), bitorder="little")
    return {int(i) for i in numpy.flatnonzero(bits[: len(VOCABULARY.tokens)])}


def _write(mask: TokenMask, text: str) -> None:
    """Consume ``text`` one byte token at a time, each one allowed by the mask first."""
    for byte in text.encode():
        assert byte in _allowed(mask), f"{chr(byte)!r} refused after some of {text!r}"
        assert mask.consume(byte) is None


def _finishes(mask: TokenMask) -> bool:
    return EOS in _allowed(mask)


OBJECT = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"}},
    "required": ["n", "x", "s"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_mask_refuses_a_17th_digit(compiler: GrammarCompiler, sign: str) -> None:
    mask = _schema_mask(compiler, OBJECT)
    _write(mask, '{"n":' + sign + "1234567890123456")
    allowed = _allowed(mask)
    assert not allowed & DIGITS  # no 17th digit, alone or in a longer token
    assert ord(",") in allowed  # the object goes on
    # the same schema without the bound: llguidance alone allows the 17th digit
    grammar = llguidance.LLMatcher.grammar_from_json_schema(OBJECT, defaults={"whitespace_flexible": False})
    bare = TokenMask(llguidance.LLMatcher(compiler.tokenizer(), grammar, log_level=0), len(VOCABULARY.tokens))
    _write(bare, '{"n":' + sign + "1234567890123456")
    assert ord("7") in _allowed(bare)


def test_a_multi_digit_token_cannot_overshoot_the_bound(compiler: GrammarCompiler) -> None:
    mask = _schema_mask(compiler, OBJECT)
    _write(mask, '{"n":12345678901234')  # 14 digits
    allowed = _allowed(mask)
    assert MULTI.index(b"12") + 256 in allowed  # 16 digits: still allowed
    assert MULTI.index(b"34567") + 256 not in allowed  # 19: refused
    assert ord("5") in allowed


def test_fraction_and_exponent_are_bounded(compiler: GrammarCompiler) -> None:
    mask = _schema_mask(compiler, OBJECT)
    _write(mask, '{"n":0,"x":2.' + "1" * 16)
    allowed = _allowed(mask)
    assert not allowed & DIGITS  # no 17th digit after the point
    assert {ord("e"), ord("E"), ord(",")} <= allowed
    _write(mask, "e-12")
    assert not _allowed(mask) & DIGITS  # no 3rd exponent digit
    # an integral part of 16 digits, then the fraction
    other = _schema_mask(compiler, OBJECT)
    _write(other, '{"n":0,"x":-9999999999999999')
    allowed = _allowed(other)
    assert not allowed & DIGITS
    assert ord(".") in allowed


def test_digits_in_strings_are_not_bounded(compiler: GrammarCompiler) -> None:
    mask = _schema_mask(compiler, OBJECT)
    _write(mask, '{"n":1,"x":1.5,"s":"' + "1234567890" * 5 + '\\"' + "0" * 20 + '"}')
    assert _finishes(mask)
    keys = _schema_mask(compiler, {"type": "object", "additionalProperties": {"type": "integer"}})
    _write(keys, '{"' + "9" * 30 + '":7}')  # a key is a string
    assert _finishes(keys)


def test_json_object_values_are_bounded(compiler: GrammarCompiler) -> None:
    """``json_object`` is ``{"type": "object"}``: every value is any JSON, numbers too."""
    mask = _schema_mask(compiler, {"type": "object"})
    _write(mask, '{"a":[{"b":' + "1" * 16)
    assert not _allowed(mask) & DIGITS
    _write(mask, '.25e1},-3],"c":true}')
    assert _finishes(mask)


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        ({"type": "integer", "minimum": 10**17}, "1" + "0" * 17),
        ({"type": "integer", "maximum": -(10**17)}, "-" + "9" * 18),
        ({"type": "integer", "minimum": 0, "maximum": 10**18}, "1" + "0" * 18),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 1e-20}, "0." + "0" * 19 + "1"),
        ({"enum": [10**22, "a"]}, "1" + "0" * 22),
        ({"type": "array", "items": {"const": 0.5}, "maxItems": 1}, "[0.5]"),
    ],
)
def test_explicit_bounds_keep_every_value_they_name(
    compiler: GrammarCompiler, schema: dict[str, Any], text: str
) -> None:
    mask = _schema_mask(compiler, schema)
    _write(mask, text)
    assert _finishes(mask)
    assert mask.bounded  # widened, not given up
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"const": 2**53 + 1},
        {"enum": ["a", [-(10**25) - 1]]},
        {"type": "integer", "minimum": 9007199254740993},
        {"properties": {"a": {"type": "integer", "multipleOf": 2**60 + 1}}},
        {"type": "integer", "maximum": 10**400},  # beyond any double (float() overflows)
    ],
)
def test_an_integer_a_double_cannot_hold_is_refused(
    compiler: GrammarCompiler, schema: dict[str, Any]
) -> None:
    """llguidance reads a schema's numbers as doubles: ``{"const": 9007199254740993}``
    would be enforced as 9007199254740992, a value the schema refuses. A 400 instead."""
    with pytest.raises(InvalidRequestError, match=r"beyond 2\*\*53"):
        _schema_mask(compiler, schema)
    _schema_mask(compiler, {"const": 2**53})  # exact: enforced
    _schema_mask(compiler, {"const": 10**22})


def test_an_explicit_bound_does_not_lift_the_bound_elsewhere_more_than_it_needs(
    compiler: GrammarCompiler,
) -> None:
    schema = {
        "type": "object",
        "properties": {"big": {"type": "integer", "maximum": 10**18}, "free": {"type": "integer"}},
        "required": ["big", "free"],
    }
    assert digit_bound(schema) == DigitBound(19, 16, 2)
    mask = _schema_mask(compiler, schema)
    _write(mask, '{"big":1,"free":' + "1" * 19)
    assert not _allowed(mask) & DIGITS


def _lark_mask(compiler: GrammarCompiler, lark: str) -> TokenMask:
    """A Lark grammar under the default digit bound, as a schema's mask would be."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    return TokenMask(
        llguidance.LLMatcher(compiler.tokenizer(), grammar, log_level=0),
        len(VOCABULARY.tokens),
        compiler.bound_matcher(DEFAULT_DIGIT_BOUND),
        resume=compiler.bound_matcher(DEFAULT_DIGIT_BOUND, resume=True),
    )


def test_the_bound_gives_way_for_a_number_the_schema_needs_longer(compiler: GrammarCompiler) -> None:
    """``multipleOf 7``: after 16 digits that are no multiple of 7 the schema needs a
    17th, which the bound refuses; rather than leave nothing allowed, the bound gives way
    for that number, and bounds the next one again."""
    schema = {"type": "array", "items": {"type": "integer", "multipleOf": 7}, "maxItems": 3}
    mask = _schema_mask(compiler, schema)
    first = 10**15 + 2  # 16 digits, not a multiple of 7
    assert first % 7
    _write(mask, "[" + str(first))
    assert not {ord(","), ord("]")} & _allowed(mask)  # the schema needs another digit
    last = next(d for d in range(10) if (first * 10 + d) % 7 == 0)
    _write(mask, f"{last},")
    assert mask.bounded
    second = 7 * (10**15 // 7 + 1)  # 16 digits, a multiple of 7
    _write(mask, str(second))
    assert not _allowed(mask) & DIGITS  # bounded again
    _write(mask, "]")
    assert _finishes(mask)
    jsonschema.validate([first * 10 + last, second], schema)


def test_the_bound_gives_way_where_it_would_leave_nothing(compiler: GrammarCompiler) -> None:
    """A grammar that needs 20 digits under the default bound: after 16 the two masks
    have nothing in common; the bound gives way for that number, and (where it cannot
    resume either: a ``;`` is no JSON) for the rest of the text."""
    mask = _lark_mask(compiler, "start: /[1-9][0-9]{19}/")
    _write(mask, "1" * 16)
    _write(mask, "2222")
    assert mask.bounded  # resumed
    assert _finishes(mask)
    mask = _lark_mask(compiler, r"start: /[0-9]{20};[0-9]+/")
    _write(mask, "1" * 20)
    _write(mask, ";" + "3" * 30)
    assert not mask.bounded
    assert _finishes(mask)


def test_a_client_grammar_is_not_bounded(compiler: GrammarCompiler) -> None:
    mask = compiler.compile(Constraint(kind="gbnf", source="root ::= [0-9]+"))
    assert not mask.bounded
    _write(mask, "1" * 40)
    assert _finishes(mask)


def test_a_copy_has_its_own_bound(compiler: GrammarCompiler) -> None:
    mask = _schema_mask(compiler, OBJECT)
    _write(mask, '{"n":123456789012345')
    copy = mask.copy()
    _write(mask, "6")
    assert not _allowed(mask) & DIGITS
    assert ord("6") in _allowed(copy)  # 15 digits there


def test_lenient_in_the_schema_cannot_turn_a_refusal_into_a_fail_open(compiler: GrammarCompiler) -> None:
    for options in ({"lenient": True}, {"coerce_one_of": True}):
        schema = {"x-guidance": options, "type": "array", "items": {"type": "integer"}, "uniqueItems": True}
        with pytest.raises(InvalidRequestError, match="uniqueItems"):
            _schema_mask(compiler, schema)
    overlapping = {"x-guidance": {"coerce_one_of": True}, "oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(InvalidRequestError, match="oneOf"):
        _schema_mask(compiler, overlapping)


def test_digit_bound_of_schemas() -> None:
    assert digit_bound({"type": "number"}) == DEFAULT_DIGIT_BOUND == DigitBound(16, 16, 2)
    assert digit_bound({"type": "integer", "minimum": 0, "maximum": 100}) == DEFAULT_DIGIT_BOUND
    assert digit_bound({"type": "integer", "maximum": 10**20}) == DigitBound(21, 16, 2)
    assert digit_bound({"type": "integer", "exclusiveMaximum": 10**20}) == DigitBound(22, 16, 2)
    assert digit_bound({"$defs": {"a": {"const": [{"b": 1.5e-30}]}}}).fraction == 31
    assert digit_bound({"enum": [1e300]}) == DigitBound(301, 16, 2)
    # property names, booleans, strings and the infinities widen nothing
    ignored = {
        "properties": {"minimum": {"type": "integer"}, "enum": {"type": "string"}},
        "exclusiveMinimum": True,
        "const": ["12345678901234567890", True, float("inf")],
        "default": 10**30,
    }
    assert digit_bound(ignored) == DEFAULT_DIGIT_BOUND


def test_the_bound_regex() -> None:
    rx = re.compile(DEFAULT_DIGIT_BOUND.regex().replace("(?s:.)", "."), re.S)
    valid = [
        '{"a":1,"b":-0.5e+10,"c":[1e2,3,true,false,null],"d":{}}',
        "9" * 16,
        '"' + "1" * 50 + '\\"\\\\"',
        "[0.0000000000000001]",
        '{ "a" : [ 1 ,\n\t2 ] }\r\n',
    ]
    for text in valid:
        assert rx.fullmatch(text), text
    for text in [
        "9" * 17,
        "1." + "1" * 17,
        "1e123",
        "[" + "1" * 17 + "]",
        '{"a":' + "2" * 17 + "}",
        "1.5.5",
        "1e5e",
    ]:
        assert not rx.fullmatch(text), text


#: schemas for the random walks (each property required, objects closed)
WALKS: list[dict[str, Any]] = [
    OBJECT,
    {"type": "object"},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "i": {"type": "integer", "minimum": -5, "maximum": 10**17},
            "f": {"type": "number", "minimum": 0, "maximum": 1},
            "e": {"enum": [1, 2.5, "x"]},
            "n": {"anyOf": [{"type": "null"}, {"type": "number"}]},
        },
        "required": ["i", "f", "e", "n"],
        "additionalProperties": False,
    },
]

_NUMBER = re.compile(rb'"(?:[^"\\]|\\.)*"|(-?[0-9]+)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?')


def _walk(mask: TokenMask, rng: random.Random) -> bytes | None:
    """A random walk over what ``mask`` allows, leaning on digits (to reach the bound),
    closing after 120 steps: the text, or ``None`` if unfinished after 400 tokens."""
    text = b""
    for step in range(400):
        allowed = sorted(_allowed(mask))
        assert allowed, text  # never a dead end
        if EOS in allowed and (allowed == [EOS] or step > 60 or rng.random() < 0.3):
            return text
        digits = [t for t in allowed if t in DIGITS]
        closers = [t for t in allowed if VOCABULARY.tokens[t] in (b'"', b"}", b"]", b'"}')]
        if step > 120 and closers:
            token = rng.choice(closers)
        elif digits and rng.random() < 0.8:
            token = rng.choice(digits)
        else:
            token = rng.choice([t for t in allowed if t != EOS])
        assert mask.consume(token) is None
        text += VOCABULARY.tokens[token]
    return None


@pytest.mark.parametrize("schema", WALKS, ids=["object", "json_object", "array", "bounds"])
def test_random_walks_validate_and_keep_the_bound(compiler: GrammarCompiler, schema: dict[str, Any]) -> None:
    """Seeded random walks over what the mask allows: every finished text validates
    against the original schema, and its numbers keep the bound."""
    bound = digit_bound(schema)
    rng = random.Random(7)
    texts = [_walk(_schema_mask(compiler, schema), rng) for _ in range(30)]
    finished = [t for t in texts if t is not None]
    assert len(finished) >= 20
    for text in finished:
        jsonschema.validate(json.loads(text), schema)
        for match in _NUMBER.finditer(text):
            integral, fraction, exponent = match.groups()
            if integral is not None:
                assert len(integral.lstrip(b"-")) <= bound.integral, text
                assert len(fraction or b"") <= bound.fraction, text
                assert len(exponent or b"") <= bound.exponent, text


def _probe() -> Any:
    """scripts/probes/grammar_engines.py, the engines' coverage probe (its schemas and
    its validator: Draft 2020-12 with formats)."""
    path = Path(__file__).parents[3] / "scripts" / "probes" / "grammar_engines.py"
    spec = importlib.util.spec_from_file_location("grammar_engines_probe", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probe_coverage_schemas_never_fail_open(compiler: GrammarCompiler) -> None:
    """The 28 feature schemas of docs/grammar-engines.md ("Coverage"), through
    trioserve's masks with the digit bound: each one is refused or enforced, and every
    finished walk validates (formats included)."""
    probe = _probe()
    errors = probe.checker()
    rng = random.Random(11)
    refused, checked = set(), 0
    for name, schema in probe.COVERAGE.items():
        try:
            mask = _schema_mask(compiler, schema)
        except InvalidRequestError:
            refused.add(name)
            continue
        for _ in range(8):
            text = _walk(mask.copy(), rng)
            if text is not None:
                checked += 1
                assert not errors(schema, json.loads(text)), (name, text)
    assert refused == {"oneOf (overlapping)", "uniqueItems", "if/then/else", "not"}
    assert checked >= 150, checked  # (measured: 186 of 192 walks finished)


@pytest.mark.model
def test_the_default_model_vocabulary_refuses_a_17th_digit(llama_backend: LlamaBackend) -> None:
    """The same on Gemma's 262,144 tokens: after 16 digits no allowed token starts with
    a digit, and after 15 none holds two."""
    grammars = llama_backend.grammars
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}, "share": {"type": "number"}},
        "required": ["age", "share"],
        "additionalProperties": False,
    }
    n_vocab = grammars.n_vocab
    pieces = [llama_backend.token_bytes(t, special=True) for t in range(n_vocab)]

    def allowed(mask: TokenMask) -> list[bytes]:
        bits = numpy.unpackbits(mask.allowed().view(numpy.uint8), bitorder="little")[:n_vocab]
        return [pieces[t] for t in numpy.flatnonzero(bits)]

    for prefix in ('{"age":' + "7" * 16, '{"age":1,"share":0.' + "3" * 16):
        mask = grammars.compile(Constraint(kind="json_schema", source=json.dumps(schema)))
        for token in grammars.tokenizer().tokenize_str(prefix):
            assert mask.consume(token) is None
        following = allowed(mask)
        assert following
        assert not [p for p in following if p[:1].isdigit()]
    mask = grammars.compile(Constraint(kind="json_schema", source=json.dumps(schema)))
    for token in grammars.tokenizer().tokenize_str('{"age":' + "7" * 15):
        assert mask.consume(token) is None
    assert not [p for p in allowed(mask) if re.match(rb"[0-9]{2}", p)]
