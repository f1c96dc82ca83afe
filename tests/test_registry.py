"""The model registry's state machine, edge by edge (docs/models.md, "States and
transitions"), with the scripted backend: no model, and every phase reached by what
shows it (a snapshot, a gate a test opens), never by a sleep.

A "client" here is a task that holds a lease (the registry cannot tell a stream from
any other lease holder); a load is held at its start by a gate the test opens."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from trioserve import (
    Backend,
    BackendSource,
    LlamaSettings,
    LlamaSource,
    ModelRegistry,
    ModelSpec,
    ScriptedBackend,
)
from trioserve._core._exceptions import InvalidRequestError, ServiceUnavailableError, TrioserveError

#: how long any phase may take to come (fake time under autojump_clock: far beyond the
#: tests' own timers)
LIMIT = 1000.0


class Loader:
    """Loads a scripted backend once its gate is open; logs each load's start and end in
    ``log`` (shared between models), so tests see which loads overlapped."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log
        #: ``None``: open; else the load waits until it is set
        self.gate: trio.Event | None = None
        #: a load raises this
        self.failure: str | None = None
        #: set once a load has begun (reset by the test with a new event)
        self.started = trio.Event()
        #: each backend loaded, with how many leases its model held when it was closed
        self.closed_with_leases: list[int] = []
        self.registry: ModelRegistry | None = None

    async def __call__(self) -> Backend:
        self.log.append(("start", self.name))
        self.started.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.failure is not None:
                raise RuntimeError(self.failure)
            return _RecordingBackend(self)
        finally:
            self.log.append(("end", self.name))


class _RecordingBackend(ScriptedBackend):
    def __init__(self, loader: Loader) -> None:
        super().__init__([b"ok"], model_id=loader.name)
        self.loader = loader

    async def aclose(self) -> None:
        registry = self.loader.registry
        assert registry is not None
        self.loader.closed_with_leases.append(registry.snapshot().model(self.loader.name).leases)


def make_registry(
    *names: str, pinned: tuple[str, ...] = (), preload: tuple[str, ...] = (), **settings: Any
) -> tuple[ModelRegistry, dict[str, Loader], list[tuple[str, str]]]:
    log: list[tuple[str, str]] = []
    loaders = {name: Loader(name, log) for name in names}
    specs = [
        ModelSpec(
            name=name,
            source=BackendSource(loaders[name], description=f"{name}.gguf"),
            pinned=name in pinned,
            preload=name in preload,
        )
        for name in names
    ]
    registry = ModelRegistry(specs, **settings)
    for loader in loaders.values():
        loader.registry = registry
    return registry, loaders, log


async def until(registry: ModelRegistry, predicate: Callable[[Any], bool]) -> None:
    """Wait until ``predicate(registry.snapshot())`` holds: re-checked at each change."""
    with trio.fail_after(LIMIT):
        while not predicate(registry.snapshot()):
            await registry.changed()


class Client:
    """A request in a task of its own: takes a lease on ``name`` (waiting as a request
    does), holds it until :meth:`leave` or a cancel; what it got is recorded."""

    def __init__(self, nursery: trio.Nursery, registry: ModelRegistry, name: str, **lease: Any) -> None:
        self.scope = trio.CancelScope()
        self.leased = trio.Event()
        self.finished = trio.Event()
        self.error: TrioserveError | None = None
        self._leave = trio.Event()
        nursery.start_soon(self._run, registry, name, lease)

    async def _run(self, registry: ModelRegistry, name: str, lease: dict[str, Any]) -> None:
        try:
            with self.scope:
                async with registry.lease(name, **lease):
                    self.leased.set()
                    await self._leave.wait()
        except TrioserveError as exc:
            self.error = exc
        finally:
            self.finished.set()

    def leave(self) -> None:
        self._leave.set()

    def cancel(self) -> None:
        self.scope.cancel()

    async def done(self) -> None:
        with trio.fail_after(LIMIT):
            await self.finished.wait()

    async def has_lease(self) -> None:
        with trio.fail_after(LIMIT):
            await self.leased.wait()


def state(snapshot: Any, name: str) -> str:
    return str(snapshot.model(name).state)


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


# ----------------------------------------------------- with a real model (llama.cpp)


async def test_aclose_never_frees_a_model_under_a_running_tokenizer_thread(model_path: str) -> None:
    """SIGTERM during a large /tokenize: the registry closes while a worker thread
    tokenizes ~4 MiB with the model; it waits for that lease, then frees the model —
    no crash, and the tokens are whole."""
    spec = ModelSpec(name="m", source=LlamaSource(LlamaSettings(model_path, n_ctx=512, n_threads=2, slots=1)))
    registry = ModelRegistry([spec])
    text = "The quick brown fox jumps over the lazy dog. " * (4 * 1024 * 1024 // 45)
    in_thread = threading.Event()
    freed_after: list[bool] = []
    tokens: list[int] = []
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery, registry:
            async with registry.lease("m") as lease:
                backend: Any = lease.engine.backend
                original = backend.tokenize

                def tokenize(*args: Any, **kwargs: Any) -> list[int]:
                    in_thread.set()
                    return list(original(*args, **kwargs))

                backend.tokenize = tokenize
            registry.on_unloaded.append(lambda _entry, _engine: freed_after.append(bool(tokens)))

            async def tokenizer() -> None:
                # what POST /tokenize does: a lease around the tokenizer's thread (the
                # close cancels the block; the thread is waited for, never abandoned)
                async with registry.lease("m") as held:
                    tokens.extend(await held.engine.backend.tokenize_text(text))

            nursery.start_soon(tokenizer)
            await trio.to_thread.run_sync(in_thread.wait)
            # the registry is closed: the thread had returned before the model was freed
    assert freed_after == [True]
    assert len(tokens) > 100_000
    assert registry.snapshot().model("m").state == "unloaded"


def test_the_registry_refuses_max_concurrent_loads_below_one() -> None:
    with pytest.raises(ValueError, match="max_concurrent_loads"):
        make_registry("a", max_concurrent_loads=0)


def test_keep_alive_defaults_to_forever() -> None:
    registry, _, _ = make_registry("a")
    assert registry.keep_alive == math.inf
