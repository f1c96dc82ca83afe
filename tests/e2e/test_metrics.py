"""``/metrics``: Prometheus text that prometheus-client's own parser reads, with the
histograms, counters and gauges that move as requests run."""

from __future__ import annotations

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from trioserve import ScriptedBackend

from .._helpers import RawStream, start_server, wait_for

HISTOGRAMS = [
    "trioserve_time_to_first_token_seconds",
    "trioserve_inter_token_latency_seconds",
    "trioserve_request_duration_seconds",
    "trioserve_queue_wait_seconds",
    "trioserve_prefill_seconds",
    "trioserve_cancel_latency_seconds",
]


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_move_as_requests_run(nursery: trio.Nursery) -> None:
    backend = ScriptedBackend(token_interval=0.002, prefill_seconds_per_token=0.0005, slots=1)
    server = await start_server(nursery, backend, close_backend=True, max_queue=0)
    async with server.client() as client:
        before = await scrape(client)
        for name in HISTOGRAMS:
            assert any(key[0] == name + "_count" for key in before), name
        # a normal completion, a streamed one
        ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8})
        assert ok.status_code == 200
        async with client.stream(
            "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "stream": True}
        ) as response:
            await response.aread()
        # a disconnect mid-stream, with a 429 while it holds the only slot
        raw = await RawStream.post(
            server.url, "/v1/completions", {"prompt": "x", "max_tokens": 3000, "stream": True}
        )
        await raw.read_until(b"data: ", 3)
        live = await scrape(client)
        assert value(live, "trioserve_active_streams") == 1
        assert value(live, "trioserve_slots_in_use") == 1
        assert value(live, "trioserve_slots") == 1
        refused = await client.post("/v1/completions", json={"prompt": "hello"})
        assert refused.status_code == 429
        await raw.aclose()
        await wait_for(lambda: not server.engine.streams)
        await server.wait_idle()
        after = await scrape(client)
    assert value(after, "trioserve_requests_total", endpoint="/v1/completions", status="200") == 3
    assert value(after, "trioserve_requests_total", endpoint="/v1/completions", status="429") == 1
    assert value(after, "trioserve_stream_ends_total", cause="length") == 2
    assert value(after, "trioserve_stream_ends_total", cause="disconnect") == 1
    assert value(after, "trioserve_stream_ends_total", cause="overloaded") == 1
    assert value(after, "trioserve_prompt_tokens_total") == 5 + 5 + 1
    assert value(after, "trioserve_completion_tokens_total") >= 16 + 3
    assert value(after, "trioserve_time_to_first_token_seconds_count") == 3
    assert value(after, "trioserve_inter_token_latency_seconds_count") >= 7 + 2
    assert value(after, "trioserve_request_duration_seconds_count") == 4
    assert value(after, "trioserve_queue_wait_seconds_count") == 3
    assert value(after, "trioserve_prefill_seconds_count") == 3
    assert value(after, "trioserve_cancel_latency_seconds_count", cause="disconnect") == 1
    assert value(after, "trioserve_cancel_latency_seconds_sum", cause="disconnect") < 0.25
    assert value(after, "trioserve_wasted_tokens_total") <= 1
    assert value(after, "trioserve_active_streams") == 0
    assert value(after, "trioserve_queued_requests") == 0
    assert value(after, "trioserve_slots_in_use") == 0
    server.server.shutdown()


@pytest.mark.parametrize("path", ["/metrics"])
async def test_metrics_are_served_while_loading(path: str, nursery: trio.Nursery) -> None:
    release = trio.Event()

    async def slow() -> ScriptedBackend:
        await release.wait()
        return ScriptedBackend()

    from trioserve import Server, ServerSettings

    server = Server(slow, ServerSettings(port=0))  # type: ignore[arg-type]
    binds = await nursery.start(server.run)
    async with httpx.AsyncClient(base_url=binds[0]) as client:
        response = await client.get(path)
        assert response.status_code == 200
        list(text_string_to_metric_families(response.text))
    release.set()
    server.shutdown()
