"""Ollama's ``options`` and ``keep_alive``, sans-IO: every option Ollama's clients know,
each honoured (as the engine's sampling fields, ``num_predict``, ``stop``) or refused by
name; and ``keep_alive``'s durations. The requests around them: :mod:`._ollama`; the
table: ``docs/api.md``, "Ollama"."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._types import SamplingParams
from ._codec import decode as _decode
from ._limits import RequestLimits
from ._refusals import Refusal, check_refused

__all__ = [
    "DEFAULTS",
    "OllamaOptions",
    "check_num_ctx",
    "max_tokens_of",
    "parse_duration",
    "peek_keep_alive",
    "sampling_of",
    "stops_of",
]

#: Ollama's sampling defaults (its ``api.DefaultOptions``), where a request names none
DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1, repeat_last_n=64)

NonNegative = Annotated[float, msgspec.Meta(ge=0.0)]
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class OllamaOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``options``: every option Ollama's clients know (the Python and JavaScript
    clients' ``Options``, Ollama's ``api.Options``), each honoured or refused."""

    # honoured
    temperature: NonNegative | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_p: Unit | None = None
    seed: int | None = None
    #: -1: until the model ends (or the context is full); -2: fill the context
    num_predict: Annotated[int, msgspec.Meta(ge=-2)] | None = None
    num_ctx: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stop: list[str] | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    #: only matters when the context shifts, which it never does here: accepted
    num_keep: int | None = None
    # refused unless "not asked for" (_REFUSED_OPTIONS)
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    #: only read by mirostat sampling (refused above): accepted
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    # load-time options: the server's flags here (refused)
    numa: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    logits_all: Any = None
    vocab_only: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    embedding_only: Any = None
    num_thread: Any = None


_LOAD_TIME = "is a load-time setting: this server loads its models with its own flags (docs/models.md)"

_REFUSED_OPTIONS: tuple[Refusal, ...] = (
    ("typical_p", (None, 1.0, 1), "typical sampling is not supported (1.0, off, is accepted)"),
    ("tfs_z", (None, 1.0, 1), "tail-free sampling is not supported (1.0, off, is accepted)"),
    ("mirostat", (None, 0), "mirostat sampling is not supported (0, off, is accepted)"),
    ("penalize_newline", (None, False), "Ollama no longer honours it either"),
    ("numa", (None,), _LOAD_TIME),
    ("num_batch", (None,), _LOAD_TIME + " (--batch-size)"),
    ("num_gpu", (None,), _LOAD_TIME + " (this server runs on the CPU)"),
    ("main_gpu", (None,), _LOAD_TIME + " (this server runs on the CPU)"),
    ("low_vram", (None,), _LOAD_TIME),
    ("f16_kv", (None,), _LOAD_TIME + " (--cache-type-k, --cache-type-v)"),
    ("logits_all", (None,), _LOAD_TIME),
    ("vocab_only", (None,), _LOAD_TIME),
    ("use_mmap", (None,), _LOAD_TIME),
    ("use_mlock", (None,), _LOAD_TIME),
    ("embedding_only", (None,), _LOAD_TIME),
    ("num_thread", (None,), _LOAD_TIME + " (--threads)"),
)


# -- keep_alive ----------------------------------------------------------------------------

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: float | str, param: str = "keep_alive") -> float:
    """Ollama's ``keep_alive``: seconds (a number, or a string of one), or a Go duration
    (``5m``, ``1h30m``, ``300ms``, ``-1m``); negative: forever (``math.inf``); 0: unload
    once the request is done."""
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            if not body or _GO_DURATION.sub("", body):
                raise InvalidRequestError(
                    f"{param} must be seconds or a duration such as 5m, 1h30m or 300ms; got {value!r}",
                    param=param,
                ) from None
            seconds = sign * sum(float(n) * _UNITS[unit] for n, unit in _GO_DURATION.findall(body))
    if math.isnan(seconds):
        raise InvalidRequestError(f"{param} must be a number of seconds; got {value!r}", param=param)
    return math.inf if seconds < 0 else seconds


class _Field(msgspec.Struct):
    keep_alive: Any = None


_keep_alive_decoder = msgspec.json.Decoder(_Field)


def peek_keep_alive(body: bytes) -> float | None:
    """The body's ``keep_alive`` in seconds (``None``: it has none), read before the
    model is leased: it is the lease's TTL (``X-Keep-Alive``'s meaning)."""
    if b'"keep_alive"' not in body:
        return None
    raw = _decode(_keep_alive_decoder, body).keep_alive
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise InvalidRequestError(
            "keep_alive must be seconds (a number) or a duration string such as 5m", param="keep_alive"
        )
    return parse_duration(raw)


# -- options → the engine's fields ----------------------------------------------------


def sampling_of(options: OllamaOptions | None) -> SamplingParams:
    if options is None:
        return DEFAULTS
    check_refused(options, _REFUSED_OPTIONS, prefix="options.")
    given = {
        name: value
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repeat_penalty",
            "repeat_last_n",
            "presence_penalty",
            "frequency_penalty",
        )
        if (value := getattr(options, name)) is not None
    }
    seed = options.seed if options.seed is not None and options.seed >= 0 else None
    return dataclasses.replace(DEFAULTS, **given, seed=seed)


def max_tokens_of(options: OllamaOptions | None) -> int | None:
    """``num_predict``: ``None`` (or < 0): until the model ends or the context is full."""
    if options is None or options.num_predict is None or options.num_predict < 0:
        return None
    return options.num_predict


def stops_of(options: OllamaOptions | None, limits: RequestLimits) -> tuple[str, ...]:
    if options is None or not options.stop:
        return ()
    limits.check_stops(options.stop, "options.stop")
    return tuple(s for s in options.stop if s)


def check_num_ctx(options: OllamaOptions | None, context_length: int | None) -> None:
    """``num_ctx`` cannot resize a loaded context: at least the served one is accepted
    (Ollama, too, clamps it to what the model has), a smaller one refused."""
    if options is None or options.num_ctx is None or context_length is None:
        return
    if options.num_ctx < context_length:
        raise InvalidRequestError(
            f"options.num_ctx {options.num_ctx} cannot be honoured: this model's context is "
            f"{context_length} tokens per sequence, set when it loads (--ctx-size, a preset's ctx_size); "
            f"send num_ctx of at least {context_length}, or leave it out",
            param="options.num_ctx",
        )
