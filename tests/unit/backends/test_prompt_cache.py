"""The prompt cache's bookkeeping: whole-piece prefix matching and the host-memory tier's
byte budget (least recently used out first)."""

from __future__ import annotations

from pathlib import Path

from trioserve._backends._cache import PieceRule
from trioserve._backends._cache._cache_policy import CachePolicy, WindowMark, WindowMarks, short_tail
from trioserve._backends._cache._prompt_cache import HostBudget, HostCache, shared_prefix
from trioserve._backends._llama import LlamaSettings
from trioserve._backends._llama._tiers import host_tier
from trioserve._backends._sources import LlamaSource


def fours(tokens: list[int]) -> list[int]:
    """Cuts every 4 tokens (the aligned rule with pieces of 4)."""
    return list(range(4, len(tokens) + 1, 4))


def test_only_whole_matching_pieces_count() -> None:
    cached = list(range(10))
    assert shared_prefix(cached, list(range(10)), [4, 8], 10) == 8
    assert shared_prefix(cached, [*range(6), 99, 7, 8], [4, 8], 9) == 4  # the second piece differs
    assert shared_prefix(cached, list(range(10)), [4, 8], 7) == 4  # the limit, in whole pieces
    assert shared_prefix([], list(range(10)), [4, 8], 10) == 0
    # pieces of any lengths: the cuts decide
    assert shared_prefix(cached, list(range(10)), [3, 5, 9], 10) == 9
    assert shared_prefix(cached, [0, 1, 2, 3, 4, 77, 6], [3, 5, 7], 7) == 5


def test_the_host_cache_keeps_its_budget_and_drops_the_least_recently_used() -> None:
    cache = HostCache(budget=100, rule="r")
    cache.put([1, 2, 3, 4], [4], b"a" * 40)
    cache.put([5, 6, 7, 8], [4], b"b" * 40)
    assert cache.best([1, 2, 3, 4, 9], [4], 4) == (4, b"a" * 40)  # now the most recent
    cache.put([9, 9, 9, 9], [4], b"c" * 40)  # over budget: [5, 6, 7, 8] goes
    assert cache.bytes == 80
    assert cache.evictions == 1
    assert cache.best([5, 6, 7, 8, 0], [4], 4) is None
    cache.put([1] * 8, [4, 8], b"d" * 101)  # larger than the whole budget: not kept
    assert cache.bytes == 80


def test_a_longer_prefix_replaces_the_entries_it_extends() -> None:
    cache = HostCache(budget=1000, rule="r")
    cache.put([1, 2, 3, 4], [4], b"x" * 10)
    cache.put([1, 2, 3, 4, 5, 6, 7, 8], [4, 8], b"y" * 20)
    assert len(cache) == 1
    assert cache.bytes == 20
    cache.put([1, 2, 3, 4], [4], b"z" * 10)  # already covered
    assert len(cache) == 1
    assert cache.best([1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 8], 8) == (8, b"y" * 20)


def test_the_host_cache_finds_the_longest_prefix_by_its_piece_hashes() -> None:
    cache = HostCache(budget=10_000, rule="r")
    for tokens, state in ((list(range(12)), b"a"), ([*range(8), 50, 51, 52, 53], b"b"), ([7] * 8, b"c")):
        cache.put(tokens, fours(tokens), state)
    prompt = [*range(12), 99]
    assert cache.best(prompt, fours(prompt), 12) == (12, b"a")
    prompt = [*range(8), 50, 51, 52, 53, 0]
    assert cache.best(prompt, fours(prompt), 12) == (12, b"b")
    prompt = [*range(8), 0, 0, 0, 0]
    assert cache.best(prompt, fours(prompt), 12)[0] == 8  # either entry: two pieces
    prompt = [*range(12), 99]
    assert cache.best(prompt, fours(prompt), 5) == (4, cache.best(prompt, fours(prompt), 4)[1])  # the limit
    assert cache.best([1, 2, 3, 4], [4], 4) is None
    # evicted and replaced entries leave the index
    cache.put(list(range(16)), fours(list(range(16))), b"d")  # extends the first: it goes
    assert len(cache) == 3
    assert cache.best([*range(16), 1], [4, 8, 12, 16], 16) == (16, b"d")
    assert cache.covers(list(range(8)), [4, 8])
    assert not cache.covers([9] * 4, [4])
    small = HostCache(budget=2, rule="r")
    small.put([1, 2, 3, 4], [4], b"x")
    small.put([5, 6, 7, 8], [4], b"yy")  # over budget: the first goes, and its hashes
    assert small.best([1, 2, 3, 4, 0], [4], 4) is None
    assert small.best([5, 6, 7, 8, 0], [4], 4) == (4, b"yy")


def test_pieces_of_other_lengths_index_other_prefixes() -> None:
    # the same tokens cut elsewhere are other pieces: a prompt cut [3, 7] does not find
    # an entry cut [4, 8] past their first common cut (there is none here)
    cache = HostCache(budget=10_000, rule="r")
    cache.put(list(range(8)), [4, 8], b"a")
    assert cache.best([*range(8), 9], [3, 7], 8) is None
    assert cache.best([*range(8), 9], [4, 8], 8) == (8, b"a")


def test_an_entry_past_the_sliding_window_serves_only_itself() -> None:
    # a saved state keeps a window layer's cells for its last `window` positions only
    cache = HostCache(budget=10_000, rule="r", window=4)
    assert cache.usable(4, 1)  # within the window: every cell is there
    assert cache.usable(10, 9)  # the whole entry but its last token: its window is there
    assert not cache.usable(10, 8)  # position 8 attends to 5..8; the state starts at 6
    tokens = list(range(10))
    cache.put(tokens, [2, 8, 10], b"a")
    assert cache.best([*range(8), 99, 99], [2, 8], 9) is None
    assert cache.best([*range(10), 99], [2, 8, 10], 10) == (10, b"a")
    assert HostCache(budget=10, rule="r").usable(1000, 1)  # no window: any prefix


def test_a_state_whose_window_cells_start_late_is_not_kept() -> None:
    # cells set from a state (an n > 1 choice's copy of its leader's prompt, taken at the
    # prompt's end) hold window cells only from that state's start: trimmed back to a cut,
    # they cannot give the cut back, so the host tier neither keeps nor offers them
    cache = HostCache(budget=10_000, rule="r", window=4)
    tokens = list(range(10))
    assert not cache.put(tokens, [2, 8, 10], b"short", floor=8)  # position 9 attends to 6..9
    assert len(cache) == 0
    assert not cache.covers(tokens, [2, 8, 10])  # a whole state is still saved after it
    assert cache.put(tokens, [2, 8, 10], b"whole", floor=0)
    assert cache.best([*range(10), 99], [2, 8, 10], 10) == (10, b"whole")
    assert cache.put(list(range(12)), [2, 8, 10, 12], b"late", floor=9)  # serves only 12
    assert cache.covers(tokens, [2, 8, 10])  # the first entry stays: the second cannot serve it
    assert cache.best([*range(10), 99], [2, 8, 10], 10) == (10, b"whole")
    assert cache.usable(12, 12, floor=9)
    assert not cache.usable(12, 11, floor=9)


def test_cells_copied_from_a_state_are_reused_saved_and_recomputed_only_where_exact() -> None:
    # pieces of 4, a window of 4; id 1 holds 8 tokens whose window cells start at 5 (an
    # n > 1 choice given its leader's state at the prompt's end, 9, then trimmed to its
    # last cut): the tokens after position 8 attend to 5..8, but from 4 on to 4..7
    host = HostCache(budget=10_000, rule="r", window=4)
    policy = CachePolicy(
        2, rule=PieceRule(None, max_piece=4), host=host, enabled=True, fast=False, idle_recompute=True
    )
    prompt = list(range(9))
    policy.release(0, prompt, [50, 51, 52, 53], 8, finished=True)  # whole: evaluated here
    policy.release(1, prompt, [50, 51, 52, 53], 8, finished=True, floor=6)  # from a state: window cells 6..7
    assert policy.cached(1) == prompt[:8]  # (kept, and shown as kept)
    assert policy.serves(0, 8)
    assert not policy.serves(1, 8)
    assert policy.savable(0)
    assert not policy.savable(1)
    assert policy.pending == 1  # id 1's conversation is not recomputed on cells it lacks
    again = [*prompt, 99]
    plan = policy.place(again, [4, 8], True, [1])  # only id 1 free: it shares 8, serves none
    assert (plan.seq_id, plan.reused, plan.save) == (1, 0, None)
    plan = policy.place(again, [4, 8], True, [0, 1])
    assert (plan.seq_id, plan.reused) == (0, 8)
    assert policy.place_follower([1]).save is None  # its prefix is not saved either
    policy.take(1)
    policy.release(1, prompt, [], 8, finished=False, floor=5)  # 5 <= 8 - 4 + 1: exact
    assert policy.serves(1, 8)
    assert policy.savable(1)


def test_a_prompt_the_recomputed_reply_pushed_past_the_window_is_checkpointed() -> None:
    # pieces of 4, a window of 4: id 0's prompt is 8 tokens, the idle recompute extends
    # its cells to 16 (prompt + reply). A state of 16 tokens holds the window cells of
    # positions 12..15 only: it cannot give back the prompt's 8, so the eviction saves
    # a checkpoint at 8 too — unless the id's next sequence reuses cells past it
    host = HostCache(budget=10_000, rule="r", window=4)
    policy = CachePolicy(
        2, rule=PieceRule(None, max_piece=4), host=host, enabled=True, fast=False, idle_recompute=True
    )
    prompt = list(range(8))
    policy.release(0, prompt, list(range(50, 58)), 8, finished=True)
    assert policy.checkpoint(0) == 0  # (its cells hold the prompt alone: nothing to add)
    while policy.pending:
        job = policy.next_recompute()
        if job is not None:
            policy.recomputed(job)
    assert len(policy.cached(0)) == 16
    assert not host.usable(16, 8)
    assert policy.checkpoint(0) == 8
    assert policy.checkpoint(0, keep=12) == 0  # the next sequence reuses 12 of its cells
    other = list(range(100, 110))
    plan = policy.place(other, [4, 8], True, [0])
    assert (plan.seq_id, plan.save, plan.checkpoint) == (0, policy.cached(0), 8)
    # once the host tier holds the prompt, no second copy
    host.put(prompt, [4, 8], b"state")
    assert policy.checkpoint(0) == 0
    # a model without a sliding window: the longer state gives the prompt back
    flat = CachePolicy(
        1,
        rule=PieceRule(None, max_piece=4),
        host=HostCache(budget=10_000, rule="r"),
        enabled=True,
        fast=False,
        idle_recompute=True,
    )
    flat.release(0, prompt, list(range(50, 58)), 8, finished=True)
    while flat.pending:
        job = flat.next_recompute()
        if job is not None:
            flat.recomputed(job)
    assert len(flat.cached(0)) == 16
    assert flat.checkpoint(0) == 0


# ---------------------------------------------------------------- salts (issue 33)


def _policy(slots: int, host: HostCache, *, fast: bool = False) -> CachePolicy:
    return CachePolicy(
        slots, rule=PieceRule(None, max_piece=4), host=host, enabled=True, fast=fast, idle_recompute=False
    )


def test_cells_of_another_salt_share_nothing_with_a_prompt() -> None:
    # id 0 keeps key A's 8-token prompt; key B sends the same prompt: it reuses nothing
    # (and takes the least recently used id), while key A's next request reuses 8
    for fast in (False, True):
        policy = _policy(2, HostCache(budget=10_000, rule="r"), fast=fast)
        prompt = list(range(8))
        policy.take(0, "key:a")
        policy.release(0, prompt, [], 8, finished=False)
        policy.take(1, "key:b")
        policy.release(1, [99] * 8, [], 8, finished=False)  # (id 1: the most recently used)
        again = [*prompt, 42]
        plan = policy.place(again, [4, 8], True, [0, 1], "key:b")
        assert (plan.seq_id, plan.reused, plan.restore) == (0, 0, None)
        assert plan.save == prompt
        assert plan.save_salt == "key:a"
        plan = policy.place(again, [4, 8], True, [0, 1], "key:a")
        assert (plan.seq_id, plan.reused) == (0, 8)
        assert policy.place(again, [4, 8], True, [0, 1], "").reused == 0  # no salt is a salt too
        policy.take(0, "key:b")  # id 0's cells now belong to key B's sequence
        assert policy.salt(0) == "key:b"


def test_host_memory_entries_serve_only_their_own_salt() -> None:
    host = HostCache(budget=10_000, rule="r")
    tokens = list(range(8))
    assert host.put(tokens, [4, 8], b"a", salt="key:a")
    assert host.covers(tokens, [4, 8], salt="key:a")
    assert not host.covers(tokens, [4, 8], salt="key:b")
    assert not host.covers(tokens, [4, 8])
    prompt = [*tokens, 42]
    assert host.best(prompt, [4, 8], 8, salt="key:b") is None
    assert host.best(prompt, [4, 8], 8, salt="key:a") == (8, b"a")
    # the same tokens under another salt: an entry of their own, neither replacing the other
    assert host.put(tokens, [4, 8], b"b", salt="key:b")
    assert len(host) == 2
    assert host.best(prompt, [4, 8], 8, salt="key:b") == (8, b"b")
    # a longer entry replaces the shorter one of its own salt only
    assert host.put([*tokens, 8, 9, 10, 11], [4, 8, 12], b"c", salt="key:a")
    assert len(host) == 2
    assert host.best(prompt, [4, 8], 8, salt="key:b") == (8, b"b")
    # the policy asks the host tier with the prompt's salt
    policy = _policy(1, host)
    assert policy.place(prompt, [4, 8], True, [0], "key:c").restore is None
    assert policy.place(prompt, [4, 8], True, [0], "key:b").restore == b"b"


# ---------------------------------------------------------------- one host budget (issue 33)


def test_the_models_host_tiers_share_one_budget_and_unloaded_models_go_first() -> None:
    pool = HostBudget(100)
    first = HostCache(100, rule="r", pool=pool)
    second = HostCache(100, rule="r", pool=pool)
    second.put([1, 2, 3, 4], [4], b"s" * 30)  # the oldest entry
    first.put([5, 6, 7, 8], [4], b"f" * 30)
    assert (pool.bytes, pool.tiers) == (60, 2)
    first.active = False  # its model unloaded
    second.put([9, 9, 9, 9], [4], b"t" * 30)
    assert pool.bytes == 90
    second.put([7, 7, 7, 7], [4], b"u" * 30)  # over: the unloaded model's entry goes first
    assert (len(first), first.bytes, first.evictions) == (0, 0, 1)
    assert (len(second), second.bytes, pool.bytes) == (3, 90, 90)
    # among loaded models: the least recently used, whichever model holds it
    first.active = True
    assert second.best([1, 2, 3, 4, 0], [4], 4) is not None  # [1, 2, 3, 4] is used again
    first.put([5, 6, 7, 8], [4], b"f" * 30)
    assert second.best([9, 9, 9, 9, 0], [4], 4) is None  # the oldest now: it went
    assert second.best([1, 2, 3, 4, 0], [4], 4) is not None
    assert pool.bytes == 90 == first.bytes + second.bytes
    # a model's own cap (its cache_ram) bounds its share within the budget
    capped = HostCache(30, rule="r", pool=pool)
    capped.put([3, 3, 3, 3], [4], b"c" * 30)
    capped.put([4, 4, 4, 4], [4], b"d" * 30)
    assert (len(capped), capped.evictions, capped.budget) == (1, 1, 30)
    assert pool.bytes <= pool.budget
    assert not capped.put([2, 2, 2, 2], [4], b"e" * 31)  # larger than its cap: not kept
    # a tier dropped (its file changed) gives its bytes back and leaves the budget
    held = pool.bytes
    capped.close()
    assert (pool.bytes, pool.tiers) == (held - 30, 2)


def test_a_tier_with_a_budget_of_its_own_is_as_before() -> None:
    cache = HostCache(budget=50, rule="r")
    assert cache.pool.budget == 50
    cache.budget = 20  # (a model loaded again with another --cache-ram)
    assert (cache.cap, cache.pool.budget, cache.budget) == (20, 20, 20)
    assert cache.put([1, 2, 3, 4], [4], b"x" * 20)
    assert not cache.put([5, 6, 7, 8], [4], b"y" * 21)


def test_a_servers_models_put_their_host_tiers_under_one_budget(tmp_path: Path) -> None:
    # what `trioserve serve --models-dir` builds: one HostBudget for every LlamaSource
    pool = HostBudget(100)
    sources = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"weights")
        sources.append(LlamaSource(LlamaSettings(path, cache_ram_bytes=100), host_pool=pool))
    first, second = (source.host_cache() for source in sources)
    assert first is not None
    assert second is not None
    assert first.pool is second.pool is pool
    first.put([1, 2, 3, 4], [4], b"a" * 60)
    second.put([5, 6, 7, 8], [4], b"b" * 60)  # 120 > 100: the least recently used goes
    assert (len(first), len(second), pool.bytes) == (0, 1, 60)
    assert sources[1].host_cache() is second  # kept across loads while the file is unchanged
    (tmp_path / "b.gguf").write_bytes(b"other weights")  # the file changed: its tier goes
    assert sources[1].host_cache() is not second
    assert (pool.bytes, pool.tiers) == (0, 2)
    # a source of its own (library use): a budget of its own
    alone = LlamaSource(LlamaSettings(tmp_path / "a.gguf", cache_ram_bytes=50))
    assert alone.host_pool is not pool
    assert alone.host_pool.budget == 50


def test_a_prompt_kept_whole_with_its_row_is_a_full_hit_only_for_itself() -> None:
    # an 8-token prompt ending on a cut, its row kept: the same prompt (same salt) is a
    # full hit on its id; a longer or shorter prompt, another salt, a choice of n > 1,
    # the cache off for the request: not
    policy = _policy(2, HostCache(budget=0, rule="r"))
    prompt = list(range(8))
    assert policy.keeps_row(True, 8, [4, 8])
    assert not policy.keeps_row(True, 9, [4, 8])  # (its last piece is not kept)
    assert not policy.keeps_row(False, 8, [4, 8])
    policy.take(1, "key:a")
    policy.release(1, prompt, [5, 6], 8, finished=True, logits=True)
    policy.take(0, "key:a")
    policy.release(0, [7] * 8, [], 8, finished=True)  # (id 0: the most recently used)
    assert policy.logits_at(1) == 8
    plan = policy.place(prompt, [4, 8], True, [0, 1], "key:a")
    assert (plan.seq_id, plan.reused, plan.whole, plan.save) == (1, 8, True, None)
    assert not policy.place(prompt, [4, 8], True, [0, 1], "key:b").whole
    assert not policy.place(prompt, [4, 8], True, [0, 1], "key:a", whole=False).whole
    assert not policy.place(prompt, [4, 8], False, [0, 1], "key:a").whole
    assert not policy.place(prompt[:7], [4], True, [0, 1], "key:a").whole
    longer = policy.place([*prompt, 1, 2, 3, 4], [4, 8, 12], True, [0, 1], "key:a")
    assert (longer.seq_id, longer.reused, longer.whole) == (1, 8, False)
    policy.take(1, "key:a")  # a new sequence on the id: its row is no longer the prompt's
    assert policy.logits_at(1) == 0
    # kept without its row, or fewer cells than the prompt: no full hit
    policy.release(1, prompt, [], 8, finished=True)
    assert not policy.place(prompt, [4, 8], True, [0, 1], "key:a").whole
    policy.take(1, "key:a")
    policy.release(1, prompt, [], 4, finished=True, logits=True)
    assert policy.logits_at(1) == 0


def test_fast_mode_keeps_no_row() -> None:
    policy = _policy(1, HostCache(budget=0, rule="r"), fast=True)
    assert not policy.keeps_row(True, 8, [4, 8])
    policy.take(0)
    policy.release(0, list(range(8)), [], 8, finished=True, logits=True)
    assert policy.logits_at(0) == 0


def test_a_short_tail_is_overwritten_unsaved_and_a_longer_one_saved_first() -> None:
    # (short_tail: kept // 256 tokens, at most 32) an id holding a 2,048-token prompt and
    # its reply: the same prompt again overwrites an 8-token reply without a save, a
    # 9-token one after saving the id's longer state; a short prefix's tail is always saved
    assert [short_tail(n) for n in (0, 255, 256, 2048, 8192, 16_384, 100_000)] == [0, 0, 1, 8, 32, 32, 32]
    prompt = list(range(2048))
    for reply, saved in ((8, False), (9, True)):
        policy = _policy(1, HostCache(budget=1 << 30, rule="r"))
        policy.take(0)
        policy.release(0, prompt, list(range(5000, 5000 + reply)), 2048 + reply, finished=True)
        plan = policy.place([*prompt, 7], list(range(4, 2049, 4)), True, [0])
        assert plan.reused == 2048
        assert (plan.save is not None) == saved
    policy = _policy(1, HostCache(budget=1 << 30, rule="r"))
    policy.take(0)
    policy.release(0, prompt[:100], [5000], 101, finished=True)
    assert policy.place([*prompt[:100], 7], list(range(4, 101, 4)), True, [0]).save == [*prompt[:100], 5000]


# ------------------------------------------------- window checkpoints (issue 49)


def test_window_marks_are_taken_at_turns_the_prompt_end_and_every_step_and_thinned_evenly() -> None:
    marks = WindowMarks(1, keep=4, step=100)
    assert not marks.wants(0, 40, 500, turn=False)  # (neither a turn, the end, nor a step past 0)
    assert marks.wants(0, 40, 500, turn=True)
    assert marks.wants(0, 100, 500, turn=False)
    assert marks.wants(0, 500, 500, turn=False)
    for end in (40, 140, 160, 260, 500):
        marks.add(0, WindowMark(end, end - 8, b"", 10))
    # five over a keep of four: the one whose loss leaves the shortest gap went (140:
    # 40 → 160), never the first nor the newest
    assert [m.end for m in marks.of(0)] == [40, 160, 260, 500]
    assert not marks.wants(0, 400, 600, turn=True)  # (not past the newest)
    assert (marks.count, marks.bytes) == (4, 40)
    # the longest mark at most the shared length whose window cells reach below its end
    assert marks.serving(0, 300, window=4) is marks.of(0)[2]
    assert marks.serving(0, 300, window=16) is None  # (cells from 8 below: a window of 16 needs 15)
    marks.cut(0, 200)
    assert [m.end for m in marks.of(0)] == [40, 160]
    assert not WindowMarks(1, keep=0, step=100).wants(0, 500, 500, turn=True)


def test_a_prefix_whose_window_cells_are_gone_is_placed_on_a_window_checkpoint() -> None:
    # a window of 4, pieces of 4: id 0 keeps 40 tokens whose window cells start at 30; a
    # prompt sharing 20 of them is served by the mark at 16 (its window cells from 13),
    # not by the cells; the id keeps its marks up to what it reuses when taken
    host = HostCache(budget=10_000, rule="r", window=4)
    policy = CachePolicy(
        1,
        rule=PieceRule(None, max_piece=4),
        host=host,
        enabled=True,
        fast=False,
        idle_recompute=False,
        marks=WindowMarks(1, keep=8, step=8),
    )
    tokens = list(range(40))
    policy.take(0)
    policy.release(0, tokens, [], 40, finished=False, floor=30)
    for end in (8, 16, 24):
        policy.marks.add(0, WindowMark(end, end - 3, b"s", 1))
    prompt = [*tokens[:20], 99, 98, 97, 96, 95]
    plan = policy.place(prompt, [4, 8, 12, 16, 20, 24], True, [0])
    assert (plan.reused, plan.window) == (16, policy.marks.of(0)[1])
    policy.take(0, marks=plan.reused)
    assert [m.end for m in policy.marks.of(0)] == [8, 16]
    # the cells alone give back a prefix whose window cells are there: no mark
    policy.release(0, tokens, [], 40, finished=False, floor=30)
    plan = policy.place([*tokens, 5], [*range(4, 41, 4)], True, [0])
    assert (plan.reused, plan.window) == (40, None)
    policy.forget(0)
    assert policy.marks.of(0) == []


def test_a_host_tier_made_before_the_load_chose_the_window_layout_is_the_one_used(tmp_path: Path) -> None:
    """``swa_full`` left to the default is chosen once the model file is read, after the
    registry made the model's host tier (tagged with every cell kept): the load re-tags
    that tier, still empty, and uses it — inside the server's one budget, and kept
    across the model's unload — instead of making one outside it."""
    pool = HostBudget(100)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"weights")
    settings = LlamaSettings(path, cache_ram_bytes=100, n_ctx=32768)
    assert settings.swa_full_asked is None
    given = LlamaSource(settings, host_pool=pool).host_cache()
    assert given is not None
    assert given.kv_types == "f16/f16"
    settings.resolve_window(512)  # (what LlamaModel does at load: past four rings, the ring)
    assert settings.kv_types == "f16/f16/window"
    host = host_tier(given, rule=given.rule, budget=100, enabled=True, window=512, kv_types=settings.kv_types)
    assert host is given
    assert host.pool is pool
    assert host.kv_types == "f16/f16/window"
    # a tier that holds cells of other types is never re-tagged: a new one
    given.put([1, 2, 3, 4], [4], b"a" * 10)
    other = host_tier(given, rule=given.rule, budget=100, enabled=True, window=512, kv_types="q8_0/q8_0")
    assert other is not given
