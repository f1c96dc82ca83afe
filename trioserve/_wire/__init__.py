"""The wire format: OpenAI request/response bodies, server-sent events, chat templates.

Pure functions over bytes and core types; no I/O, no Trio. The face: the codec every
body goes through (:mod:`._codec`) and the dialect specs the HTTP layer picks per route.
"""

from ._chat import ChatFormat
from ._choices import finished_choice
from ._codec import decode, encode_json
from ._dialect import Dialect
from ._inbound import CHAT, COMPLETIONS, MESSAGES, OPENAI, RESPONSES, SPECS, spec_for_path
from ._spec import DialectSpec, ErrorBody, ParsedRequest, ReadOptions

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MESSAGES",
    "OPENAI",
    "RESPONSES",
    "SPECS",
    "ChatFormat",
    "Dialect",
    "DialectSpec",
    "ErrorBody",
    "ParsedRequest",
    "ReadOptions",
    "decode",
    "encode_json",
    "finished_choice",
    "spec_for_path",
]
