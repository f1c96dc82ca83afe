"""A key's bounds on its resumable streams (issue 48; docs/resumable-streams.md, "Bounds,
flags and their answers"): its keys-file fields over the flags', a file that would
widen the flags refused naming the field and the flag, and the registry's answers —
403 for a key that may keep none, 429 naming the bound that was reached (no server)."""

from __future__ import annotations

import pytest
import trio

from trioserve._core._exceptions import OverloadedError, PermissionDeniedError
from trioserve._http._accounts import Account, parse_keys_file
from trioserve._http._detach import DetachedStreams, DetachSettings, keys_refusal

FLAGS = DetachSettings(log_bytes=1 << 20, timeout=300.0, per_key=8, max_streams=3)


def test_a_keys_fields_replace_the_flags_and_never_widen_the_time_or_the_window() -> None:
    assert FLAGS.of(None) == (8, 300.0, 1 << 20)
    assert FLAGS.of(Account()) == (8, 300.0, 1 << 20)
    narrow = Account(detach_streams=20, detach_timeout=5.0, detach_log_kib=16)
    assert FLAGS.of(narrow) == (20, 5.0, 16 * 1024)  # (more streams: --detach-max bounds them)
    assert FLAGS.of(Account(detach_streams=0)) == (0, 300.0, 1 << 20)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[[key]]\nname = 'phone'\nkey = 'a'\ndetach_timeout = 600\n",
            "[[key]] #1 (phone): detach_timeout 600 is over the server's --detach-timeout 300",
        ),
        ("[defaults]\ndetach_timeout = 300.5\n", "[defaults]: detach_timeout 300.5 is over"),
        (
            "[[key]]\nkey = 'a'\ndetach_log_kib = 2048\n",
            "[[key]] #1 (key1): detach_log_kib 2048 is over the server's --detach-log-kib 1024",
        ),
    ],
)
def test_a_keys_file_that_would_widen_the_flags_is_refused_naming_both(text: str, message: str) -> None:
    refusal = keys_refusal(parse_keys_file(text, {}), FLAGS)
    assert refusal is not None
    assert refusal.startswith(message), refusal
    assert keys_refusal(parse_keys_file(text, {}), None) is None  # (--detach-max 0: nothing detaches)


def test_a_keys_file_within_the_flags_is_taken() -> None:
    text = "[defaults]\ndetach_timeout = 300\n[[key]]\nkey = 'a'\ndetach_timeout = 1\ndetach_log_kib = 1024\n"
    assert keys_refusal(parse_keys_file(text, {}), FLAGS) is None


async def test_the_registry_answers_a_keys_bounds_by_name(nursery: trio.Nursery) -> None:
    streams = DetachedStreams(FLAGS, nursery)
    with pytest.raises(PermissionDeniedError) as none:
        streams.open("k", "c1", Account(detach_streams=0))
    assert none.value.param == "X-Conversation-Id"
    assert "detach_streams = 0" in none.value.message
    with pytest.raises(PermissionDeniedError) as background:
        streams.open("k", "resp_1", Account(detach_streams=0), param="stream")
    assert background.value.param == "stream"
    one = Account(detach_streams=1, detach_timeout=2.0, detach_log_kib=4)
    stream = streams.open("k", "c1", one)
    assert (stream.timeout, stream.log.max_bytes) == (2.0, 4096)  # (the stream keeps them)
    with pytest.raises(OverloadedError) as full:
        streams.open("k", "c2", one)
    assert full.value.code == "too_many_detached_streams"
    assert "(1: detach_streams in the keys file, all running)" in full.value.message
    # without a field: the flag, named
    streams.open("j", "c1")
    streams.open("i", "c1")
    with pytest.raises(OverloadedError) as server:
        streams.open("h", "c1")
    assert server.value.code == "detach_capacity"
    assert "(3: --detach-max, all running)" in server.value.message


async def test_a_lowered_bound_drops_enough_finished_logs_and_never_a_running_stream(
    nursery: trio.Nursery,
) -> None:
    """A reload lowered the key's ``detach_streams`` under what it keeps: its next
    stream drops as many of its finished logs as it takes (oldest first), and is
    refused while the rest are running."""
    streams = DetachedStreams(FLAGS, nursery)
    kept = [streams.open("k", f"c{i}", Account(detach_streams=3)) for i in range(3)]
    for i, stream in enumerate(kept[:2]):
        stream.state = "finished"
        stream.log.completed_at = float(i)
    streams.open("k", "c3", Account(detach_streams=2))
    assert [s.conversation_id for s in streams.streams.values()] == ["c2", "c3"]
    assert all(s.dropped for s in kept[:2])
    with pytest.raises(OverloadedError):
        streams.open("k", "c4", Account(detach_streams=1))
    assert not kept[2].dropped
