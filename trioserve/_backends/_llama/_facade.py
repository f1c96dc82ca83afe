"""What a backend that runs one loaded model says of that model
(:class:`ModelFacade`): the model's part of the :class:`~trioserve._core._backend.Backend`
interface — settings, vocabulary, tokenizing, ``prepare`` — delegated to the
:class:`~._model.LlamaModel` it holds (:attr:`ModelFacade.llama_model`). The backend
(:class:`~._backend.LlamaBackend`) adds what runs the model: its contexts."""

from __future__ import annotations

from collections.abc import Sequence as Items
from typing import Any

from ..._core._backend import Backend, ModelInfo, PreparedPrompt
from ..._core._types import GenerationRequest
from .._cache import PieceRule
from .._decoding import GrammarCompiler
from .._platform import RepackDecision
from ._model import LlamaModel
from ._settings import LlamaSettings

__all__ = ["ModelFacade"]


class ModelFacade(Backend):
    """The held model's side of a backend: every member reads or calls
    :attr:`llama_model` (composition: the model is a part, not a base class)."""

    #: the loaded model: vocabulary, tokenizer, prepare, sampler chains
    llama_model: LlamaModel

    @property
    def settings(self) -> LlamaSettings:
        return self.llama_model.settings

    @property
    def lib(self) -> Any:
        """llama.cpp's bindings the model and its contexts are run with (a test may
        swap them for a wrapper that fails on purpose: the setter sets the model's)."""
        return self.llama_model.lib

    @lib.setter
    def lib(self, value: Any) -> None:
        self.llama_model.lib = value

    @property
    def info(self) -> ModelInfo:
        return self.llama_model.info

    @property
    def slots(self) -> int:
        return self.llama_model.settings.slots

    @property
    def n_vocab(self) -> int:
        return self.llama_model.n_vocab

    @property
    def piece_rule(self) -> PieceRule:
        """Where prompts are cut into prefill calls (docs/prompt-cache.md, "The cut")."""
        return self.llama_model.piece_rule

    @property
    def grammars(self) -> GrammarCompiler:
        return self.llama_model.grammars

    @property
    def system_info(self) -> str:
        """``llama_print_system_info()`` of the loaded llama.cpp."""
        return self.llama_model.system_info

    @property
    def repack(self) -> RepackDecision | None:
        """Whether the weights were repacked (extra buffer types), and why."""
        return self.llama_model.repack

    def tokenize(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Text → token ids (:meth:`LlamaModel.tokenize`)."""
        return self.llama_model.tokenize(text, add_bos=add_bos, parse_special=parse_special)

    def piece(self, token: int) -> bytes:
        """The bytes of one token (:meth:`LlamaModel.piece`)."""
        return self.llama_model.piece(token)

    def detokenize(self, tokens: Items[int]) -> bytes:
        return self.llama_model.detokenize(tokens)

    def token_bytes(self, token: int, *, special: bool) -> bytes:
        """llama.cpp's ``llama_token_to_piece`` (:meth:`LlamaModel.token_bytes`)."""
        return self.llama_model.token_bytes(token, special=special)

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        return await self.llama_model.prompts.prepare(request)

    async def tokenize_text(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        return await self.llama_model.prompts.tokenize_text(
            text, add_special=add_special, parse_special=parse_special
        )

    async def count_text_tokens(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> int:
        return await self.llama_model.prompts.count_text_tokens(
            text, add_special=add_special, parse_special=parse_special
        )

    async def token_pieces(self, tokens: Items[int]) -> list[bytes]:
        return await self.llama_model.prompts.token_pieces(tokens)
