"""The argparse types (and the kind of flag) that more than one group of ``trioserve
serve``'s flags uses."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["add_repeatable", "non_negative_int", "positive_float", "positive_int"]


def add_repeatable(
    group: argparse._ArgumentGroup,
    flag: str,
    *,
    metavar: str,
    help: str,
    type: Callable[[str], Any] = str,
) -> None:
    """A flag that may be given again and again: each value (read by ``type``) is
    appended to its list, empty when the flag is never given."""
    group.add_argument(flag, action="append", default=[], type=type, metavar=metavar, help=help)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value
