"""The registry's names while it serves (Ollama's create, copy and delete: docs/models.md,
"Ollama's model routes"), edge by edge, with the scripted backend: a model added, an
alias added and taken away, a model's last name taking the model with it — its streams
given the grace, never cut before, and a request that waited for it refused."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from trioserve import BackendSource, ModelSpec
from trioserve._core._exceptions import InvalidRequestError, NotFoundError

from ._registry_helpers import Client, Loader, make_registry, state, until


async def test_an_added_model_loads_on_demand_and_its_names_are_unique(autojump_clock: Any) -> None:
    registry, _, log = make_registry("a")
    async with registry:
        loader = Loader("b", log)
        loader.registry = registry
        registry.add(ModelSpec(name="b", source=BackendSource(loader)))
        assert registry.names() == ["a", "b"]
        assert state(registry.snapshot(), "b") == "unloaded"
        (await registry.acquire("b")).release()
        assert state(registry.snapshot(), "b") == "loaded"
        with pytest.raises(InvalidRequestError) as taken:
            registry.add(ModelSpec(name="a", source=BackendSource(loader)))
        assert taken.value.code == "model_exists"


async def test_an_alias_is_the_same_model_and_taking_it_away_leaves_the_model(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", "b")
    async with registry:
        registry.add_alias("a", "copy:v1")
        assert registry.resolve("copy:v1") is registry.resolve("a")
        registry.add_alias("a", "copy:v1")  # (again: nothing changes)
        with pytest.raises(InvalidRequestError):
            registry.add_alias("a", "b")  # another model's name
        (await registry.acquire("copy:v1")).release()
        entry, gone = await registry.remove_name("copy:v1")
        assert not gone
        assert entry.state == "loaded"
        with pytest.raises(NotFoundError):
            registry.resolve("copy:v1")
        # its own name taken away, an alias carries it on (its first alias is its name)
        registry.add_alias("a", "other")
        _, gone = await registry.remove_name("a")
        assert not gone
        assert registry.resolve("other").name == "other"


async def test_a_models_last_name_takes_it_away_after_its_streams_grace(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", "b", unload_grace=30.0)
    async with registry, trio.open_nursery() as nursery:
        streaming = Client(nursery, registry, "a")
        await streaming.has_lease()
        removed = trio.Event()

        async def remove() -> None:
            await registry.remove_name("a")
            removed.set()

        nursery.start_soon(remove)
        await until(registry, lambda s: state(s, "a") == "unloading")
        with pytest.raises(NotFoundError):  # new requests: 404 at once
            registry.resolve("a")
        started = trio.current_time()
        await streaming.done()  # ended by the unload after its grace, never before
        assert trio.current_time() - started == pytest.approx(30.0, abs=1.0)
        await removed.wait()
        assert registry.names() == ["b"]
        assert [m.name for m in registry.snapshot().models] == ["b"]


async def test_a_request_that_waited_for_a_deleted_model_is_refused(autojump_clock: Any) -> None:
    registry, loaders, _ = make_registry("a", "b", max_loaded=1, unload_grace=0.0)
    async with registry, trio.open_nursery() as nursery:
        holder = Client(nursery, registry, "b")
        await holder.has_lease()
        waiting = Client(nursery, registry, "a")  # waits for b's room
        await until(registry, lambda s: s.claims == 1)
        await registry.remove_name("a")
        await waiting.done()
        assert isinstance(waiting.error, NotFoundError)
        holder.leave()
        await holder.done()
        assert loaders["a"].started.is_set() is False


async def test_a_pinned_or_only_model_keeps_its_last_name(autojump_clock: Any) -> None:
    registry, _, _ = make_registry("a", "b", pinned=("a",))
    async with registry:
        with pytest.raises(InvalidRequestError) as pinned:
            await registry.remove_name("a")
        assert pinned.value.code == "model_pinned"
        await registry.remove_name("b")
        registry.add_alias("a", "alias")
        await registry.remove_name("alias")  # an alias of a pinned model may go
        with pytest.raises(InvalidRequestError):
            await registry.remove_name("a")
