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


class InvalidRequestError(TrioserveError):
    status = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class AuthenticationError(TrioserveError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(TrioserveError):
    """A valid API key that may not do this (403): an admin's action
    (``docs/operations.md``, "Access")."""

    status = 403
    error_type = "permission_error"
    default_code = "admin_key_required"


class NotFoundError(TrioserveError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowedError(TrioserveError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLargeError(TrioserveError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class HeadersTooLargeError(TrioserveError):
    status = 431
    error_type = "invalid_request_error"
    default_code = "headers_too_large"


class UnsupportedMediaTypeError(TrioserveError):
    status = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class OverloadedError(TrioserveError):
    """Refused at admission. ``retry_after`` (seconds) goes into ``Retry-After``."""

    status = 429
    error_type = "overloaded_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        # the same request's deadline would pass again in the same queue
        super().__init__(message, code=code, should_retry=False if code == "deadline_unreachable" else None)
        self.retry_after = retry_after


class RateLimitError(TrioserveError):
    """The API key is over one of its limits (the keys file: requests or tokens per
    minute). ``retry_after``: when the limit has room again; the ``x-ratelimit-*``
    headers say which limit and how much is left."""

    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, retry_after: float, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers


class ServiceUnavailableError(TrioserveError):
    status = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ConflictError(TrioserveError):
    """The request conflicts with one in flight (its ``X-Request-Id`` is taken)."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "conflict"
    should_retry = False


class RequestCancelledError(TrioserveError):
    """Someone cancelled the request by its id (or a newer request of its session
    superseded it) before its response began."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "request_cancelled"
    should_retry = False


class DeadlineExceededError(TrioserveError):
    """The request's own deadline passed: sent again, it gets the same budget."""

    status = 504
    error_type = "timeout_error"
    default_code = "deadline_exceeded"
    should_retry = False


class NotSupportedError(TrioserveError):
    """The backend serving this server cannot do what the request asks (for example
    ``/tokenize`` on a backend without a tokenizer): no retry or change of the request
    will help on this server. 501, as llama-server answers an unsupported feature."""

    status = 501
    error_type = "not_supported_error"
    default_code = "not_supported"
    should_retry = False


class BackendError(TrioserveError):
    status = 500
    error_type = "server_error"
    default_code = "backend_error"


class ChatTemplateError(TrioserveError):
    """The model's chat template failed on these messages (a bug in the template, not a
    refusal: that is a 400). Sent again, the same messages fail the same way."""

    status = 500
    error_type = "server_error"
    default_code = "chat_template_error"
    should_retry = False
