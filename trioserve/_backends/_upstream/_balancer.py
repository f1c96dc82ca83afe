"""Which upstream serves the next request, and which are skipped for now.

A request goes to the available upstream with the fewest requests outstanding (ties:
in turn). An upstream that failed is skipped for ``cooldown`` seconds; after that one
request at a time probes it. No background traffic: health is learnt from requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

__all__ = ["Balancer", "UpstreamState"]

logger = logging.getLogger("trioserve.upstream")


@dataclass(kw_only=True, eq=False)
class UpstreamState:
    """One upstream server as the balancer sees it (read it for health pages, tests)."""

    url: str
    #: the model name this upstream serves (``None``: unknown; the backend's id is sent)
    model_id: str | None = None
    #: fields this kind of server needs in every request (llama-server:
    #: ``return_progress``); the backend's ``extra_body`` overrides them
    request_fields: dict[str, object] = field(default_factory=dict)
    #: requests on this upstream right now
    outstanding: int = 0
    #: requests sent, and attempts that failed (connect error, 502/503/504, broken stream)
    requests: int = 0
    failures: int = 0
    #: ``trio.current_time()`` until which the upstream is skipped; ``None``: healthy
    failed_until: float | None = None
    #: a request is probing it after its cooldown
    probing: bool = False
    last_error: str | None = None
    #: what its last answers showed it can do: ``"infill"`` (llama-server's
    #: ``/infill``), ``"rerank"`` (``/v1/rerank``); absent: not asked yet
    capabilities: dict[str, bool] = field(default_factory=dict)

    def available(self, now: float) -> bool:
        if self.failed_until is None:
            return True
        return now >= self.failed_until and not self.probing


class Balancer:
    """The upstreams, their health, and the choice of one per attempt."""

    def __init__(self, urls: Sequence[str], *, cooldown: float) -> None:
        self.upstreams = [UpstreamState(url=url) for url in urls]
        self.cooldown = cooldown
        self._turn = 0

    def pick(self, tried: set[int]) -> tuple[int, UpstreamState, bool] | None:
        """``(index, upstream, probing)``: the available upstream not in ``tried`` with
        the fewest outstanding requests; ``None`` if there is none."""
        now = trio.current_time()
        count = len(self.upstreams)
        self._turn = (self._turn + 1) % count
        best: tuple[int, int, int] | None = None
        for index, upstream in enumerate(self.upstreams):
            if index in tried or not upstream.available(now):
                continue
            key = (upstream.outstanding, (index - self._turn) % count, index)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        upstream = self.upstreams[best[2]]
        probing = upstream.failed_until is not None
        if probing:
            upstream.probing = True
        return best[2], upstream, probing

    def all_cooling_down(self) -> float | None:
        """Seconds until the first upstream may be tried again, if every one is in its
        cooldown now; ``None`` if some upstream may be tried."""
        now = trio.current_time()
        waits = [u.failed_until - now for u in self.upstreams if u.failed_until is not None]
        if len(waits) == len(self.upstreams) and min(waits) > 0:
            return min(waits)
        return None

    @contextmanager
    def attempt(self, upstream: UpstreamState, probing: bool) -> Iterator[None]:
        """Count one request on ``upstream`` for as long as it runs."""
        upstream.outstanding += 1
        upstream.requests += 1
        try:
            yield
        finally:
            upstream.outstanding -= 1
            if probing:
                upstream.probing = False

    def healthy(self, upstream: UpstreamState) -> None:
        """It answered (whatever it thought of the request): it is up."""
        if upstream.failed_until is not None:
            logger.info("upstream %s is back", upstream.url)
        upstream.failed_until = None
        upstream.last_error = None

    def failed(self, upstream: UpstreamState, message: str) -> None:
        """It could not serve: skip it for the cooldown."""
        upstream.failures += 1
        upstream.last_error = message
        if upstream.failed_until is None:
            logger.warning("%s; skipping it for %g s", message, self.cooldown)
        upstream.failed_until = trio.current_time() + self.cooldown
