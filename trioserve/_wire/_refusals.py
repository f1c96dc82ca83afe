"""The one refused-field mechanism of every dialect: a table of the fields trioserve
knows and does not honour, each with the values that mean "not asked for" and why it is
refused. Any other value is a 400 naming the field (docs/api.md, "Request fields")."""

from __future__ import annotations

from .._core._exceptions import InvalidRequestError

__all__ = ["Refusal", "check_refused"]

#: (the field, the values that mean "not asked for", why it is refused)
Refusal = tuple[str, tuple[object, ...], str]


def check_refused(request: object, table: tuple[Refusal, ...], prefix: str = "") -> None:
    """Refuse the first field of ``table`` that ``request`` sets to anything but one of
    its "not asked for" values (of the same type: ``0`` is not ``False``); ``prefix``:
    where ``request`` sits in the body (``"options."``)."""
    for name, defaults, why in table:
        value = getattr(request, name, None)
        if not any(value == default and type(value) is type(default) for default in defaults):
            raise InvalidRequestError(f"{prefix}{name} is not supported: {why}", param=prefix + name)
