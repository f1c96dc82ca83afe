"""The registry's room, edge by edge (docs/models.md, "States and transitions"):
eviction, draining and the claims for room in arrival order. With the scripted
backend: no model, and every phase reached by what shows it (a snapshot, a gate a test
opens), never by a sleep."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trioserve._core._exceptions import InvalidRequestError, ServiceUnavailableError

from ._registry_helpers import Client, make_registry, state, until

# --------------------------------------------------- loaded → unloading → unloaded (room)


async def test_an_idle_model_is_evicted_at_once_to_make_room(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", "b", max_loaded=1)
    async with registry:
        (await registry.acquire("a")).release()
        lease = await registry.acquire("b")
        snapshot = registry.snapshot()
        assert (state(snapshot, "a"), state(snapshot, "b")) == ("unloaded", "loaded")
        assert loaders["a"].closed_with_leases == [0]
        lease.release()


async def test_a_busy_model_drains_and_is_evicted_when_its_last_lease_ends(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", "b", max_loaded=1)
    async with registry, trio.open_nursery() as nursery:
        stream_a = Client(nursery, registry, "a")
        await stream_a.has_lease()
        wants_b = Client(nursery, registry, "b")
        await until(registry, lambda s: s.model("a").draining)
        assert state(registry.snapshot(), "a") == "loaded"  # a running stream is never cut
        stream_a.leave()
        await wants_b.has_lease()
        assert state(registry.snapshot(), "a") == "unloaded"
        assert loaders["a"].closed_with_leases == [0]
        wants_b.leave()


async def test_a_request_for_a_draining_model_is_answered_when_the_claim_for_room_leaves(
    autojump_clock: Any,
) -> None:
    """#33: with one model slot, a stream on A, a request for B (A drains), a second
    request for A waits; B's client leaves: A stops draining — and the second A request
    gets its lease (it used to wait for an unload that never came)."""
    registry, _, _ = make_registry("a", "b", max_loaded=1)
    async with registry, trio.open_nursery() as nursery:
        stream_a = Client(nursery, registry, "a")
        await stream_a.has_lease()
        wants_b = Client(nursery, registry, "b")
        await until(registry, lambda s: s.model("a").draining)
        second_a = Client(nursery, registry, "a")
        await until(registry, lambda s: s.waiting_for_model == 1)
        wants_b.cancel()  # cancelled while waiting for room
        await wants_b.done()
        await second_a.has_lease()
        snapshot = registry.snapshot()
        assert (state(snapshot, "a"), snapshot.model("a").draining, snapshot.model("a").leases) == (
            "loaded",
            False,
            2,
        )
        assert (snapshot.claims, snapshot.waiting_for_model, state(snapshot, "b")) == (0, 0, "unloaded")
        stream_a.leave()
        second_a.leave()


async def test_drain_and_undrain_cycles_leave_no_task_behind(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", "b", max_loaded=1)
    async with registry, trio.open_nursery() as nursery:
        stream_a = Client(nursery, registry, "a")
        await stream_a.has_lease()
        for _ in range(20):
            wants_b = Client(nursery, registry, "b")
            await until(registry, lambda s: s.model("a").draining)
            wants_b.cancel()
            await wants_b.done()
            await until(registry, lambda s: not s.model("a").draining)
        snapshot = registry.snapshot()
        assert snapshot.tasks == 0  # (no idle timer: keep-alive is forever)
        assert not snapshot.model("a").evicting
        # and draining still works: the stream's end evicts A, once
        wants_b = Client(nursery, registry, "b")
        await until(registry, lambda s: s.model("a").draining)
        stream_a.leave()
        await wants_b.has_lease()
        assert loaders["a"].closed_with_leases == [0]
        await until(registry, lambda s: s.tasks == 0)
        wants_b.leave()


async def test_a_request_for_a_draining_model_cancelled_leaves_nothing(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", "b", max_loaded=1)
    async with registry, trio.open_nursery() as nursery:
        stream_a = Client(nursery, registry, "a")
        await stream_a.has_lease()
        wants_b = Client(nursery, registry, "b")
        await until(registry, lambda s: s.model("a").draining)
        second_a = Client(nursery, registry, "a")
        await until(registry, lambda s: s.waiting_for_model == 1)
        second_a.cancel()  # cancelled while waiting for a draining model
        await second_a.done()
        snapshot = registry.snapshot()
        assert (snapshot.waiting_for_model, snapshot.model("a").leases) == (0, 1)
        assert snapshot.model("a").draining  # still wanted by B's claim
        stream_a.leave()
        await wants_b.has_lease()
        wants_b.leave()


async def test_a_claim_waiting_behind_another_keeps_arrival_order_when_cancelled(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", "b", "c", max_loaded=1)
    async with registry, trio.open_nursery() as nursery:
        stream_a = Client(nursery, registry, "a")
        await stream_a.has_lease()
        wants_b = Client(nursery, registry, "b")
        await until(registry, lambda s: s.claims == 1 and s.model("a").draining)
        wants_c = Client(nursery, registry, "c")
        await until(registry, lambda s: s.claims == 2)
        wants_c.cancel()  # not the head: only its place goes
        await wants_c.done()
        snapshot = registry.snapshot()
        assert (snapshot.claims, snapshot.model("a").draining) == (1, True)
        stream_a.leave()
        await wants_b.has_lease()
        assert state(registry.snapshot(), "c") == "unloaded"
        wants_b.leave()


async def test_a_model_that_can_never_fit_beside_the_pinned_ones_is_refused(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", "b", pinned=("a",), max_loaded=1)
    async with registry:
        lease = await registry.acquire("a")
        lease.release()
        with pytest.raises(ServiceUnavailableError) as refused:
            await registry.acquire("b")
        assert refused.value.code == "model_does_not_fit"


# --------------------------------------------------- a LoRA adapter's file (docs/lora.md)


async def test_an_adapter_loaded_at_run_time_counts_against_the_memory_budget(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, _, _ = make_registry("a", "b", memory_budget=1000)
    async with registry:
        lease = await registry.acquire("a")
        entry = lease.entry
        registry.check_adapter_room(entry, 1000)  # (fits: nothing else takes room)
        with pytest.raises(InvalidRequestError, match="--models-memory") as refused:
            registry.check_adapter_room(entry, 1001)
        assert refused.value.param == "lora_path"
        # a file loaded counts in its model's footprint until it is freed
        monkeypatch.setattr(type(lease.engine.backend), "adapter_bytes", 600)
        assert entry.footprint() == 600
        with pytest.raises(InvalidRequestError, match="the loaded models take 600 of the 1,000-byte"):
            registry.check_adapter_room(entry, 500)
        lease.release()
