"""Controls on a running generation (llama-server's ``POST /v1/chat/completions/control``;
trioserve's ``POST /v1/requests/{id}/control``): the bodies, and the answer in
llama-server's shape — ``{"success": true}`` or ``{"success": false, "message": …}``,
with llama-server's messages where it has one (docs/dialects.md, "Ending the reasoning")."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from .._core._backend import ControlOutcome
from .._core._exceptions import InvalidRequestError
from ._codec import decode

__all__ = [
    "NO_COMPLETION",
    "ChatControlRequest",
    "ControlAnswer",
    "RequestControlRequest",
    "control_answer",
    "decode_chat_control",
    "decode_request_control",
]

#: the one action there is (llama-server's)
REASONING_END = "reasoning_end"
#: llama-server's answer for an id no running completion has
NO_COMPLETION = "no active completion for this id"

#: why a control did nothing, per outcome (llama-server's words for its two cases)
_MESSAGES: dict[ControlOutcome, str] = {
    "not_enabled": "reasoning control not enabled for this completion",
    "not_reasoning": (
        "this completion is not reasoning: its model has no reasoning markers, or its request turned "
        "reasoning off (thinking disabled, a constrained answer)"
    ),
    "already_ended": "reasoning already ended",
    "finished": NO_COMPLETION,
    "unsupported": "this model's backend cannot end a reasoning (the upstream relay forwards no controls)",
}


class ChatControlRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions/control``: llama-server's body."""

    #: the completion's id (its chunks' ``chatcmpl-…``, ``msg_…``, ``resp_…``) or its
    #: request's ``X-Request-Id``
    id: str | None = None
    #: ``reasoning_end``
    action: str | None = None


class RequestControlRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/requests/{id}/control``."""

    #: ``reasoning_end``
    action: str | None = None


class ControlAnswer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Both control routes' answer (llama-server's shape)."""

    success: bool
    #: why it did nothing (absent on success)
    message: str | None = None


_chat_decoder = msgspec.json.Decoder(ChatControlRequest)
_request_decoder = msgspec.json.Decoder(RequestControlRequest)


def _check_action(action: str | None) -> None:
    if action != REASONING_END:
        # (llama-server's message, for a missing action too; the param names the field)
        raise InvalidRequestError("unknown control action", param="action")


def decode_chat_control(body: bytes) -> str:
    """The id a ``/v1/chat/completions/control`` body names (400 for a missing id or an
    action other than ``reasoning_end``, as llama-server)."""
    request = decode(_chat_decoder, body)
    if not request.id:
        raise InvalidRequestError("missing completion id", param="id")
    _check_action(request.action)
    return request.id


def decode_request_control(body: bytes) -> None:
    """Check a ``/v1/requests/{id}/control`` body (400 for an unknown action)."""
    _check_action(decode(_request_decoder, body).action)


def control_answer(outcomes: Iterable[ControlOutcome]) -> dict[str, object]:
    """The answer to a control that reached ``outcomes`` (one per choice of each request
    it found; none: no such request): a success if any choice's reasoning is being
    ended, else the first one's reason."""
    first: ControlOutcome | None = None
    for outcome in outcomes:
        if outcome == "forced":
            return {"success": True}
        first = first or outcome
    return {"success": False, "message": NO_COMPLETION if first is None else _MESSAGES[first]}
