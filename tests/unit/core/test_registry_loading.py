"""The registry's loads, edge by edge (docs/models.md, "States and transitions"):
unloaded → loading → loaded, an aborted load, loads one at a time. With the scripted
backend: no model, and every phase reached by what shows it (a snapshot, a gate a test
opens), never by a sleep."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trioserve._core._exceptions import ServiceUnavailableError

from ._registry_helpers import LIMIT, Client, make_registry, state, until

# ------------------------------------------------------------ unloaded → loading → loaded


async def test_a_request_loads_an_unloaded_model_and_holds_a_lease(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a")
    loaders["a"].gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        assert state(registry.snapshot(), "a") == "unloaded"
        client = Client(nursery, registry, "a")
        await until(registry, lambda s: s.model("a").load_waiters == 1)
        assert state(registry.snapshot(), "a") == "loading"
        loaders["a"].gate.set()
        await client.has_lease()
        snapshot = registry.snapshot()
        assert (state(snapshot, "a"), snapshot.model("a").leases) == ("loaded", 1)
        client.leave()
        await client.done()
        assert registry.snapshot().model("a").leases == 0
    assert state(registry.snapshot(), "a") == "unloaded"  # (the registry closed)


async def test_a_failed_load_is_failed_and_a_later_request_tries_again(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a")
    loaders["a"].failure = "no such tensor"
    async with registry:
        with pytest.raises(ServiceUnavailableError, match="no such tensor"):
            await registry.acquire("a")
        assert state(registry.snapshot(), "a") == "failed"
        loaders["a"].failure = None
        lease = await registry.acquire("a")
        assert state(registry.snapshot(), "a") == "loaded"
        lease.release()


async def test_a_preload_loads_at_startup_and_a_leaving_waiter_never_aborts_it(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", preload=("a",))
    loaders["a"].gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        assert state(registry.snapshot(), "a") == "loading"
        client = Client(nursery, registry, "a")
        await until(registry, lambda s: s.model("a").load_waiters == 1)
        client.cancel()
        await client.done()
        assert state(registry.snapshot(), "a") == "loading"
        loaders["a"].gate.set()
        await until(registry, lambda s: state(s, "a") == "loaded")


# -------------------------------------------------------- loading → unloaded (aborted)


async def test_the_last_waiter_leaving_aborts_the_load(autojump_clock: Any) -> None:
    registry, loaders, log = make_registry("a")
    loaders["a"].gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        first, second = Client(nursery, registry, "a"), None
        await until(registry, lambda s: s.model("a").load_waiters == 1)
        second = Client(nursery, registry, "a")
        await until(registry, lambda s: s.model("a").load_waiters == 2)
        first.cancel()  # cancelled while waiting for the load: the load goes on
        await first.done()
        snapshot = registry.snapshot()
        assert (state(snapshot, "a"), snapshot.model("a").load_waiters) == ("loading", 1)
        second.cancel()  # the last one: the load is aborted
        await second.done()
        await until(registry, lambda s: state(s, "a") == "unloaded" and s.loads_running == 0)
        assert log == [("start", "a"), ("end", "a")]
        assert registry.snapshot().tasks == 0


async def test_an_unload_of_a_loading_model_aborts_the_load_and_its_waiters_load_it_again(
    autojump_clock: Any,
) -> None:
    registry, loaders, log = make_registry("a")
    loaders["a"].gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        client = Client(nursery, registry, "a")
        await until(registry, lambda s: s.model("a").load_waiters == 1)
        await loaders["a"].started.wait()
        loaders["a"].started = trio.Event()
        await registry.unload("a")
        # the aborted load ended; the waiter, still there, started the next one
        with trio.fail_after(LIMIT):
            await loaders["a"].started.wait()
        assert log == [("start", "a"), ("end", "a"), ("start", "a")]
        loaders["a"].gate.set()
        await client.has_lease()
        client.leave()


# ------------------------------------------------------------- loads: one at a time


async def test_loads_run_one_at_a_time_in_arrival_order(autojump_clock: Any) -> None:
    registry, loaders, log = make_registry("a", "b", "c")
    for loader in loaders.values():
        loader.gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        clients = []
        for name in ("c", "a", "b"):
            clients.append(Client(nursery, registry, name))
            await until(registry, lambda s, name=name: s.model(name).load_waiters == 1)
        snapshot = registry.snapshot()
        assert (snapshot.loads_running, snapshot.loads_queued) == (1, 2)
        assert [m.load_queued for m in snapshot.models] == [True, True, False]  # a, b wait; c runs
        for loader in loaders.values():
            loader.gate.set()
        for client in clients:
            await client.has_lease()
        # each load ended before the next began: no load measured another's growth
        assert log == [
            ("start", "c"),
            ("end", "c"),
            ("start", "a"),
            ("end", "a"),
            ("start", "b"),
            ("end", "b"),
        ]
        for client in clients:
            client.leave()


async def test_max_concurrent_loads_lets_that_many_run_at_once(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", "b", "c", max_concurrent_loads=2)
    for loader in loaders.values():
        loader.gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        for name in ("a", "b", "c"):
            Client(nursery, registry, name)
            await until(registry, lambda s, name=name: s.model(name).load_waiters == 1)
        snapshot = registry.snapshot()
        assert (snapshot.loads_running, snapshot.loads_queued) == (2, 1)
        nursery.cancel_scope.cancel()


async def test_a_queued_load_whose_waiter_leaves_gives_up_its_place(autojump_clock: Any) -> None:
    registry, loaders, log = make_registry("a", "b")
    loaders["a"].gate = trio.Event()
    async with registry, trio.open_nursery() as nursery:
        first = Client(nursery, registry, "a")
        await until(registry, lambda s: s.model("a").load_waiters == 1)
        second = Client(nursery, registry, "b")
        await until(registry, lambda s: s.model("b").load_queued)
        second.cancel()  # cancelled while its load waits for a slot
        await second.done()
        await until(registry, lambda s: state(s, "b") == "unloaded" and s.loads_queued == 0)
        loaders["a"].gate.set()
        await first.has_lease()
        assert ("start", "b") not in log  # it never started
        first.leave()
