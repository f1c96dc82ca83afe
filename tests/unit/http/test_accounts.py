"""The keys file and the accounts: parsing (every mistake named), each key's ticket,
the rate limits' buckets and their ``x-ratelimit-*`` headers (no server)."""

from __future__ import annotations

import hashlib

import pytest
import trio
import trio.testing

from trioserve._core._exceptions import PermissionDeniedError, RateLimitError
from trioserve._http._accounts import Account, Accounts, parse_keys_file

FILE = """
[defaults]
priority = 5
weight = 1

[[key]]
name = "editor"
key = "sk-editor"
priority = 0
weight = 4
concurrency = 2

[[key]]
name = "batch"
key_env = "BATCH_KEY"
priority = 10
tokens_per_minute = 600
requests_per_minute = 2

[[key]]
name = "ops"
key_sha256 = "{}"
admin = true
min_priority = -10
""".format(hashlib.sha256(b"sk-ops").hexdigest())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def test_a_keys_file_gives_each_key_its_entry_and_the_rest_the_defaults() -> None:
    keys = parse_keys_file(FILE, {"BATCH_KEY": "sk-batch"})
    editor, batch, ops = keys.accounts
    assert (editor.name, editor.priority, editor.weight, editor.concurrency) == ("editor", 0, 4.0, 2)
    assert editor.min_priority == 0  # a key may lower its priority, not raise it
    assert (batch.digest, batch.tokens_per_minute, batch.requests_per_minute) == (_digest("sk-batch"), 600, 2)
    assert (ops.digest, ops.admin, ops.priority, ops.min_priority) == (_digest("sk-ops"), True, 5, -10)
    assert keys.admin_keys == (_digest("sk-ops"),)
    assert keys.defaults.priority == 5
    assert keys.defaults.min_priority == 5  # the keys without an entry too
    accounts = Accounts(keys)
    assert accounts.account("sk-editor") is editor
    assert accounts.account("sk-other") is keys.defaults
    assert accounts.account(None) is keys.defaults


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[key]]\nname = 'a'\n", "give exactly one of key, key_env, key_sha256"),
        ("[[key]]\nkey = 'a'\nkey_env = 'B'\n", "give exactly one of"),
        ("[[key]]\nkey_env = 'MISSING'\n", "MISSING is not set"),
        ("[[key]]\nkey_sha256 = 'abc'\n", "64 hexadecimal digits"),
        ("[[key]]\nkey = 'a'\n[[key]]\nkey = 'a'\n", "the same key as key1"),
        ("[[key]]\nkey = 'a'\nweight = 0\n", "weight must be a positive number"),
        ("[[key]]\nkey = 'a'\nconcurrency = 0\n", "concurrency must be at least 1"),
        ("[[key]]\nkey = 'a'\npriority = 'high'\n", "priority must be an integer"),
        ("[[key]]\nkey = 'a'\npriority = 0\nmin_priority = 3\n", "better than its min_priority"),
        ("[[key]]\nkey = 'a'\nrate = 3\n", "unknown field(s) rate"),
        ("[[key]]\nkey = 'a'\ndetach_streams = -1\n", "detach_streams must be at least 0, got -1"),
        ("[[key]]\nkey = 'a'\ndetach_streams = 1.5\n", "detach_streams must be an integer"),
        ("[[key]]\nkey = 'a'\ndetach_timeout = 0\n", "detach_timeout must be seconds, more than 0"),
        ("[defaults]\ndetach_timeout = 'long'\n", "[defaults]: detach_timeout must be seconds"),
        ("[[key]]\nkey = 'a'\ndetach_timeout = true\n", "detach_timeout must be seconds"),
        ("[[key]]\nkey = 'a'\ndetach_timeout = inf\n", "detach_timeout must be seconds"),
        ("[[key]]\nkey = 'a'\ndetach_log_kib = 0\n", "detach_log_kib must be at least 1"),
        ("[defaults]\nkey = 'a'\n", "belongs to a [[key]] entry"),
        ("[limits]\n", "unknown table(s) limits"),
        ("key = 3", "key must be an array of tables"),
        ("[[key]\n", "not valid TOML"),
    ],
)
def test_every_mistake_in_a_keys_file_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_keys_file(text, {})


def test_a_keys_resumable_stream_bounds_come_from_its_entry_else_the_defaults() -> None:
    keys = parse_keys_file(
        "[defaults]\ndetach_streams = 2\n\n"
        "[[key]]\nkey = 'a'\ndetach_streams = 0\ndetach_timeout = 30\ndetach_log_kib = 64\n\n"
        "[[key]]\nkey = 'b'\ndetach_timeout = 2.5\n\n"
        "[[key]]\nkey = 'c'\n",
        {},
    )
    a, b, c = keys.accounts
    assert (a.detach_streams, a.detach_timeout, a.detach_log_kib) == (0, 30.0, 64)
    assert (b.detach_streams, b.detach_timeout, b.detach_log_kib) == (2, 2.5, None)  # (the defaults')
    assert (c.detach_streams, c.detach_timeout, c.detach_log_kib) == (2, None, None)
    assert keys.defaults.detach_streams == 2
    assert parse_keys_file("", {}).defaults.detach_streams is None  # (the flag's)


def test_a_request_asks_for_its_priority_within_what_its_key_allows() -> None:
    keys = parse_keys_file(FILE, {"BATCH_KEY": "sk-batch"})
    accounts = Accounts(keys)
    editor, _batch, ops = keys.accounts
    assert accounts.ticket(editor, "key:e", None).priority == 0
    assert accounts.ticket(editor, "key:e", 7).priority == 7
    ticket = accounts.ticket(editor, "key:e", None)
    assert (ticket.account, ticket.weight, ticket.concurrency) == ("key:e", 4.0, 2)
    with pytest.raises(PermissionDeniedError, match="at best 0") as refused:
        accounts.ticket(editor, "key:e", -1)
    assert refused.value.param == "priority"
    assert accounts.ticket(ops, "key:o", -10).priority == -10
    # no keys file: anything goes
    assert Accounts().ticket(Account(), "", -1000).priority == -1000


async def test_the_rate_limits_refuse_with_openai_headers_and_refill(autojump_clock: trio.abc.Clock) -> None:
    keys = parse_keys_file(FILE, {"BATCH_KEY": "sk-batch"})
    accounts = Accounts(keys)
    batch = keys.accounts[1]
    headers = dict(accounts.admit("key:b", batch))
    assert headers[b"x-ratelimit-limit-requests"] == b"2"
    assert headers[b"x-ratelimit-remaining-requests"] == b"1"
    assert headers[b"x-ratelimit-limit-tokens"] == b"600"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"600"
    accounts.charge("key:b", batch, 650)  # a prompt and a reply: past the limit
    with pytest.raises(RateLimitError, match="tokens per minute") as refused:
        accounts.admit("key:b", batch)
    error = refused.value
    assert error.status == 429
    assert error.code == "rate_limit_exceeded"
    assert dict(error.headers)[b"x-ratelimit-remaining-tokens"] == b"0"
    assert error.retry_after == pytest.approx(5.1, abs=0.2)  # 51 tokens at 10 per second
    await trio.sleep(6.0)
    headers = dict(accounts.admit("key:b", batch))
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    with pytest.raises(RateLimitError, match="requests per minute"):
        accounts.admit("key:b", batch)
    # another key is not limited by this one's use
    assert accounts.admit("key:e", keys.accounts[0]) == []


def test_a_reload_that_fails_keeps_the_keys_in_force(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "keys.toml"
    path.write_text("[[key]]\nkey = 'sk-a'\nname = 'a'\n")
    accounts = Accounts(parse_keys_file(path.read_text()), path)
    path.write_text("[[key]]\nkey = 'sk-b'\nweight = -1\n")
    assert not accounts.reload()
    assert accounts.account("sk-a").name == "a"
    path.write_text("[[key]]\nkey = 'sk-b'\nname = 'b'\n")
    assert accounts.reload()
    assert accounts.account("sk-b").name == "b"
    assert accounts.account("sk-a").name == "default"


def test_the_defaults_may_lower_their_priority_never_raise_it() -> None:
    """``[defaults]`` without ``min_priority``: its own priority, as for a ``[[key]]`` —
    a key without an entry (``--api-key``) cannot ask for ``priority: -1000`` and pause
    every listed key's streams (issue 47)."""
    keys = parse_keys_file("[defaults]\npriority = 5\n", {})
    assert keys.defaults.min_priority == 5
    accounts = Accounts(keys)
    outsider = accounts.account("sk-outside")  # (no entry: the defaults)
    assert accounts.ticket(outsider, "key:x", 9).priority == 9
    with pytest.raises(PermissionDeniedError, match="at best 5") as refused:
        accounts.ticket(outsider, "key:x", -1000)
    assert refused.value.param == "priority"
    # an empty file: the defaults' priority is 0, and so is the best one it may ask for
    assert parse_keys_file("", {}).defaults.min_priority == 0
    # said explicitly, it holds
    assert parse_keys_file("[defaults]\npriority = 5\nmin_priority = -3\n", {}).defaults.min_priority == -3


async def test_a_reload_keeps_each_known_keys_bucket_and_drops_a_removed_ones(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A reload must not refill a key's buckets (a key at its limit stays there), a
    lowered limit caps the level, a removed key's buckets go (issue 47)."""
    keys = parse_keys_file(FILE, {"BATCH_KEY": "sk-batch"})
    accounts = Accounts(keys)
    batch = keys.accounts[1]
    accounts.admit("key:b", batch)
    accounts.admit("key:b", batch)
    with pytest.raises(RateLimitError, match="requests per minute"):
        accounts.admit("key:b", batch)
    assert accounts.buckets == 1
    accounts.replace(parse_keys_file(FILE, {"BATCH_KEY": "sk-batch"}))  # the same file again
    batch = accounts.account("sk-batch")
    with pytest.raises(RateLimitError, match="requests per minute"):
        accounts.admit("key:b", batch)  # still at its limit: the reload refilled nothing
    await trio.sleep(30.0)  # one request's worth refilled (2 per minute)
    # a higher limit: the level stays (1 of 10), not a full bucket
    accounts.replace(
        parse_keys_file(
            FILE.replace("requests_per_minute = 2", "requests_per_minute = 10"), {"BATCH_KEY": "sk-batch"}
        )
    )
    headers = dict(accounts.admit("key:b", accounts.account("sk-batch")))
    assert headers[b"x-ratelimit-limit-requests"] == b"10"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    # the key removed: its buckets go; the keys still known keep theirs
    accounts.admit("key:e", accounts.account("sk-editor"))  # (no limits: no bucket)
    assert accounts.buckets == 1
    accounts.replace(parse_keys_file(FILE.split('[[key]]\nname = "batch"')[0], {}))
    assert accounts.buckets == 0


async def test_a_key_without_an_entry_keeps_its_bucket_across_reloads(autojump_clock: trio.abc.Clock) -> None:
    limited = "[defaults]\nrequests_per_minute = 1\n"
    accounts = Accounts(parse_keys_file(limited, {}))
    accounts.admit("key:outside", accounts.account("sk-outside"))
    accounts.replace(parse_keys_file(limited + "[[key]]\nkey = 'sk-new'\n", {}))
    assert accounts.buckets == 1
    with pytest.raises(RateLimitError):
        accounts.admit("key:outside", accounts.account("sk-outside"))


async def test_a_charge_after_a_reload_counts_under_the_keys_in_force(autojump_clock: trio.abc.Clock) -> None:
    """A request charges its reply when it ends, holding the account it was admitted
    with: the charge follows the keys in force (never back to the old limit), charges
    nothing for a key the reload removed, and never makes a bucket."""
    accounts = Accounts(parse_keys_file(FILE, {"BATCH_KEY": "sk-batch"}))
    admitted = accounts.account("sk-batch")  # (tokens_per_minute = 600)
    accounts.admit("key:b", admitted)
    lowered = FILE.replace("tokens_per_minute = 600", "tokens_per_minute = 100")
    accounts.replace(parse_keys_file(lowered, {"BATCH_KEY": "sk-batch"}))
    accounts.charge("key:b", admitted, 40)  # the request admitted before the reload ends
    headers = dict(accounts.admit("key:b", accounts.account("sk-batch")))
    assert headers[b"x-ratelimit-limit-tokens"] == b"100"
    # charged under the limit in force (100 - 40), not under the old one (capped to 100)
    assert headers[b"x-ratelimit-remaining-tokens"] == b"60"
    # the key removed: its buckets go, and a request of it that ends brings none back
    accounts.replace(parse_keys_file(FILE.split('[[key]]\nname = "batch"')[0], {}))
    assert accounts.buckets == 0
    accounts.charge("key:b", admitted, 40)
    assert accounts.buckets == 0
    # only admit makes buckets: a charge for a key that has none counts nothing
    limited = Accounts(parse_keys_file("[defaults]\ntokens_per_minute = 10\n", {}))
    limited.charge("key:x", limited.account("sk-x"), 5)
    assert limited.buckets == 0
