"""Shared fixtures.

The real model (Gemma 3 270M from PyPI) is loaded once per session and shared by every
test that asks for ``llama_backend``; each test gets its own :class:`Engine` or server
around it, so no Trio object crosses test boundaries.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from trioserve import LlamaBackend, LlamaSettings, default_model_path

from ._helpers import RunningServer, start_server

THREADS = int(os.environ.get("TRIOSERVE_TEST_THREADS", "2"))


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(default_model_path(progress=False))


@pytest.fixture(scope="session")
def llama_backend(model_path: str) -> Iterator[LlamaBackend]:
    """One sequence: the queued phase needs only one holder."""
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=4096, n_threads=THREADS, slots=1))
    yield backend
    backend._free()


@pytest.fixture(scope="session")
def uncached_backend(model_path: str) -> Iterator[LlamaBackend]:
    """The prompt cache off: the fresh-server reference for cached answers."""
    backend = LlamaBackend.load(
        LlamaSettings(model_path, n_ctx=4096, n_threads=THREADS, slots=1, prompt_cache=False)
    )
    yield backend
    backend._free()


@pytest.fixture(scope="session")
def batched_backend(model_path: str) -> Iterator[LlamaBackend]:
    """Two sequences: the cancellation matrix runs against it too (the queued phase
    occupies both), so a cancel of one sequence beside another is covered."""
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=4096, n_threads=THREADS, slots=2))
    yield backend
    backend._free()


@pytest.fixture(scope="session")
def batched8_backend(model_path: str) -> Iterator[LlamaBackend]:
    """Eight sequences, throughput mode (the default settings but a smaller context)."""
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=1024, n_threads=THREADS, slots=8))
    yield backend
    backend._free()


@pytest.fixture(scope="session")
def invariant_backend(model_path: str) -> Iterator[LlamaBackend]:
    """Eight sequences in batch-invariant mode."""
    backend = LlamaBackend.load(
        LlamaSettings(model_path, n_ctx=1024, n_threads=THREADS, slots=8, batch_invariant=True)
    )
    yield backend
    backend._free()


@pytest.fixture
async def llama_server(llama_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, llama_backend)
    yield running
    running.server.shutdown()


def pytest_sessionfinish() -> None:
    # llama-cpp-python opens two /dev/null files at import and never closes them
    # (llama_cpp/_utils.py); close them so the interpreter exits without a ResourceWarning.
    import sys

    utils = sys.modules.get("llama_cpp._utils")
    if utils is not None:
        for name in ("outnull_file", "errnull_file"):
            handle = getattr(utils, name, None)
            if handle is not None:
                handle.close()
