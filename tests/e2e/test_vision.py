"""Images in the conversation (docs/vision.md), beside llama.cpp's own llama-server on
the same files: the default Gemma 3 270M with the tiny random-weight gemma3 projector of
``tests/_vision_model.py`` (16 image tokens, wrapped in ``<start_of_image>`` /
``<end_of_image>``).

- The same chat with an image gives llama-server ``--mmproj``'s prompt count and greedy
  text; the Anthropic and Responses shapes of it give the chat's.
- The image-aware cache: a second turn about the same image restores the image's cells
  (no encode) and its text equals a fresh server's; another image at the same place
  shares only the text before it; a text-only request to the vision model caches as on
  a text model.
- A client that leaves during an image encode stops it (the abort flag, through ggml's
  graph-evaluation callback) and frees its slot.
- Refusals: a model without a projector, an undecodable image, the image-token budget.
- Token counting holds a queue place while it fetches: a full server refuses a count with
  an image URL before any fetch.
- Decoding under bounds: a decompression bomb (a 1-bit PNG of 30,000 × 30,000 pixels in
  150 KB) and every image Pillow cannot read answer 400; a request waits for its share
  of the decode budget (and leaves the line when its client leaves); one whose images
  alone exceed it answers 400 naming ``--image-decode-budget``; 16 large images in
  parallel requests keep the server process's peak RSS under the budget.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import (
    Engine,
    GenerationRequest,
    HTTPSettings,
    LlamaBackend,
    LlamaSettings,
    OverloadedError,
    SamplingParams,
    TextDelta,
    Usage,
    default_model_path,
)
from trioserve._core._media import ImageBudget, image_marker
from trioserve._http._fetch import FetchPolicy, parse_allow

from .._greedy import Step, assert_same_greedy_text, steps
from .._helpers import RawStream, RunningServer, ServerProcess, llama_server_command, start_server, wait_for
from .._image_host import Host
from .._vision_model import IMAGE_TOKENS, png_bytes, solid_png, tiny_gemma3_projector

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)

#: images that differ in colour, size and kind (a gradient, solids; libmtmd resizes all)
IMAGES = [png_bytes(64, 64, (200, 30, 30)), png_bytes(48, 80), png_bytes(32, 32, (20, 160, 220))]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat_body(image: bytes, question: str = "What is in the picture?", **extra: Any) -> dict[str, Any]:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question},
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                ],
            }
        ],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }


@pytest.fixture(scope="module")
def projector() -> Path:
    return tiny_gemma3_projector()


@pytest.fixture(scope="module")
def vision_backend(projector: Path) -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(
        LlamaSettings(default_model_path(), n_ctx=1024, n_threads=2, slots=2, mmproj=projector)
    )
    backend.idle_recompute = False  # (the cache tests count what each turn evaluates)
    yield backend
    backend.close()


#: Gemma's turn format as a Jinja template, the layout trioserve's Gemma format renders
#: (this base model has no template of its own): llama-server with ``--jinja`` joins a
#: message's parts as trioserve does — text parts with a newline, nothing around an
#: image's marker; its ``--no-jinja`` path puts a newline between every two parts
GEMMA_TEMPLATE = (
    "{%- for message in messages -%}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\\n' + message['content'] + '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def peer(projector: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server ``--mmproj`` on the same files, with the same Gemma turn format, one
    slot."""
    folder = tmp_path_factory.mktemp("llama-server-vision")
    template = folder / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    port = free_port()
    argv = llama_server_command(
        default_model_path(),
        port,
        ["--mmproj", str(projector), "--jinja", "--chat-template-file", str(template), "--parallel", "1"],
    )
    server = Server(LLAMA_SERVER, argv, port, folder)
    try:
        server.wait_ready(timeout=120)
        yield server.url
    finally:
        server.stop(grace=10)


@pytest.fixture
async def vision(vision_backend: LlamaBackend, nursery: trio.Nursery) -> RunningServer:
    vision_backend.clear_cache()
    running = await start_server(nursery, vision_backend, http=HTTPSettings())
    return running


async def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await client.post(path, json=body)


async def chat_steps(url: str, body: dict[str, Any]) -> tuple[list[Step], dict[str, Any]]:
    """A chat's tokens with their two best candidates each, and its usage."""
    response = await post(url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return steps(answer["choices"][0]["logprobs"]), answer["usage"]


async def chat(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = await post(url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["message"]["content"], answer["usage"]


async def test_an_image_chat_equals_llama_servers(projector: Path, peer: str, vision: RunningServer) -> None:
    """The same calls: llama-server evaluates the text before an image in one call, so
    trioserve runs here with the aligned cut of 512 (its pieces: the text before the
    image, the image, the text after: llama-server's calls). On an AMD EPYC (AVX2) the
    bits were the same and every text equal; on an Intel Xeon with AVX-512 one of the
    three images' greedy texts parts from llama-server's at a token whose two best
    candidates are 0.17 nat apart in trioserve, the two servers' log-probabilities there
    ~0.1 nat apart (where the two programs' numbers part is not found yet:
    docs/vision.md). So: every text equal to llama-server's, each shared token's
    log-probability within 0.25 nat of llama-server's, or the texts equal up to a near
    tie both servers saw (tests/_greedy.py). With the default text cut a greedy text may
    also part in a near tie; it equals a fresh trioserve's, which the cache tests check."""
    aligned = LlamaBackend.load(
        LlamaSettings(
            default_model_path(),
            n_ctx=1024,
            n_threads=2,
            slots=1,
            mmproj=projector,
            piece_rule="aligned",
            prefill_chunk=512,
        )
    )
    probes = {"logprobs": True, "top_logprobs": 2}
    try:
        async with trio.open_nursery() as serving:
            running = await start_server(serving, aligned, http=HTTPSettings())
            for index, image in enumerate(IMAGES):
                ours, usage = await chat_steps(running.url, chat_body(image, **probes))
                theirs, their_usage = await chat_steps(
                    peer, {**chat_body(image, **probes), "cache_prompt": False}
                )
                assert usage["prompt_tokens"] == their_usage["prompt_tokens"]
                assert_same_greedy_text(index, ours, theirs)
            running.server.shutdown()
    finally:
        aligned.close()
    # each image counted: its 16 embeddings and the two tokens around them
    _, text_only = await chat(
        vision.url,
        {**chat_body(IMAGES[0]), "messages": [{"role": "user", "content": "What is in the picture?"}]},
    )
    _, with_image = await chat(vision.url, chat_body(IMAGES[0]))
    assert with_image["prompt_tokens"] - text_only["prompt_tokens"] == IMAGE_TOKENS + 2


async def test_the_anthropic_and_responses_shapes_give_the_chats_text(vision: RunningServer) -> None:
    image = IMAGES[1]
    text, usage = await chat(vision.url, chat_body(image))
    b64 = base64.b64encode(image).decode()
    image_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    anthropic_messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}, image_block]}
    ]
    messages = await post(
        vision.url,
        "/v1/messages",
        {
            "max_tokens": 12,
            "temperature": 0,
            "messages": anthropic_messages,
        },
    )
    assert messages.status_code == 200, messages.text
    answer = messages.json()
    assert (
        answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"] == usage["prompt_tokens"]
    )
    assert "".join(b["text"] for b in answer["content"] if b["type"] == "text") == text
    responses = await post(
        vision.url,
        "/v1/responses",
        {
            "max_output_tokens": 12,
            "temperature": 0,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in the picture?"},
                        {"type": "input_image", "image_url": data_url(image)},
                    ],
                }
            ],
        },
    )
    assert responses.status_code == 200, responses.text
    body = responses.json()
    assert body["usage"]["input_tokens"] == usage["prompt_tokens"]
    said = [c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"]]
    assert "".join(said) == text
    # counted as generated: the image's tokens included
    counted = await post(
        vision.url,
        "/v1/messages/count_tokens",
        {
            "messages": anthropic_messages,
        },
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == usage["prompt_tokens"]


async def test_a_second_turn_about_the_same_image_restores_its_cells(
    vision: RunningServer, vision_backend: LlamaBackend
) -> None:
    projector = vision_backend.llama_model.projector
    assert projector is not None
    first = chat_body(IMAGES[0])
    answer, usage = await chat(vision.url, first)
    encodes = projector.encodes
    turn2 = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And what colour is it?"},
        ],
    }
    text2, usage2 = await chat(vision.url, turn2)
    assert projector.encodes == encodes  # the image's cells were reused: nothing encoded
    # everything up to the end of turn 1's prompt pieces came from the cache
    image_end = usage["prompt_tokens"] - 6  # (after the image: "\n", the turn's end and header)
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= image_end
    # the text equals a fresh server's
    vision_backend.clear_cache()
    fresh, fresh_usage = await chat(vision.url, turn2)
    assert fresh_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert projector.encodes == encodes + 1
    assert fresh == text2
    # another image at the same place shares only the text before it
    _other, other_usage = await chat(
        vision.url,
        {
            **turn2,
            "messages": [
                {
                    **turn2["messages"][0],
                    "content": [
                        turn2["messages"][0]["content"][0],
                        {"type": "image_url", "image_url": {"url": data_url(IMAGES[2])}},
                    ],
                },
                *turn2["messages"][1:],
            ],
        },
    )
    assert (
        other_usage["prompt_tokens_details"]["cached_tokens"] <= image_end - IMAGE_TOKENS
    )  # (none of the image)
    assert projector.encodes == encodes + 2


async def test_a_text_only_request_to_a_vision_model_caches_as_on_a_text_model(
    vision: RunningServer, llama_server: RunningServer
) -> None:
    """llama-server with --mmproj reuses no prompt at all (llama.cpp #21133); here a
    text-only request to the vision model reuses exactly what the text model reuses."""
    lines = "\n".join(
        f"Line {i}: the river runs past the old market and under the bridge." for i in range(12)
    )
    body = {"messages": [{"role": "user", "content": lines}], "max_tokens": 4, "temperature": 0}
    cached = []
    for url in (vision.url, llama_server.url):
        _, first = await chat(url, body)
        _, second = await chat(url, body)
        assert first["prompt_tokens_details"]["cached_tokens"] < 8  # (at most a turn header)
        cached.append(second["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == cached[1]
    assert cached[0] > 100  # (the whole pieces of a ~170-token prompt)


async def test_a_client_that_leaves_during_an_image_encode_stops_it(
    vision: RunningServer, vision_backend: LlamaBackend
) -> None:
    """The encode waits at its start (a seam) until the client has left and the abort
    flag is up; then libmtmd's graph stops at its first node through ``cb_eval``."""
    projector = vision_backend.llama_model.projector
    assert projector is not None
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    encodes, aborted, calls = projector.encodes, projector.aborted_encodes, vision_backend.aborted_calls
    projector.before_encode = hold
    try:
        client = await RawStream.post(
            vision.url, "/v1/chat/completions", {**chat_body(IMAGES[2]), "stream": True}
        )
        await wait_for(entered.is_set, limit=30)
        await client.aclose()
        await wait_for(lambda: projector.abort_requested, limit=10)
    finally:
        release.set()
        projector.before_encode = None
    await vision.wait_idle()
    assert projector.aborted_encodes == aborted + 1
    assert projector.encodes == encodes
    assert vision_backend.aborted_calls == calls + 1
    assert vision_backend.generations.running == 0
    # and the next request about that image encodes it and answers
    _text, _ = await chat(vision.url, chat_body(IMAGES[2]))
    assert projector.encodes == encodes + 1


@pytest.fixture
async def image_host(nursery: trio.Nursery) -> Host:
    host = Host()
    listeners = await nursery.start(partial(trio.serve_tcp, host.handle, 0, host="127.0.0.1"))
    host.port = listeners[0].socket.getsockname()[1]
    return host


async def test_an_image_url_is_fetched_and_a_client_that_leaves_cancels_the_fetch(
    vision_backend: LlamaBackend, image_host: Host, nursery: trio.Nursery, vision: RunningServer
) -> None:
    """With --media-fetch (the local host trusted by name, as an operator's internal
    image server would be): a fetched image answers as the same image sent inline; a
    client that leaves while the image host is silent closes the fetch's connection."""
    image_host.files["/photo.png"] = IMAGES[1]
    media = FetchPolicy(enabled=True, trust=parse_allow([f"127.0.0.1:{image_host.port}"]))
    fetching = await start_server(nursery, vision_backend, http=HTTPSettings(media=media))
    body = chat_body(IMAGES[1])
    inline, _ = await chat(fetching.url, body)
    url = f"http://127.0.0.1:{image_host.port}/photo.png"
    body["messages"][0]["content"][1]["image_url"]["url"] = url
    fetched, _ = await chat(fetching.url, body)
    assert fetched == inline
    # the default server does not fetch: a 400 that says how
    off = await post(vision.url, "/v1/chat/completions", body)
    assert off.status_code == 400, off.text
    assert off.json()["error"]["code"] == "media_fetch_disabled"
    # a client that leaves during a slow fetch
    body["messages"][0]["content"][1]["image_url"]["url"] = f"http://127.0.0.1:{image_host.port}/slow"
    client = await RawStream.post(fetching.url, "/v1/chat/completions", body)
    with trio.fail_after(30):
        await image_host.slow.wait()
    await client.aclose()
    with trio.fail_after(5):
        await image_host.closed.wait()
    await fetching.wait_idle()


async def test_a_full_server_refuses_an_image_count_before_any_fetch(
    vision_backend: LlamaBackend, image_host: Host, nursery: trio.Nursery
) -> None:
    """Token counting (``count_tokens``, ``input_tokens``) fetches and decodes images as
    generation does, so it holds a queue place first, as generation does: with every
    place taken (held by the test, as other requests would hold them) a count with an
    image URL is refused — 429 (Anthropic's 529) — and the image host sees no request.
    Once places free, the same counts fetch, answer, and give their place back."""
    image_host.files["/photo.png"] = IMAGES[1]
    media = FetchPolicy(enabled=True, trust=parse_allow([f"127.0.0.1:{image_host.port}"]))
    fetching = await start_server(nursery, vision_backend, http=HTTPSettings(media=media))
    url = f"http://127.0.0.1:{image_host.port}/photo.png"
    counts = {
        "/v1/messages/count_tokens": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in the picture?"},
                        {"type": "image", "source": {"type": "url", "url": url}},
                    ],
                }
            ]
        },
        "/v1/responses/input_tokens": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in the picture?"},
                        {"type": "input_image", "image_url": url},
                    ],
                }
            ]
        },
    }
    admission = fetching.engine.admission
    held = [admission.reserve() for _ in range(admission.slots + admission.max_queue)]
    with pytest.raises(OverloadedError):  # every place is taken
        admission.check()
    try:
        for path, body in counts.items():
            refused = await post(fetching.url, path, body)
            assert refused.status_code == (529 if path.startswith("/v1/messages") else 429), refused.text
            assert "at capacity" in refused.text
        assert image_host.requests == []  # nothing fetched (nor decoded)
    finally:
        for reservation in held:
            reservation.release()
    assert admission.reserved == 0
    for path, body in counts.items():
        counted = await post(fetching.url, path, body)
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > IMAGE_TOKENS
    assert image_host.requests == ["/photo.png", "/photo.png"]
    assert admission.reserved == 0  # (each count gave its place back)


async def test_refusals(
    vision: RunningServer, vision_backend: LlamaBackend, llama_server: RunningServer
) -> None:
    bad = await post(vision.url, "/v1/chat/completions", chat_body(b"not an image at all"))
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == "invalid_image"
    # the image-token budget (--max-image-tokens)
    settings = vision_backend.llama_model.settings
    settings.max_image_tokens = IMAGE_TOKENS - 1
    try:
        over = await post(vision.url, "/v1/chat/completions", chat_body(IMAGES[0]))
    finally:
        settings.max_image_tokens = 4096
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "too_many_image_tokens"
    assert "--max-image-tokens" in over.json()["error"]["message"]
    # a model without a projector
    refused = await post(llama_server.url, "/v1/chat/completions", chat_body(IMAGES[0]))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "images_not_supported"
    assert "--mmproj" in error["message"]
    # the other streams are undisturbed: the vision model still answers
    await chat(vision.url, chat_body(IMAGES[1]))


async def test_an_images_cells_survive_a_restart_in_the_disk_tier(projector: Path, tmp_path: Path) -> None:
    """Turn 1 about an image, the backend closed (its cache written to disk) and loaded
    again: turn 2 restores the image's cells from disk, encodes nothing, and answers
    as a backend with the cache off."""
    settings = {
        "n_ctx": 1024,
        "n_threads": 2,
        "slots": 1,
        "mmproj": projector,
        "idle_recompute": False,
        "warm_up": False,
    }
    image = png_bytes(40, 24, (250, 200, 10))
    prompt = f"<start_of_turn>user\nDescribe it.{image_marker(0)}<end_of_turn>\n<start_of_turn>model\n"
    turn2 = (
        prompt
        + "It is yellow.<end_of_turn>\n<start_of_turn>user\n"
        + "And its shape?<end_of_turn>\n<start_of_turn>model\n"
    )

    async def run(backend: LlamaBackend, text: str) -> tuple[str, Usage]:
        request = GenerationRequest(prompt=text, max_tokens=8, sampling=GREEDY, images=(image,))
        async with Engine(backend) as engine:
            parts: list[str] = []
            async with engine.stream(request) as events:
                async for event in events:
                    if type(event) is TextDelta:
                        parts.append(event.text)
                usage = events.usage
        assert usage is not None
        return "".join(parts), usage

    first = await LlamaBackend.aload(LlamaSettings(default_model_path(), cache_dir=tmp_path, **settings))
    try:
        await run(first, prompt)
    finally:
        await first.aclose()
    again = await LlamaBackend.aload(LlamaSettings(default_model_path(), cache_dir=tmp_path, **settings))
    try:
        text, usage = await run(again, turn2)
        assert again.llama_model.projector is not None
        assert again.llama_model.projector.encodes == 0
        assert usage.cached_disk_tokens == usage.cached_tokens > IMAGE_TOKENS
    finally:
        await again.aclose()
    fresh = await LlamaBackend.aload(LlamaSettings(default_model_path(), prompt_cache=False, **settings))
    try:
        fresh_text, fresh_usage = await run(fresh, turn2)
        assert fresh_usage.cached_tokens == 0
    finally:
        await fresh.aclose()
    assert text == fresh_text


async def test_a_decompression_bomb_and_every_unreadable_image_is_a_400(vision: RunningServer) -> None:
    """Sizes are read from the header before anything is decoded: a 1-bit PNG of 900 M
    pixels (Pillow's DecompressionBombError), one of 100 M (its DecompressionBombWarning,
    an error where warnings are), one of 64 M (over this server's 50 M); a truncated
    file and a header with nothing after it are not images."""
    bomb = solid_png(30_000, 30_000, bits=1, color_type=0)
    assert len(bomb) < 200_000
    cases = [
        (bomb, "image_too_large", "larger than this server decodes"),
        (
            solid_png(10_000, 10_000, bits=1, color_type=0),
            "image_too_large",
            "larger than this server decodes",
        ),
        (solid_png(8_000, 8_000, bits=1, color_type=0), "image_too_large", "8000×8000 pixels"),
        (IMAGES[0][:60], "invalid_image", "messages (image 0)"),
        (b"GIF89a\x01", "invalid_image", "not an image this server can read"),
    ]
    for image, code, says in cases:
        response = await post(vision.url, "/v1/chat/completions", chat_body(image))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == (code, "messages"), error
        assert says in error["message"], error["message"]
    await chat(vision.url, chat_body(IMAGES[1]))  # (and the server answers on)


async def test_a_request_waits_for_its_share_of_the_decode_budget(
    vision: RunningServer, vision_backend: LlamaBackend
) -> None:
    """The budget full (held by the test, as another request's decode would hold it): a
    request waits in line, queued; its client leaves and it leaves the line; once the
    budget frees, a request decodes and answers. A request whose images need more than
    the whole budget is refused at once, naming the flag."""
    settings = vision_backend.llama_model.settings
    saved = settings.image_budget
    budget = settings.image_budget = ImageBudget(1 << 20)  # 1 MiB: a 64 × 64 image needs 76 KiB
    try:
        async with budget.hold(budget.capacity):
            client = await RawStream.post(vision.url, "/v1/chat/completions", chat_body(IMAGES[0]))
            await wait_for(lambda: budget.waiting == 1, limit=30)
            assert vision.engine.admission.snapshot().queued == 1  # (its place held)
            await client.aclose()
            await wait_for(lambda: budget.waiting == 0, limit=10)
        assert budget.in_use == 0
        await vision.wait_idle()
        await chat(vision.url, chat_body(IMAGES[0]))
        assert 0 < budget.peak <= budget.capacity
        big = await post(vision.url, "/v1/chat/completions", chat_body(solid_png(300, 300)))
        assert big.status_code == 400, big.text
        error = big.json()["error"]
        assert error["code"] == "image_too_large"
        assert "--image-decode-budget" in error["message"]
    finally:
        settings.image_budget = saved


def _reset_peak(pid: int) -> int:
    """Reset ``pid``'s peak RSS to its RSS now (``clear_refs`` 5), and return it."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _memory(pid, "VmHWM")


def _memory(pid: int, field: str) -> int:
    """``field`` (VmRSS, VmHWM) of ``/proc/<pid>/status``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def test_sixteen_large_images_at_once_stay_under_the_decode_budget(projector: Path) -> None:
    """16 requests at once, each with a 4,000 × 4,000 RGB PNG (48 MB of pixels, 56 KB as
    a file): the server process's peak RSS (VmHWM, reset once the server is warm) grows
    by less than ``--image-decode-budget`` (a request's share: 3 bytes a pixel held and
    16 while it decodes, 304 MB; the budget fits one at a time) and a margin for the
    requests themselves. Decoded all at once (no budget), they take over 1.5 GB."""
    budget_mib, margin = 384, 96 << 20
    image = solid_png(4000, 4000)
    with ServerProcess(
        "--threads", "2", "--ctx-size", "1024", "--slots", "2", "--max-queue", "32",
        "--mmproj", str(projector), "--image-decode-budget", str(budget_mib),
    ) as server:  # fmt: skip
        url = server.wait_ready()
        pid = server.process.pid
        await chat(url, chat_body(IMAGES[0]))  # (warm: the first image's allocations)
        base = _reset_peak(pid)
        statuses: list[int] = []

        async def one() -> None:
            statuses.append((await post(url, "/v1/chat/completions", chat_body(image))).status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(one)
        grown = _memory(pid, "VmHWM") - base
        print(f"peak RSS grew by {grown / (1 << 20):.0f} MiB (budget {budget_mib} MiB)")
        assert statuses == [200] * 16
        assert grown < (budget_mib << 20) + margin
