"""The chat page in a real browser (Debian's Chromium, driven by Playwright) against a
real server: tokens stream in, Stop really stops the server's inference, and a fast
stream never blocks the page's main thread."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from .._helpers import ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parents[2] / "artifacts"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("Chromium is missing: install Debian's chromium (./scripts/test does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture(scope="module")
def model_server() -> Iterator[str]:
    with ServerProcess("--threads", "2") as server:
        yield server.wait_ready()
        assert server.stop() == 0


@pytest.mark.model
def test_a_prompt_streams_into_the_page(page: Page, model_server: str) -> None:
    page.goto(model_server + "/")
    page.fill("#prompt", "Once upon a time")
    page.fill("#max-tokens", "120")
    page.fill("#temperature", "0")
    page.click("#send")
    page.wait_for_function(
        "document.querySelector('#output').textContent.length > 'Once upon a time'.length + 5"
    )
    early = len(page.text_content("#output") or "")
    page.wait_for_function("document.querySelector('#ended').textContent !== '–'", timeout=30_000)
    final = len(page.text_content("#output") or "")
    assert final > early  # it arrived in pieces, not all at once
    assert page.text_content("#ended") == "length"
    assert page.text_content("#tokens") == "120"
    assert (page.text_content("#ttft") or "").endswith(" ms")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-done.png"))


@pytest.mark.model
def test_stop_ends_the_stream_and_the_server_stops_inference(page: Page, model_server: str) -> None:
    page.goto(model_server + "/")
    page.fill("#prompt", "Once upon a time")
    page.fill("#max-tokens", "3000")
    page.click("#send")
    page.wait_for_function("Number(document.querySelector('#tokens').textContent) >= 20")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-streaming.png"))
    page.click("#stop")
    stopped = time.perf_counter()
    # the server's own state: no inference thread, no stream, within a generous bound
    with httpx.Client(base_url=model_server) as client:
        while True:
            health = client.get("/health").json()
            if health["generations_running"] == 0 and health["active_streams"] == 0:
                break
            assert time.perf_counter() - stopped < 2.0, health
            time.sleep(0.01)
        metrics = client.get("/metrics").text
    assert 'trioserve_stream_ends_total{cause="disconnect"} 1.0' in metrics
    page.wait_for_selector("#server[data-state='idle']", timeout=5_000)
    assert (page.text_content("#ended") or "").startswith("stopped")
    assert page.is_enabled("#send")


def test_a_fast_stream_never_blocks_the_main_thread(page: Page) -> None:
    with ServerProcess("--scripted", "--scripted-interval", "0.0002") as server:
        url = server.wait_ready()
        page.goto(url + "/")
        page.evaluate(
            """() => {
                window.longTasks = [];
                new PerformanceObserver((list) => {
                    for (const entry of list.getEntries()) window.longTasks.push(entry.duration);
                }).observe({ type: "longtask", buffered: true });
            }"""
        )
        page.fill("#max-tokens", "4000")
        page.click("#send")
        page.wait_for_function("document.querySelector('#ended').textContent !== '–'", timeout=60_000)
        assert page.text_content("#ended") == "length"
        assert page.text_content("#tokens") == "4000"
        rate = float(page.text_content("#rate") or 0)
        long_tasks = page.evaluate("window.longTasks")
        assert server.stop() == 0
    assert rate > 500  # a fast stream indeed
    assert [d for d in long_tasks if d > 50] == []
