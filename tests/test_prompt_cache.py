"""The prompt cache's bookkeeping: whole-chunk prefix matching and the host-memory tier's
byte budget (least recently used out first)."""

from __future__ import annotations

from trioserve._backends._prompt_cache import HostCache, shared_chunks


def test_only_whole_matching_chunks_count() -> None:
    cached = list(range(10))
    assert shared_chunks(cached, list(range(10)), 10, 4) == 8
    assert shared_chunks(cached, [*range(6), 99, 7, 8], 9, 4) == 4  # the second chunk differs
    assert shared_chunks(cached, list(range(10)), 7, 4) == 4  # the limit, in whole chunks
    assert shared_chunks([], list(range(10)), 10, 4) == 0


def test_the_host_cache_keeps_its_budget_and_drops_the_least_recently_used() -> None:
    cache = HostCache(budget=100, chunk=4)
    cache.put([1, 2, 3, 4], b"a" * 40)
    cache.put([5, 6, 7, 8], b"b" * 40)
    assert cache.best([1, 2, 3, 4, 9], 4, 4) == (4, b"a" * 40)  # now the most recent
    cache.put([9, 9, 9, 9], b"c" * 40)  # over budget: [5, 6, 7, 8] goes
    assert cache.bytes == 80
    assert cache.evictions == 1
    assert cache.best([5, 6, 7, 8, 0], 4, 4) is None
    cache.put([1] * 8, b"d" * 101)  # larger than the whole budget: not kept
    assert cache.bytes == 80


def test_a_longer_prefix_replaces_the_entries_it_extends() -> None:
    cache = HostCache(budget=1000, chunk=4)
    cache.put([1, 2, 3, 4], b"x" * 10)
    cache.put([1, 2, 3, 4, 5, 6, 7, 8], b"y" * 20)
    assert len(cache) == 1
    assert cache.bytes == 20
    cache.put([1, 2, 3, 4], b"z" * 10)  # already covered
    assert len(cache) == 1
    assert cache.best([1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 4) == (8, b"y" * 20)


def test_the_host_cache_finds_the_longest_prefix_by_its_chunk_hashes() -> None:
    cache = HostCache(budget=10_000, chunk=4)
    cache.put(list(range(12)), b"a")
    cache.put([*range(8), 50, 51, 52, 53], b"b")  # shares two chunks with the first
    cache.put([7] * 8, b"c")
    assert cache.best([*range(12), 99], 12, 4) == (12, b"a")
    assert cache.best([*range(8), 50, 51, 52, 53, 0], 12, 4) == (12, b"b")
    assert cache.best([*range(8), 0, 0, 0, 0], 12, 4)[0] == 8  # either entry: two chunks
    assert cache.best([*range(12), 99], 5, 4) == (4, cache.best([*range(12)], 5, 4)[1])  # the limit
    assert cache.best([1, 2, 3, 4], 4, 4) is None
    # evicted and replaced entries leave the index
    cache.put(list(range(16)), b"d")  # extends the first: it goes
    assert len(cache) == 3
    assert cache.best([*range(16), 1], 16, 4) == (16, b"d")
    assert cache.covers(list(range(8)))
    assert not cache.covers([9] * 4)
    small = HostCache(budget=2, chunk=4)
    small.put([1, 2, 3, 4], b"x")
    small.put([5, 6, 7, 8], b"yy")  # over budget: the first goes, and its hashes
    assert small.best([1, 2, 3, 4, 0], 4, 4) is None
    assert small.best([5, 6, 7, 8, 0], 4, 4) == (4, b"yy")
