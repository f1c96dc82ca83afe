"""Chat messages → one prompt string, and the stop strings that end an assistant turn.

:func:`chat_format_for` picks the format: the GGUF's chat template
(``tokenizer.chat_template``), rendered in a sandboxed Jinja environment, or a fallback
by architecture (Gemma's turn format, system messages prepended to the first user turn;
else ChatML). The fallbacks: ``docs/api.md``, "Chat prompts".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._core._exceptions import InvalidRequestError
from ._openai import ChatMessage

__all__ = ["ChatFormat", "chat_format_for"]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    stops: tuple[str, ...]
    #: the text already holds the BOS token (templates usually write it themselves)
    has_bos: bool


class ChatFormat:
    """Renders chat messages for one model."""

    name = "base"

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt:  # pragma: no cover
        raise NotImplementedError


def _check_roles(messages: Sequence[ChatMessage]) -> None:
    if not any(m.role == "user" for m in messages):
        raise InvalidRequestError("messages must include at least one user message", param="messages")


class GemmaFormat(ChatFormat):
    name = "gemma"

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        _check_roles(messages)
        system = "\n\n".join(m.text() for m in messages if m.role in ("system", "developer"))
        parts: list[str] = []
        first_user = True
        for message in messages:
            if message.role in ("system", "developer"):
                continue
            role = "model" if message.role == "assistant" else "user"
            text = message.text()
            if role == "user" and first_user and system:
                text = f"{system}\n\n{text}"
            if role == "user":
                first_user = False
            parts.append(f"<start_of_turn>{role}\n{text.strip()}<end_of_turn>\n")
        parts.append("<start_of_turn>model\n")
        return ChatPrompt(text="".join(parts), stops=("<end_of_turn>", "<start_of_turn>"), has_bos=False)


class ChatMLFormat(ChatFormat):
    name = "chatml"

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        _check_roles(messages)
        parts = [
            f"<|im_start|>{'system' if m.role == 'developer' else m.role}\n{m.text()}<|im_end|>\n"
            for m in messages
        ]
        parts.append("<|im_start|>assistant\n")
        return ChatPrompt(text="".join(parts), stops=("<|im_end|>", "<|im_start|>"), has_bos=False)


class JinjaFormat(ChatFormat):
    name = "gguf-template"

    def __init__(self, template: str, *, bos_token: str, eos_token: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InvalidRequestError(
                f"the model's chat template refused the messages: {message}", param="messages"
            )

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        _check_roles(messages)
        text = self._template.render(
            messages=[{"role": m.role, "content": m.text()} for m in messages],
            bos_token=self._bos,
            eos_token=self._eos,
            add_generation_prompt=True,
        )
        has_bos = bool(self._bos) and text.startswith(self._bos)
        stops = (self._eos,) if self._eos else ()
        return ChatPrompt(text=text, stops=stops, has_bos=has_bos)


def chat_format_for(
    *, template: str | None, architecture: str | None, bos_token: str = "", eos_token: str = ""
) -> ChatFormat:
    """Pick the chat format: the model's own template, else a fallback by architecture."""
    if template:
        return JinjaFormat(template, bos_token=bos_token, eos_token=eos_token)
    if architecture and architecture.startswith("gemma"):
        return GemmaFormat()
    return ChatMLFormat()
