"""The registry's settings (what it refuses, its defaults) and its face: the package's
curated ``__init__`` (no model)."""

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


def test_the_registry_package_exports_a_sorted_face_that_trioserve_re_exports() -> None:
    import trioserve
    from trioserve._core import _registry

    assert _registry.__all__ == sorted(_registry.__all__)
    # (ModelState, a type alias, is the registry's own)
    for name in set(_registry.__all__) - {"ModelState"}:
        assert getattr(trioserve, name) is getattr(_registry, name), name
