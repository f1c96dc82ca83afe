"""A fuzzing pass over the HTTP API: hypothesis generates request bodies — valid,
almost valid and garbage — and the server (a real process, scripted backend) must
answer every one with a 2xx or a 4xx carrying an OpenAI-style error: never a 5xx,
never a crash, never a hang."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .._helpers import ServerProcess

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
anything = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]), "content": anything}
    ),
    max_size=3,
)
FIELDS = {
    "model": anything,
    "prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 300_000), max_size=5), anything),
    "messages": st.one_of(messages, anything),
    "max_tokens": st.one_of(st.integers(-5, 6000), anything),
    "temperature": st.one_of(st.floats(-3, 5, allow_nan=False), anything),
    "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), anything),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), anything),
    "seed": anything,
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=7), st.floats(-200, 200), max_size=3), anything),
    "stream": st.one_of(st.booleans(), anything),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": anything}), anything),
    "n": st.one_of(st.integers(-2, 4), anything),
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with ServerProcess("--scripted", "--scripted-interval", "0", "--ctx-size", "512") as server:
        yield server.wait_ready()
        assert server.stop() == 0


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans())
def test_generated_json_bodies_never_get_a_5xx(url: str, body: dict[str, object], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=url, timeout=30) as client:
        _check(
            client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200), chat=st.booleans())
def test_arbitrary_bytes_never_get_a_5xx(url: str, raw: bytes, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=url, timeout=30) as client:
        _check(client.post(path, content=raw, headers={"content-type": "application/json"}))
