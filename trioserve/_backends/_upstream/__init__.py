"""The upstream backend: trioserve in front of OpenAI-compatible servers.

One job per module, from the face down::

    _backend     UpstreamBackend: the Backend the engine sees (prepare, generate --
                 /v1/completions, or /infill for fill in the middle --, embed_inputs,
                 rerank, aload); checks each request
    _relay       Relay: each kind of request to the upstreams: its body
                 (_wire._upstream), its attempts and errors, capabilities learnt
    _discovery   at load: what the upstreams serve, and which answer at all
    _attempts    the one attempt/retry loop: an upstream per attempt, retry while no
                 byte reached the client
    _balancer    which upstream serves the next attempt; health and cooldown
    _client      HTTP/1.1 to one upstream: one exchange for every POST, the SSE relay,
                 /v1/models and /props
    _errors      every way an upstream fails, mapped to trioserve's errors; what the
                 client gets when no upstream is left

What is said on the wire (the request body, the streamed events, error bodies, the
embeddings answer) is :mod:`trioserve._wire._upstream`'s: sans-IO, no httpx.
Imports :mod:`trioserve._core` and :mod:`trioserve._wire`, and no other backend.
"""

from ._backend import UpstreamBackend
from ._balancer import Balancer, UpstreamState

__all__ = ["Balancer", "UpstreamBackend", "UpstreamState"]
