"""The states a registry entry can be in. Every edge between them is one row of the
table in ``docs/models.md`` ("States and transitions"), made by the part named there
(loading, draining, room), and each has a test in ``tests/unit/core/``."""

from __future__ import annotations

from typing import Literal

__all__ = ["ModelState"]

ModelState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]
