"""Which upstream serves the next attempt, and which are skipped for now."""

from __future__ import annotations

from typing import Any

import trio

from trioserve._backends._upstream import Balancer


def _picked(balancer: Balancer, tried: set[int] | None = None) -> int | None:
    picked = balancer.pick(tried or set())
    return None if picked is None else picked[0]


async def test_ties_are_taken_in_turn() -> None:
    balancer = Balancer(["http://a", "http://b", "http://c"], cooldown=5.0)
    assert [_picked(balancer) for _ in range(6)] == [1, 2, 0, 1, 2, 0]


async def test_the_least_busy_upstream_is_picked() -> None:
    balancer = Balancer(["http://a", "http://b"], cooldown=5.0)
    a, b = balancer.upstreams
    with balancer.attempt(a, False), balancer.attempt(a, False), balancer.attempt(b, False):
        assert (a.outstanding, b.outstanding) == (2, 1)
        assert {_picked(balancer) for _ in range(4)} == {1}
    assert (a.outstanding, b.outstanding, a.requests, b.requests) == (0, 0, 2, 1)


async def test_tried_upstreams_are_not_picked_again() -> None:
    balancer = Balancer(["http://a", "http://b"], cooldown=5.0)
    assert _picked(balancer, {0}) == 1
    assert _picked(balancer, {0, 1}) is None


async def test_a_failed_upstream_is_skipped_for_its_cooldown_then_probed_once(autojump_clock: Any) -> None:
    balancer = Balancer(["http://a", "http://b"], cooldown=5.0)
    a, _ = balancer.upstreams
    balancer.failed(a, "a is down")
    assert (a.failures, a.last_error) == (1, "a is down")
    assert {_picked(balancer) for _ in range(4)} == {1}
    await trio.sleep(5.0)
    picked = balancer.pick({1})
    assert picked is not None
    assert picked[0] == 0
    assert picked[2]  # a probe
    assert a.probing
    assert _picked(balancer, {1}) is None  # one probe at a time
    with balancer.attempt(a, probing=True):
        balancer.healthy(a)
    assert (a.probing, a.failed_until, a.last_error) == (False, None, None)
    assert _picked(balancer, {1}) == 0


async def test_all_cooling_down_says_until_when(autojump_clock: Any) -> None:
    balancer = Balancer(["http://a", "http://b"], cooldown=5.0)
    a, b = balancer.upstreams
    balancer.failed(a, "down")
    assert balancer.all_cooling_down() is None
    await trio.sleep(2.0)
    balancer.failed(b, "down")
    assert balancer.all_cooling_down() == 3.0
    await trio.sleep(3.0)
    assert balancer.all_cooling_down() is None
