"""llama.cpp's sampler chain for a request's sampling parameters, in llama-server's order,
and the request's logit bias as arrays (checked against the vocabulary)."""

from __future__ import annotations

import random
from typing import Any

import trio

from ..._core._exceptions import InvalidRequestError
from ..._core._types import SamplingParams
from .._decoding import LogitBias

__all__ = ["logit_bias", "sampler_chain"]

#: a logit bias with more entries than this is turned into arrays in a worker thread
_INLINE_BIAS = 4096


def sampler_chain(
    lib: Any,
    n_vocab: int,
    n_ctx: int,
    params: SamplingParams,
    *,
    max_new_tokens: int = 0,
    seed_offset: int = 0,
    bias: LogitBias | None = None,
    vocab: Any = None,
) -> Any:
    """llama.cpp's sampler chain for ``params``, in llama-server's order: logit
    bias, penalties, top-k, top-p, min-p, temperature, then the draw (or greedy) —
    or, where the request names its ``samplers``, those in its order, then the draw,
    as llama-server builds them (``common_sampler_init``). ``bias``:
    ``params.logit_bias`` as arrays, if the request's prepare made them; ``vocab``:
    the model's vocabulary (the ``infill`` sampler needs it)."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    add = lib.llama_sampler_chain_add
    if params.logit_bias:
        if bias is None:
            bias = LogitBias(params.logit_bias)
        # OpenAI: -100 bans a token (-inf), +100 forces it
        entries = bias.entries(lib.llama_logit_bias)
        add(chain, lib.llama_sampler_init_logit_bias(n_vocab, len(entries), entries))
    # (llama-cpp-python 0.3.36's llama.h: the vocabulary size comes first)
    penalties = lib.llama_sampler_init_penalties
    if params.samplers is not None:
        _named_chain(lib, chain, params, n_vocab, max_new_tokens, vocab)
        seed = params.seed + seed_offset if params.seed is not None else random.getrandbits(32)
        add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain
    if params.repeat_penalty != 1:
        last_n = params.repeat_last_n if params.repeat_last_n >= 0 else max(1, max_new_tokens)
        add(chain, penalties(n_vocab, last_n, params.repeat_penalty, 0.0, 0.0))
    if params.frequency_penalty or params.presence_penalty:
        # OpenAI's penalties count every token generated so far: a window as long
        # as the generation
        window = max(1, max_new_tokens or n_ctx)
        frequency, presence = params.frequency_penalty, params.presence_penalty
        add(chain, penalties(n_vocab, window, 1.0, frequency, presence))
    if params.temperature == 0:
        add(chain, lib.llama_sampler_init_greedy())
    else:
        if params.top_k > 0:
            add(chain, lib.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0:
            add(chain, lib.llama_sampler_init_min_p(params.min_p, 1))
        add(chain, lib.llama_sampler_init_temp(params.temperature))
        seed = params.seed + seed_offset if params.seed is not None else random.getrandbits(32)
        add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain


def _named_chain(
    lib: Any, chain: Any, params: SamplingParams, n_vocab: int, max_new: int, vocab: Any
) -> None:
    """The samplers ``params.samplers`` names, in its order, with llama-server's
    arguments (``min_keep`` 0; temperature through ``temp_ext``, which at 0 keeps only
    the most likely token)."""
    add = lib.llama_sampler_chain_add
    for name in params.samplers or ():
        if name == "top_k":
            add(chain, lib.llama_sampler_init_top_k(params.top_k))
        elif name == "top_p":
            add(chain, lib.llama_sampler_init_top_p(params.top_p, 0))
        elif name == "min_p":
            add(chain, lib.llama_sampler_init_min_p(params.min_p, 0))
        elif name == "temperature":
            add(chain, lib.llama_sampler_init_temp_ext(params.temperature, 0.0, 1.0))
        elif name == "infill":
            add(chain, lib.llama_sampler_init_infill(vocab))
        elif name == "penalties":
            last_n = params.repeat_last_n if params.repeat_last_n >= 0 else max(1, max_new)
            frequency, presence = params.frequency_penalty, params.presence_penalty
            add(
                chain,
                lib.llama_sampler_init_penalties(n_vocab, last_n, params.repeat_penalty, frequency, presence),
            )
        else:  # pragma: no cover - (the wire layer checks the names: SAMPLER_NAMES)
            raise InvalidRequestError(f"unknown sampler {name!r}", param="samplers")


async def logit_bias(params: SamplingParams, n_vocab: int) -> LogitBias | None:
    """The request's logit bias as arrays (``None``: none), made once: the draws and
    the sampler chain of every choice use them. A bias naming a token id outside the
    vocabulary is refused (400)."""
    if not params.logit_bias:
        return None
    try:
        if len(params.logit_bias) > _INLINE_BIAS:  # (a whole vocabulary: milliseconds)
            bias = await trio.to_thread.run_sync(LogitBias, params.logit_bias)
        else:
            bias = LogitBias(params.logit_bias)
        low, high = bias.bounds()
    except OverflowError:  # (a key past int64)
        low, high = -1, -1
    if low < 0 or high >= n_vocab:
        token = high if high >= n_vocab else low
        raise InvalidRequestError(
            f"logit_bias key {token} is not a token id of this model (vocabulary: {n_vocab})"
            if token >= 0
            else f"logit_bias keys must be token ids of this model (vocabulary: {n_vocab})",
            param="logit_bias",
        )
    return bias
