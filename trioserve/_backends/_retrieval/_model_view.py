"""The loaded model as retrieval sees it: what embeddings and rerank read of
``LlamaModel`` (:class:`ModelView`). A protocol, so that they name no class of the
generation side that builds them: the model imports its reranker, never the reverse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ModelView", "SettingsView"]


class SettingsView(Protocol):
    """The settings retrieval reads (``LlamaSettings``'s)."""

    @property
    def model_id(self) -> str: ...

    @property
    def n_batch(self) -> int: ...

    @property
    def n_threads(self) -> int: ...

    @property
    def rerank(self) -> str | None: ...

    @property
    def rerank_template(self) -> str | None: ...


class ModelView(Protocol):
    """A loaded model: its bindings (``lib``), llama.cpp's model and vocabulary, its
    settings, its metadata and its tokenizer."""

    @property
    def lib(self) -> Any: ...

    @property
    def model(self) -> Any: ...

    @property
    def vocab(self) -> Any: ...

    @property
    def settings(self) -> SettingsView: ...

    @property
    def bos(self) -> int: ...

    @property
    def architecture(self) -> str: ...

    def tokenize(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> bytes: ...

    def meta(self, key: str) -> str | None: ...

    def yes_no_tokens(self) -> tuple[int, int]: ...

    def pair_flags(self) -> dict[str, Any]: ...
