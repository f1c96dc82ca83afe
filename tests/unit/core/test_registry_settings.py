"""The registry's settings: what it refuses and its defaults (no model)."""

from __future__ import annotations

import math

import pytest

from ._registry_helpers import make_registry


def test_the_registry_refuses_max_concurrent_loads_below_one() -> None:
    with pytest.raises(ValueError, match="max_concurrent_loads"):
        make_registry("a", max_concurrent_loads=0)


def test_keep_alive_defaults_to_forever() -> None:
    registry, _, _ = make_registry("a")
    assert registry.keep_alive == math.inf
