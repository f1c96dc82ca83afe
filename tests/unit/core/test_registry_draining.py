"""The registry's idle timer, explicit unloads and close, edge by edge (docs/models.md,
"States and transitions"). With the scripted backend: no model, and every phase reached
by what shows it (a snapshot, a gate a test opens), never by a sleep."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trioserve import BackendSource, ModelRegistry, ModelSpec
from trioserve._core._exceptions import InvalidRequestError, ServiceUnavailableError

from ._registry_helpers import Client, Loader, make_registry, state, until

# ------------------------------------------------------------------ idle timer


async def test_the_idle_timer_unloads_after_keep_alive_and_a_new_lease_stops_it(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", keep_alive=60.0)
    async with registry:
        (await registry.acquire("a")).release()
        assert registry.snapshot().model("a").idle_timer
        await trio.sleep(30)
        lease = await registry.acquire("a")  # in use: the timer stops
        await until(registry, lambda s: not s.model("a").idle_timer)
        await trio.sleep(120)
        assert state(registry.snapshot(), "a") == "loaded"
        lease.release()  # the timer again, from now
        start = trio.current_time()
        await until(registry, lambda s: state(s, "a") == "unloaded")
        assert trio.current_time() - start == pytest.approx(60.0, abs=1.0)
        assert registry.snapshot().tasks == 0


async def test_a_request_keep_alive_zero_unloads_when_it_is_the_last(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a")  # the registry's keep-alive: forever
    async with registry:
        lease = await registry.acquire("a", keep_alive=0.0)
        lease.release()
        await until(registry, lambda s: state(s, "a") == "unloaded")


async def test_a_pinned_model_has_no_idle_timer(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", pinned=("a",), keep_alive=0.0)
    async with registry:
        (await registry.acquire("a", keep_alive=0.0)).release()
        assert not registry.snapshot().model("a").idle_timer
        await trio.sleep(10)
        assert state(registry.snapshot(), "a") == "loaded"


# -------------------------------------------------------------- explicit unload


async def test_an_unload_waits_the_grace_then_tells_each_holder_and_frees_after_the_last(
    autojump_clock: Any,
) -> None:
    registry, loaders, _ = make_registry("a", unload_grace=5.0)
    async with registry, trio.open_nursery() as nursery:
        holder = Client(nursery, registry, "a")
        await holder.has_lease()
        started = trio.current_time()
        nursery.start_soon(registry.unload, "a")
        await until(registry, lambda s: state(s, "a") == "unloading")
        await holder.done()  # its block was cancelled at the end of the grace
        assert trio.current_time() - started == pytest.approx(5.0, abs=0.5)
        assert isinstance(holder.error, ServiceUnavailableError)
        assert holder.error.code == "model_unloaded"
        await until(registry, lambda s: state(s, "a") == "unloaded")
        assert loaders["a"].closed_with_leases == [0]


async def test_a_request_during_an_unload_waits_and_loads_it_again(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", unload_grace=5.0)
    async with registry, trio.open_nursery() as nursery:
        holder = Client(nursery, registry, "a")
        await holder.has_lease()
        nursery.start_soon(registry.unload, "a")
        await until(registry, lambda s: state(s, "a") == "unloading")
        later = Client(nursery, registry, "a")
        await until(registry, lambda s: s.waiting_for_model == 1)
        holder.leave()
        await later.has_lease()
        assert len(loaders["a"].closed_with_leases) == 1  # unloaded once, loaded again
        later.leave()


async def test_a_request_cancelled_while_its_model_unloads_leaves_nothing(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", unload_grace=5.0)
    async with registry, trio.open_nursery() as nursery:
        holder = Client(nursery, registry, "a")
        await holder.has_lease()
        nursery.start_soon(registry.unload, "a")
        await until(registry, lambda s: state(s, "a") == "unloading")
        later = Client(nursery, registry, "a")
        await until(registry, lambda s: s.waiting_for_model == 1)
        later.cancel()
        await later.done()
        assert later.error is None
        assert registry.snapshot().waiting_for_model == 0
        holder.leave()
        await until(registry, lambda s: state(s, "a") == "unloaded")
        assert registry.snapshot().model("a").leases == 0


@pytest.mark.parametrize("ready_gate", [False, True])
async def test_a_pinned_model_refuses_an_unload_that_says_why(autojump_clock: Any, ready_gate: bool) -> None:
    loader = Loader("a", [])
    spec = ModelSpec(name="a", source=BackendSource(loader), pinned=True, preload=True, ready_gate=ready_gate)
    registry = loader.registry = ModelRegistry([spec])
    async with registry:
        await until(registry, lambda s: state(s, "a") == "loaded")
        with pytest.raises(InvalidRequestError) as refused:
            await registry.unload("a")
        assert refused.value.code == "model_pinned"
        assert ("only model" if ready_gate else "pinned") in refused.value.message
        assert state(registry.snapshot(), "a") == "loaded"
        await registry.unload("a", force=True)  # a library may
        assert state(registry.snapshot(), "a") == "unloaded"


# ------------------------------------------------------------------- aclose


async def test_aclose_waits_for_every_lease_before_freeing_a_model(autojump_clock: Any) -> None:
    """A lease held outside any stream (a tokenizer in a thread): closing tells it, and
    frees the model only once it is released."""
    registry, loaders, _ = make_registry("a", "b")
    told = trio.Event()
    async with trio.open_nursery() as nursery:
        async with registry:
            lease = await registry.acquire("a")
            lease.on_unload = told.set  # (a holder that takes its time to stop)
            (await registry.acquire("b")).release()

            async def holder() -> None:
                await told.wait()
                await trio.sleep(3)  # the "thread" finishing its work
                assert loaders["a"].closed_with_leases == []  # still not freed
                lease.release()

            nursery.start_soon(holder)
        # left the registry: after the holder released, and only then
        assert loaders["a"].closed_with_leases == [0]
        assert loaders["b"].closed_with_leases == [0]


async def test_an_aclose_cancelled_while_a_lease_is_held_leaves_that_model_allocated(
    autojump_clock: Any,
) -> None:
    registry, loaders, _ = make_registry("a", "b")
    async with registry:
        lease = await registry.acquire("a")  # (no on_unload: nobody can be told)
        (await registry.acquire("b")).release()
        with trio.move_on_after(5) as waited:  # (a second signal)
            await registry.aclose()
        assert waited.cancelled_caught
        assert loaders["a"].closed_with_leases == []  # never freed under its holder
        assert loaders["b"].closed_with_leases == [0]
        lease.release()
        await registry.aclose()  # (idempotent: now it goes)
        assert loaders["a"].closed_with_leases == [0]


async def test_aclose_ends_a_lease_block_with_shutting_down(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a")
    async with trio.open_nursery() as nursery:
        async with registry:
            holder = Client(nursery, registry, "a")
            await holder.has_lease()
        await holder.done()
    assert isinstance(holder.error, ServiceUnavailableError)
    assert holder.error.code == "shutting_down"


@pytest.mark.parametrize("phase", ["loading", "room", "draining"])
async def test_aclose_answers_every_waiter_with_shutting_down(autojump_clock: Any, phase: str) -> None:
    registry, loaders, _ = make_registry("a", "b", max_loaded=1)
    async with trio.open_nursery() as nursery:
        async with registry:
            holder = Client(nursery, registry, "a")
            if phase == "loading":
                loaders["a"].gate = trio.Event()
                await until(registry, lambda s: s.model("a").load_waiters == 1)
                waiter = holder
            else:
                await holder.has_lease()
                waiter = Client(nursery, registry, "b")
                await until(registry, lambda s: s.model("a").draining)
                if phase == "draining":
                    waiter = Client(nursery, registry, "a")
                    await until(registry, lambda s: s.waiting_for_model == 1)
        await waiter.done()
        assert isinstance(waiter.error, ServiceUnavailableError)
        assert waiter.error.code == "shutting_down"
    snapshot = registry.snapshot()
    assert all(m.state in ("unloaded", "failed") and m.leases == 0 for m in snapshot.models)
    assert (snapshot.claims, snapshot.waiting_for_model, snapshot.loads_running, snapshot.loads_queued) == (
        0,
        0,
        0,
        0,
    )
