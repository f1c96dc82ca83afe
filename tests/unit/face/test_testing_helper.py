"""trioserve.testing: the fixture helper for users' own pytest-trio suites."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from trioserve.testing import TestServer, open_test_server


@pytest.fixture
async def llm() -> AsyncIterator[TestServer]:
    async with open_test_server(script=[b"Hello", b" world"]) as server:
        yield server


async def test_the_helper_serves_the_script(llm: TestServer) -> None:
    async with httpx.AsyncClient(base_url=llm.url) as client:
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10})
    assert response.json()["choices"][0]["text"] == "Hello world"
    assert llm.engine.admission.in_use == 0
