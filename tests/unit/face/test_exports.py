"""The public API is exactly ``trioserve.__all__``, sorted, and every name exists."""

from __future__ import annotations

import trioserve


def test_all_is_sorted_and_complete() -> None:
    assert list(trioserve.__all__) == sorted(trioserve.__all__)
    for name in trioserve.__all__:
        assert hasattr(trioserve, name), name


def test_no_private_module_leaks_into_the_namespace() -> None:
    # public submodules (trioserve.testing) appear once imported; nothing else may
    public = {name for name in vars(trioserve) if not name.startswith("_")} - {"testing"}
    assert public == set(trioserve.__all__)


def test_request_limits_are_public_for_http_settings() -> None:
    limits = trioserve.RequestLimits(max_tools=8, max_stop_sequences=4)
    settings = trioserve.HTTPSettings(request_limits=limits)
    assert settings.request_limits.max_tools == 8
    assert trioserve.HTTPSettings().request_limits == trioserve.RequestLimits()
