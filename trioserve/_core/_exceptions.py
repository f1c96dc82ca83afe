"""The error tree: every trioserve error is a :class:`TrioserveError`.

Each error knows its HTTP status and its OpenAI error body (``type``, ``param``,
``code``); foreign errors are mapped to these once, at each boundary, and the HTTP layer
renders them in one place (``trioserve/_http/_errors.py``). The tree with each status:
``docs/embedding.md``, "Errors"; the codes on the wire: ``docs/api.md``, "Errors".
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AuthenticationError",
    "BackendError",
    "ChatTemplateError",
    "ConflictError",
    "ContextLengthError",
    "DeadlineExceededError",
    "HeadersTooLargeError",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "NotFoundError",
    "NotSupportedError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestCancelledError",
    "ServiceUnavailableError",
    "TrioserveError",
    "UnsupportedMediaTypeError",
]


class TrioserveError(Exception):
    """Base of every error trioserve raises on purpose."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    #: seconds after which a retry may succeed (sent as ``Retry-After``); ``None``: no advice
    retry_after: float | None = None
    #: more response headers (a rate limit's ``x-ratelimit-*``)
    headers: tuple[tuple[bytes, bytes], ...] = ()
    #: whether the same request sent again can succeed (sent as ``x-should-retry``, which
    #: the OpenAI and Anthropic SDKs obey instead of their own rule: they retry every 5xx,
    #: 408, 409 and 429 twice by default); ``None``: no advice
    should_retry: bool | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        if should_retry is not None:
            self.should_retry = should_retry

    def __init_subclass__(
        cls,
        *,
        status: int | None = None,
        error_type: str | None = None,
        code: str | None = None,
        should_retry: bool | None = None,
        **kwargs: object,
    ) -> None:
        """A subclass names what differs from its base in its class line:
        ``class NotFoundError(TrioserveError, status=404, code="not_found")``."""
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if error_type is not None:
            cls.error_type = error_type
        if code is not None:
            cls.default_code = code
        if should_retry is not None:
            cls.should_retry = should_retry

    def to_dict(self) -> dict[str, object]:
        """The OpenAI-style error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


_INVALID = "invalid_request_error"


class InvalidRequestError(TrioserveError, status=400, error_type=_INVALID):
    pass


class ContextLengthError(InvalidRequestError, code="context_length_exceeded"):
    pass


class AuthenticationError(
    TrioserveError, status=401, error_type="authentication_error", code="invalid_api_key"
):
    pass


class PermissionDeniedError(
    TrioserveError, status=403, error_type="permission_error", code="admin_key_required"
):
    """A valid API key that may not do this (403): an admin's action
    (``docs/operations.md``, "Access")."""


class NotFoundError(TrioserveError, status=404, error_type=_INVALID, code="not_found"):
    pass


class MethodNotAllowedError(TrioserveError, status=405, error_type=_INVALID, code="method_not_allowed"):
    pass


class PayloadTooLargeError(TrioserveError, status=413, error_type=_INVALID, code="payload_too_large"):
    pass


class HeadersTooLargeError(TrioserveError, status=431, error_type=_INVALID, code="headers_too_large"):
    pass


class UnsupportedMediaTypeError(
    TrioserveError, status=415, error_type=_INVALID, code="unsupported_media_type"
):
    pass


class OverloadedError(TrioserveError, status=429, error_type="overloaded_error", code="overloaded"):
    """Refused at admission. ``retry_after`` (seconds) goes into ``Retry-After``."""

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        # the same request's deadline would pass again in the same queue
        super().__init__(message, code=code, should_retry=False if code == "deadline_unreachable" else None)
        self.retry_after = retry_after


class RateLimitError(TrioserveError, status=429, error_type="rate_limit_error", code="rate_limit_exceeded"):
    """The API key is over one of its limits (the keys file: requests or tokens per
    minute). ``retry_after``: when the limit has room again; the ``x-ratelimit-*``
    headers say which limit and how much is left."""

    def __init__(
        self, message: str, *, retry_after: float, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers


class ServiceUnavailableError(
    TrioserveError, status=503, error_type="service_unavailable", code="service_unavailable"
):
    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ConflictError(TrioserveError, status=409, error_type=_INVALID, code="conflict", should_retry=False):
    """The request conflicts with one in flight (its ``X-Request-Id`` is taken)."""


class RequestCancelledError(
    TrioserveError, status=409, error_type=_INVALID, code="request_cancelled", should_retry=False
):
    """Someone cancelled the request by its id (or a newer request of its session
    superseded it) before its response began."""


class DeadlineExceededError(
    TrioserveError, status=504, error_type="timeout_error", code="deadline_exceeded", should_retry=False
):
    """The request's own deadline passed: sent again, it gets the same budget."""


class NotSupportedError(
    TrioserveError, status=501, error_type="not_supported_error", code="not_supported", should_retry=False
):
    """The backend serving this server cannot do what the request asks (for example
    ``/tokenize`` on a backend without a tokenizer): no retry or change of the request
    will help on this server. 501, as llama-server answers an unsupported feature."""


class BackendError(TrioserveError, status=500, error_type="server_error", code="backend_error"):
    pass


class ChatTemplateError(
    TrioserveError, status=500, error_type="server_error", code="chat_template_error", should_retry=False
):
    """The model's chat template failed on these messages (a bug in the template, not a
    refusal: that is a 400). Sent again, the same messages fail the same way."""
