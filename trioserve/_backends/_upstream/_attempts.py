"""The one attempt/retry loop every upstream request goes through.

An attempt is one call on one upstream the balancer picked. One that fails with
:class:`~._errors.UpstreamUnavailable` puts its upstream in cooldown; with
:class:`~._errors.Retry` it only fails. Either way the next available upstream is
tried, unless a byte already reached the client (``committed()``: then the attempt's
error is the request's) or the upstreams are exhausted (``exhausted(errors)`` says
what the client gets). Any other exception (the client's own 4xx, ``Cancelled``) ends
the request at once; the attempt's count on its upstream is undone however it ends.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from ..._core._exceptions import OverloadedError, TrioserveError
from ._balancer import Balancer, UpstreamState
from ._errors import Retry, UpstreamUnavailable

__all__ = ["Attempt", "attempt_each"]

logger = logging.getLogger("trioserve.upstream")

#: one attempt: ``(upstream, answered)`` → the result; ``answered()`` marks the
#: upstream healthy as soon as it has answered
type Attempt[T] = Callable[[UpstreamState, Callable[[], None]], Awaitable[T]]


def _never() -> bool:
    return False


async def attempt_each[T](
    balancer: Balancer,
    attempt: Attempt[T],
    *,
    unavailable: Callable[[str], TrioserveError],
    exhausted: Callable[[list[TrioserveError]], TrioserveError],
    committed: Callable[[], bool] = _never,
    overload_ends: bool = False,
) -> T:
    """Run ``attempt`` on one upstream after another until one succeeds.

    Args:
        balancer: picks each upstream, and learns their health.
        attempt: one try on one upstream.
        unavailable: the client's error for an upstream that is not serving (its
            :class:`UpstreamUnavailable` message).
        exhausted: the client's error when no upstream is left to try, from the
            attempts' errors (none: every upstream was cooling down).
        committed: whether the client has received something (no retry then).
        overload_ends: once every upstream has been tried, a last attempt that was
            overloaded (429) is the request's error as it is.

    Cancellation: the attempt in flight is cancelled (the client closes its
    connection) and its upstream's count undone before ``Cancelled`` propagates.
    """
    tried: set[int] = set()
    errors: list[TrioserveError] = []
    count = len(balancer.upstreams)
    while True:
        picked = balancer.pick(tried)
        if picked is None:
            raise exhausted(errors)
        index, upstream, probing = picked
        tried.add(index)
        error: TrioserveError
        try:
            with balancer.attempt(upstream, probing):
                return await attempt(upstream, functools.partial(balancer.healthy, upstream))
        except UpstreamUnavailable as exc:
            balancer.failed(upstream, exc.message)
            error = unavailable(exc.message)
        except Retry as retry:
            error = retry.error
        if committed():
            raise error from None
        errors.append(error)
        if len(tried) < count:
            logger.warning("%s; retrying on another upstream", error.message)
        if overload_ends and isinstance(error, OverloadedError) and len(tried) == count:
            raise error from None
