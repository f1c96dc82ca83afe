"""The prompt cache's disk tier with the real model (docs/prompt-cache.md, "On disk"):
a conversation that comes back after its backend was closed and loaded again — a
restart — evaluates only its new text, restored from disk, and its text is the text of
a backend with the cache off; a damaged entry, or one made with other settings, is a
miss and the text is still right."""

from __future__ import annotations

import logging
import shutil
import signal
import time
import uuid
from pathlib import Path

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
from trioserve._backends._disk_cache import DiskStore
from trioserve._backends._prompt_cache import HostBudget

from .._helpers import ServerProcess
from ..conftest import THREADS

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
    engine = Engine(backend)
    try:
        prepared = await engine.prepare(
            GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY)
        )
        parts: list[str] = []
        async with engine.stream(prepared) as events:
            async for event in events:
                if type(event) is TextDelta:
                    parts.append(event.text)
            return "".join(parts), events.usage
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
        text, usage = await _complete(backend, second)
    finally:
        await backend.aclose()
    reference, _ = await _complete(uncached_backend, second)
    assert text == reference
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
