"""The wire format: OpenAI request/response bodies, server-sent events, chat templates.

Pure functions over bytes and core types; no I/O, no Trio. The face: the codec every
body goes through (:mod:`._codec`) and the dialect specs the HTTP layer picks per route.
"""

from ._codec import decode, encode_json

__all__ = ["decode", "encode_json"]
