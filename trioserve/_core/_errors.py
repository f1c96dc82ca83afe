"""Exception groups at the seams: a nursery the caller cannot see must not change the
type of what the caller raised.

:func:`unwrap_group` wraps a private nursery: a group holding exactly one exception that
is not ``trio.Cancelled`` comes out as that exception (same object, traceback, cause and
context, as ``trio.as_safe_channel`` does); a group of only ``Cancelled`` is left for its
cancel scope; several real errors stay a group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["unwrap_group"]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@contextmanager
def unwrap_group() -> Iterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        errors = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(errors) != 1:
            raise
        error = errors[0]
        context, suppress = error.__context__, error.__suppress_context__
        try:
            raise error
        finally:
            # `raise` inside `except` chains the group as the context: undo that
            error.__context__, error.__suppress_context__ = context, suppress
            del error, group
