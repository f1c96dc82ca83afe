"""The chat page in a real browser (Debian's Chromium, driven by Playwright) against a
real server: tokens stream in, a conversation reuses its cached prompt prefix turn after
turn (and the page shows it), Stop really stops the server's inference, a fast stream
never blocks the page's main thread, and the model picker lists a registry's models with
their states and sends the one picked."""

from __future__ import annotations

import contextlib
import queue
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from playwright.sync_api import Browser, Page, Request, expect, sync_playwright

from trioserve import Backend, ScriptedBackend, Server, ServerSettings
from trioserve._core._registry import BackendSource, ModelRegistry, ModelSpec

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
    page.select_option("#mode", "text")
    page.fill("#prompt", "Once upon a time")
    page.fill("#max-tokens", "120")
    page.fill("#temperature", "0")
    page.click("#send")
    page.wait_for_function(
        "document.querySelector('#conversation .reply').textContent.length > 'Once upon a time'.length + 5"
    )
    early = len(page.text_content("#conversation .reply") or "")
    page.wait_for_function("document.querySelector('#ended').textContent !== '–'", timeout=30_000)
    final = len(page.text_content("#conversation .reply") or "")
    assert final > early  # it arrived in pieces, not all at once
    assert page.text_content("#ended") == "length"
    assert page.text_content("#tokens") == "120"
    assert (page.text_content("#ttft") or "").endswith(" ms")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-done.png"))


@pytest.mark.model
def test_stop_ends_the_stream_and_the_server_stops_inference(page: Page, model_server: str) -> None:
    streams = _stream_requests(page)
    page.goto(model_server + "/")
    page.select_option("#mode", "text")
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
    # Stop is the server's DELETE /v1/stream for the reply's id (its cause: cancelled)
    assert 'trioserve_stream_ends_total{cause="cancelled"} 1.0' in metrics
    page.wait_for_selector("#server[data-state='idle']", timeout=5_000)
    assert (page.text_content("#ended") or "").startswith("stopped")
    assert page.is_enabled("#send")
    post, delete = streams
    assert delete.method == "DELETE"
    assert delete.url == f"{model_server}/v1/stream?conv_id={post.headers['x-conversation-id']}"


# ~100–130 words each: the first prompt alone passes one 128-token chunk, so every later turn
# has whole chunks of the conversation so far to reuse.
CONVERSATION = [
    "I keep a small lighthouse on a rocky island in the north. Every evening I climb the "
    "iron stairs, clean the great lens, trim the wick and check the clockwork that turns "
    "the light. The storms in winter are long and loud, and the supply boat comes only "
    "once a month when the sea is calm enough. I have a cat, a radio, a shelf of old "
    "books and a garden of cabbages behind the wall. The nearest harbour is a day's sail to "
    "the south, and the keeper before me left a logbook full of notes about the tides, the "
    "winds and the birds that nest on the cliffs. Tell me, in a few careful sentences, "
    "how I should prepare the lighthouse and the garden for the first great storm of the "
    "coming winter season.",
    "Thank you. The supply boat was late this month, and the flour is almost gone. I "
    "still have oats, dried beans, salted fish, potatoes from the cellar, a little butter "
    "and a jar of honey from the mainland. The stove burns driftwood and peat, and the "
    "chimney smokes when the wind blows from the east. My neighbour on the next island "
    "signals with a lamp at dusk, and we trade news that way. What could I cook each day "
    "for two weeks with what I have, and how should I keep the stove burning well?",
    "The storm has passed at last, and the light never failed. Some slates blew off the "
    "roof of the shed, the garden wall lost a few stones, and a gull with a hurt wing has "
    "taken shelter by the door. The cat is not pleased about the gull. The radio says "
    "another storm may come at the end of the week, stronger than the first one. I would "
    "like to mend what broke, look after the gull, and keep the peace between it and the "
    "cat. Which of these should I do first, and why, in a short and practical plan?",
]
ANOTHER_TOPIC = (
    "Our village bakery opens at six in the morning, and I am the new apprentice there. "
    "The baker makes rye loaves, white rolls, cinnamon buns and a dark fruit cake for "
    "holidays. Each night the dough rises in wooden troughs under linen cloths, and at "
    "four o'clock we light the brick oven with beech wood. The first customers are the "
    "fishermen, then the schoolchildren, then the old ladies who like to talk. What "
    "should an apprentice learn first to be useful, and what mistakes do beginners make "
    "most often when shaping loaves by hand?"
)


def _chat_requests(page: Page) -> list[dict[str, object]]:
    """The bodies of the page's chat requests, as they are sent."""
    sent: list[dict[str, object]] = []

    def record(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            sent.append(request.post_data_json)

    page.on("request", record)
    return sent


def _figures(page: Page, turn: int) -> dict[str, int]:
    """Wait for turn ``turn`` to finish; read its figures off the page."""
    element = page.locator(f"#conversation .turn[data-turn='{turn}']")
    expect(element).to_have_attribute("data-state", "done", timeout=60_000)
    figures = element.locator(".figures")
    values = {
        name: int(figures.get_attribute(f"data-{name}") or "-1")
        for name in ("prompt-tokens", "cached-tokens", "evaluated-tokens", "ttft-ms")
    }
    prompt, cached, evaluated, ttft = values.values()
    disk = int(figures.get_attribute("data-disk-tokens") or "0")
    host = int(figures.get_attribute("data-host-tokens") or "0")
    tiers = [f"{n} from {where}" for n, where in ((host, "host memory"), (disk, "disk")) if n]
    reused = f"{cached} reused" + (f" ({', '.join(tiers)})" if tiers else "")
    assert figures.text_content() == (
        f"prompt {prompt} tokens: {reused}, {evaluated} evaluated · first token {ttft} ms"
    )
    values |= {"disk-tokens": disk, "host-tokens": host}
    assert evaluated + cached == prompt
    assert evaluated >= 1
    assert ttft > 0
    return values


@pytest.mark.model
def test_a_conversation_reuses_its_cached_prefix_and_the_page_shows_it(page: Page, model_server: str) -> None:
    sent = _chat_requests(page)
    page.goto(model_server + "/")
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")
    turns: list[dict[str, int]] = []
    replies: list[str] = []
    for number, message in enumerate(CONVERSATION, start=1):
        page.fill("#prompt", message)
        page.click("#send")
        turns.append(_figures(page, number))
        replies.append(page.text_content(f"#conversation .turn[data-turn='{number}'] .reply") or "")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-conversation.png"))

    # each request carried the whole history, the replies as the page showed them
    assert len(sent) == 3
    for number, body in enumerate(sent):
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        expected: list[dict[str, str]] = []
        for earlier in range(number):
            expected += [
                {"role": "user", "content": CONVERSATION[earlier]},
                {"role": "assistant", "content": replies[earlier]},
            ]
        assert body["messages"] == [*expected, {"role": "user", "content": CONVERSATION[number]}]
    assert all(replies)

    chunk = 128  # the server's default --prefill-chunk
    cached = [turn["cached-tokens"] for turn in turns]
    assert turns[0]["prompt-tokens"] > chunk, turns  # (so turn 2 has a whole chunk to reuse)
    assert cached[0] < 16  # at most the first turn header, shared by every conversation
    assert chunk <= cached[1] < cached[2], turns
    for turn in turns[1:]:
        # whole pieces, never the whole prompt (its last piece is evaluated)
        assert turn["cached-tokens"] < turn["prompt-tokens"]

    # a new conversation sends only its own message, and reuses nothing: the old prefix is
    # still cached, but the new text leaves it within the first chunk
    page.click("#new-conversation")
    expect(page.locator("#conversation .turn")).to_have_count(0)
    page.fill("#prompt", ANOTHER_TOPIC)
    page.click("#send")
    fresh = _figures(page, 1)
    assert sent[-1]["messages"] == [{"role": "user", "content": ANOTHER_TOPIC}]
    assert fresh["cached-tokens"] < 16  # (the first turn header at most)
    expect(page.locator("#conversation .turn")).to_have_count(1)


@pytest.mark.model
def test_the_page_says_which_tier_the_reused_prompt_came_from(page: Page, tmp_path: Path) -> None:
    """A prompt sent, the server restarted on the same --cache-dir, the prompt sent
    again: its prefix comes from the disk tier, and the page says so."""
    args = ("--threads", "2", "--cache-dir", str(tmp_path))
    prompt = "Write a short poem about the sea, the wind, the gulls and the old lighthouse keeper."
    figures = []
    for _ in range(2):
        with ServerProcess(*args) as server:
            page.goto(server.wait_ready() + "/")
            page.fill("#max-tokens", "8")
            page.fill("#prompt", prompt)
            page.click("#send")
            figures.append(_figures(page, 1))
            assert server.stop() == 0
    before, after = figures
    assert before["disk-tokens"] == 0
    assert after["disk-tokens"] > 0
    assert after["disk-tokens"] <= after["cached-tokens"]


def test_a_stopped_reply_stays_in_the_conversation_as_far_as_it_got(page: Page) -> None:
    """Stop asks the server to stop (``DELETE /v1/stream`` with the reply's id, answered
    once the work has stopped), then lets go of the connection; the server is idle, the
    reply stays as far as it got and the next request sends it."""
    sent = _chat_requests(page)
    streams = _stream_requests(page)
    with ServerProcess("--scripted", "--scripted-interval", "0.01") as server:
        url = server.wait_ready()
        page.goto(url + "/")
        page.fill("#prompt", "Count.")
        page.fill("#max-tokens", "3000")
        page.click("#send")
        page.wait_for_function("Number(document.querySelector('#tokens').textContent) >= 10")
        page.click("#stop")
        turn = page.locator("#conversation .turn[data-turn='1']")
        expect(turn).to_have_attribute("data-state", "stopped")
        expect(turn.locator(".figures")).to_contain_text("stopped: kept as far as it got")
        page.wait_for_selector("#server[data-state='idle']", timeout=5_000)
        shown = turn.locator(".reply").text_content() or ""
        end_cause = turn.get_attribute("data-end-cause")
        post, delete = streams
        conversation = post.headers["x-conversation-id"]
        assert delete.method == "DELETE"
        assert delete.url == f"{url}/v1/stream?conv_id={conversation}"
        stop_answer = delete.response()
        assert stop_answer is not None
        assert stop_answer.status == 204
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text
        page.fill("#max-tokens", "5")
        page.fill("#prompt", "Go on.")
        page.click("#send")
        expect(page.locator("#conversation .turn[data-turn='2']")).to_have_attribute("data-state", "done")
        assert server.stop() == 0
    assert shown.startswith(" tok0 tok1")
    assert end_cause == "cancelled"  # the reply ended with its final event (then the abort)
    assert health["generations_running"] == 0
    assert health["active_streams"] == 0
    assert 'trioserve_stream_ends_total{cause="cancelled"} 1.0' in metrics, metrics
    assert sent[-1]["messages"] == [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": shown},
        {"role": "user", "content": "Go on."},
    ]


def _stream_requests(page: Page) -> list[Request]:
    """The page's requests to the resumable-stream routes and the generation routes, in order."""
    sent: list[Request] = []

    def record(request: Request) -> None:
        if "/v1/stream" in request.url or request.url.endswith("/completions"):
            sent.append(request)

    page.on("request", record)
    return sent


def _scripted_reply(tokens: int) -> str:
    return "".join(f" tok{i}" for i in range(tokens))


def test_a_reload_mid_reply_reattaches_and_the_reply_goes_on_where_it_was(page: Page) -> None:
    """The page sends each reply with an ``X-Conversation-Id`` and keeps its stream's id
    and the bytes it took in sessionStorage: reloaded mid-reply, it finds the stream
    (``POST /v1/streams/lookup``), reads on from that byte (``GET /v1/stream``) into the
    same turn, and its text equals an unreloaded run's."""
    sent = _stream_requests(page)
    with ServerProcess("--scripted", "--scripted-interval", "0.01") as server:
        page.goto(server.wait_ready() + "/")
        page.fill("#max-tokens", "500")
        # an unreloaded run
        page.fill("#prompt", "Count.")
        page.click("#send")
        turn = page.locator("#conversation .turn[data-turn='1']")
        expect(turn).to_have_attribute("data-state", "done", timeout=30_000)
        undisturbed = turn.locator(".reply").text_content() or ""
        page.click("#new-conversation")
        # the same, reloaded mid-reply
        page.fill("#prompt", "Count.")
        page.click("#send")
        page.wait_for_function("Number(document.querySelector('#tokens').textContent) >= 30")
        before = turn.locator(".reply").text_content() or ""
        page.reload()
        expect(page.locator("#link")).to_have_attribute("data-state", "reattached")
        expect(turn).to_have_attribute("data-state", "done", timeout=30_000)
        assert turn.locator(".user").text_content() == "Count."
        final = turn.locator(".reply").text_content() or ""
        link = page.text_content("#link") or ""
        tokens = page.text_content("#tokens")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-page-reattached.png"))
        assert server.stop() == 0
    assert undisturbed == _scripted_reply(500)
    assert final == undisturbed
    assert 0 < len(before) < len(final)
    assert final.startswith(before)  # (it went on where it was)
    assert tokens == "500"
    # the reloaded reply's requests: its POST, then after the reload lookup and GET from
    # the byte the page had taken, with the POST's id
    post, lookup, resume = sent[1:]
    conversation = post.headers["x-conversation-id"]
    assert re.fullmatch(r"page-[0-9a-f]{24}", conversation)
    assert lookup.url.endswith("/v1/streams/lookup")
    assert lookup.post_data_json == {"conversation_ids": [conversation]}
    offset = int(re.fullmatch(r"reattached at byte (\d+)", link)[1])  # type: ignore[index]
    assert offset > 0
    assert resume.method == "GET"
    assert resume.url.endswith(f"/v1/stream?conv_id={conversation}&from={offset}")


def test_a_lost_connection_reattaches_with_back_off_and_the_reply_completes(page: Page) -> None:
    """The network gone for 3 s mid-reply: the page says it lost the connection, retries
    the same ``GET /v1/stream`` with back-off, says it reattached when it did, and the
    reply completes as an undisturbed one."""
    sent = _stream_requests(page)
    with ServerProcess("--scripted", "--scripted-interval", "0.01") as server:
        page.goto(server.wait_ready() + "/")
        page.evaluate(
            """() => {
                const link = document.querySelector("#link");
                window.linkStates = [];
                new MutationObserver(() => {
                    const state = link.dataset.state ?? "";
                    if (window.linkStates.at(-1) !== state) window.linkStates.push(state);
                }).observe(link, { attributes: true });
            }"""
        )
        page.fill("#max-tokens", "1000")  # 10 s: offline for 3 s, back-off up to 4 s
        page.fill("#prompt", "Count.")
        page.click("#send")
        page.wait_for_function("Number(document.querySelector('#tokens').textContent) >= 30")
        page.context.set_offline(True)
        expect(page.locator("#link")).to_have_attribute("data-state", "lost")
        expect(page.locator("#link")).to_have_text("connection lost, reattaching…")
        lost_at = len(page.text_content("#conversation .reply") or "")
        page.wait_for_timeout(3_000)  # the network stays away a while (a bounded wait, no phase)
        page.context.set_offline(False)
        expect(page.locator("#link")).to_have_attribute("data-state", "reattached", timeout=15_000)
        turn = page.locator("#conversation .turn[data-turn='1']")
        expect(turn).to_have_attribute("data-state", "done", timeout=30_000)
        final = turn.locator(".reply").text_content() or ""
        states = page.evaluate("window.linkStates")
        link = page.text_content("#link") or ""
        assert server.stop() == 0
    assert final == _scripted_reply(1000)
    assert 0 < lost_at < len(final)
    assert states == ["lost", "reattached"]
    offset = int(re.fullmatch(r"reattached at byte (\d+)", link)[1])  # type: ignore[index]
    post = sent[0]
    conversation = post.headers["x-conversation-id"]
    resumes = [r for r in sent if r.method == "GET"]
    assert resumes  # (the tries made while offline failed in the browser, and are among them)
    base = post.url.split("/v1/")[0]
    assert {r.url for r in resumes} == {f"{base}/v1/stream?conv_id={conversation}&from={offset}"}


def test_a_server_that_keeps_no_streams_gets_plain_replies(page: Page) -> None:
    """``--detach-max 0``: the server refuses ``X-Conversation-Id`` (400 naming it); the
    page sends the reply again without it, and every later one too."""
    sent = _stream_requests(page)
    with ServerProcess("--scripted", "--scripted-interval", "0.001", "--detach-max", "0") as server:
        page.goto(server.wait_ready() + "/")
        page.fill("#max-tokens", "5")
        for number in (1, 2):
            page.fill("#prompt", "Count.")
            page.click("#send")
            turn = page.locator(f"#conversation .turn[data-turn='{number}']")
            expect(turn).to_have_attribute("data-state", "done")
            expect(turn.locator(".reply")).to_have_text(_scripted_reply(5))
        refused = sent[0].response()
        assert refused is not None
        assert refused.status == 400
        assert server.stop() == 0
    assert ["x-conversation-id" in r.headers for r in sent] == [True, False, False]


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
        page.fill("#prompt", "Count.")  # chat, the page's default mode
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


@contextlib.contextmanager
def _serving(registry: ModelRegistry) -> Iterator[str]:
    """An in-process server for ``registry``, in its own thread's Trio run (the page's
    tests drive the browser synchronously); yields its URL, shuts it down after."""
    started: queue.Queue[tuple[Server, trio.lowlevel.TrioToken] | BaseException] = queue.Queue()
    url: list[str] = []

    async def main() -> None:
        server = Server(registry, ServerSettings(host="127.0.0.1", port=0, shutdown_grace=0.0))
        async with trio.open_nursery() as nursery:
            url.extend(await nursery.start(server.run))
            await server.ready.wait()
            started.put((server, trio.lowlevel.current_trio_token()))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test, not lost in the thread
            started.put(exc)

    thread = threading.Thread(target=run, name="trioserve", daemon=True)
    thread.start()
    first = started.get(timeout=30)
    if isinstance(first, BaseException):
        raise first
    server, token = first
    try:
        yield url[0]
    finally:
        trio.from_thread.run_sync(server.shutdown, trio_token=token)
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"
    if not started.empty():
        raise started.get()


def test_the_model_picker_lists_the_models_and_sends_the_one_picked(page: Page) -> None:
    beta_gate = threading.Event()  # beta's load waits here until the page has shown it loading

    async def load_alpha() -> Backend:
        return ScriptedBackend(script=[b"Alpha", b" here."], token_interval=0.005, model_id="alpha")

    async def load_beta() -> Backend:
        await trio.to_thread.run_sync(beta_gate.wait, abandon_on_cancel=True)
        return ScriptedBackend(script=[b"Beta", b" says", b" hello."], token_interval=0.005, model_id="beta")

    registry = ModelRegistry(
        [
            ModelSpec(name="alpha", source=BackendSource(load_alpha, description="alpha")),
            ModelSpec(name="beta", source=BackendSource(load_beta, description="beta")),
        ]
    )
    sent = _chat_requests(page)
    options = page.locator("#model option")
    try:
        with _serving(registry) as url:
            page.goto(url + "/")
            # every model, with its state; the first is the default
            expect(options).to_have_text(["alpha (unloaded)", "beta (unloaded)"])
            expect(page.locator("#model")).to_have_value("alpha")

            page.fill("#prompt", "Who are you?")
            page.click("#send")
            first = page.locator("#conversation .turn[data-turn='1']")
            expect(first).to_have_attribute("data-state", "done")
            expect(first.locator(".reply")).to_have_text("Alpha here.")
            expect(options).to_have_text(["alpha (loaded)", "beta (unloaded)"])  # refreshed after the reply

            page.select_option("#model", "beta")
            page.fill("#prompt", "And you?")
            page.click("#send")
            # the request waits for beta's load, and the picker shows it loading meanwhile
            expect(page.locator("#model option[value='beta']")).to_have_text(re.compile(r"^beta \(loading"))
            second = page.locator("#conversation .turn[data-turn='2']")
            expect(second).to_have_attribute("data-state", "streaming")
            beta_gate.set()
            expect(second).to_have_attribute("data-state", "done")
            expect(second.locator(".reply")).to_have_text("Beta says hello.")
            expect(second).to_have_attribute("data-model", "beta")
            expect(options).to_have_text(["alpha (loaded)", "beta (loaded)"])
            expect(page.locator("#model")).to_have_value("beta")  # the pick survives the refreshes
    finally:
        beta_gate.set()
    assert [body.get("model") for body in sent] == ["alpha", "beta"]
    assert sent[1]["messages"] == [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "Alpha here."},
        {"role": "user", "content": "And you?"},
    ]
