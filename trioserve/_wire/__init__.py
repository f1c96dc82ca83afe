"""The wire format: OpenAI request/response bodies, server-sent events, chat templates.

Pure functions over bytes and core types; no I/O, no Trio. The face: the codec every
body goes through (:mod:`._codec`) and the dialect specs the HTTP layer picks per route.
"""

from ._chat import ChatFormat, chat_format_for
from ._choices import finished_choice
from ._codec import decode, encode_json
from ._control import control_answer, decode_chat_control, decode_request_control
from ._conversation import Conversation, generation_for
from ._dialect import Dialect
from ._embeddings import decode_embeddings_request, embeddings_inputs, embeddings_response
from ._inbound import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    OLLAMA,
    OPENAI,
    RESPONSES,
    SPECS,
    responses_reply,
    spec_for_path,
)
from ._limits import RequestLimits
from ._models import RouterModelRequest, decode_router_request
from ._rerank import RerankQuery, decode_rerank_request, rerank_response
from ._responses_writer import StoredTurn
from ._spec import DialectSpec, ErrorBody, ParsedRequest, ReadOptions, StoredAsk, StoredContext
from ._sse import number_events
from ._tokenize import (
    decode_detokenize_request,
    decode_tokenize_request,
    detokenize_response,
    tokenize_response,
)
from ._transcriptions import TranscriptionForm, chat_body
from ._truncation import Dropped, Truncation, TruncationMode

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MESSAGES",
    "OLLAMA",
    "OPENAI",
    "RESPONSES",
    "SPECS",
    "ChatFormat",
    "Conversation",
    "Dialect",
    "DialectSpec",
    "Dropped",
    "ErrorBody",
    "ParsedRequest",
    "ReadOptions",
    "RequestLimits",
    "RerankQuery",
    "RouterModelRequest",
    "StoredAsk",
    "StoredContext",
    "StoredTurn",
    "TranscriptionForm",
    "Truncation",
    "TruncationMode",
    "chat_body",
    "chat_format_for",
    "control_answer",
    "decode",
    "decode_chat_control",
    "decode_detokenize_request",
    "decode_embeddings_request",
    "decode_request_control",
    "decode_rerank_request",
    "decode_router_request",
    "decode_tokenize_request",
    "detokenize_response",
    "embeddings_inputs",
    "embeddings_response",
    "encode_json",
    "finished_choice",
    "generation_for",
    "number_events",
    "rerank_response",
    "responses_reply",
    "spec_for_path",
    "tokenize_response",
]
