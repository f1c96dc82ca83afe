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

from . import _openai_validation as openai_validation
from ._helpers import RunningServer, start_server

THREADS = int(os.environ.get("TRIOSERVE_TEST_THREADS", "2"))


@pytest.fixture(scope="session", autouse=True)
def _openai_validation_seam() -> Iterator[None]:
    """Every in-process server's generation responses are checked against the openai
    SDK's types (tests/_openai_validation.py); server processes check their own."""
    with pytest.MonkeyPatch.context() as patch:
        openai_validation.install_in_process(patch.setattr)
        yield


@pytest.fixture(autouse=True)
def openai_validation_collector(request: pytest.FixtureRequest) -> Iterator[openai_validation.Collector]:
    """Fails the test (at teardown, with the offending bytes) if a generation response
    it received is not what an OpenAI client accepts. Opt out with
    ``@pytest.mark.no_openai_validation("why")``."""
    exempt = request.node.get_closest_marker(openai_validation.MARKER) is not None
    collector = openai_validation.Collector(request.node.nodeid, exempt=exempt)
    openai_validation.current = collector
    try:
        yield collector
    finally:
        openai_validation.current = None
        openai_validation.drain_processes(collector)
    failure = collector.failure()
    if failure is not None:
        pytest.fail(failure, pytrace=False)


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(default_model_path(progress=False))


@pytest.fixture(scope="session")
def llama_backend(model_path: str) -> Iterator[LlamaBackend]:
    """One sequence: the queued phase needs only one holder."""
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=4096, n_threads=THREADS, slots=1))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def uncached_backend(model_path: str) -> Iterator[LlamaBackend]:
    """The prompt cache off: the fresh-server reference for cached answers."""
    backend = LlamaBackend.load(
        LlamaSettings(model_path, n_ctx=4096, n_threads=THREADS, slots=1, prompt_cache=False)
    )
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def batched_backend(model_path: str) -> Iterator[LlamaBackend]:
    """Two sequences: the cancellation matrix runs against it too (the queued phase
    occupies both), so a cancel of one sequence beside another is covered."""
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=4096, n_threads=THREADS, slots=2))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def batched8_backend(model_path: str) -> Iterator[LlamaBackend]:
    """Eight sequences, throughput mode (the default settings but a smaller context)."""
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=1024, n_threads=THREADS, slots=8))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def invariant_backend(model_path: str) -> Iterator[LlamaBackend]:
    """Eight sequences in batch-invariant mode."""
    backend = LlamaBackend.load(
        LlamaSettings(model_path, n_ctx=1024, n_threads=THREADS, slots=8, batch_invariant=True)
    )
    yield backend
    backend.close()


@pytest.fixture
async def llama_server(llama_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, llama_backend)
    yield running
    running.server.shutdown()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if openai_validation.unattributed:  # checked while no test ran: fail the session
        import sys

        print("\ngeneration responses outside any test that OpenAI clients would reject:", file=sys.stderr)
        for violation in openai_validation.unattributed:
            print(f"  {violation}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # llama-cpp-python opens two /dev/null files at import and never closes them
    # (llama_cpp/_utils.py); close them so the interpreter exits without a ResourceWarning.
    import sys

    utils = sys.modules.get("llama_cpp._utils")
    if utils is not None:
        for name in ("outnull_file", "errnull_file"):
            handle = getattr(utils, name, None)
            if handle is not None:
                handle.close()
