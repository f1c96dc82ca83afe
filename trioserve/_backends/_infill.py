"""Fill-in-the-middle prompts, laid out token for token as llama-server's ``/infill``
lays them out (``format_prompt_infill``, tools/server/server-common.cpp of the llama.cpp
that llama-cpp-python vendors), from the model's own FIM tokens — so an editor's
request gives the same prompt tokens here as there, and no client needs a template
registry.

Pure: the tokenizer is passed in. The layout (repo-level FIM, arXiv 2409.12186)::

    [extra context][BOS][FIM_PRE]prefix prompt[FIM_SUF]suffix[FIM_MID]

where the extra context is ``[FIM_REP]myproject\\n`` then, per chunk,
``[FIM_SEP]filename\\n`` + its text (a model without ``FIM_SEP``: a ``--- snippet ---``
line instead), then ``[FIM_SEP]filename\\n``. The extra context comes first, before the
BOS, so the prompt cache reuses it from one keystroke to the next while the prefix
and suffix around the cursor change. Limits as llama-server's with its defaults
(``n_batch`` 2048, ``n_predict`` -1): the prefix keeps its last 1,536 tokens, the
suffix its first 510 − 2 − the prompt's; the extra context its last ``n_ctx`` − 2,046.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["FimTokens", "InfillParts", "infill_tokens"]

#: llama-server's defaults that bound the layout (``--batch-size``, ``--n-predict``)
SERVER_BATCH = 2048
SERVER_PREDICT = -1
#: the chunk separator of a model without FIM_SEP (llama-server's, byte for byte)
SNIPPET = "\n\n--- snippet ---\n\n"

#: text → tokens, without special tokens added; ``parse_special``: read special
#: tokens written in the text as themselves
Tokenize = Callable[[str, bool], list[int]]


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A model's fill-in-the-middle token ids (``None``: the model has none)."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    separator: int | None = None


@dataclass(frozen=True, slots=True)
class InfillParts:
    """What an editor sends: the text before and after the cursor (a string, or
    llama-server's mixed list of strings and token ids), the start of the middle
    (``prompt``), and extra context chunks ``(filename, text)`` (other files, recent
    edits)."""

    prefix: str | Sequence[str | int]
    suffix: str | Sequence[str | int]
    prompt: str = ""
    extra: tuple[tuple[str, str], ...] = ()


def _mixed(tokenize: Tokenize, value: str | Sequence[str | int]) -> list[int]:
    """llama-server's ``tokenize_mixed`` without special tokens: strings tokenized
    (special-token text read as plain text), ids kept."""
    if isinstance(value, str):
        return tokenize(value, False)
    out: list[int] = []
    for part in value:
        out.extend(tokenize(part, False) if isinstance(part, str) else [part])
    return out


def infill_tokens(
    parts: InfillParts,
    fim: FimTokens,
    tokenize: Tokenize,
    *,
    n_ctx: int,
    bos: int | None,
) -> list[int]:
    """The prompt tokens of a fill-in-the-middle request (``bos``: the BOS token id
    where the model adds one, else ``None``)."""
    prefix = _mixed(tokenize, parts.prefix)
    suffix = _mixed(tokenize, parts.suffix)
    prompt = tokenize(parts.prompt, True) if parts.prompt else []
    extra: list[int] = []
    if fim.repo is not None:
        extra.append(fim.repo)
        extra.extend(tokenize("myproject\n", False))
    for filename, text in parts.extra:
        if fim.separator is not None:
            extra.append(fim.separator)
            extra.extend(tokenize(filename + "\n", False))
        else:
            extra.extend(tokenize(SNIPPET, False))
        extra.extend(tokenize(text, False))
    if fim.separator is not None:
        extra.append(fim.separator)
        extra.extend(tokenize("filename\n", False))
    n_batch = SERVER_BATCH
    take_prefix = min(len(prefix), 3 * (n_batch // 4))
    take_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    take_extra = min(max(0, n_ctx - n_batch - 2 * SERVER_PREDICT), len(extra))
    prefix = prefix[len(prefix) - take_prefix :]
    suffix = suffix[:take_suffix]
    head = ([bos] if bos is not None else []) + [fim.prefix, *prefix, *prompt]
    return [*extra[len(extra) - take_extra :], *head, fim.suffix, *suffix, fim.middle]
