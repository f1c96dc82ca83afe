"""The keys file never lets access fall open (issue 47), on a real ``trioserve serve``
process reloaded by a real SIGHUP (scripted backend): a file without keys still
requires one, a key a reload adds works at once while no key and a wrong key get 401,
a reload that would leave no key (or a bad file) is refused with the keys in force
kept, unless ``--allow-empty-keys-reload``; and ``[defaults]`` bounds the priority of
a key without an entry. The rules: docs/operations.md, "Keys, priorities and limits"."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
import trio

from trioserve import ScriptedBackend

from .._helpers import ServerProcess, start_server

ONE_KEY = '[defaults]\npriority = 5\n\n[[key]]\nname = "alpha"\nkey = "sk-alpha"\n'
COMPLETION = {"prompt": "x", "max_tokens": 1}


def _serve(keys: Path, *flags: str) -> ServerProcess:
    return ServerProcess("--scripted", "--scripted-interval", "0", "--keys-file", str(keys), *flags)


def _reload(server: ServerProcess, marker: str) -> str:
    """Send SIGHUP and wait for the log line it leads to (one more ``marker`` line than
    before: what shows the reload happened); that line."""
    before = sum(marker in line for line in server.log)
    server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in server.log if marker in line]
        if len(lines) > before:
            return lines[-1]
        assert time.monotonic() < deadline, "".join(server.log[-20:])
        time.sleep(0.02)  # (the reload is logged: what shows it happened)


def _status(client: httpx.Client, key: str | None, method: str = "GET", path: str = "/v1/models") -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body = COMPLETION if path == "/v1/completions" else {"model": "scripted"} if method == "POST" else None
    return client.request(method, path, json=body, headers=headers).status_code


def _locked(client: httpx.Client, keys: tuple[str | None, ...] = (None, "sk-wrong")) -> None:
    """Every keyed route refuses ``keys`` (no key, a wrong one): 401, never served."""
    for key in keys:
        assert _status(client, key) == 401
        assert _status(client, key, "POST", "/v1/completions") == 401
        assert _status(client, key, "POST", "/models/unload") == 401
        assert _status(client, key, "GET", "/loads") == 401


def test_a_key_added_to_a_defaults_only_file_works_at_once_and_nothing_else_gets_in(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text("[defaults]\npriority = 5\n")
    with _serve(keys) as server, httpx.Client(base_url=server.wait_ready()) as client:
        assert any("holds no key" in line for line in server.log)  # said at start
        _locked(client)  # a file without keys is no open door
        assert client.get("/health").status_code == 200  # (open, the status alone)
        keys.write_text(ONE_KEY)
        assert "reloaded: 1 key(s)" in _reload(server, "keys file")
        assert _status(client, "sk-alpha") == 200
        assert _status(client, "sk-alpha", "POST", "/v1/completions") == 200
        _locked(client)  # before the fix: 200 for both
        assert server.stop() == 0


@pytest.mark.parametrize(
    "emptied",
    [
        pytest.param("", id="empty"),
        pytest.param("[defaults]\npriority = 1\n", id="defaults-only"),
        pytest.param('[[key]]\nname = "alpha"\nkey = "sk-al', id="unparsable"),
        pytest.param('[[key]]\nname = "alpha"\n', id="partial"),
    ],
)
def test_a_reload_that_would_leave_no_key_or_a_bad_file_is_refused(tmp_path: Path, emptied: str) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(ONE_KEY)
    with _serve(keys) as server, httpx.Client(base_url=server.wait_ready()) as client:
        assert _status(client, "sk-alpha") == 200
        keys.write_text(emptied)  # what an editor may leave for a moment while it saves
        line = _reload(server, "keys file")
        assert "not reloaded, the keys in force stay" in line, line
        assert "ERROR" in line
        if "key" not in emptied:
            assert "holds no key" in line, line
            assert "--allow-empty-keys-reload" in line, line
        # the keys in force stay: the key works, nothing else gets in
        assert _status(client, "sk-alpha") == 200
        assert _status(client, "sk-alpha", "POST", "/v1/completions") == 200
        _locked(client)  # before the fix (empty, defaults-only): 200, and unload reached the registry
        assert server.stop() == 0


def test_the_operator_may_remove_every_key_and_then_nothing_is_served(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(ONE_KEY)
    with (
        _serve(keys, "--allow-empty-keys-reload") as server,
        httpx.Client(base_url=server.wait_ready()) as client,
    ):
        keys.write_text("[defaults]\n")
        assert "reloaded: 0 key(s)" in _reload(server, "keys file")
        _locked(client, (None, "sk-wrong", "sk-alpha"))  # locked, never open
        keys.write_text(ONE_KEY)
        assert "reloaded: 1 key(s)" in _reload(server, "keys file")
        assert _status(client, "sk-alpha") == 200
        assert server.stop() == 0


async def test_a_key_without_an_entry_gets_the_defaults_priority_bound(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """``[defaults]`` without ``min_priority``: a key outside the file (``--api-key``)
    may lower its priority, never ask for a better one than the defaults' (403 naming
    ``priority``) — before the fix, ``"priority": -1000`` was served. Keys without a
    file: priority 0 at best."""
    keys = tmp_path / "keys.toml"
    keys.write_text(ONE_KEY)
    with_file = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, api_keys=("sk-outside",), keys_file=keys
    )
    without_file = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, api_keys=("sk-outside",)
    )
    for running, best in ((with_file, 5), (without_file, 0)):
        async with running.client(headers={"Authorization": "Bearer sk-outside"}) as client:
            refused = await client.post("/v1/completions", json={**COMPLETION, "priority": -1000})
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["param"] == "priority"
            assert f"at best {best}" in error["message"]
            refused = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "priority": best - 1},
            )
            assert refused.status_code == 403
            served = await client.post("/v1/completions", json={**COMPLETION, "priority": best + 3})
            assert served.status_code == 200, served.text
    # with no key at all (one local user), any priority goes
    alone = await start_server(nursery, ScriptedBackend([b"ok"]), close_backend=True)
    async with alone.client() as client:
        served = await client.post("/v1/completions", json={**COMPLETION, "priority": -1000})
        assert served.status_code == 200
    for running in (with_file, without_file, alone):
        running.server.shutdown()


async def test_an_unknown_key_makes_no_bucket_and_a_reload_keeps_the_levels(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Rate-limit buckets exist only for known keys (a wrong key is 401 before any), and
    a reload (the path SIGHUP takes: ``Server.reload_keys``) refills none of them."""
    keys = tmp_path / "keys.toml"
    limited = '[[key]]\nname = "alpha"\nkey = "sk-alpha"\nrequests_per_minute = 2\n'
    keys.write_text(limited)
    running = await start_server(nursery, ScriptedBackend([b"ok"]), close_backend=True, keys_file=keys)
    accounts = running.server.state.accounts
    async with running.client() as client:
        for attempt in range(20):
            wrong = await client.post(
                "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer sk-guess-{attempt}"}
            )
            assert wrong.status_code == 401
        assert accounts.buckets == 0
        alpha = {"Authorization": "Bearer sk-alpha"}
        for remaining in ("1", "0"):
            served = await client.post("/v1/completions", json=COMPLETION, headers=alpha)
            assert served.headers["x-ratelimit-remaining-requests"] == remaining
        assert (await client.post("/v1/completions", json=COMPLETION, headers=alpha)).status_code == 429
        keys.write_text(limited + '\n[[key]]\nname = "beta"\nkey = "sk-beta"\n')
        assert running.server.reload_keys()
        # before the fix, the reload refilled every bucket: 200 here
        limited_still = await client.post("/v1/completions", json=COMPLETION, headers=alpha)
        assert limited_still.status_code == 429, limited_still.text
        assert accounts.buckets == 1
    running.server.shutdown()
