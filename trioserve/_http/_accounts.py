"""API keys as accounts: the keys file (TOML, read at start and on ``SIGHUP``), each
key's priority, fair-share weight and limits, and the rate limits' buckets.

A request's account is its API key (the same hash that salts its prompt cache and owns
its stored responses); where no key is required, every request is the one account
``""``. The file's ``[defaults]`` apply to keys without an entry (``--api-key`` keys,
or none at all). A reload keeps each known key's rate-limit buckets (their levels)
and drops a removed key's; only known keys have buckets. Pure bookkeeping on the
event loop: a few dict lookups per request. The format and the rules:
docs/operations.md, "Keys, priorities and limits".
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from .._core._admission import Ticket
from .._core._exceptions import PermissionDeniedError, RateLimitError

__all__ = ["Account", "Accounts", "KeysFile", "RateBucket", "parse_keys_file"]

logger = logging.getLogger("trioserve.server")

#: a request's ``priority`` field: an integer in this range (lower first)
PRIORITY_RANGE = (-1_000_000, 1_000_000)

_FIELDS = frozenset(
    {
        "name",
        "key",
        "key_env",
        "key_sha256",
        "admin",
        "priority",
        "min_priority",
        "weight",
        "concurrency",
        "tokens_per_minute",
        "requests_per_minute",
        "detach_streams",
        "detach_timeout",
        "detach_log_kib",
    }
)


@dataclass(frozen=True, kw_only=True)
class Account:
    """One key's entry (or the defaults)."""

    name: str = "default"
    #: SHA-256 of the key (``b""``: the defaults)
    digest: bytes = b""
    admin: bool = False
    #: the priority of its requests that name none
    priority: int = 0
    #: the best (lowest) priority its requests may ask for (``None``: any — only where
    #: no key is configured; an entry's default, ``[defaults]``' too: its ``priority``)
    min_priority: int | None = None
    #: its weight in the fair share of the slots and of the tokens served
    weight: float = 1.0
    #: the most slots its requests hold at once (the rest wait)
    concurrency: int | None = None
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    #: its resumable streams (``X-Conversation-Id``; docs/resumable-streams.md), each
    #: ``None`` for the server's flag: how many it keeps at once (``--detach-per-key``;
    #: 0: none, the header is refused), how long one goes without a reader and a
    #: finished one's log is kept (``--detach-timeout``, seconds: never longer), and
    #: its log's window (``--detach-log-kib``: never larger)
    detach_streams: int | None = None
    detach_timeout: float | None = None
    detach_log_kib: int | None = None


@dataclass(frozen=True)
class KeysFile:
    defaults: Account = dataclasses.field(default_factory=Account)
    accounts: tuple[Account, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(account.digest for account in self.accounts)

    @property
    def admin_keys(self) -> tuple[bytes, ...]:
        return tuple(account.digest for account in self.accounts if account.admin)


def _int(table: Mapping[str, object], name: str, where: str, *, low: int | None = None) -> int | None:
    value = table.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{where}: {name} must be at least {low}, got {value}")
    lo, hi = PRIORITY_RANGE
    if name in ("priority", "min_priority") and not lo <= value <= hi:
        raise ValueError(f"{where}: {name} must be in [{lo}, {hi}], got {value}")
    return value


def _account(table: Mapping[str, object], where: str, base: Account, digest: bytes) -> Account:
    unknown = set(table) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    weight = table.get("weight", base.weight)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ValueError(f"{where}: weight must be a positive number, got {weight!r}")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}: admin must be true or false")
    name = table.get("name", base.name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string")
    priority = _int(table, "priority", where)
    min_priority = _int(table, "min_priority", where)
    priority = base.priority if priority is None else priority
    if "min_priority" not in table:
        # a key may lower its own priority, never raise it above its default; so may
        # the keys without an entry ([defaults]: --api-key keys)
        min_priority = priority
    if min_priority is not None and priority < min_priority:
        raise ValueError(f"{where}: priority {priority} is better than its min_priority {min_priority}")

    def limit(field: str, low: int = 1) -> int | None:
        value = _int(table, field, where, low=low)
        return getattr(base, field) if field not in table else value

    detach_timeout = table.get("detach_timeout", base.detach_timeout)
    if detach_timeout is not None and (
        isinstance(detach_timeout, bool)
        or not isinstance(detach_timeout, int | float)
        or not 0 < detach_timeout < math.inf
    ):
        raise ValueError(f"{where}: detach_timeout must be seconds, more than 0, got {detach_timeout!r}")

    return Account(
        name=name,
        digest=digest,
        admin=admin,
        priority=priority,
        min_priority=min_priority,
        weight=float(weight),
        concurrency=limit("concurrency"),
        tokens_per_minute=limit("tokens_per_minute"),
        requests_per_minute=limit("requests_per_minute"),
        detach_streams=limit("detach_streams", low=0),
        detach_timeout=None if detach_timeout is None else float(detach_timeout),
        detach_log_kib=limit("detach_log_kib"),
    )


def _digest(table: Mapping[str, object], where: str, env: Mapping[str, str]) -> bytes:
    given = [name for name in ("key", "key_env", "key_sha256") if name in table]
    if len(given) != 1:
        raise ValueError(f"{where}: give exactly one of key, key_env, key_sha256")
    value = table[given[0]]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {given[0]} must be a non-empty string")
    if given[0] == "key_sha256":
        try:
            digest = bytes.fromhex(value)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: key_sha256 must be 64 hexadecimal digits")
        return digest
    if given[0] == "key_env":
        key = env.get(value)
        if not key:
            raise ValueError(f"{where}: the environment variable {value} is not set")
        value = key
    return hashlib.sha256(value.encode()).digest()


def parse_keys_file(text: str, env: Mapping[str, str] | None = None) -> KeysFile:
    """The keys file's accounts. Raises ``ValueError`` naming the entry and field at
    fault (a reload that fails keeps the accounts in force)."""
    env = os.environ if env is None else env
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML: {exc}") from None
    unknown = set(data) - {"defaults", "key"}
    if unknown:
        raise ValueError(f"unknown table(s) {', '.join(sorted(unknown))}: expected [defaults] and [[key]]")
    defaults_table = data.get("defaults", {})
    if not isinstance(defaults_table, dict):
        raise ValueError("[defaults] must be a table")
    for forbidden in ("key", "key_env", "key_sha256", "admin", "name"):
        if forbidden in defaults_table:
            raise ValueError(f"[defaults]: {forbidden} belongs to a [[key]] entry")
    defaults = _account(defaults_table, "[defaults]", Account(), b"")
    entries = data.get("key", [])
    if not isinstance(entries, list):
        raise ValueError("key must be an array of tables: [[key]]")
    accounts: list[Account] = []
    seen: dict[bytes, str] = {}
    for index, table in enumerate(entries):
        where = f"[[key]] #{index + 1}"
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be a table")
        if "name" in table and isinstance(table["name"], str):
            where += f" ({table['name']})"
        digest = _digest(table, where, env)
        if digest in seen:
            raise ValueError(f"{where}: the same key as {seen[digest]}")
        base = dataclasses.replace(defaults, name=f"key{index + 1}")
        account = _account(table, where, base, digest)
        seen[digest] = account.name
        accounts.append(account)
    return KeysFile(defaults, tuple(accounts))


class RateBucket:
    """A per-minute limit as a bucket that refills continuously: ``limit`` per minute,
    at most ``limit`` at once. Its level may go below zero (tokens are counted when
    known: a prompt when prepared, a reply when it ends); nothing is admitted then."""

    __slots__ = ("at", "level", "limit")

    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        self.level = float(limit)
        self.at = now

    def refill(self, now: float) -> float:
        self.level = min(float(self.limit), self.level + (now - self.at) * self.limit / 60.0)
        self.at = now
        return self.level

    def until(self, level: float) -> float:
        """Seconds until the bucket holds ``level``."""
        return max(0.0, (level - self.level) * 60.0 / self.limit)


def _duration(seconds: float) -> str:
    """OpenAI's form of ``x-ratelimit-reset-*``: ``"1s"``, ``"6m0s"``, ``"120ms"``."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class _Buckets:
    __slots__ = ("digest", "requests", "tokens")

    def __init__(self, digest: bytes) -> None:
        #: the entry of the key they count (``b""``: a key without one, ``--api-key``)
        self.digest = digest
        self.requests: RateBucket | None = None
        self.tokens: RateBucket | None = None

    def follow(self, account: Account, now: float) -> None:
        """Take ``account``'s limits, keeping the levels (a reload changes a limit, not
        what the key has used): a new limit starts full, a lower one caps the level, a
        removed one drops its bucket."""
        self.digest = account.digest
        self.requests = _follow(self.requests, account.requests_per_minute, now)
        self.tokens = _follow(self.tokens, account.tokens_per_minute, now)


def _follow(bucket: RateBucket | None, limit: int | None, now: float) -> RateBucket | None:
    if limit is None:
        return None
    if bucket is None:
        return RateBucket(limit, now)
    if bucket.limit != limit:
        bucket.refill(now)
        bucket.limit = limit
        bucket.level = min(bucket.level, float(limit))
    return bucket


class Accounts:
    """The keys file in force, and each account's buckets."""

    def __init__(self, keys: KeysFile | None = None, path: Path | None = None) -> None:
        self.path = path
        self.file = keys or KeysFile()
        self._by_digest = {account.digest: account for account in self.file.accounts}
        self._buckets: dict[str, _Buckets] = {}
        self.reloads = 0

    @property
    def buckets(self) -> int:
        """How many keys have rate-limit buckets (one per known key that has used a
        limited account: bounded by the keys, never by what clients send)."""
        return len(self._buckets)

    def replace(self, keys: KeysFile) -> None:
        """Use ``keys`` for the requests to come (a request in flight keeps its ticket).
        The buckets of keys still known keep their levels (under their new limits, from
        their next request on); a removed key's are dropped."""
        self.file = keys
        self._by_digest = {account.digest: account for account in keys.accounts}
        for owner, buckets in list(self._buckets.items()):
            if buckets.digest and buckets.digest not in self._by_digest:
                del self._buckets[owner]
        self.reloads += 1

    def reload(self, check: Callable[[KeysFile], str | None] | None = None) -> bool:
        """Read the keys file again (``SIGHUP``); a file that fails to parse, or that
        ``check`` refuses (a reason), is logged and the accounts in force stay. Whether
        it was replaced."""
        if self.path is None:
            return False
        try:
            keys = parse_keys_file(self.path.read_text())
        except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
            logger.error("keys file %s not reloaded, the keys in force stay: %s", self.path, exc)
            return False
        refusal = check(keys) if check is not None else None
        if refusal is not None:
            logger.error("keys file %s not reloaded, the keys in force stay: %s", self.path, refusal)
            return False
        self.replace(keys)
        logger.info("keys file %s reloaded: %d key(s)", self.path, len(keys.accounts))
        return True

    def account(self, key: str | None) -> Account:
        """The entry of ``key`` (already checked valid), or the defaults."""
        if key is None or not self._by_digest:
            return self.file.defaults
        return self._by_digest.get(hashlib.sha256(key.encode()).digest(), self.file.defaults)

    def ticket(self, account: Account, owner: str, priority: int | None) -> Ticket:
        """The request's place in the queue: its ``priority`` field, else its key's.
        A priority better than the key may ask for is refused (403)."""
        if priority is None:
            priority = account.priority
        elif account.min_priority is not None and priority < account.min_priority:
            raise PermissionDeniedError(
                f"priority {priority} is better than this API key may ask for (at best "
                f"{account.min_priority}; lower is sooner); send a priority of at least that",
                param="priority",
            )
        return Ticket(
            priority=priority, account=owner, weight=account.weight, concurrency=account.concurrency
        )

    def _buckets_of(self, owner: str, account: Account, now: float) -> _Buckets:
        buckets = self._buckets.get(owner)
        if buckets is None:
            buckets = self._buckets[owner] = _Buckets(account.digest)
        buckets.follow(account, now)
        return buckets

    def admit(self, owner: str, account: Account) -> list[tuple[bytes, bytes]]:
        """Take one request from the account's limits: its ``x-ratelimit-*`` headers,
        or :class:`RateLimitError` (429) if a limit has no room now."""
        if account.requests_per_minute is None and account.tokens_per_minute is None:
            return []
        now = trio.current_time()
        buckets = self._buckets_of(owner, account, now)
        requests, tokens = buckets.requests, buckets.tokens
        waits: list[tuple[float, str]] = []
        if requests is not None and requests.refill(now) < 1.0:
            waits.append((requests.until(1.0), f"requests per minute ({requests.limit})"))
        if tokens is not None and tokens.refill(now) <= 0.0:
            waits.append((tokens.until(1.0), f"tokens per minute ({tokens.limit})"))
        if waits:
            wait, which = max(waits)
            raise RateLimitError(
                f"rate limit reached for this API key: {which}; retry in {_duration(wait)}",
                retry_after=max(1.0, wait),
                headers=tuple(self._headers(buckets)),
            )
        if requests is not None:
            requests.level -= 1.0
        return self._headers(buckets)

    def current(self, account: Account) -> Account | None:
        """``account`` as the keys in force have it (a request holds the one it was
        admitted with, perhaps from before a reload): its entry looked up again by its
        digest, the defaults in force for a key without one; ``None``: its key was
        removed."""
        if not account.digest:
            return self.file.defaults
        return self._by_digest.get(account.digest)

    def charge(self, owner: str, account: Account, tokens: int) -> None:
        """Count ``tokens`` (a prompt evaluated, a reply) against the account's limit:
        its limit in force now (a reload since the request was admitted changed it:
        never back to the old one), nothing for a key the reload removed. Only
        :meth:`admit` makes buckets: a key without any is not counted."""
        if tokens <= 0:
            return
        buckets = self._buckets.get(owner)
        current = self.current(account)
        if buckets is None or current is None:
            return
        now = trio.current_time()
        if buckets.digest == current.digest:
            buckets.follow(current, now)
        # (else a request of the key's admitted since, under its new entry, made them
        # follow that one: they keep its limits)
        bucket = buckets.tokens
        if bucket is not None:
            bucket.refill(now)
            bucket.level -= tokens

    def _headers(self, buckets: _Buckets) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        for kind, bucket in (("requests", buckets.requests), ("tokens", buckets.tokens)):
            if bucket is None:
                continue
            headers += [
                (f"x-ratelimit-limit-{kind}".encode(), str(bucket.limit).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), str(max(0, math.floor(bucket.level))).encode()),
                (f"x-ratelimit-reset-{kind}".encode(), _duration(bucket.until(bucket.limit)).encode()),
            ]
        return headers
