"""Stored responses and the order of checks at the edges (issue 47), on real servers
with the scripted backend: a key's limits answer 429 before a model load and before a
background response is stored; a store that cannot write (SQLite's own "database or
disk is full", from a page limit on the live database) never changes a finished
answer — it is sent, logged, counted in /metrics, /health says the store is degraded,
and it recovers with the next write that succeeds."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from trioserve import HTTPSettings, ScriptedBackend, Server, ServerSettings
from trioserve._core._backend import Backend
from trioserve._core._registry import BackendSource, ModelRegistry, ModelSpec
from trioserve._http._response_db import StoredResponse
from trioserve._http._stored import StoredResponses

from .._helpers import RunningServer, start_server, wait_for

SCRIPT = [b"The", b" answer", b" is", b" forty", b"-two", b"."]
ANSWER = "The answer is forty-two."

KEYS = """
[[key]]
name = "limited"
key = "sk-limited"
requests_per_minute = 1
"""


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


async def _registry_server(nursery: trio.Nursery, tmp_path: Path, loads: list[str]) -> RunningServer:
    def source(name: str) -> BackendSource:
        async def load() -> Backend:
            loads.append(name)
            return ScriptedBackend(SCRIPT, model_id=name)

        return BackendSource(load, description=name)

    registry = ModelRegistry(
        [ModelSpec(name="alpha", source=source("alpha")), ModelSpec(name="beta", source=source("beta"))]
    )
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    server = Server(
        registry,
        ServerSettings(host="127.0.0.1", port=0, keys_file=keys, http=HTTPSettings(responses_db="memory")),
    )
    binds = await nursery.start(server.run)
    await server.ready.wait()
    return RunningServer(server, binds[0])


async def test_a_rate_limited_key_gets_429_before_a_model_load_and_before_a_background_store(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    loads: list[str] = []
    running = await _registry_server(nursery, tmp_path, loads)
    registry = running.server.registry
    headers = {"Authorization": "Bearer sk-limited"}
    try:
        async with running.client(headers=headers) as client:
            first = await client.post(
                "/v1/completions", json={"model": "alpha", "prompt": "Hi", "max_tokens": 2}
            )
            assert first.status_code == 200, first.text
            assert loads == ["alpha"]
            # the key's one request a minute is spent: beta is never loaded for it
            second = await client.post(
                "/v1/completions", json={"model": "beta", "prompt": "Hi", "max_tokens": 2}
            )
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
            assert "requests per minute" in second.json()["error"]["message"]
            assert loads == ["alpha"]
            assert registry.resolve("beta").state == "unloaded"
            # nor is a background response stored (or run) for it: 429, as in the foreground
            background = await client.post(
                "/v1/responses", json={"model": "alpha", "input": "Hi", "background": True}
            )
            assert background.status_code == 429, background.text
            assert background.json()["error"]["code"] == "rate_limit_exceeded"
            responses = running.server.state.responses
            assert responses is not None
            assert not responses.jobs
            assert await responses.store.run(responses.store.store.usage) == (0, 0)
            # (a stored conversation is not read for it either: the 429 comes first)
            chained = await client.post(
                "/v1/responses", json={"model": "alpha", "input": "Hi", "previous_response_id": "resp_nope"}
            )
            assert chained.status_code == 429, chained.text
    finally:
        running.server.shutdown()


@pytest.fixture
async def stored_server(nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    backend = ScriptedBackend(SCRIPT)
    running = await start_server(
        nursery, backend, close_backend=True, shutdown_grace=0.0, http=HTTPSettings(responses_db="memory")
    )
    yield running
    running.server.shutdown()


def _fill(responses: StoredResponses, full: bool) -> None:
    """Cap the live database at the pages it has (SQLite answers "database or disk is
    full", SQLITE_FULL, as on a full disk), or lift the cap."""
    store = responses.store.store
    with store._lock:
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages if full else 1 << 30}")


async def test_a_failed_store_sends_the_answer_intact_and_the_store_recovers(
    stored_server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    running = stored_server
    responses = running.server.state.responses
    assert responses is not None
    long_input = "a question that takes room " * 120  # (more than a page of the database)
    async with running.client() as client:
        kept = await client.post("/v1/responses", json={"input": "Hi"})
        assert kept.status_code == 200, kept.text
        await trio.to_thread.run_sync(_fill, responses, True)
        with caplog.at_level(logging.ERROR, logger="trioserve.responses"):
            for stream in (False, True):
                answer = await client.post("/v1/responses", json={"input": long_input, "stream": stream})
                assert answer.status_code == 200, answer.text
                if stream:
                    assert ANSWER.replace(" ", "") in answer.text.replace(" ", "").replace('"', "")
                    assert "response.completed" in answer.text
                else:
                    body = answer.json()
                    assert body["status"] == "completed"
                    assert body["output"][0]["content"][0]["text"] == ANSWER
                    # not stored: reading it back is a 404, as for an expired one
                    assert (await client.get(f"/v1/responses/{body['id']}")).status_code == 404
        assert any("could not be stored" in r.getMessage() for r in caplog.records)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, 'trioserve_response_store_failures_total{reason="error"}') == 2
        health = (await client.get("/health")).json()
        assert health["status"] == "ok"  # degraded, not down: answers are sent
        assert health["responses_store"]["state"] == "degraded"
        assert "full" in health["responses_store"]["error"]
        assert health["responses_store"]["failures"] == 2
        # the earlier response is intact, and completions never noticed
        assert (await client.get(f"/v1/responses/{kept.json()['id']}")).status_code == 200
        completion = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 6})
        assert completion.json()["choices"][0]["text"] == ANSWER
        # a background response cannot be kept: refused before it runs (503, nothing lost)
        refused = await client.post("/v1/responses", json={"input": long_input, "background": True})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "store_unavailable"
        assert not responses.jobs
        # room again: the next write succeeds and the store is healthy
        await trio.to_thread.run_sync(_fill, responses, False)
        again = await client.post("/v1/responses", json={"input": long_input})
        assert again.status_code == 200
        assert (await client.get(f"/v1/responses/{again.json()['id']}")).status_code == 200
        health = (await client.get("/health")).json()
        assert health["responses_store"] == {"state": "ok", "failures": 3}


class _Gated(ScriptedBackend):
    """Generates once ``gate`` is set: a background response stays queued till then."""

    def __init__(self, script: list[bytes]) -> None:
        super().__init__(script)
        self.gate = trio.Event()

    async def generate(self, prompt, channel, progress):  # type: ignore[no-untyped-def]
        await self.gate.wait()
        return await super().generate(prompt, channel, progress)


@pytest.mark.parametrize("failure_stored", [True, False], ids=["failure-stored", "nothing-stored"])
async def test_a_background_response_whose_result_cannot_be_stored_records_its_failure(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, failure_stored: bool
) -> None:
    """Queued (stored), then the database fills before its end: the result's write
    fails, and the failure — a smaller write — is stored in its place. Where that write
    fails too, the failure is remembered in memory: a poller sees it end (``failed``),
    never ``queued`` for ever."""
    backend = _Gated([b"word " * 200] * 20)  # a result far larger than the queued object
    running = await start_server(
        nursery, backend, close_backend=True, shutdown_grace=0.0, http=HTTPSettings(responses_db="memory")
    )
    responses = running.server.state.responses
    assert responses is not None
    store = responses.store.store
    if not failure_stored:
        put = store.put

        def put_but_the_failure(response: StoredResponse, *, streamed: bool = False) -> None:
            if response.status == "failed":  # (as SQLite says it: no room for it either)
                raise sqlite3.OperationalError("database or disk is full")
            put(response, streamed=streamed)

        monkeypatch.setattr(store, "put", put_but_the_failure)
    try:
        async with running.client() as client:
            created = await client.post("/v1/responses", json={"input": "Hi", "background": True})
            assert created.status_code == 200, created.text
            response_id = created.json()["id"]
            job = responses.jobs[response_id]
            await trio.to_thread.run_sync(_fill, responses, True)
            backend.gate.set()
            await job.done.wait()
            assert response_id not in responses.jobs
            assert responses.failures == (1 if failure_stored else 2)
            row = await responses.store.run(store.get, response_id, "")
            assert row is not None
            assert row.status == ("failed" if failure_stored else "queued")
            answer = await client.get(f"/v1/responses/{response_id}")
            assert answer.status_code == 200, answer.text
            stored = answer.json()
            assert stored["status"] == "failed"
            assert "could not be stored" in stored["error"]["message"]
            assert stored["output"] == []
            assert (stored["id"], stored["background"]) == (response_id, True)
            # deleted, it is gone, remembered or not
            assert (await client.delete(f"/v1/responses/{response_id}")).status_code == 200
            assert (await client.get(f"/v1/responses/{response_id}")).status_code == 404
            assert response_id not in responses.unstored
    finally:
        running.server.shutdown()


async def test_a_background_response_charges_its_reply_to_its_keys_tokens_per_minute(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A background reply of 300 tokens, against a key's 200 tokens a minute: its
    next request is refused (429), as after the same reply in the foreground."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "metered"\nkey = "sk-metered"\ntokens_per_minute = 200\n')
    backend = _Gated([b"w "] * 300)
    running = await start_server(
        nursery,
        backend,
        close_backend=True,
        shutdown_grace=0.0,
        keys_file=keys,
        http=HTTPSettings(responses_db="memory"),
    )
    responses = running.server.state.responses
    assert responses is not None
    try:
        async with running.client(headers={"Authorization": "Bearer sk-metered"}) as client:
            created = await client.post("/v1/responses", json={"input": "Hi", "background": True})
            assert created.status_code == 200, created.text
            response_id = created.json()["id"]
            job = responses.jobs[response_id]
            backend.gate.set()
            await job.done.wait()
            done = (await client.get(f"/v1/responses/{response_id}")).json()
            assert done["status"] == "completed"
            usage = done["usage"]
            # (its prompt alone leaves room: only its reply takes the key past its limit)
            assert usage["input_tokens"] < 200 < usage["input_tokens"] + usage["output_tokens"]
            refused = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert "tokens per minute" in refused.json()["error"]["message"]
    finally:
        running.server.shutdown()


async def test_a_full_queue_answers_429_before_the_stored_conversation_is_read(nursery: trio.Nursery) -> None:
    """One slot, no queue, the slot held: a continuation of a response that does not
    exist is refused for capacity (429) — its chain is never read (a 400 would say it
    was)."""
    backend = ScriptedBackend(token_interval=0.01)  # (never ends on its own)
    running = await start_server(
        nursery,
        backend,
        close_backend=True,
        shutdown_grace=0.0,
        max_queue=0,
        http=HTTPSettings(responses_db="memory"),
    )
    engine = running.engine
    try:
        async with running.client() as client, trio.open_nursery() as holders:

            async def hold() -> None:
                await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3000})

            holders.start_soon(hold)
            await wait_for(lambda: engine.admission.in_use == 1)
            answer = await client.post(
                "/v1/responses", json={"input": "Hi", "previous_response_id": "resp_nope"}
            )
            assert answer.status_code == 429, answer.text
            assert answer.json()["error"]["code"] == "overloaded"
            background = await client.post("/v1/responses", json={"input": "Hi", "background": True})
            assert background.status_code == 429, background.text
            holders.cancel_scope.cancel()
    finally:
        running.server.shutdown()
