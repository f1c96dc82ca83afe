"""The argparse types that more than one group of ``trioserve serve``'s flags uses."""

from __future__ import annotations

import argparse

__all__ = ["positive_float", "positive_int"]


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
