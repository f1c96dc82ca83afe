"""A key's own bounds on its resumable streams (issue 48; docs/resumable-streams.md,
"Bounds, flags and their answers"), on a real ``trioserve serve`` process with a real
keys file, reloaded by a real SIGHUP (scripted backend): ``detach_streams`` (0: the
header refused with a 403 naming it; N: the (N+1)th running stream a 429 naming it),
``detach_timeout`` (shorter than the server's: a stream nobody reads ends after it),
``detach_log_kib`` (a smaller window: the stream pauses sooner, ``GET /v1/requests``
shows it detached with its log full); a file that would widen the server's flags is
refused at start and on reload, naming the field and the flag."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .._helpers import ServerProcess

KEYS = """
[[key]]
name = "batch"
key = "sk-batch"
detach_streams = 0

[[key]]
name = "tablet"
key = "sk-tablet"
detach_streams = 1
detach_log_kib = 2

[[key]]
name = "phone"
key = "sk-phone"
detach_timeout = 0.5
"""
LONG = {"prompt": "hi", "max_tokens": 4000, "stream": True}


def _serve(keys: Path, *flags: str) -> ServerProcess:
    return ServerProcess("--scripted", "--scripted-interval", "0.002", "--keys-file", str(keys), *flags)


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _until[T](probe: Callable[[], T | None], what: str, limit: float = 15.0) -> T:
    """Poll the server (from outside, as a client would) until ``probe`` returns
    something: what shows the state the test waits for."""
    deadline = time.monotonic() + limit
    while (found := probe()) is None:
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)
    return found


def _drop_after(client: httpx.Client, key: str, conversation: str, events: int = 2) -> None:
    """POST a resumable stream, read ``events`` events, then drop the connection."""
    with client.stream(
        "POST", "/v1/completions", json=LONG, headers={**_as(key), "X-Conversation-Id": conversation}
    ) as response:
        assert response.status_code == 200, response.read()
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen >= events:
                break


def _listed(client: httpx.Client, key: str, conversation: str) -> dict[str, Any] | None:
    for entry in client.get("/v1/requests", headers=_as(key)).json()["data"]:
        if entry["conversation_id"] == conversation:
            return dict(entry)
    return None


def _listed_if(client: httpx.Client, conversation: str, **wanted: object) -> dict[str, Any] | None:
    """The tablet key's request of ``conversation`` once its fields are ``wanted``."""
    entry = _listed(client, "sk-tablet", conversation)
    return entry if entry is not None and all(entry[k] == v for k, v in wanted.items()) else None


def _lookup(client: httpx.Client, key: str, conversation: str) -> dict[str, Any]:
    (found,) = client.post(
        "/v1/streams/lookup", json={"conversation_ids": [conversation]}, headers=_as(key)
    ).json()
    return dict(found)


def _reload(server: ServerProcess, marker: str) -> str:
    """SIGHUP, then the log line it led to (one more ``marker`` line than before)."""

    def marked() -> list[str]:
        return [line for line in server.log if marker in line]

    before = len(marked())
    server.process.send_signal(signal.SIGHUP)
    return _until(lambda: marked()[-1] if len(marked()) > before else None, "the reload's log line")


def test_a_keys_detach_fields_bound_its_own_streams(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with _serve(keys) as server, httpx.Client(base_url=server.wait_ready(), timeout=30) as client:
        # detach_streams = 0: the header is refused by name; without it, served
        refused = client.post(
            "/v1/completions", json=LONG, headers={**_as("sk-batch"), "X-Conversation-Id": "b1"}
        )
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["param"] == "X-Conversation-Id"
        assert "detach_streams = 0" in error["message"]
        short = {"prompt": "hi", "max_tokens": 3}
        plain = client.post("/v1/completions", json=short, headers=_as("sk-batch"))
        assert plain.status_code == 200

        # detach_log_kib = 2: nobody reads, the stream pauses with about 2 KiB in its
        # log (the server's window is 1 MiB: 4000 tokens would fit), and GET
        # /v1/requests says so
        _drop_after(client, "sk-tablet", "t1")
        entry = _until(lambda: _listed_if(client, "t1", paused="log_full"), "t1 detached with its log full")
        assert (entry["phase"], entry["readers"], entry["key"]) == ("detached", 0, "tablet")
        held = _lookup(client, "sk-tablet", "t1")["total_bytes"]
        assert 2048 <= held < 2048 + 1024, held  # (the window, over it by at most one event)
        assert entry["completion_tokens"] < 60

        # detach_streams = 1: a second running stream is a 429 naming the field
        second = client.post(
            "/v1/completions", json=LONG, headers={**_as("sk-tablet"), "X-Conversation-Id": "t2"}
        )
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "too_many_detached_streams"
        assert "detach_streams" in second.json()["error"]["message"]

        # a reader attached: listed with it, no longer detached
        with client.stream("GET", "/v1/stream", params={"conv_id": "t1"}, headers=_as("sk-tablet")) as reader:
            assert reader.status_code == 200
            chunks = reader.iter_bytes()  # (held: a closed iterator closes the connection)
            next(chunks)
            entry = _until(lambda: _listed_if(client, "t1", readers=1), "t1 with its reader")
            assert entry["phase"] != "detached"
        stop = client.delete("/v1/stream", params={"conv_id": "t1"}, headers=_as("sk-tablet"))
        assert stop.status_code == 204

        # detach_timeout = 0.5 (the server's: 300): nobody reads, it ends after 0.5 s
        started = time.monotonic()
        _drop_after(client, "sk-phone", "p1")
        _until(lambda: _lookup(client, "sk-phone", "p1")["is_done"] or None, "p1 ended", limit=20)
        assert time.monotonic() - started < 20
        ended = client.get("/v1/stream", params={"conv_id": "p1"}, headers=_as("sk-phone"))
        assert b'"end_cause":"detach_timeout"' in ended.content
        assert any("no reader for 0.5 s: ended (detach_timeout)" in line for line in server.log)
        assert server.stop() == 0


def test_a_reload_changes_a_keys_bounds_and_a_file_that_widens_the_flags_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with (
        _serve(keys, "--detach-timeout", "60") as server,
        httpx.Client(base_url=server.wait_ready(), timeout=30) as client,
    ):

        def status() -> int:
            return client.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 3, "stream": True},
                headers={**_as("sk-batch"), "X-Conversation-Id": "b1"},
            ).status_code

        assert status() == 403
        keys.write_text(KEYS.replace("detach_streams = 0", "detach_streams = 2"))
        assert "reloaded: 3 key(s)" in _reload(server, f"keys file {keys}")
        assert status() == 200  # served at once
        for wider, named in (
            ("detach_timeout = 61", "detach_timeout 61 is over the server's --detach-timeout 60"),
            ("detach_log_kib = 4096", "detach_log_kib 4096 is over the server's --detach-log-kib 1024"),
            ("detach_streams = -1", "detach_streams must be at least 0, got -1"),
        ):
            keys.write_text(KEYS.replace("detach_streams = 0", wider))
            line = _reload(server, f"keys file {keys}")
            assert "not reloaded, the keys in force stay" in line, line
            assert "[[key]] #1 (batch)" in line, line
            assert named in line, line
            assert status() == 200  # the keys in force stay
        assert server.stop() == 0


def test_a_keys_file_that_widens_the_flags_stops_the_server_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trioserve._cli import main

    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    args = ["serve", "--port", "0", "--scripted", "--keys-file", str(keys)]
    assert main([*args, "--detach-timeout", "0.25"]) == 2
    err = capsys.readouterr().err
    assert "[[key]] #3 (phone): detach_timeout 0.5 is over the server's --detach-timeout 0.25" in err
    assert main([*args, "--detach-log-kib", "1"]) == 2
    err = capsys.readouterr().err
    assert "[[key]] #2 (tablet): detach_log_kib 2 is over the server's --detach-log-kib 1" in err
