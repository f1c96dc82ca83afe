"""Chat messages → one prompt string, and the stop strings that end an assistant turn.

:func:`chat_format_for` picks the format: the GGUF's chat template
(``tokenizer.chat_template``), rendered in a sandboxed Jinja environment, or a fallback
by architecture (Gemma's turn format, system messages prepended to the first user turn;
else ChatML). The fallbacks: ``docs/api.md``, "Chat prompts".
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._core._exceptions import ChatTemplateError, InvalidRequestError
from ._limits import MAX_JSON_DEPTH, json_depth, nested_too_deep
from ._messages import ChatMessage
from ._tools import Tool, parameters_of

__all__ = ["ChatFormat", "chat_format_for", "template_environment"]

logger = logging.getLogger("trioserve.chat")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    stops: tuple[str, ...]
    #: the text already holds the BOS token (templates usually write it themselves)
    has_bos: bool
    #: the model reasons before it answers: the markers around its reasoning
    #: (``("<think>", "</think>")``), else ``None`` (docs/dialects.md, "Reasoning")
    reasoning: tuple[str, str] | None = None
    #: the prompt ends inside the reasoning (the template opened it): the answer
    #: starts with reasoning, without the opening marker
    opens_reasoning: bool = False


class ChatFormat:
    """Renders chat messages (and the tools the model may call) for one model."""

    name = "base"
    #: the markers around the model's reasoning, if its template has them
    reasoning: tuple[str, str] | None = None

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool] | None = None,
        thinking: bool | None = None,
    ) -> ChatPrompt:
        """``thinking``: ``False`` asks a reasoning template not to reason (its
        ``enable_thinking``), ``None`` leaves the template's default.

        Raises:
            InvalidRequestError: no message is the user's.
        """
        _check_roles(messages)
        return self._render(messages, tools, thinking)

    def _render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, thinking: bool | None
    ) -> ChatPrompt:  # pragma: no cover
        """The prompt for messages that include a user's (each format its own)."""
        raise NotImplementedError


def _tool_line(tool: Tool) -> str:
    spec: dict[str, object] = {"name": tool.function.name}
    if tool.function.description:
        spec["description"] = tool.function.description
    spec["parameters"] = parameters_of(tool)
    return json.dumps(spec, separators=(",", ":"))


def tools_preamble(tools: Sequence[Tool]) -> str:
    """How the fallback formats tell the model about its tools (docs/structured-output.md)."""
    lines = "\n".join(_tool_line(tool) for tool in tools)
    return (
        "You can call these functions:\n"
        f"{lines}\n"
        'To call one, reply with only a JSON object: {"name": <the function name>, '
        '"arguments": <an object of its parameters>}. Otherwise answer normally.'
    )


def call_text(message: ChatMessage) -> str:
    """An assistant message's tool calls, as the model writes them (one per line)."""
    lines = []
    for call in message.tool_calls or ():
        text = call.function.arguments or "{}"
        # (JSON in a string: the body's depth check does not see into it)
        if json_depth(text.encode()) > MAX_JSON_DEPTH:
            raise nested_too_deep(f"the arguments of tool call {call.id or call.function.name!r}", "messages")
        try:
            arguments = json.loads(text)
        except ValueError:
            raise InvalidRequestError(
                f"the arguments of tool call {call.id or call.function.name!r} are not valid JSON",
                param="messages",
            ) from None
        lines.append(json.dumps({"name": call.function.name, "arguments": arguments}, separators=(",", ":")))
    return "\n".join(lines)


def _call_names(messages: Sequence[ChatMessage]) -> dict[str, str]:
    """tool_call_id → the function's name, from the assistant messages."""
    return {
        call.id: call.function.name
        for message in messages
        for call in message.tool_calls or ()
        if call.id is not None
    }


def _tool_result(message: ChatMessage, names: dict[str, str]) -> str:
    name = names.get(message.tool_call_id or "", message.name or "the function")
    return f"{name} returned: {message.text()}"


def _check_roles(messages: Sequence[ChatMessage]) -> None:
    if not any(m.role == "user" for m in messages):
        raise InvalidRequestError("messages must include at least one user message", param="messages")


class GemmaFormat(ChatFormat):
    name = "gemma"

    def _render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, thinking: bool | None
    ) -> ChatPrompt:
        system = "\n\n".join(m.text() for m in messages if m.role in ("system", "developer"))
        if tools:
            system = f"{system}\n\n{tools_preamble(tools)}" if system else tools_preamble(tools)
        names = _call_names(messages)
        parts: list[str] = []
        first_user = True
        previous = ""
        for message in messages:
            if message.role in ("system", "developer"):
                continue
            # Gemma has two roles: a tool's result is a user turn (consecutive results: one turn)
            role = "model" if message.role == "assistant" else "user"
            if message.role == "tool":
                text = _tool_result(message, names)
            elif message.role == "assistant" and message.tool_calls:
                text = "\n".join(t for t in (message.text().strip(), call_text(message)) if t)
            else:
                text = message.text()
                if message.name and role == "user":
                    text = f"{message.name}: {text}"
            if role == "user" and first_user and system:
                text = f"{system}\n\n{text}"
            if role == "user":
                first_user = False
            if message.role == "tool" and previous == "tool":
                parts[-1] = parts[-1].removesuffix("<end_of_turn>\n") + f"\n{text.strip()}<end_of_turn>\n"
            else:
                parts.append(f"<start_of_turn>{role}\n{text.strip()}<end_of_turn>\n")
            previous = message.role
        parts.append("<start_of_turn>model\n")
        return ChatPrompt(text="".join(parts), stops=("<end_of_turn>", "<start_of_turn>"), has_bos=False)


class ChatMLFormat(ChatFormat):
    name = "chatml"

    def _render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, thinking: bool | None
    ) -> ChatPrompt:
        parts = [f"<|im_start|>system\n{tools_preamble(tools)}<|im_end|>\n"] if tools else []
        for m in messages:
            text = m.text()
            if m.tool_calls:
                calls = "\n".join(f"<tool_call>\n{line}\n</tool_call>" for line in call_text(m).splitlines())
                text = f"{text}\n{calls}" if text else calls
            parts.append(f"<|im_start|>{'system' if m.role == 'developer' else m.role}\n{text}<|im_end|>\n")
        parts.append("<|im_start|>assistant\n")
        return ChatPrompt(text="".join(parts), stops=("<|im_end|>", "<|im_start|>"), has_bos=False)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``: plain ``json.dumps`` (Jinja's own escapes ``<``, ``>``, ``&`` and
    ``'`` as HTML, which changes the prompt a model was trained on)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _generation_extension() -> type:
    """HF's ``{% generation %}…{% endgeneration %}`` (it marks the assistant's tokens for
    training masks): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}  # noqa: RUF012 - (jinja2 declares a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


def template_environment() -> Any:
    """The Jinja environment chat templates are written for: Hugging Face transformers'
    (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, the ``generation``
    tag, ``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidRequestError(
            f"the model's chat template refused the messages: {message}", param="messages"
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_extension()]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaFormat(ChatFormat):
    name = "gguf-template"

    def __init__(self, template: str, *, bos_token: str, eos_token: str) -> None:
        # raises jinja2.TemplateSyntaxError: chat_format_for falls back, and says so
        self._template = template_environment().from_string(template)
        self._bos = bos_token
        self._eos = eos_token
        # a template that writes reasoning markers: the model reasons (Qwen3, DeepSeek-R1,
        # gpt-oss-style templates use <think>…</think>)
        if "<think>" in template and "</think>" in template:
            self.reasoning = ("<think>", "</think>")

    def _render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, thinking: bool | None
    ) -> ChatPrompt:
        extra: dict[str, object] = {}
        if tools:
            extra["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.function.name,
                        "description": t.function.description or "",
                        "parameters": parameters_of(t),
                    },
                }
                for t in tools
            ]
        if thinking is not None:
            extra["enable_thinking"] = thinking
        try:
            text = self._template.render(
                messages=[_template_message(m) for m in messages],
                bos_token=self._bos,
                eos_token=self._eos,
                add_generation_prompt=True,
                **extra,
            )
        except InvalidRequestError:
            raise  # the template's own raise_exception: it refused these messages
        except Exception as exc:
            raise ChatTemplateError(
                f"the model's chat template failed to render these messages: {type(exc).__name__}: {exc}"
            ) from None
        has_bos = bool(self._bos) and text.startswith(self._bos)
        stops = (self._eos,) if self._eos else ()
        reasoning = self.reasoning
        opens = reasoning is not None and text.rstrip().endswith(reasoning[0])
        return ChatPrompt(text=text, stops=stops, has_bos=has_bos, reasoning=reasoning, opens_reasoning=opens)


def _template_message(message: ChatMessage) -> dict[str, object]:
    """A message as chat templates expect it (tool call arguments as objects, as
    llama.cpp passes them)."""
    out: dict[str, object] = {"role": message.role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.loads(line)["arguments"]},
            }
            for call, line in zip(message.tool_calls, call_text(message).splitlines(), strict=True)
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def chat_format_for(
    *, template: str | None, architecture: str | None, bos_token: str = "", eos_token: str = ""
) -> ChatFormat:
    """Pick the chat format: the model's own template, else a fallback by architecture
    (also when the template does not compile: logged, as llama-server does)."""
    if template:
        from jinja2 import TemplateError

        try:
            return JinjaFormat(template, bos_token=bos_token, eos_token=eos_token)
        except TemplateError as exc:
            fallback = _fallback(architecture)
            logger.error(
                "the model's chat template does not compile (%s: %s); chats are rendered in the %s "
                'format instead (docs/api.md, "Chat prompts")',
                type(exc).__name__,
                exc,
                fallback.name,
            )
            return fallback
    return _fallback(architecture)


def _fallback(architecture: str | None) -> ChatFormat:
    if architecture and architecture.startswith("gemma"):
        return GemmaFormat()
    return ChatMLFormat()
