"""Audio in the conversation (docs/audio.md), beside llama.cpp's own llama-server on the
same files: the default Gemma 3 270M with the tiny random-weight ultravox projector of
``tests/_audio_model.py`` (375 tokens per 30 seconds begun).

- An ``input_audio`` chat (WAV and MP3, one chunk and two) gives llama-server
  ``--mmproj``'s prompt count and greedy text, and the text of libmtmd's own evaluation
  (``mtmd_helper_eval_chunks`` on a plain llama.cpp context, in this process). llama-server
  runs with ``--ctx-checkpoints 0``: with checkpoints it decodes a prompt's last 4 tokens
  in a call of their own, which moves the random-weight projector's near ties
  (docs/audio.md, "llama-server's text").
- The cache: a second question about the same clip restores its cells (no encode), and
  its text equals a fresh server's; another clip at the same place shares only the text
  before it.
- A client that leaves during an audio encode stops it (the abort flag, through ggml's
  graph-evaluation callback) and frees its slot.
- Refusals, each naming its flag or field: bytes, seconds (from the header, before any
  decode), parts, format, a signature that is not the format's, a model without an
  audio projector.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import HTTPSettings, LlamaBackend, LlamaSettings, default_model_path
from trioserve._wire._limits import RequestLimits

from .._audio_model import CHUNK_TOKENS, silence_wav, sine_mp3, sine_wav, tiny_ultravox_projector
from .._helpers import RawStream, RunningServer, llama_server_command, start_server, wait_for

pytestmark = pytest.mark.model

#: EOS and <end_of_turn> banned: a random-weight projector's answer runs its length
NO_END = {"1": -100, "106": -100}
CLIPS = {"wav": sine_wav(1.5, 440.0), "mp3": sine_mp3(1.5, 330.0)}


def audio_part(clip: bytes, audio_format: str) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(clip).decode(), "format": audio_format},
    }


def chat_body(clip: bytes, audio_format: str = "wav", question: str = "What do you hear?") -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": question}, audio_part(clip, audio_format)]}
        ],
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": NO_END,
    }


#: Gemma's turn format as a Jinja template (tests/e2e/test_vision.py: the base model has
#: none of its own)
GEMMA_TEMPLATE = (
    "{%- for message in messages -%}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\\n' + message['content'] + '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def projector() -> Path:
    return tiny_ultravox_projector()


@pytest.fixture(scope="module")
def audio_backend(projector: Path) -> Iterator[LlamaBackend]:
    """As llama-server lays the calls out (test_vision.py: the aligned cut of 512 — the
    text before a clip in one call, each chunk one call)."""
    backend = LlamaBackend.load(
        LlamaSettings(
            default_model_path(),
            n_ctx=2048,
            n_threads=2,
            slots=1,
            mmproj=projector,
            piece_rule="aligned",
            prefill_chunk=512,
            max_audio_seconds=60,
        )
    )
    backend.idle_recompute = False  # (the cache tests count what each turn evaluates)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def peer(projector: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server ``--mmproj`` on the same files, with the same Gemma turn format, and
    without window checkpoints: with them (its default for Gemma 3's window layers) it
    cuts a prompt's last 4 tokens into a call of their own to checkpoint before them,
    where trioserve (every window cell kept) evaluates the text after a clip in one call
    — other matrix kernels for that row, other last bits in its cells, and the
    random-weight projector's near ties turn on them (docs/audio.md, "llama-server's
    text")."""
    folder = tmp_path_factory.mktemp("llama-server-audio")
    template = folder / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    port = free_port()
    argv = llama_server_command(
        default_model_path(),
        port,
        [
            *("--mmproj", str(projector), "--jinja", "--chat-template-file", str(template)),
            *("--parallel", "1", "--ctx-checkpoints", "0"),
        ],
    )
    server = Server(LLAMA_SERVER, argv, port, folder)
    try:
        server.wait_ready(timeout=120)
        yield server.url
    finally:
        server.stop(grace=10)


@pytest.fixture
async def audio(audio_backend: LlamaBackend, nursery: trio.Nursery) -> RunningServer:
    audio_backend.clear_cache()
    limits = RequestLimits(max_audio_parts=2, max_audio_bytes=600_000)
    return await start_server(nursery, audio_backend, http=HTTPSettings(request_limits=limits))


async def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await client.post(path, json=body)


async def chat(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = await post(url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["message"]["content"], answer["usage"]


@pytest.fixture(scope="module")
def reference(projector: Path) -> Iterator[Callable[[bytes], tuple[str, int]]]:
    """libmtmd's own evaluation of a clip's chat (the Gemma turn around "What do you
    hear?" and the clip), on a plain llama.cpp context: ``mtmd_helper_eval_chunks``,
    then 12 greedy tokens, EOS and ``<end_of_turn>`` banned. Its text and prompt count."""
    import ctypes

    import llama_cpp
    import numpy
    from llama_cpp import mtmd_cpp as mtmd

    model = llama_cpp.llama_model_load_from_file(
        str(default_model_path()).encode(), llama_cpp.llama_model_default_params()
    )
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 2048, 2048, 512
    params.n_threads = params.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(model, params)
    mparams = mtmd.mtmd_context_params_default()
    mparams.use_gpu, mparams.n_threads, mparams.print_timings = False, 2, False
    mctx = mtmd.mtmd_init_from_file(str(projector).encode(), model, mparams)
    batch = llama_cpp.llama_batch_init(1, 0, 1)

    def run(clip: bytes) -> tuple[str, int]:
        buffer = ctypes.cast(ctypes.c_char_p(clip), ctypes.POINTER(ctypes.c_uint8))
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(mctx, buffer, len(clip), False)
        chunks = mtmd.mtmd_input_chunks_init()
        marker = mtmd.mtmd_default_marker().decode()
        text = f"<start_of_turn>user\nWhat do you hear?{marker}<end_of_turn>\n<start_of_turn>model\n".encode()
        given = mtmd.mtmd_input_text(text=text, text_len=len(text), add_special=True, parse_special=True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(given), bitmaps, 1) == 0
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 2048, True, ctypes.byref(n_past)) == 0
        prompt, position, out = n_past.value, n_past.value, b""
        for _ in range(12):
            logits = numpy.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)
            ).copy()
            logits[[int(k) for k in NO_END]] = -numpy.inf
            token = int(logits.argmax())
            piece = ctypes.create_string_buffer(64)
            size = llama_cpp.llama_token_to_piece(vocab, token, piece, 64, 0, False)
            out += piece.raw[:size]
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, position, 1, 1
            batch.seq_id[0][0] = 0
            assert llama_cpp.llama_decode(ctx, batch) == 0
            position += 1
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        return out.decode(), prompt

    yield run
    llama_cpp.llama_batch_free(batch)
    mtmd.mtmd_free(mctx)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("audio_format", ["wav", "mp3"])
async def test_an_audio_chat_equals_llama_servers_and_libmtmds(
    audio_format: str, peer: str, audio: RunningServer, reference: Callable[[bytes], tuple[str, int]]
) -> None:
    body = chat_body(CLIPS[audio_format], audio_format)
    ours, usage = await chat(audio.url, body)
    theirs, their_usage = await chat(peer, {**body, "cache_prompt": False})
    assert usage["prompt_tokens"] == their_usage["prompt_tokens"]
    assert ours == theirs
    text, prompt = reference(CLIPS[audio_format])
    assert usage["prompt_tokens"] == prompt
    assert ours == text
    # the clip counted: its one chunk's embeddings (ultravox writes no text around them)
    _, text_only = await chat(
        audio.url, {**body, "messages": [{"role": "user", "content": "What do you hear?"}]}
    )
    assert usage["prompt_tokens"] - text_only["prompt_tokens"] == CHUNK_TOKENS


async def test_a_clip_of_two_chunks_equals_llama_servers_and_libmtmds(
    peer: str, audio: RunningServer, reference: Callable[[bytes], tuple[str, int]]
) -> None:
    """31 seconds at 8 kHz (resampled to 16 kHz by miniaudio): two 30-second windows,
    two chunks, each its own call."""
    clip = sine_wav(31.0, 523.0, rate=8000)
    body = chat_body(clip)
    ours, usage = await chat(audio.url, body)
    theirs, their_usage = await chat(peer, {**body, "cache_prompt": False})
    assert usage["prompt_tokens"] == their_usage["prompt_tokens"]
    assert ours == theirs
    text, prompt = reference(clip)
    assert usage["prompt_tokens"] == prompt
    assert prompt > 2 * CHUNK_TOKENS
    assert ours == text


async def test_a_second_question_about_the_same_clip_encodes_nothing(
    audio: RunningServer, audio_backend: LlamaBackend
) -> None:
    projector = audio_backend.llama_model.projector
    assert projector is not None
    first = chat_body(CLIPS["wav"])
    answer, usage = await chat(audio.url, first)
    encodes = projector.encodes
    turn2 = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And how loud is it?"},
        ],
    }
    text2, usage2 = await chat(audio.url, turn2)
    assert projector.encodes == encodes  # the clip's cells were reused: nothing encoded
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 6
    # the text equals a fresh server's
    audio_backend.clear_cache()
    fresh, fresh_usage = await chat(audio.url, turn2)
    assert fresh_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert projector.encodes == encodes + 1
    assert fresh == text2
    # the same sound in another container (the samples differ: MP3 is lossy) is
    # another clip: only the text before it is shared
    other = chat_body(CLIPS["mp3"], "mp3")
    _, other_usage = await chat(audio.url, other)
    assert other_usage["prompt_tokens_details"]["cached_tokens"] < 16
    assert projector.encodes == encodes + 2


async def test_a_client_that_leaves_during_an_audio_encode_stops_it(
    audio: RunningServer, audio_backend: LlamaBackend
) -> None:
    """The encode waits at its start (a seam) until the client has left and the abort
    flag is up; then libmtmd's graph stops at its first node through ``cb_eval``."""
    projector = audio_backend.llama_model.projector
    assert projector is not None
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    encodes, aborted = projector.encodes, projector.aborted_encodes
    projector.before_encode = hold
    try:
        client = await RawStream.post(
            audio.url, "/v1/chat/completions", {**chat_body(sine_wav(1.0, 600.0)), "stream": True}
        )
        await wait_for(entered.is_set, limit=30)
        await client.aclose()
        await wait_for(lambda: projector.abort_requested, limit=10)
    finally:
        release.set()
        projector.before_encode = None
    await audio.wait_idle()
    assert projector.aborted_encodes == aborted + 1
    assert projector.encodes == encodes
    assert audio_backend.generations.running == 0


async def test_refusals(audio: RunningServer, llama_server: RunningServer) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = []
    too_big = sine_wav(20.0)  # (640 KB: over this server's 600,000 bytes)
    cases.append((chat_body(too_big), "--max-audio-bytes", "audio_too_large"))
    cases.append((chat_body(silence_wav(61.0, rate=2000)), "--max-audio-seconds", "audio_too_long"))
    three = chat_body(CLIPS["wav"])
    three["messages"][0]["content"] += [audio_part(CLIPS["wav"], "wav")] * 2
    cases.append((three, "--max-audio-parts", "too_many_audio_parts"))
    cases.append((chat_body(CLIPS["wav"], "ogg"), "format", "invalid_audio"))
    cases.append((chat_body(CLIPS["mp3"], "wav"), "not a wav file", "invalid_audio"))
    for body, named, code in cases:
        response = await post(audio.url, "/v1/chat/completions", body)
        assert response.status_code == 400, (named, response.text)
        error = response.json()["error"]
        assert named in error["message"] or named in (error.get("param") or ""), error
        assert error["code"] == code, error
        assert error["param"].startswith("messages"), error
    response = await post(llama_server.url, "/v1/chat/completions", chat_body(CLIPS["wav"]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "audio_not_supported", error
    assert "--mmproj" in error["message"], error


# -- POST /v1/audio/transcriptions -------------------------------------------------------


def model_of(running: RunningServer) -> str:
    return running.engine.backend.info.id


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("audio_format", ["wav", "mp3"])
async def test_a_transcription_through_the_openai_sdk_equals_llama_servers(
    audio_format: str, peer: str, audio: RunningServer
) -> None:
    """The SDK's ``audio.transcriptions.create``, whole and streamed, beside
    llama-server's ``/v1/audio/transcriptions`` on the same file: the same text and
    input tokens (llama-server's ASR prompt, built the same way)."""
    clip = (f"clip.{audio_format}", CLIPS[audio_format])
    extra = {"max_tokens": 12, "temperature": 0}
    async with _client(audio.url) as client, _client(peer) as peer_client:
        ours = await client.audio.transcriptions.create(model=model_of(audio), file=clip, extra_body=extra)
        theirs = await peer_client.audio.transcriptions.create(model="any", file=clip, extra_body=extra)
        assert ours.text == theirs.text
        assert ours.usage is not None
        assert theirs.usage is not None
        assert ours.usage.input_tokens == theirs.usage.input_tokens  # type: ignore[union-attr]
        deltas, done = [], None
        stream = await client.audio.transcriptions.create(
            model=model_of(audio), file=clip, stream=True, extra_body=extra
        )
        async for event in stream:
            if event.type == "transcript.text.delta":
                deltas.append(event.delta)
            else:
                done = event
    assert done is not None
    assert done.text == "".join(deltas) == ours.text
    # response_format text: the transcript alone, text/plain
    async with httpx.AsyncClient(base_url=audio.url, timeout=120) as client:
        response = await client.post(
            "/v1/audio/transcriptions",
            files={"file": clip},
            data={
                "model": model_of(audio),
                "response_format": "text",
                "max_tokens": "12",
                "temperature": "0",
            },
        )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == ours.text


async def test_transcription_refusals(audio: RunningServer, llama_server: RunningServer) -> None:
    clip = ("clip.wav", CLIPS["wav"])
    cases: list[tuple[dict[str, Any], dict[str, Any], int, str]] = [
        ({"file": clip}, {"response_format": "srt"}, 400, "response_format"),
        ({"file": clip}, {"response_format": "verbose_json"}, 400, "response_format"),
        ({"file": clip}, {"stream": "maybe"}, 400, "stream"),
        ({"file": clip}, {"timestamp_granularities[]": "word"}, 400, "timestamp_granularities[]"),
        ({"file": clip}, {"voice": "alloy"}, 400, "voice"),
        ({"file": ("notes.txt", b"hello, this is text")}, {}, 400, "file"),
        ({"other": clip}, {}, 400, "file"),
        ({"file": ("big.wav", sine_wav(20.0))}, {}, 400, "file"),  # (--max-audio-bytes 600,000)
    ]
    async with httpx.AsyncClient(base_url=audio.url, timeout=120) as client:
        for files, data, status, param in cases:
            response = await client.post(
                "/v1/audio/transcriptions", files=files, data={"model": model_of(audio), **data}
            )
            assert response.status_code == status, (param, response.text)
            assert response.json()["error"]["param"] == param, response.text
        # a body declared larger than the clip limit and the form's allowance: 413 before
        # a byte of it is sent
        host, port = audio.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000000\r\n\r\n"
            )
            answer = b""
            with trio.fail_after(10):
                while b"--max-audio-bytes" not in answer:
                    answer += await stream.receive_some()
        assert answer.startswith(b"HTTP/1.1 413"), answer
        # JSON is not a form
        response = await client.post("/v1/audio/transcriptions", json={"file": "x"})
        assert response.status_code == 400, response.text
        # speech: refused by name
        response = await client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "alloy"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "speech_not_supported"
    async with httpx.AsyncClient(base_url=llama_server.url, timeout=120) as client:
        response = await client.post("/v1/audio/transcriptions", files={"file": clip}, data={})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "audio_not_supported"
