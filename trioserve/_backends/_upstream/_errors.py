"""Every way an upstream can fail, mapped to trioserve's errors in this one place.

An attempt on one upstream ends in one of three ways::

    UpstreamUnavailable    the upstream is not serving (unreachable, 502/503/504, a
                           stream broken off, shutting down): cooldown, try another
    Retry(error)           this attempt failed in a way another upstream may not (429,
                           other 5xx, a mid-stream error; for embeddings a 501 or a
                           silent read timeout; for /infill and rerank an upstream
                           without that endpoint): try another
    TrioserveError         the client's own fault (a 4xx: InvalidRequestError,
                           ContextLengthError), with the upstream's message: no retry

Whether another upstream is tried at all is :mod:`._attempts`' business (not once a
byte reached the client); what the client gets when none is left is decided here too
(:func:`generation_failed`, :func:`infill_failed`, :func:`embeddings_failed`, which
rerank shares), and the 503 with
``Retry-After`` while every upstream cools down (:func:`refuse_if_all_cooling_down`).
"""

from __future__ import annotations

from typing import Literal

from ..._core._exceptions import (
    BackendError,
    ContextLengthError,
    InvalidRequestError,
    NotSupportedError,
    OverloadedError,
    ServiceUnavailableError,
    TrioserveError,
)
from ._balancer import Balancer

__all__ = [
    "UNAVAILABLE_STATUSES",
    "Endpoint",
    "Retry",
    "UpstreamUnavailable",
    "broken_off",
    "describe_error",
    "embeddings_failed",
    "ended",
    "failed_mid_stream",
    "generation_failed",
    "infill_failed",
    "malformed_embeddings",
    "malformed_rerank",
    "not_json",
    "refusal",
    "refuse_if_all_cooling_down",
    "silent",
    "unavailable_for_embeddings",
    "unfinished",
    "unreachable",
]

#: statuses that say "this upstream is not serving": cooldown, retry elsewhere
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
#: statuses that say "this upstream has no such endpoint" (vLLM: 404 for /infill;
#: llama-server: 501 for a model without FIM tokens, or without --reranking)
_NO_ENDPOINT_STATUSES = frozenset({404, 405, 501})

#: which upstream endpoint a request went to: ``/v1/completions``,
#: ``/v1/embeddings``, ``/infill``, ``/v1/rerank``
type Endpoint = Literal["completions", "embeddings", "infill", "rerank"]


class UpstreamUnavailable(Exception):
    """The upstream is not serving: put it in its cooldown, try another."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Retry(Exception):
    """This attempt failed in a way another upstream may not: try the next one (if no
    byte has reached the client yet)."""

    def __init__(self, error: TrioserveError) -> None:
        super().__init__(error.message)
        self.error = error


def describe_error(exc: BaseException) -> str:
    """A foreign exception as one line: its type, and its text if it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def unreachable(url: str, exc: BaseException) -> UpstreamUnavailable:
    """The request could not be sent (connect error, a transport failure before the
    answer's headers)."""
    return UpstreamUnavailable(f"cannot reach upstream {url}: {describe_error(exc)}")


def broken_off(url: str, what: str, exc: BaseException) -> UpstreamUnavailable:
    """The answer broke off after its headers (``what``: "the stream", "its embeddings
    answer")."""
    return UpstreamUnavailable(f"upstream {url} broke off {what}: {describe_error(exc)}")


def refusal(
    url: str,
    status: int,
    message: str,
    param: str | None,
    code: str | None,
    *,
    endpoint: Endpoint = "completions",
) -> Exception:
    """A non-200 answer (``message``, ``param``, ``code`` from its body) as the
    exception to raise."""
    if status in UNAVAILABLE_STATUSES:
        return UpstreamUnavailable(f"upstream {url} answered {status}: {message}")
    if endpoint == "infill" and _lacks("infill", status, message):
        return Retry(
            InvalidRequestError(
                f"fill in the middle (/infill, suffix) is not supported by upstream {url}: it answered "
                f"{status}: {message}",
                param="input_prefix",
                code="infill_not_supported",
            )
        )
    if endpoint == "rerank" and _lacks("rerank", status, message):
        return Retry(
            InvalidRequestError(
                f"reranking is not supported by upstream {url}: it answered {status}: {message}",
                param="model",
                code="rerank_not_supported",
            )
        )
    if endpoint == "embeddings" and status == 501:  # not an embedding model; up, though
        return Retry(
            NotSupportedError(f"upstream {url} computes no embeddings: {message}", code="no_embeddings")
        )
    if status == 429:
        return Retry(OverloadedError(f"the upstream servers are overloaded: {message}"))
    if status >= 500 or status in (401, 403, 404, 405):
        # its failure, or our configuration (key, URL, model): not the client's fault
        return Retry(BackendError(f"upstream {url} answered {status}: {message}"))
    if code == "context_length_exceeded":
        return ContextLengthError(message, param=param)
    return InvalidRequestError(message, param=param, code=code)


def _lacks(what: str, status: int, message: str) -> bool:
    """Whether an answer says the upstream cannot do ``what`` ("infill", "rerank"): no
    such endpoint, or a 4xx saying so (llama-server: "Infill is not supported by this
    model", "This server does not support reranking")."""
    if status in _NO_ENDPOINT_STATUSES:
        return True
    text = message.lower()
    return 400 <= status < 500 and what in text and "not support" in text


def unfinished(url: str) -> UpstreamUnavailable:
    """The stream ended (``[DONE]`` or the connection's end) without a finish reason."""
    return UpstreamUnavailable(f"upstream {url} ended the stream without a finish reason")


def ended(url: str, reason: str, message: str | None) -> Exception | None:
    """How a stream that ended with ``reason`` (OpenAI's finish_reason, or an upstream
    trioserve's ``end_cause``) fails; ``None``: it did not fail (``stop``, ``length``,
    an unknown reason: reported as ``stop``). ``deadline`` is not decided here: the
    client first lets ours fire."""
    detail = f": {message}" if message else ""
    if reason == "deadline":
        return BackendError(f"upstream {url} ended the stream at its own deadline{detail}")
    if reason == "shutdown":
        return UpstreamUnavailable(f"upstream {url} is shutting down{detail}")
    if reason == "error":
        return Retry(BackendError(f"upstream {url} failed{detail}"))
    return None


def failed_mid_stream(url: str, error: str) -> Retry:
    """An error event in the stream (vLLM and llama-server report mid-stream errors so)."""
    return Retry(BackendError(f"upstream {url} failed: {error}"))


def not_json(url: str) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"upstream {url} sent an event that is not JSON")


def silent(url: str) -> Retry:
    """An embeddings answer is silent until all of it is computed: a read timeout is a
    long batch on a busy upstream, not a dead one (no cooldown)."""
    return Retry(BackendError(f"upstream {url} did not answer within its read timeout"))


def malformed_embeddings(url: str, inputs: int) -> Retry:
    return Retry(
        BackendError(
            f"upstream {url} answered POST /v1/embeddings with something other than "
            f"one embedding per input ({inputs})"
        )
    )


def malformed_rerank(url: str, documents: int) -> Retry:
    return Retry(
        BackendError(
            f"upstream {url} answered POST /v1/rerank with something other than "
            f"one score per document ({documents})"
        )
    )


# ------------------------------------------------- what the client gets in the end


def refuse_if_all_cooling_down(balancer: Balancer) -> None:
    """Refuse a request while every upstream is in its cooldown.

    Raises:
        ServiceUnavailableError: 503 with ``Retry-After``: until the first upstream may
            be tried again.
    """
    wait = balancer.all_cooling_down()
    if wait is not None:
        raise ServiceUnavailableError(
            f"every upstream failed recently; the next is retried in {wait:.1f} s",
            retry_after=wait,
            code="upstream_unavailable",
        )


def _why_none(balancer: Balancer) -> str:
    return "; ".join(f"{u.url}: {u.last_error or 'cooling down'}" for u in balancer.upstreams)


def generation_failed(balancer: Balancer, errors: list[TrioserveError]) -> TrioserveError:
    """The error for a completion no upstream served: each attempt's message."""
    if errors:
        return BackendError("; ".join(error.message for error in errors))
    return BackendError(f"no upstream is available: {_why_none(balancer)}")


def infill_failed(balancer: Balancer, errors: list[TrioserveError]) -> TrioserveError:
    """The error for a fill-in-the-middle request no upstream served: the 400
    ``infill_not_supported`` (each upstream's message) when every upstream tried said
    it cannot; else as :func:`generation_failed`."""
    if errors and all(getattr(error, "code", None) == "infill_not_supported" for error in errors):
        last = errors[-1]
        if len(errors) > 1:
            last.message = "; ".join(error.message for error in errors)
            last.args = (last.message,)
        return last
    return generation_failed(balancer, errors)


def unavailable_for_embeddings(balancer: Balancer, message: str) -> TrioserveError:
    """An upstream not serving, as an embeddings request's error: nothing reached the
    client yet, so a 503 it may send again after the cooldown."""
    return ServiceUnavailableError(message, retry_after=balancer.cooldown, code="upstream_unavailable")


def embeddings_failed(balancer: Balancer, errors: list[TrioserveError]) -> TrioserveError:
    """The error for an embeddings (or rerank) request no upstream served: the
    attempts' own kind of error if they all failed alike (503, 501, 429, rerank's
    400), else a
    :class:`BackendError` naming each."""
    if not errors:
        wait = balancer.all_cooling_down()
        return ServiceUnavailableError(
            f"no upstream is available: {_why_none(balancer)}",
            retry_after=wait if wait is not None else balancer.cooldown,
            code="upstream_unavailable",
        )
    if all(type(error) is type(errors[-1]) for error in errors):
        last = errors[-1]
        if len(errors) > 1:
            last.message = "; ".join(error.message for error in errors)
            last.args = (last.message,)
        return last
    return BackendError("; ".join(error.message for error in errors))
