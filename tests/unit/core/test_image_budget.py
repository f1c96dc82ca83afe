"""The server-wide image decode budget (``_core/_media.py``'s :class:`ImageBudget`,
docs/vision.md): bytes held at once never exceed it; waiters are served in arrival
order (a large one at the head is not overtaken); a waiter cancelled leaves the line
and the ones behind it move up."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trioserve._core._media import ImageBudget


async def test_holders_stay_under_the_budget_and_are_served_in_order() -> None:
    budget = ImageBudget(100)
    order: list[str] = []
    release = {name: trio.Event() for name in ("a", "big", "small")}

    async def holder(name: str, amount: int) -> None:
        async with budget.hold(amount):
            order.append(name)
            assert budget.in_use <= budget.capacity
            await release[name].wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder, "a", 60)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(holder, "big", 70)  # waits: 60 + 70 > 100
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(holder, "small", 35)  # would fit beside "a", but waits behind "big"
        await trio.testing.wait_all_tasks_blocked()
        assert (order, budget.waiting, budget.in_use) == (["a"], 2, 60)
        release["a"].set()
        await trio.testing.wait_all_tasks_blocked()
        # the head is served; the one behind it waits (70 + 35 > 100)
        assert (order, budget.waiting, budget.in_use) == (["a", "big"], 1, 70)
        release["big"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert (order, budget.waiting, budget.in_use) == (["a", "big", "small"], 0, 35)
        release["small"].set()
    assert (budget.in_use, budget.waiting, budget.peak) == (0, 0, 70)


async def test_a_waiter_cancelled_leaves_the_line() -> None:
    budget = ImageBudget(100)
    got: list[str] = []

    async def take(amount: int, name: str) -> None:
        async with budget.hold(amount):
            got.append(name)

    async with budget.hold(90):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, 50, "cancelled")  # waits: 90 + 50 > 100
            await trio.testing.wait_all_tasks_blocked()
            assert budget.waiting == 1
            nursery.cancel_scope.cancel()
        assert budget.waiting == 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, 10, "fits")  # (nothing ahead of it now)
    assert got == ["fits"]
    assert budget.in_use == 0


async def test_more_than_the_budget_is_never_waited_for() -> None:
    budget = ImageBudget(100)
    with pytest.raises(ValueError, match="can never fit"):
        async with budget.hold(101):
            pass
    with pytest.raises(ValueError, match="at least 1 byte"):
        ImageBudget(0)
