"""Tool calls, sans-IO: the constraint a forced call is decoded under, and the
calls read back out of the generated text (whole, or as it streams).

A call is written as one compact JSON object, ``{"name":"<function>","arguments":{…}}``
— the format the chat prompt teaches (``_chat.py``) and, for ``tool_choice``
``required`` or a named function, the only text the constraint allows: the name is one
of the tools' (``const``) and the arguments validate against that tool's
``parameters``. With ``auto`` the text is unconstrained and read as a call only if it
is exactly such objects: one or several (parallel calls), each alone on its lines or
inside ``<tool_call>`` tags; only the first when the request turned parallel calls off
(``parallel_tool_calls: false``, ``disable_parallel_tool_use``). The formats and
choices: ``docs/structured-output.md``, "Tools".
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._types import Constraint
from ._limits import RequestLimits

__all__ = [
    "FunctionDef",
    "ParsedCall",
    "StreamedCallParser",
    "Tool",
    "ToolChoiceFunction",
    "ToolChoiceObject",
    "call_constraint",
    "check_tool_name",
    "chosen_tool",
    "new_call_id",
    "parse_calls",
]


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDef


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoiceObject(msgspec.Struct, kw_only=True):
    type: str
    function: ToolChoiceFunction


#: the tool names each dialect accepts, by their longest (Anthropic's: 128; OpenAI's: 64)
_NAMES = {64: re.compile(r"^[A-Za-z0-9_-]{1,64}$"), 128: re.compile(r"^[A-Za-z0-9_-]{1,128}$")}


def check_tool_name(name: str | None, param: str, longest: int = 64) -> None:
    """The one tool-name check of every dialect: 1 to ``longest`` letters, digits, ``_``
    or ``-`` (a 400 naming ``param`` otherwise)."""
    if name is None or not _NAMES[longest].match(name):
        raise InvalidRequestError(
            f"{param} {name!r} must be 1-{longest} letters, digits, '_' or '-'", param=param
        )


def chosen_tool(
    name: str | None, tools: Sequence[Tool], *, noun: str = "function", param: str = "tool_choice"
) -> str:
    """The tool a ``tool_choice`` names, checked to be one of ``tools`` (a 400 naming
    ``param`` and listing the tools otherwise; ``noun``: the dialect's word for a tool)."""
    names = [tool.function.name for tool in tools]
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names the {noun} {name!r}, which is not in tools ({', '.join(names)})",
            param=param,
        )
    return name


_EMPTY_PARAMETERS: dict[str, object] = {"type": "object", "properties": {}}


def check_tool_choice(choice: object) -> None:
    if isinstance(choice, ToolChoiceObject) and choice.type != "function":
        raise InvalidRequestError(
            f"tool_choice.type is {choice.type!r}; only 'function' is supported", param="tool_choice.type"
        )


def check_tool_schemas(
    tools: Sequence[Tool], limits: RequestLimits, *, schema_field: str = "function.parameters"
) -> None:
    """Refuse more tools than ``limits`` allow, or a tool whose parameters' schema is
    larger (``schema_field``: the dialect's name for it, in the error's ``param``)."""
    limits.check_count("tools", len(tools), limits.max_tools, "--max-tools", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            encoded = msgspec.json.encode(tool.function.parameters)
            limits.check_schema(encoded, f"tools[{i}].{schema_field}")


def check_tools(tools: Sequence[Tool], limits: RequestLimits | None = None) -> None:
    """Refuse what cannot be served: other tool types, bad or repeated names; with
    ``limits``, more tools or larger schemas than they allow."""
    if limits is not None:
        check_tool_schemas(tools, limits)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequestError(
                f"tools[{i}].type is {tool.type!r}; only 'function' tools are supported",
                param=f"tools[{i}].type",
            )
        name = tool.function.name
        check_tool_name(name, f"tools[{i}].function.name")
        if name in seen:
            raise InvalidRequestError(f"two tools are named {name!r}", param="tools")
        seen.add(name)


def parameters_of(tool: Tool) -> dict[str, object]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def call_constraint(tools: Sequence[Tool]) -> Constraint:
    """The constraint of a forced call to one of ``tools``: exactly one compact
    ``{"name":…,"arguments":…}`` object whose arguments validate against the named
    tool's ``parameters``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters_of(tool)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return Constraint(kind="json_schema", source=json.dumps(schema))


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    #: the arguments as JSON text (as OpenAI sends them)
    arguments: str


_OPEN_TAG, _CLOSE_TAG = "<tool_call>", "</tool_call>"
_WHITESPACE = re.compile(r"\s*")
_read_json = json.JSONDecoder().raw_decode


def _skip_space(text: str, position: int) -> int:
    match = _WHITESPACE.match(text, position)
    return match.end() if match else position


def _call(value: object, names: Sequence[str]) -> ParsedCall | None:
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if name not in names or not isinstance(arguments, dict):
        return None
    return ParsedCall(name=name, arguments=json.dumps(arguments, separators=(",", ":")))


def parse_calls(text: str, names: Sequence[str], *, parallel_calls: bool = True) -> list[ParsedCall] | None:
    """The tool calls ``text`` is, in order, or ``None`` if it is not only calls (then it
    is content): one or more call objects, each bare or inside ``<tool_call>`` tags,
    separated by whitespace (a model that calls several tools at once writes several).

    ``parallel_calls=False`` (the request asked for one call at a time): the text is
    read by the same rule, and only its first call is returned — the text of any later
    call is dropped, never content, so the reply holds exactly one call."""
    calls: list[ParsedCall] = []
    position = _skip_space(text, 0)
    while position < len(text):
        tagged = text.startswith(_OPEN_TAG, position)
        if tagged:
            position = _skip_space(text, position + len(_OPEN_TAG))
        if not text.startswith("{", position):
            return None
        try:
            value, position = _read_json(text, position)
        except (ValueError, RecursionError):  # (RecursionError: nested deeper than Python goes)
            return None
        call = _call(value, names)
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(text, position)
        if tagged:
            if not text.startswith(_CLOSE_TAG, position):
                return None
            position = _skip_space(text, position + len(_CLOSE_TAG))
    if not parallel_calls:
        del calls[1:]
    return calls or None


_HEAD = re.compile(r'^\{"name":"((?:[^"\\]|\\.)*)","arguments":')


class StreamedCallParser:
    """Reads a forced call as it streams (the constraint fixes its layout): first the
    name — :meth:`feed` returns it once, with the first argument text — then argument
    fragments, holding back the wrapper's closing ``}``."""

    __slots__ = ("_buffer", "name")

    def __init__(self) -> None:
        self._buffer = ""
        self.name: str | None = None

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the function name when it is first complete, else ``None``; new argument text)."""
        self._buffer += text
        if self.name is None:
            match = _HEAD.match(self._buffer)
            if match is None:
                return None, ""
            self.name = json.loads(f'"{match.group(1)}"')
            self._buffer = self._buffer[match.end() :]
            fragment, self._buffer = self._buffer[:-1], self._buffer[-1:]
            return self.name, fragment
        fragment, self._buffer = self._buffer[:-1], self._buffer[-1:]
        return None, fragment

    def finish(self, *, complete: bool = True) -> str:
        """The last argument text: the held ``}`` is the wrapper's and dropped when the
        call is ``complete``; a call cut short (``max_tokens``) keeps it (it belongs to
        the arguments). Before the name, the text held so far."""
        rest, self._buffer = self._buffer, ""
        if complete and self.name is not None and rest.endswith("}"):
            return rest[:-1]
        return rest
