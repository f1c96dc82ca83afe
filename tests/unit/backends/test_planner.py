"""The step planner (``_llama._planner``): data in, a plan out — no model, no threads."""

from __future__ import annotations

import dataclasses

import pytest

from trioserve._backends._llama import Candidate, Limits, StepPlan, next_cut, plan_step

WIDE = Limits(max_call_width=8, shared_context_limit=None, speculate=False)


def _decoder(key: int, seq_id: int | None = None, *, pos: int = 10, room: int = 4) -> Candidate:
    return Candidate(
        key=key, seq_id=key if seq_id is None else seq_id, pos=pos, decoding=True, waiting=False, room=room
    )


def _prefiller(
    key: int,
    *,
    prefilled: int = 0,
    length: int = 300,
    cuts: list[int] | None = None,
    waiting: bool = False,
    priority: int = 0,
) -> Candidate:
    return Candidate(
        key=key,
        seq_id=key,
        pos=prefilled,
        decoding=False,
        waiting=waiting,
        room=4,
        prefilled=prefilled,
        prompt_length=length,
        cuts=cuts if cuts is not None else [128, 256],
        priority=priority,
    )


def test_nothing_running_plans_no_call() -> None:
    assert plan_step([], WIDE) == StepPlan([], None)


def test_decoders_share_one_call_in_seq_id_order() -> None:
    # llama.cpp splits out-of-order ids into a second graph run: the call lists them sorted
    plan = plan_step([_decoder(0, 3), _decoder(1, 1), _decoder(2, 2)], WIDE)
    assert plan.calls == [[(1, 0), (2, 0), (0, 0)]]


def test_a_paused_stream_is_left_out() -> None:
    plan = plan_step([_decoder(0), _decoder(1, room=0)], WIDE)
    assert plan.calls == [[(0, 0)]]


def test_one_prompt_piece_per_step_in_a_call_of_its_own_after_the_decoders() -> None:
    plan = plan_step([_prefiller(0), _prefiller(1), _decoder(2)], WIDE)
    assert plan.calls == [[(2, 0)], [(0, 128)]]


def test_a_prompts_last_piece_goes_before_the_decoders() -> None:
    # its first token is drawn from that call: it does not wait for the decode calls
    plan = plan_step([_prefiller(0, prefilled=256), _decoder(1)], WIDE)
    assert plan.calls == [[(0, 44)], [(1, 0)]]


def test_a_better_prioritys_prompt_goes_first_and_worse_streams_wait() -> None:
    worse = Candidate(key=1, seq_id=1, pos=10, decoding=True, waiting=False, room=4, priority=5)
    same = Candidate(key=2, seq_id=2, pos=10, decoding=True, waiting=False, room=4, priority=0)
    plan = plan_step([_prefiller(3, priority=5), _prefiller(0), worse, same], WIDE)
    # the priority-0 prompt first (a whole piece), the priority-5 stream left out this step
    assert plan.calls == [[(0, 128)], [(2, 0)]]


def test_a_prompt_piece_ends_on_the_next_cut_or_the_prompt_end() -> None:
    assert plan_step([_prefiller(0, prefilled=128)], WIDE).calls == [[(0, 128)]]
    assert plan_step([_prefiller(0, prefilled=256)], WIDE).calls == [[(0, 44)]]


def test_a_follower_waits_for_its_leader() -> None:
    assert plan_step([_prefiller(0, waiting=True)], WIDE).calls == []


def test_decode_calls_are_split_to_the_measured_width() -> None:
    limits = Limits(max_call_width=7, shared_context_limit=None, speculate=False)
    plan = plan_step([_decoder(i) for i in range(8)], limits)
    assert [len(call) for call in plan.calls] == [4, 4]


def test_past_the_shared_context_limit_a_sequence_decodes_alone() -> None:
    limits = Limits(max_call_width=8, shared_context_limit=100, speculate=False)
    plan = plan_step([_decoder(0, pos=99), _decoder(1, pos=100), _decoder(2, pos=5)], limits)
    # (pos 99 decodes the 100th cell: still shared; pos 100 the 101st: alone)
    assert plan.calls == [[(0, 0), (2, 0)], [(1, 0)]]


@pytest.mark.parametrize(
    ("candidates", "draft"),
    [
        ([_decoder(0)], 0),  # a lone stream drafts
        ([_decoder(0), _decoder(1)], None),  # two decode together: no drafts
        ([_decoder(0), _prefiller(1)], 0),  # a prompt being evaluated does not count
        ([_decoder(0), _decoder(1, room=0)], 0),  # nor does a paused stream
    ],
)
def test_only_a_stream_that_decodes_alone_drafts(candidates: list[Candidate], draft: int | None) -> None:
    limits = Limits(max_call_width=8, shared_context_limit=None, speculate=True)
    assert plan_step(candidates, limits).draft == draft
    assert plan_step(candidates, WIDE).draft is None  # speculation off


def test_a_stream_alone_past_the_limit_may_still_draft() -> None:
    limits = Limits(max_call_width=8, shared_context_limit=10, speculate=True)
    assert plan_step([_decoder(0, pos=50)], limits) == StepPlan([[(0, 0)]], 0)


@pytest.mark.parametrize(
    ("cuts", "after", "default", "expected"),
    [
        ([128, 256], 0, 300, 128),
        ([128, 256], 128, 300, 256),
        ([128, 256], 256, 300, 300),  # past the last cut: the prompt's end
        ([128, 256], 0, 100, 100),  # a cut past the prompt's end is not taken
        ([128, 256], 128, 0, 256),  # no default: the next cut
        ([128, 256], 256, 0, 0),  # none left
    ],
)
def test_next_cut(cuts: list[int], after: int, default: int, expected: int) -> None:
    assert next_cut(cuts, after, default) == expected


def test_each_adapter_set_decodes_in_calls_of_its_own_every_step() -> None:
    # (docs/lora.md) llama.cpp applies one adapter set to a whole call: the base model's
    # sequences first, then each set's, each in seq-id order and split by the width;
    # no set waits for another to finish
    def adapted(key: int, adapters: int) -> Candidate:
        return dataclasses.replace(_decoder(key), adapters=adapters)

    plan = plan_step([adapted(0, 2), adapted(1, 0), adapted(2, 1), adapted(3, 2), adapted(4, 0)], WIDE)
    assert plan.calls == [[(1, 0), (4, 0)], [(2, 0)], [(0, 0), (3, 0)]]
    narrow = Limits(max_call_width=2, shared_context_limit=None, speculate=False)
    plan = plan_step([adapted(k, 1) for k in range(3)] + [adapted(3, 0)], narrow)
    assert plan.calls == [[(3, 0)], [(0, 0), (1, 0)], [(2, 0)]]
