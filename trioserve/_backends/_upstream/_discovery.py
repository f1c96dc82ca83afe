"""What the upstreams serve, asked once at load: their model, and which answer at all.

No background traffic later: health is learnt from requests (:mod:`._balancer`).
"""

from __future__ import annotations

import logging

import trio

from ..._core._exceptions import BackendError
from ..._wire._upstream import ModelDescription
from ._balancer import Balancer, UpstreamState
from ._client import UpstreamClient

__all__ = ["describe_upstreams"]

logger = logging.getLogger("trioserve.upstream")


async def describe_upstreams(
    client: UpstreamClient, balancer: Balancer, load_timeout: float
) -> ModelDescription:
    """The first upstream's model (``GET /v1/models``, and llama-server's ``/props``).

    Asks every upstream, once a second for up to ``load_timeout`` seconds, until at
    least one answers (an upstream still loading its model answers 503); those that
    do not are put in cooldown. Cancellation: the questions in flight are cancelled
    (their connections closed); no upstream is put in cooldown.

    Raises:
        BackendError: no upstream answered within ``load_timeout``.
    """
    found: dict[int, ModelDescription] = {}

    async def describe(index: int, upstream: UpstreamState) -> None:
        description = await client.describe(upstream)
        if description is not None:
            found[index] = description

    with trio.move_on_after(load_timeout):
        while True:
            async with trio.open_nursery() as nursery:
                for index, upstream in enumerate(balancer.upstreams):
                    if index not in found:
                        nursery.start_soon(describe, index, upstream)
            if found:
                break
            await trio.sleep(1.0)
    if not found:
        raise BackendError(
            f"no upstream answered GET /v1/models within {load_timeout:g} s: "
            + "; ".join(f"{u.url}: {u.last_error}" for u in balancer.upstreams)
        )
    now = trio.current_time()
    for index, upstream in enumerate(balancer.upstreams):
        if index not in found:
            upstream.failed_until = now + balancer.cooldown
            logger.warning(
                "upstream %s did not answer (%s); will retry it", upstream.url, upstream.last_error
            )
    ids = {u.model_id for u in balancer.upstreams if u.model_id is not None}
    if len(ids) > 1:
        logger.warning("the upstreams serve different models: %s", ", ".join(sorted(ids)))
    return found[min(found)]
