"""The prompt cache's disk tier (``_backends/_cache/_disk_cache.py``), without a model: the
format, the index, the checks that make a bad entry a miss, the budget, the leftovers
of a killed writer, and the host tier on top of it. The states are opaque bytes here;
the real model's restores are in tests/e2e/test_disk_cache.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trioserve._backends._cache import (
    DiskEntry,
    DiskStore,
    DiskTier,
    HostCache,
    StateBuffer,
    fingerprint,
    gguf_digest,
)

FP = "a" * 32
TOKENS = list(range(100, 164))
CUTS = [16, 32, 48, 64]
STATE = bytes(range(256)) * 40


def _store(tmp_path: Path, budget: int = 1 << 30) -> DiskStore:
    return DiskStore(tmp_path / "cache", budget)


def _written(
    store: DiskStore, tier: DiskTier, tokens: list[int] = TOKENS, state: bytes = STATE, **kw: object
) -> None:
    cuts = [c for c in CUTS if c <= len(tokens)] or [len(tokens)]
    assert tier.put(tokens, cuts, state, start=0, salt=str(kw.get("salt", "")))
    assert store.flush(timeout=10)


def _only_entry(tier: DiskTier) -> Path:
    (path,) = tier.directory.glob("*.kv")
    return path


def test_an_entry_written_is_found_and_read_back_by_a_new_process(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _written(store, store.tier(FP))
    store.close()
    # another store on the same directory (a restart) indexes what is there
    again = _store(tmp_path)
    tier = again.tier(FP)
    assert len(tier) == 1
    found = tier.best([*TOKENS, 7, 8, 9], [*CUTS, 67], 66)
    assert found is not None
    shared, entry = found
    assert shared == 64
    assert isinstance(entry, DiskEntry)
    assert bytes(tier.read(entry) or b"") == STATE
    # a prompt sharing only the first two pieces finds them (a prefix of the entry)
    partial = tier.best(TOKENS[:32] + [1] * 32, CUTS, 63)
    assert partial is not None
    assert partial[0] == 32
    # nothing shared: nothing found
    assert tier.best([1] * 64, CUTS, 63) is None
    again.close()


def test_a_host_buffer_is_written_as_it_is(tmp_path: Path) -> None:
    store = _store(tmp_path)
    tier = store.tier(FP)
    _written(store, tier, state=StateBuffer.of(STATE))  # type: ignore[arg-type]
    found = tier.best(TOKENS, CUTS, 64)
    assert found is not None
    assert bytes(tier.read(found[1]) or b"") == STATE
    store.close()


def test_each_salt_finds_only_its_own_entries_and_the_salt_is_not_on_disk(tmp_path: Path) -> None:
    store = _store(tmp_path)
    tier = store.tier(FP)
    _written(store, tier, salt="key:secret-salt-of-key-a")
    assert tier.best(TOKENS, CUTS, 64) is None
    assert tier.best(TOKENS, CUTS, 64, salt="key:another") is None
    assert tier.best(TOKENS, CUTS, 64, salt="key:secret-salt-of-key-a") is not None
    assert b"secret-salt" not in _only_entry(tier).read_bytes()
    store.close()


def test_the_same_tokens_are_written_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    tier = store.tier(FP)
    _written(store, tier)
    _written(store, tier)
    _written(store, tier, tokens=TOKENS[:32])  # (covered by the longer one)
    assert store.writes == 1
    assert len(tier) == 1
    store.close()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other model", "garbage"])
def test_a_bad_entry_is_a_logged_miss_moved_aside(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path)
    tier = store.tier(FP)
    _written(store, tier)
    path = _only_entry(tier)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        flipped = bytearray(data)
        flipped[len(data) - 100] ^= 0x01  # a byte of the state
        path.write_bytes(bytes(flipped))
    elif damage == "other model":
        other = store.tier("b" * 32)
        _written(store, other)
        os.replace(_only_entry(other), path)  # another model's entry renamed into place
    else:
        path.write_bytes(b"not an entry at all")
    caplog.set_level(logging.WARNING, logger="trioserve.cache")
    # what a restart sees: the index is read again from the files
    fresh = DiskStore(tmp_path / "cache", 1 << 30).tier(FP)
    found = fresh.best(TOKENS, CUTS, 64)
    if found is not None:  # (a header intact: found, and the read fails its check)
        assert fresh.read(found[1]) is None
    assert fresh.best(TOKENS, CUTS, 64) is None
    assert not path.exists()
    assert list((tmp_path / "cache" / "v1" / "bad").iterdir())
    assert "unusable" in caplog.text
    store.close()


def test_a_cancelled_read_is_a_miss_that_keeps_the_entry(tmp_path: Path) -> None:
    store = _store(tmp_path)
    tier = store.tier(FP)
    _written(store, tier)
    found = tier.best(TOKENS, CUTS, 64)
    assert found is not None
    assert tier.read(found[1], cancelled=lambda: True) is None
    assert _only_entry(tier).exists()
    assert tier.read(found[1]) is not None
    store.close()


def test_the_budget_holds_for_the_whole_directory_oldest_out(tmp_path: Path) -> None:
    entry_size = len(STATE) + 1000
    store = _store(tmp_path, budget=3 * entry_size)
    tiers = [store.tier("c" * 32), store.tier("d" * 32)]
    for i in range(6):
        _written(store, tiers[i % 2], tokens=[i] * 64)
    assert store.bytes <= 3 * entry_size
    assert store.evictions == 3
    # a read makes an entry the most recently used: entry 3 outlives entries 4 and 5
    found = tiers[1].best([3] * 64, CUTS, 64)
    assert found is not None
    assert tiers[1].read(found[1]) is not None
    for i in range(6, 8):
        _written(store, tiers[i % 2], tokens=[i] * 64)
    fresh = [DiskStore(tmp_path / "cache", 1 << 30).tier(name * 32) for name in "cd"]
    kept = [k for k in range(8) if any(tier.best([k] * 64, CUTS, 64) for tier in fresh)]
    assert kept == [3, 6, 7]
    store.close()


def test_what_a_killed_writer_left_is_swept_at_start(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.close()
    tmp = tmp_path / "cache" / "v1" / "tmp"
    # a process that is gone (a child that exited) left half an entry
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    left = tmp / f"{'e' * 40}.{int(child.stdout)}.1"
    left.write_bytes(b"half")
    again = _store(tmp_path)
    assert again.swept == 1
    assert not left.exists()
    again.close()


def test_the_fingerprint_is_the_content_and_the_settings_not_the_path(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a = tmp_path / "a.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 5000)
    b = tmp_path / "elsewhere" / "b.gguf"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    digest = gguf_digest(a, store.root)
    assert gguf_digest(b, store.root) == digest
    # remembered by (device, inode, size, mtime)
    assert len(list((store.base / "digests").iterdir())) == 2
    a.write_bytes(b"GGUF" + b"\1" * 5000)
    assert gguf_digest(a, store.root) != digest
    settings = {"n_ctx": 4096, "type_k": 1}
    assert fingerprint(digest, settings, "build 1") == fingerprint(digest, dict(settings), "build 1")
    assert fingerprint(digest, {**settings, "n_ctx": 2048}, "build 1") != fingerprint(
        digest, settings, "build 1"
    )
    assert fingerprint(digest, settings, "build 2") != fingerprint(digest, settings, "build 1")
    store.close()


def test_a_digest_stops_when_the_load_is_aborted(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (20 << 20))

    class Aborted(Exception):
        pass

    def check() -> None:
        raise Aborted

    with pytest.raises(Aborted):
        gguf_digest(model, None, check=check)


def test_the_window_rule_holds_on_disk_too(tmp_path: Path) -> None:
    # a state whose window cells start at 40 gives back 64 tokens (window 32: the
    # tokens after them attend to 33 on? no — from 64 - 32 + 1 = 33 < 40): not kept as
    # serving 64; the host tier refuses such a state before it reaches the disk
    store = _store(tmp_path)
    tier = store.tier(FP, window=32)
    assert tier.serves(33, 64)
    assert not tier.serves(40, 64)
    host = HostCache(0, rule="text", window=32)
    host.disk = tier
    assert not host.put(TOKENS, CUTS, STATE, floor=40)
    assert store.flush(timeout=10)
    assert store.writes == 0
    store.close()


def test_the_host_tier_writes_through_and_offers_what_only_the_disk_holds(tmp_path: Path) -> None:
    store = _store(tmp_path)
    host = HostCache(0, rule="text")  # no host memory at all
    assert not host.keeps
    host.disk = store.tier(FP)
    assert host.keeps
    assert host.put(TOKENS, CUTS, STATE)
    assert store.flush(timeout=10)
    found = host.best([*TOKENS, 5], [*CUTS, 65], 64)
    assert found is not None
    assert found[0] == 64
    assert isinstance(found[1], DiskEntry)
    # with host memory holding the same prefix, host memory serves it
    roomy = HostCache(1 << 20, rule="text")
    roomy.disk = host.disk
    assert roomy.put(TOKENS, CUTS, STATE)
    found = roomy.best([*TOKENS, 5], [*CUTS, 65], 64)
    assert found is not None
    assert not isinstance(found[1], DiskEntry)
    store.close()


def test_entries_another_process_writes_are_found_without_a_restart(tmp_path: Path) -> None:
    mine = _store(tmp_path)
    tier = mine.tier(FP)
    assert tier.best(TOKENS, CUTS, 64) is None
    theirs = _store(tmp_path)
    _written(theirs, theirs.tier(FP))
    found = tier.best(TOKENS, CUTS, 64)
    assert found is not None
    assert bytes(tier.read(found[1]) or b"") == STATE
    mine.close()
    theirs.close()


def test_a_longer_prefix_another_process_writes_is_found_over_a_shorter_one_known(tmp_path: Path) -> None:
    """A conversation that moves between workers behind a gateway: this process knows
    turn 1's prefix; another writes turn 2's, which holds it; the next lookup finds
    turn 2's (the index's shorter match does not stop it looking at the directory)."""
    mine = _store(tmp_path)
    tier = mine.tier(FP)
    _written(mine, tier, TOKENS[:32])
    longer = [*TOKENS, 7, 8, 9]
    assert tier.best(longer, [*CUTS, 67], 66) is not None  # turn 1's 32 tokens, known
    assert tier.best(longer, [*CUTS, 67], 66)[0] == 32  # type: ignore[index]
    theirs = _store(tmp_path)
    _written(theirs, theirs.tier(FP), TOKENS)
    found = tier.best(longer, [*CUTS, 67], 66)
    assert found is not None
    assert found[0] == 64
    mine.close()
    theirs.close()
