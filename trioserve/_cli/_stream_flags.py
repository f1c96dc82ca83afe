"""``trioserve serve``'s flags for streams: resumable streams (``--detach-*``; the design
and every bound: docs/resumable-streams.md) and the coalescing of a stream's events
(``--stream-interval-ms``: docs/api.md, "Streaming format")."""

from __future__ import annotations

import argparse

from ._flag_types import non_negative_int, positive_float, positive_int

__all__ = ["add_detach_flags", "add_stream_interval_flag"]


def add_detach_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "resumable streams (X-Conversation-Id; GET /v1/stream; docs/resumable-streams.md)"
    )
    group.add_argument(
        "--detach-max",
        type=non_negative_int,
        default=64,
        metavar="N",
        help="detachable streams kept at once, server-wide, running and finished (default: 64; "
        "0: X-Conversation-Id is refused)",
    )
    group.add_argument(
        "--detach-per-key",
        type=positive_int,
        default=8,
        metavar="N",
        help="detachable streams one API key may keep (its oldest finished one dropped first; default: 8)",
    )
    group.add_argument(
        "--detach-log-events",
        type=positive_int,
        default=1280,
        metavar="N",
        help="events a stream's log keeps for readers that come back (default: 1280, about 28 s "
        "of one stream of the default model); full with nobody reading, the stream pauses",
    )
    group.add_argument(
        "--detach-log-kib",
        type=positive_int,
        default=1024,
        metavar="KIB",
        help="bytes a stream's log keeps, in KiB (default: 1024)",
    )
    group.add_argument(
        "--detach-park-after",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds a paused stream nobody reads keeps its slot before it is parked (its state "
        "saved within --pause-ram, its slot freed; default: 2)",
    )
    group.add_argument(
        "--detach-timeout",
        type=positive_float,
        default=300.0,
        metavar="S",
        help="seconds without a reader before a stream ends (cause detach_timeout), and that a "
        "finished stream's log is kept (default: 300, llama-server's)",
    )


def _milliseconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 10_000:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be between 0 and 10000 ms, got {text}")
    return value


def add_stream_interval_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--stream-interval-ms",
        type=_milliseconds,
        default=0.0,
        metavar="MS",
        help="hold a stream's text deltas that arrive within MS of its last event and send them "
        "as one event when MS has passed (vLLM's stream_interval); the first delta and the end "
        "are never delayed (default: 0, every delta its own event)",
    )
