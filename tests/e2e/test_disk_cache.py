"""The prompt cache's disk tier with the real model (docs/prompt-cache.md, "On disk"):
a conversation that comes back after its backend was closed and loaded again — a
restart — evaluates only its new text, restored from disk, and its text is the text of
a backend with the cache off; a damaged entry, or one made with other settings, is a
miss and the text is still right."""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioserve import (
    Engine,
    GenerationRequest,
    LlamaBackend,
    LlamaSettings,
    LlamaSource,
    ModelRegistry,
    ModelSpec,
    SamplingParams,
    TextDelta,
    Usage,
)
from trioserve._backends._cache import DiskStore, HostBudget
from trioserve._backends._cache._disk_format import read_header

from .._helpers import ServerProcess, start_server
from .._small_disk import SmallDisk
from ..conftest import THREADS
from .test_metrics import scrape, value

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
CHUNK = 128


def _settings(model_path: str, cache_dir: Path, **changes: object) -> LlamaSettings:
    options: dict[str, object] = {
        "n_ctx": 4096,
        "n_threads": THREADS,
        "slots": 1,
        "prefill_chunk": CHUNK,
        "idle_recompute": False,  # (what is cached is what the prompt left: no reply pieces)
        "cache_dir": cache_dir,
        "warm_up": False,
    }
    options.update(changes)
    return LlamaSettings(model_path, **options)  # type: ignore[arg-type]


async def _complete(backend: LlamaBackend, prompt: str, max_tokens: int = 12) -> tuple[str, Usage]:
    text, _, usage = await _complete_with_logprobs(backend, prompt, max_tokens)
    return text, usage


async def _complete_with_logprobs(
    backend: LlamaBackend, prompt: str, max_tokens: int = 12
) -> tuple[str, list[Any], Usage]:
    """The greedy text, each token's log-probability (the bits of the logits it was drawn
    from: a restored cell placed elsewhere changes them before it changes a text) and
    the usage."""
    engine = Engine(backend)
    try:
        prepared = await engine.prepare(
            GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, logprobs=1)
        )
        parts: list[str] = []
        logprobs: list[Any] = []
        async with engine.stream(prepared) as events:
            async for event in events:
                if type(event) is TextDelta:
                    parts.append(event.text)
                    logprobs.extend(event.logprobs or ())
            return "".join(parts), logprobs, events.usage
    finally:
        await engine.aclose(close_backend=False)


def _conversation(tag: str) -> tuple[str, str]:
    """A first turn past Gemma 3's 512-token sliding window, and a second turn's new text."""
    first = f"[{tag}] A conversation about lighthouses.\n" + "".join(
        f"User: question {i}: how did the keepers of lighthouse {i} live through the winter storms?\n"
        f"Assistant: they kept the lamp lit, logged the weather and repaired the lens {i} times.\n"
        for i in range(24)
    )
    return first, "User: and what did they eat when the supply boat could not land?\nAssistant:"


def _entries(cache_dir: Path, pattern: str = "v1/*/*.kv") -> list[Path]:
    return sorted(cache_dir.glob(pattern))


def _damage(entry: Path, damage: str, other: Path | None = None) -> None:
    if damage == "flipped byte":
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0x40
        entry.write_bytes(bytes(data))
    elif damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:-4096])
    elif other is not None:
        shutil.copyfile(other, entry)


async def _first_turn_on_disk(model_path: str, cache_dir: Path, tag: str) -> str:
    """Serve the first turn on a backend with a disk tier, then close it (its cells are
    written at unload); the first turn's prompt."""
    first, _ = _conversation(tag)
    backend = await LlamaBackend.aload(_settings(model_path, cache_dir))
    try:
        _, usage = await _complete(backend, first)
        assert usage.cached_tokens == 0
    finally:
        await backend.aclose()
    assert _entries(cache_dir), "nothing was written to the disk tier at unload"
    return first


@pytest.fixture
def store_dirs() -> list[Path]:
    made: list[Path] = []
    yield made
    for path in made:
        DiskStore.shared(path, 1).close()


async def test_a_conversation_after_a_restart_evaluates_only_its_new_text_and_equals_the_cache_off_text(
    model_path: str, uncached_backend: LlamaBackend, tmp_path: Path, store_dirs: list[Path]
) -> None:
    store_dirs.append(tmp_path)
    first = await _first_turn_on_disk(model_path, tmp_path, uuid.uuid4().hex)
    _, new = _conversation("")
    second = first + new
    # the restart: a new backend on the same directory (host memory starts empty)
    backend = await LlamaBackend.aload(_settings(model_path, tmp_path))
    try:
        first_tokens = len(backend.tokenize(first))
        text, logprobs, usage = await _complete_with_logprobs(backend, second)
    finally:
        await backend.aclose()
    reference, reference_logprobs, _ = await _complete_with_logprobs(uncached_backend, second)
    assert text == reference
    # bit for bit: the restored cells sit where the fresh evaluation put them (measured
    # before they did: these differed in every run, the text in one of 12)
    assert logprobs == reference_logprobs
    assert usage.cached_disk_tokens == usage.cached_tokens > 0
    # only the new text, and at most the one piece of the first prompt that did not end
    # on a cut, is evaluated
    new_tokens = usage.prompt_tokens - first_tokens
    assert usage.prompt_tokens - usage.cached_tokens <= new_tokens + CHUNK


@pytest.mark.parametrize(
    "damage", ["flipped byte", "truncated", "another model's file", "another context size"]
)
async def test_a_damaged_or_foreign_entry_is_a_logged_miss_and_the_text_is_right(
    model_path: str,
    uncached_backend: LlamaBackend,
    tmp_path: Path,
    damage: str,
    caplog: pytest.LogCaptureFixture,
    store_dirs: list[Path],
) -> None:
    cache_dir = tmp_path / "cache"
    store_dirs.append(cache_dir)
    first = await _first_turn_on_disk(model_path, cache_dir, uuid.uuid4().hex)
    (entry,) = _entries(cache_dir)
    changes: dict[str, object] = {}
    other = None
    if damage == "another model's file":
        # an entry written for other settings (a smaller context), renamed into this
        # model's directory under this entry's name
        other_dir = tmp_path / "other"
        store_dirs.append(other_dir)
        backend = await LlamaBackend.aload(_settings(model_path, other_dir, n_ctx=2048))
        try:
            await _complete(backend, first)
        finally:
            await backend.aclose()
        (other,) = _entries(other_dir)
    elif damage == "another context size":
        changes["n_ctx"] = 2048
    _damage(entry, damage, other)
    caplog.set_level(logging.INFO, logger="trioserve.cache")
    _, new = _conversation("")
    backend = await LlamaBackend.aload(_settings(model_path, cache_dir, **changes))
    try:
        text, usage = await _complete(backend, first + new)
    finally:
        await backend.aclose()
    reference, _ = await _complete(uncached_backend, first + new)
    assert text == reference
    assert usage.cached_disk_tokens == 0
    assert usage.cached_tokens == 0
    if damage == "another context size":
        assert "made with other settings" in caplog.text
    else:
        assert "unusable" in caplog.text
        assert _entries(cache_dir, "v1/bad/*")


async def test_a_disk_cache_written_with_f16_is_not_used_by_a_q8_0_backend_whose_own_entries_restore_exactly(
    model_path: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, store_dirs: list[Path]
) -> None:
    """The KV cache types are part of the disk tier's fingerprint (docs/prompt-cache.md,
    "On disk"): f16 cells are never restored into a q8_0 cache; q8_0's own are, after a
    restart, and the text equals the q8_0 text computed with nothing cached."""
    store_dirs.append(tmp_path)
    first = await _first_turn_on_disk(model_path, tmp_path, uuid.uuid4().hex)  # (f16)
    _, new = _conversation("")
    q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    caplog.set_level(logging.INFO, logger="trioserve.cache")
    backend = await LlamaBackend.aload(_settings(model_path, tmp_path, **q8))
    try:
        fresh, usage = await _complete(backend, first + new)
    finally:
        await backend.aclose()  # (its cells are written at unload, under q8_0's fingerprint)
    assert usage.cached_tokens == usage.cached_disk_tokens == 0
    assert "made with other settings (type_k, type_v)" in caplog.text
    backend = await LlamaBackend.aload(_settings(model_path, tmp_path, **q8))
    try:
        again, usage = await _complete(backend, first + new)
    finally:
        await backend.aclose()
    assert usage.cached_disk_tokens == usage.cached_tokens > 0
    assert again == fresh


@pytest.mark.parametrize("types", ["f16", "q8_0"])
async def test_a_conversation_restored_from_disk_into_a_window_ring_gives_the_cache_off_bits(
    model_path: str, tmp_path: Path, store_dirs: list[Path], types: str
) -> None:
    """The window layers kept to their ring (``swa_full=False``): a conversation past the
    window served, its cells written at unload, then restored from disk by the next
    backend — a state whose window cells go into a ring, laid out as a fresh evaluation
    leaves it (docs/prompt-cache.md, "The window's ring, exact"). Every token's
    log-probability equals the one computed with nothing cached. (Restored as saved, a
    q8_0 text here differed.)"""
    store_dirs.append(tmp_path)
    first, new = _conversation(uuid.uuid4().hex)
    ring = {"swa_full": False, "cache_type_k": types, "cache_type_v": types}
    backend = await LlamaBackend.aload(_settings(model_path, tmp_path, **ring))
    try:
        fresh, fresh_logprobs, usage = await _complete_with_logprobs(backend, first + new)
    finally:
        await backend.aclose()
    assert usage.cached_tokens == 0
    backend = await LlamaBackend.aload(_settings(model_path, tmp_path, **ring))
    try:
        assert backend.cache_stats()["window_ring"] is not None
        again, logprobs, usage = await _complete_with_logprobs(backend, first + new)
    finally:
        await backend.aclose()
    assert usage.cached_disk_tokens == usage.cached_tokens > 512
    assert again == fresh
    assert logprobs == fresh_logprobs


def _complete_http(url: str, prompt: str) -> tuple[str, dict[str, object]]:
    response = httpx.post(
        url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
        timeout=300,
    )
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["text"], body["usage"]


def _disk_writes(url: str) -> int:
    disk = httpx.get(url + "/health", timeout=10).json()["batch"]["cache"]["disk"]
    return int(disk["writes"])


@pytest.mark.parametrize("stop", ["SIGTERM", "kill -9"])
def test_trioserve_serve_restores_a_conversation_after_a_restart_or_a_kill(
    tmp_path: Path, uncached_backend: LlamaBackend, stop: str, store_dirs: list[Path]
) -> None:
    """The CLI as a user runs it: ``--cache-dir``; the server stopped with SIGTERM (every
    cached prefix written at shutdown) or killed with SIGKILL once ``/health`` shows the
    prefix written while it was idle; the next server's turn is restored from disk and
    its text is the cache-off backend's."""
    first, new = _conversation(uuid.uuid4().hex)
    flags = ("--threads", str(THREADS), "--slots", "1", "--cache-dir", str(tmp_path))
    with ServerProcess(*flags) as server:
        url = server.wait_ready()
        text, _ = _complete_http(url, first)
        if stop == "SIGTERM":
            assert server.stop(signal.SIGTERM) == 0
        else:
            deadline = time.monotonic() + 60
            while _disk_writes(url) < 1:  # the idle write of the first turn's prefix
                assert time.monotonic() < deadline, "the idle server wrote nothing to the disk tier"
                time.sleep(0.02)
            server.process.kill()
            server.process.wait()
    second = first + text + new
    with ServerProcess(*flags) as server:
        url = server.wait_ready()
        answer, usage = _complete_http(url, second)
        assert server.stop() == 0
    reference, _ = trio.run(_complete, uncached_backend, second)
    assert answer == reference
    split = usage["trioserve"]["cached_tokens"]  # type: ignore[index]
    assert split["disk"] == usage["prompt_tokens_details"]["cached_tokens"] > 0  # type: ignore[index]


async def test_a_model_swapped_out_beyond_host_memory_restores_its_conversation_from_disk(
    model_path: str, uncached_backend: LlamaBackend, tmp_path: Path, store_dirs: list[Path]
) -> None:
    """``--models-max 1``, three models, a host budget (1 MiB) smaller than one cached
    prefix's state: the first model's conversation comes back after the other two ran,
    restored from disk, and its text is the cache-off text."""
    store_dirs.append(tmp_path)
    pool = HostBudget(1 << 20)
    names = ("alpha", "beta", "gamma")
    specs = [
        ModelSpec(
            name=name,
            source=LlamaSource(
                _settings(model_path, tmp_path, model_id=name, cache_ram_bytes=1 << 20), host_pool=pool
            ),
        )
        for name in names
    ]
    registry = ModelRegistry(specs, max_loaded=1)
    first, new = _conversation(uuid.uuid4().hex)
    async with registry:
        async with registry.lease("alpha") as lease:
            reply, _ = await _complete(lease.engine.backend, first)
        for other in names[1:]:
            async with registry.lease(other) as lease:
                await _complete(lease.engine.backend, f"[{other}] Another conversation entirely.")
        assert registry.snapshot().model("alpha").state == "unloaded"
        async with registry.lease("alpha") as lease:
            answer, usage = await _complete(lease.engine.backend, first + reply + new)
    reference, _ = await _complete(uncached_backend, first + reply + new)
    assert answer == reference
    assert usage.cached_disk_tokens == usage.cached_tokens > 0


# ---------------------------------------------------------------- faults (issue 47)


def _note(tag: str) -> str:
    """A prompt of ~250 tokens (an entry of a few MB), its first tokens ``tag``'s."""
    return f"[{tag}] Notes on lighthouses.\n" + "".join(
        f"Lighthouse {i}: the keepers logged the weather and repaired the lens.\n" for i in range(16)
    )


async def _answered(client: httpx.AsyncClient, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


async def _disk_health(client: httpx.AsyncClient) -> dict[str, object]:
    response = await client.get("/health")
    assert response.status_code == 200, response.text
    disk: dict[str, object] = response.json()["batch"]["cache"]["disk"]
    return disk


async def _settled(client: httpx.AsyncClient, done: Callable[[dict[str, object]], bool]) -> dict[str, object]:
    """The disk tier once ``done(its /health)`` and no write is queued or running."""
    with trio.fail_after(60):
        while True:
            disk = await _disk_health(client)
            if done(disk) and disk["pending_writes"] == 0:
                return disk
            await trio.sleep(0.02)


async def _temp_files_at_rest(
    client: httpx.AsyncClient, disk: SmallDisk, done: Callable[[dict[str, object]], bool]
) -> tuple[dict[str, object], list[Path]]:
    """The disk tier once ``done``, and the temporary files its directory holds at a
    moment no write ran: the idle thread may start a write (a free id's prefix) right
    after a health read says none is pending, so the listing counts only when a second
    read says none is pending and no write began or ended in between."""
    with trio.fail_after(60):
        while True:
            before = await _settled(client, done)
            temp = disk.temp_files()
            after = await _disk_health(client)
            counters = ("pending_writes", "writes", "failed_writes")
            if all(after[key] == before[key] for key in counters):
                return before, temp


def _entry_of(disk: SmallDisk, tokens: tuple[int, ...]) -> Path | None:
    """The entry on disk holding a prefix of the prompt of ``tokens`` (its idle write)."""
    for path in disk.entries():
        with contextlib.suppress(OSError, ValueError):
            entry, _ = read_header(path, path.parent.name)
            if len(entry.tokens) >= 64 and tokens[: len(entry.tokens)] == entry.tokens:
                return path
    return None


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    disk = SmallDisk(tmp_path / "small", 64 << 20, monkeypatch)
    try:
        yield disk
    finally:
        with contextlib.suppress(OSError):  # (the store of a writable directory: closed)
            DiskStore.shared(disk.path, 1).close()
        disk.close()


async def test_a_full_disk_answers_every_request_leaves_no_temp_file_and_writes_again_once_space_frees(
    model_path: str, small_disk: SmallDisk, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A filesystem of 64 MiB under a budget of 1 GiB. Full of another program's file:
    every request is answered, each write fails alone (counted, ``/health`` says
    "failing" and why, one warning) and leaves nothing behind. Space freed: the next
    prompt is written. Then the tier's own entries fill it: the oldest go, the write
    is tried again and succeeds — a full disk does not stay full."""
    caplog.set_level(logging.INFO, logger="trioserve.cache")
    backend = await LlamaBackend.aload(_settings(model_path, small_disk.path, cache_disk_bytes=1 << 30))
    # (tokenized before any request: the test's loop is the server's)
    tokens = {tag: tuple(backend.tokenize(_note(tag))) for tag in ("freed", "own 0", "own 1")}
    try:
        server = await start_server(nursery, backend)
        async with server.client() as client:
            small_disk.fill()
            for i in range(3):
                assert await _answered(client, _note(f"full {i}"))
                disk, temp = await _temp_files_at_rest(
                    client,
                    small_disk,
                    lambda d, i=i: int(d["failed_writes"]) > i,  # type: ignore[misc,call-overload]
                )
                assert temp == []
            assert disk["state"] == "failing"
            assert "No space left on device" in str(disk["error"])
            assert (disk["writes"], small_disk.entries()) == (0, [])
            samples = await scrape(client)
            assert value(samples, "trioserve_prompt_cache_disk_failing") == 1
            failed = value(samples, "trioserve_prompt_cache_disk_failed_writes_total")
            assert failed >= 3
            assert caplog.text.count("could not write a cached prefix") == 1  # (not one a request)
            # space frees: the next prompt is on disk
            small_disk.free()
            await _answered(client, _note("freed"))
            disk = await _settled(client, lambda _: _entry_of(small_disk, tokens["freed"]))
            assert (disk["state"], disk["error"]) == ("ok", None)
            # (an idle write of a free id's prefix may still have failed between the scrape
            # and the freeing: from here on, with room, none fails)
            assert int(disk["failed_writes"]) >= failed  # type: ignore[call-overload]
            failed = int(disk["failed_writes"])  # type: ignore[call-overload]
            assert "the disk cache writes again" in caplog.text
            oldest = min(small_disk.entries(), key=lambda p: p.stat().st_mtime)
            # room for one more entry, not two: the second evicts the oldest and is written
            small_disk.fill(leave=max(p.stat().st_size for p in small_disk.entries()) * 3 // 2)
            for tag in ("own 0", "own 1"):
                await _answered(client, _note(tag))
                disk = await _settled(client, lambda _, tag=tag: _entry_of(small_disk, tokens[tag]))  # type: ignore[misc]
            assert (disk["state"], disk["failed_writes"]) == ("ok", failed)
            assert int(disk["evictions"]) >= 1  # type: ignore[call-overload]
            assert oldest not in small_disk.entries()
            assert _entry_of(small_disk, tokens["own 0"]) is not None
            _, temp = await _temp_files_at_rest(client, small_disk, lambda _: True)
            assert temp == []
            assert value(await scrape(client), "trioserve_prompt_cache_disk_failing") == 0
    finally:
        await backend.aclose()


async def test_a_read_only_cache_dir_serves_the_model_without_the_disk_tier(
    model_path: str, small_disk: SmallDisk, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    small_disk.read_only()
    backend = await LlamaBackend.aload(_settings(model_path, small_disk.path))
    try:
        assert "the prompt cache's disk tier is OFF" in caplog.text
        server = await start_server(nursery, backend)
        async with server.client() as client:
            assert await _answered(client, _note("read-only"))
            disk = await _disk_health(client)
            assert disk["state"] == "off"
            assert "Read-only file system (EROFS)" in str(disk["error"])
            assert str(small_disk.path) in str(disk["error"])
            assert value(await scrape(client), "trioserve_prompt_cache_disk_off") == 1
    finally:
        await backend.aclose()
