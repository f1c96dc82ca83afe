"""The fields both OpenAI endpoints share, read into the engine's terms within a
request's limits: the stop sequences, ``logit_bias`` (counted before it is decoded), the
sampling parameters, and the one constraint ``response_format`` (or llama-server's
``json_schema``, ``grammar``) asks for."""

from __future__ import annotations

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._types import Constraint, SamplingParams
from ._constraints import ANY_OBJECT, json_schema_constraint
from ._limits import RequestLimits, top_level_entries
from ._openai_request import Bias, _CommonFields

__all__ = ["DEFAULT_LIMITS"]


#: the limits a decoder applies when its caller passes none
DEFAULT_LIMITS = RequestLimits()


def _stops(stop: str | list[str] | None, limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    limits.check_stops(stops, "stop", openai=True)
    return tuple(s for s in stops if s)


_bias_decoder = msgspec.json.Decoder(dict[str, Bias] | None)


def _logit_bias(raw: msgspec.Raw, limits: RequestLimits = DEFAULT_LIMITS) -> dict[int, float]:
    """The ``logit_bias`` field, counted (``--max-logit-bias``) before it is decoded."""
    data = bytes(raw)
    if not data:
        return {}
    limits.check_count(
        "logit_bias", top_level_entries(data), limits.max_logit_bias, "--max-logit-bias", "logit_bias"
    )
    try:
        bias = _bias_decoder.decode(data)
    except msgspec.ValidationError as exc:  # (its path, as the whole body's would be)
        message, _, path = str(exc).partition(" - at `$")
        param = "logit_bias" + path.rstrip("`")
        raise InvalidRequestError(f"{message} at `{param}`", param=param) from None
    if not bias:
        return {}
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (integers as strings); got {key!r}",
                param="logit_bias",
            ) from None
        if token < 0:
            raise InvalidRequestError(f"logit_bias key {key!r} is not a valid token id", param="logit_bias")
        out[token] = value
    return out


def _sampling(request: _CommonFields, limits: RequestLimits = DEFAULT_LIMITS) -> SamplingParams:
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        logit_bias=_logit_bias(request.logit_bias, limits),
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        repeat_penalty=request.repeat_penalty,
        repeat_last_n=request.repeat_last_n,
    )


def _constraint(request: _CommonFields, limits: RequestLimits = DEFAULT_LIMITS) -> Constraint | None:
    """The constraint ``response_format`` (or llama-server's ``json_schema``/``grammar``)
    asks for; at most one of them (a schema no larger than ``limits`` allow)."""
    asked: list[tuple[str, Constraint]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            schema = fmt.schema_
            source = ANY_OBJECT if schema is None else msgspec.json.encode(schema).decode()
            constraint = json_schema_constraint(source, "response_format.schema", limits)
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema (a JSON Schema object)",
                    param="response_format.json_schema.schema",
                )
            source = msgspec.json.encode(fmt.json_schema.schema_).decode()
            constraint = json_schema_constraint(source, "response_format.json_schema.schema", limits)
        asked.append(("response_format", constraint))
    if request.json_schema is not None:
        source = msgspec.json.encode(request.json_schema).decode()
        asked.append(("json_schema", json_schema_constraint(source, "json_schema", limits)))
    if request.grammar:
        size = len(request.grammar.encode())
        if size > limits.max_schema_bytes:
            raise InvalidRequestError(
                f"grammar is {size} bytes; this server accepts at most "
                f"{limits.max_schema_bytes} (--max-schema-bytes)",
                param="grammar",
            )
        asked.append(("grammar", Constraint(kind="gbnf", source=request.grammar)))
    if len(asked) > 1:
        raise InvalidRequestError(
            f"send one constraint, not {' and '.join(name for name, _ in asked)}", param=asked[1][0]
        )
    return asked[0][1] if asked else None
