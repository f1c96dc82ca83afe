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
    cache = HostCache(budget=100)
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
    cache = HostCache(budget=1000)
    cache.put([1, 2, 3, 4], b"x" * 10)
    cache.put([1, 2, 3, 4, 5, 6, 7, 8], b"y" * 20)
    assert len(cache) == 1
    assert cache.bytes == 20
    cache.put([1, 2, 3, 4], b"z" * 10)  # already covered
    assert len(cache) == 1
    assert cache.best([1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 4) == (8, b"y" * 20)
