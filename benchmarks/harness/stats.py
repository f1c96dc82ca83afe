"""Statistics and tables."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any


def clean(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers (no ``None``, no NaN)."""
    return [v for v in values if v is not None and v == v]


def median(values: Iterable[float | None]) -> float:
    return statistics.median(kept) if (kept := clean(values)) else math.nan


def spread(values: Iterable[float | None], spec: str = ".1f") -> str:
    """``median (min–max)``; one value alone; ``—`` for none."""
    if not (kept := clean(values)):
        return "—"
    low, mid, high = min(kept), statistics.median(kept), max(kept)
    return f"{mid:{spec}}" if low == high else f"{mid:{spec}} ({low:{spec}}–{high:{spec}})"


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def dist(values: list[float]) -> dict[str, float] | None:
    """n, p50, p99 (nearest rank) and max; ``None`` for no values."""
    if not values:
        return None
    p50, p99 = (nearest_rank(values, q) for q in (0.5, 0.99))
    return {"n": len(values), "p50": p50, "p99": p99, "max": max(values)}


def fmt(value: float | None, spec: str = ".1f", none: str = "—") -> str:
    if value is None or value != value:
        return none
    return "timeout" if math.isinf(value) else f"{value:{spec}}"


def ratio(value: float | None) -> str:
    return fmt(value, ".2f") + ("×" if value is not None and value == value else "")


def finite(value: Any) -> Any:
    """For JSON: infinities (timeouts) become null."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def first_difference(a: str, b: str) -> str:
    """Where two texts part: ``from character i: 'a…' vs 'b…'``."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"from character {at}: {a[at : at + 40]!r} vs {b[at : at + 40]!r}"


def table(rows: list[list[str]]) -> str:
    """A markdown table; ``rows[0]`` is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def rows_table(items: Iterable[Any], columns: list[tuple[str, Callable[[Any], str]]]) -> str:
    """A markdown table with one row per item, one ``(header, cell)`` per column."""
    return table([[head for head, _ in columns], *[[cell(item) for _, cell in columns] for item in items]])


def dict_table(records: Iterable[dict[str, Any]], keys: str) -> str:
    """A markdown table of ``records``, one column per space-separated key (floats by :func:`fmt`)."""
    cell = lambda v: fmt(v) if isinstance(v, float) else "—" if v is None else str(v)  # noqa: E731
    return rows_table(records, [(k, lambda r, k=k: cell(r.get(k))) for k in keys.split()])
