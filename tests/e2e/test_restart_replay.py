"""A background stream's events across a restart (issue 48; docs/resumable-streams.md,
"Across a restart"): ``trioserve serve --scripted`` in a subprocess on a file store; a
``background`` + ``stream`` response begun with the official openai SDK, dropped after a
few events, the server stopped (SIGTERM, and SIGKILL) and started again on the same
database: ``responses.retrieve(id, stream=True, starting_after=N)`` reads every event
after ``N`` once, in order, and then ``response.incomplete`` with cause ``shutdown``. A
finished stream whose in-memory log is gone replays from the store as it was sent,
before and after a restart; another key's is a 404."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from trioserve._wire._sse import SSEDecoder

from .._helpers import ServerProcess

KEY, OTHER = "sk-one", "sk-two"


def _serve(db: Path, *flags: str) -> ServerProcess:
    return ServerProcess(
        "--scripted",
        "--scripted-interval",
        "0.01",
        "--responses-db",
        str(db),
        "--api-key",
        KEY,
        "--api-key",
        OTHER,
        "--shutdown-grace",
        "0",
        *flags,
    )


def _sdk(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _stored_up_to(db: Path, response_id: str) -> int:
    """The last sequence number the store holds of the response's own events (-1: none)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as reader:
        row = reader.execute(
            "SELECT MAX(last_seq) FROM response_events WHERE response_id = ? AND note IS NULL",
            (response_id,),
        ).fetchone()
    return -1 if row[0] is None else int(row[0])


def _wait_stored(db: Path, response_id: str, sequence: int, limit: float = 20.0) -> int:
    """Wait until the store holds the response's events up to ``sequence`` (the server
    writes them in batches; the test watches the file); the last one it holds."""
    give_up = time.monotonic() + limit
    while (last := _stored_up_to(db, response_id)) < sequence:
        assert time.monotonic() < give_up, f"events up to {sequence} never stored (at {last})"
        time.sleep(0.02)
    return last


def _dropped_after(client: openai.OpenAI, last: int) -> list[Any]:
    """A background stream's events up to sequence number ``last``; then its connection
    is closed (the work goes on)."""
    stream = client.responses.create(
        model="scripted", input="hi", max_output_tokens=4000, background=True, stream=True
    )
    seen = []
    for event in stream:
        seen.append(event)
        if event.sequence_number >= last:
            break
    stream.close()
    return seen


def _cause(event: Any) -> str:
    return str(event.response.to_dict()["trioserve"]["end_cause"])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_background_stream_resumes_after_a_restart(tmp_path: Path, signum: signal.Signals) -> None:
    db = tmp_path / "responses.sqlite3"
    with _serve(db) as server, _sdk(server.wait_ready()) as client:
        seen = _dropped_after(client, 20)
        response_id = seen[0].response.id
        if signum == signal.SIGKILL:
            # killed once the store holds more than the client read (a kill loses the
            # events since the last batch: the resume below starts from what is kept)
            _wait_stored(db, response_id, 30)
        assert server.stop(signum) == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
    # what the store holds of its events (after a SIGTERM: up to its end)
    kept = _stored_up_to(db, response_id) if signum == signal.SIGKILL else 1 << 20
    with _serve(db) as server, _sdk(server.wait_ready()) as client:
        resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=10))
        stored = client.responses.retrieve(response_id)
        # a client that read past what a SIGKILL left in the store: the end, next
        # (after a SIGTERM, past its end: nothing)
        beyond = list(client.responses.retrieve(response_id, stream=True, starting_after=kept + 5))
        with _sdk(server.url, OTHER) as other, pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response_id, stream=True, starting_after=10)
    numbers = [event.sequence_number for event in resumed]
    assert numbers == list(range(11, 11 + len(numbers)))  # each once, in order
    # the events the client had read are replayed as they were sent
    assert [e.to_dict() for e in resumed[:10]] == [e.to_dict() for e in seen[11:21]]
    kinds = [event.type for event in resumed]
    # a graceful shutdown ends the stream as a cancel does (its message closed, then
    # its end); a SIGKILL's end is the one the restart added
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    ending = [*closing, "response.incomplete"] if signum == signal.SIGTERM else ["response.incomplete"]
    assert kinds == ["response.output_text.delta"] * (len(kinds) - len(ending)) + ending
    final = resumed[-1]
    assert final.type == "response.incomplete"
    assert final.response.id == response_id
    assert final.response.status == "incomplete"
    assert _cause(final) == "shutdown"
    if signum == signal.SIGKILL:
        assert final.sequence_number == kept + 1  # (the restart's end, after the last kept)
    assert stored.status == "incomplete"
    extension: Any = stored.to_dict()["trioserve"]  # (trioserve's own field)
    assert extension["end_cause"] == "shutdown"
    if signum == signal.SIGKILL:
        (end,) = beyond
        assert (end.type, end.sequence_number) == ("response.incomplete", kept + 6)
        assert _cause(end) == "shutdown"
    else:
        assert beyond == []  # (nothing was lost: its end is stored, and it is past it)


def _events(body: bytes) -> list[tuple[str | None, str, str, int | None]]:
    return [(e.id, e.event, e.data, e.retry) for e in SSEDecoder().feed(body)]


def test_a_finished_stream_replays_from_the_store_as_it_was_sent(tmp_path: Path) -> None:
    db = tmp_path / "responses.sqlite3"
    ask = {"model": "scripted", "input": "hi", "max_output_tokens": 150, "background": True, "stream": True}
    mine = {"Authorization": f"Bearer {KEY}"}
    # its log is dropped 0.2 s after its end and its last reader
    with _serve(db, "--detach-timeout", "0.2") as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, headers=mine, timeout=60) as http:
            with http.stream("POST", "/v1/responses", json=ask) as posted:
                assert posted.status_code == 200
                original = b"".join(posted.iter_bytes())
            sent = _events(original)
            response_id = json.loads(sent[0][2])["response"]["id"]
            give_up = time.monotonic() + 10
            while http.get("/health").json()["detached"]["streams"]:
                assert time.monotonic() < give_up, "the log was never dropped"
                time.sleep(0.02)
            replayed = http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
            after = http.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 100})
        assert server.stop() == 0
    assert replayed.status_code == 200, replayed.text
    assert replayed.headers["content-type"].startswith("text/event-stream")
    assert [int(event_id or -1) for event_id, *_ in sent] == list(range(len(sent)))
    assert sent[-1][1] == "response.incomplete"  # (max_output_tokens)
    assert _events(replayed.content) == sent
    assert _events(after.content) == sent[101:]
    with _serve(db) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=60) as http:
            path = f"/v1/responses/{response_id}"
            again = http.get(path, params={"stream": "true"}, headers=mine)
            last = sent[-1][0]
            assert last is not None
            done = http.get(path, params={"stream": "true"}, headers={**mine, "Last-Event-ID": last})
            theirs = http.get(path, params={"stream": "true"}, headers={"Authorization": f"Bearer {OTHER}"})
        assert server.stop() == 0
    assert _events(again.content) == sent
    assert done.status_code == 204  # (past its end: an EventSource stops reconnecting)
    assert theirs.status_code == 404
    assert theirs.json()["error"]["param"] == "response_id"
