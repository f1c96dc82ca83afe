"""The one attempt/retry loop (and the backend's refusals before it), with attempts
that are plain functions: no model, no socket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from trioserve._backends._upstream import Balancer, UpstreamBackend, UpstreamState
from trioserve._backends._upstream._attempts import attempt_each
from trioserve._backends._upstream._errors import Retry, UpstreamUnavailable
from trioserve._core._backend import ModelInfo
from trioserve._core._exceptions import (
    BackendError,
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
    TrioserveError,
)
from trioserve._core._types import GenerationRequest

URLS = ["http://a", "http://b"]


class Script:
    """Attempts that fail or succeed as told, one outcome per attempt, in order."""

    def __init__(self, *outcomes: Exception | str, sent_after: int | None = None) -> None:
        self.outcomes = list(outcomes)
        self.tried: list[str] = []
        #: the client has received something once this many attempts ran
        self.sent_after = sent_after

    async def __call__(self, upstream: UpstreamState, answered: Callable[[], None]) -> str:
        self.tried.append(upstream.url)
        assert upstream.outstanding == 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        answered()
        return outcome

    def committed(self) -> bool:
        return self.sent_after is not None and len(self.tried) >= self.sent_after


def _exhausted(errors: list[TrioserveError]) -> TrioserveError:
    return BackendError("exhausted: " + "; ".join(error.message for error in errors))


async def _run(balancer: Balancer, script: Script, *, overload_ends: bool = False) -> str:
    return await attempt_each(
        balancer,
        script,
        unavailable=BackendError,
        exhausted=_exhausted,
        committed=script.committed,
        overload_ends=overload_ends,
    )


async def test_an_unavailable_upstream_is_retried_elsewhere_before_the_first_byte() -> None:
    balancer = Balancer(URLS, cooldown=5.0)
    script = Script(UpstreamUnavailable("a is down"), "ok")
    assert await _run(balancer, script) == "ok"
    assert len(set(script.tried)) == 2
    down, up = (balancer.upstreams[URLS.index(url)] for url in script.tried)
    assert (down.failures, down.last_error, down.failed_until is not None) == (1, "a is down", True)
    assert (up.failures, up.failed_until, up.outstanding, down.outstanding) == (0, None, 0, 0)


async def test_a_failed_attempt_is_not_retried_after_the_first_byte() -> None:
    balancer = Balancer(URLS, cooldown=5.0)
    script = Script(Retry(BackendError("mid-stream")), "never", sent_after=1)
    with pytest.raises(BackendError, match="mid-stream"):
        await _run(balancer, script)
    assert len(script.tried) == 1


async def test_a_retry_puts_no_upstream_in_cooldown() -> None:
    balancer = Balancer(URLS, cooldown=5.0)
    assert await _run(balancer, Script(Retry(BackendError("500")), "ok")) == "ok"
    assert all(upstream.failed_until is None for upstream in balancer.upstreams)


async def test_when_every_upstream_failed_the_client_gets_each_error() -> None:
    balancer = Balancer(URLS, cooldown=5.0)
    script = Script(UpstreamUnavailable("one"), Retry(BackendError("two")))
    with pytest.raises(BackendError, match="exhausted: one; two"):
        await _run(balancer, script)


async def test_all_overloaded_ends_with_the_last_overload_when_asked() -> None:
    script = Script(Retry(OverloadedError("busy 1")), Retry(OverloadedError("busy 2")))
    with pytest.raises(OverloadedError, match=r"^busy 2$"):
        await _run(Balancer(URLS, cooldown=5.0), script, overload_ends=True)
    script = Script(Retry(OverloadedError("busy 1")), Retry(OverloadedError("busy 2")))
    with pytest.raises(BackendError, match="exhausted: busy 1; busy 2"):
        await _run(Balancer(URLS, cooldown=5.0), script)


async def test_the_clients_own_error_is_not_retried() -> None:
    balancer = Balancer(URLS, cooldown=5.0)
    script = Script(InvalidRequestError("bad top_p"), "never")
    with pytest.raises(InvalidRequestError, match="bad top_p"):
        await _run(balancer, script)
    assert len(script.tried) == 1
    assert all(upstream.failed_until is None for upstream in balancer.upstreams)


async def test_a_cancel_during_an_attempt_undoes_its_count(autojump_clock: Any) -> None:
    balancer = Balancer(["http://a"], cooldown=5.0)
    (upstream,) = balancer.upstreams
    upstream.failed_until = trio.current_time() - 1  # its cooldown is over: this one probes
    started = trio.Event()

    async def hangs(upstream: UpstreamState, answered: Callable[[], None]) -> str:
        assert upstream.probing
        started.set()
        await trio.sleep_forever()
        raise AssertionError("not reached")

    with trio.move_on_after(1.0) as scope:
        await attempt_each(balancer, hangs, unavailable=BackendError, exhausted=_exhausted)
    assert scope.cancelled_caught
    assert started.is_set()
    assert (upstream.outstanding, upstream.requests, upstream.probing, upstream.failures) == (0, 1, False, 0)


async def test_every_upstream_cooling_down_is_exhausted_with_no_attempt(autojump_clock: Any) -> None:
    balancer = Balancer(URLS, cooldown=5.0)
    for upstream in balancer.upstreams:
        balancer.failed(upstream, f"{upstream.url} is down")
    script = Script("never")
    with pytest.raises(BackendError, match=r"^exhausted: $"):
        await _run(balancer, script)
    assert script.tried == []
    await trio.sleep(5.0)
    assert await _run(balancer, Script("probed")) == "probed"


# ------------------------------------------------------------------- the backend


async def test_the_backend_refuses_with_retry_after_while_every_upstream_cools_down(
    autojump_clock: Any,
) -> None:
    backend = UpstreamBackend(URLS, info=ModelInfo(id="m", context_length=100), cooldown=30.0)
    try:
        for upstream in backend.upstreams:
            backend.balancer.failed(upstream, "down")
        await trio.sleep(10.0)
        with pytest.raises(ServiceUnavailableError, match=r"retried in 20\.0 s") as caught:
            await backend.prepare(GenerationRequest(prompt="hi"))
        assert caught.value.retry_after == pytest.approx(20.0)
        assert caught.value.code == "upstream_unavailable"
        with pytest.raises(ServiceUnavailableError) as caught:
            await backend.embed_inputs(["hi"])
        assert caught.value.retry_after == pytest.approx(20.0)
    finally:
        await backend.aclose()


async def test_the_backend_refuses_token_ids_and_empty_prompts() -> None:
    backend = UpstreamBackend(URLS, info=ModelInfo(id="m", context_length=100))
    try:
        with pytest.raises(InvalidRequestError, match="token-id prompts"):
            await backend.prepare(GenerationRequest(prompt=[1, 2]))
        with pytest.raises(InvalidRequestError, match="empty"):
            await backend.prepare(GenerationRequest(prompt=""))
        assert backend.slots == 16
    finally:
        await backend.aclose()
