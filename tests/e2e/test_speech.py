"""``POST /v1/audio/speech`` on the tiny random-weight PocketTTS pair of
``tests/_speech_model.py`` (docs/audio.md, "Speech"), through OpenAI's own SDK: a WAV
the stdlib reads, the same samples streamed (chunked audio and ``speech.audio.delta``
events) as answered whole for the same seed, every refusal naming its field, a server
without a speech model refusing by name, the flags loading the pair in a real
``trioserve serve``, and a client that leaves mid-generation stopping the engine.

Seeds: libmtmd reseeds the flow net's noise only when the seed changes
(docs/audio.md, "Speech"), so the comparisons alternate two seeds: 7, 8, 7, 8."""

from __future__ import annotations

import base64
import io
import json
import struct
import wave
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from trioserve import Backend, ScriptedBackend, Server, ServerSettings
from trioserve._backends._media import SpeechEngine
from trioserve._cli._parser import parser
from trioserve._cli._speech_flags import speech_source
from trioserve._http._speech_service import SpeechService, SpeechSource
from trioserve._wire._speech import MAX_INPUT_CHARS

from .._helpers import RawStream, RunningServer, ServerProcess, wait_for
from .._speech_model import SAMPLE_RATE, SAMPLES_PER_FRAME, tiny_pockettts

NAME = "tiny-pockettts"
#: a sentence of the talkative pair runs to its budget: (tokens / 3 + 2) × 12.5 frames
SENTENCE = "A longer sentence that runs to its budget."


@pytest.fixture(scope="module")
def terse() -> tuple[Path, Path]:
    return tiny_pockettts()


@pytest.fixture(scope="module")
def talkative() -> tuple[Path, Path]:
    return tiny_pockettts(talkative=True)


async def serve_speech(
    nursery: trio.Nursery, pair: tuple[Path, Path] | None, *, max_queue: int = 16
) -> RunningServer:
    """A real hypercorn server (the scripted backend for text) with the pair as its
    speech model, loaded at start as ``trioserve serve --tts-model`` loads it."""
    backend = ScriptedBackend()

    async def load() -> Backend:
        return backend

    source = None
    if pair is not None:
        model, mmproj = pair
        source = SpeechSource(NAME, lambda: SpeechEngine(model, mmproj, threads=1))
    settings = ServerSettings(host="127.0.0.1", port=0, max_queue=max_queue)
    server = Server(load, settings, speech=source)
    binds = await nursery.start(server.run)
    await server.ready.wait()
    return RunningServer(server, binds[0])


def service(running: RunningServer) -> SpeechService:
    speech = running.server.state.speech
    assert speech is not None
    return speech


def engine(running: RunningServer) -> SpeechEngine:
    model = service(running).model
    assert isinstance(model, SpeechEngine)
    return model


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def read_wav(data: bytes) -> tuple[wave.Wave_read, bytes]:
    """A streamed WAV: its header says 0xFFFFFFFF for both sizes (the length was not
    known when it went out); with the sizes put right, the stdlib reads it."""
    assert data[:4] == b"RIFF"
    assert data[8:16] == b"WAVEfmt "
    assert data[36:40] == b"data"
    assert struct.unpack("<I", data[4:8])[0] == struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    fixed = data[:4] + struct.pack("<I", len(data) - 8) + data[8:40] + struct.pack("<I", len(data) - 44)
    with wave.open(io.BytesIO(fixed + data[44:]), "rb") as reader:
        return reader, reader.readframes(reader.getnframes())


async def test_the_openai_sdk_gets_a_wav_the_stdlib_reads(
    terse: tuple[Path, Path], nursery: trio.Nursery
) -> None:
    running = await serve_speech(nursery, terse)
    speech = service(running)
    async with client(running.url) as sdk:
        response = await sdk.audio.speech.create(
            model=NAME, voice="default", input="Hello there, how are you?", response_format="wav"
        )
    assert response.response.headers["content-type"] == "audio/wav"
    reader, pcm = read_wav(response.content)
    assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate()) == (1, 2, SAMPLE_RATE)
    # the terse pair's end-of-speech head fires at once: 3 frames of tail, 1,920 samples each
    frames = engine(running).frames_made
    assert frames == 3
    assert reader.getnframes() == frames * SAMPLES_PER_FRAME
    assert len(pcm) == 2 * frames * SAMPLES_PER_FRAME
    assert any(pcm)
    assert (speech.generations, speech.stopped, speech.running) == (1, 0, 0)
    # shutdown closes the model
    running.server.shutdown()
    await running.server.stopped.wait()
    assert (speech.state, speech.model) == ("closed", None)


async def test_streamed_answers_are_the_whole_answers_samples(
    talkative: tuple[Path, Path], nursery: trio.Nursery
) -> None:
    running = await serve_speech(nursery, talkative)
    async with client(running.url) as sdk:
        ask: dict[str, Any] = {"model": NAME, "voice": "default", "input": SENTENCE}
        whole_7 = await sdk.audio.speech.create(**ask, response_format="wav", extra_body={"seed": 7})
        _, pcm_7 = read_wav(whole_7.content)
        pcm_8 = (await sdk.audio.speech.create(**ask, response_format="pcm", extra_body={"seed": 8})).content
        frames = engine(running).frames_made // 2
        assert len(pcm_7) == len(pcm_8) == 2 * frames * SAMPLES_PER_FRAME  # (the budget: ≥ 8 windows)
        assert frames > 8 * 8
        assert pcm_7 != pcm_8

        # chunked audio, read as it comes
        async with sdk.audio.speech.with_streaming_response.create(
            **ask, response_format="pcm", extra_body={"seed": 7}
        ) as streamed:
            assert streamed.headers["content-type"] == "audio/pcm"
            chunks = [chunk async for chunk in streamed.iter_bytes()]
        assert b"".join(chunks) == pcm_7

        # speech.audio.delta events, then speech.audio.done with the usage
        events = []
        async with sdk.audio.speech.with_streaming_response.create(
            **ask, response_format="pcm", stream_format="sse", extra_body={"seed": 8}
        ) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            async for line in streamed.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
        deltas, done = events[:-1], events[-1]
        assert len(deltas) > 1
        assert {event["type"] for event in deltas} == {"speech.audio.delta"}
        assert b"".join(base64.b64decode(event["audio"]) for event in deltas) == pcm_8
        assert done["type"] == "speech.audio.done"
        usage = done["usage"]
        assert usage["output_tokens"] == frames
        assert usage["input_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

        # a WAV in events: the header rides in the first delta
        events.clear()
        async with sdk.audio.speech.with_streaming_response.create(
            **ask, response_format="wav", stream_format="sse", extra_body={"seed": 7}
        ) as streamed:
            async for line in streamed.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
        audio = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
        assert audio == whole_7.content


async def test_a_client_that_leaves_mid_generation_stops_the_engine(
    talkative: tuple[Path, Path], nursery: trio.Nursery
) -> None:
    running = await serve_speech(nursery, talkative)
    speech, made = service(running), engine(running)
    text = " ".join([SENTENCE] * 40)  # (about 40 × 172 frames: seconds of CPU, minutes of sound)
    body = {"model": NAME, "voice": "default", "input": text, "response_format": "pcm"}
    # a small receive window: the server's sends wait for this client, and so does the engine
    raw = await RawStream.post(running.url, "/v1/audio/speech", body, receive_buffer=16384)
    head = await raw.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body_at = head.index(b"\r\n\r\n") + 4
    while len(raw.received) < body_at + 4096:  # the first audio
        chunk = await raw.stream.receive_some(65536)
        assert chunk, raw.received[:200]
        raw.received += chunk
    assert made.frames_made > 0
    await raw.aclose()
    await wait_for(lambda: speech.stopped == 1 and speech.running == 0, limit=30)
    stopped_at = made.frames_made
    # far from its budget (about 6,900 frames: 172 a sentence): it stopped, not finished
    # (measured: 8, the first window, the one its send waited on)
    assert stopped_at < 1000, stopped_at
    await running.wait_idle()
    assert made.frames_made == stopped_at
    # the engine serves the next request
    async with client(running.url) as sdk:
        answer = await sdk.audio.speech.create(
            model=NAME, voice="default", input="Hi.", response_format="pcm"
        )
    assert len(answer.content) > 0
    assert len(answer.content) % 2 == 0


@pytest.mark.parametrize("max_queue", [1, 0])
async def test_one_generation_at_a_time_and_a_waiting_request_leaves_when_its_client_does(
    talkative: tuple[Path, Path], nursery: trio.Nursery, max_queue: int
) -> None:
    running = await serve_speech(nursery, talkative, max_queue=max_queue)
    speech = service(running)
    long = {"model": NAME, "voice": "default", "input": " ".join([SENTENCE] * 40), "response_format": "pcm"}
    # the first holds the engine: its client reads nothing past the head
    first = await RawStream.post(running.url, "/v1/audio/speech", long, receive_buffer=16384)
    await first.read_until(b"\r\n\r\n")
    await wait_for(lambda: speech.running == 1)
    short = {**long, "input": "Hi."}
    if max_queue == 0:  # no place to wait: 429
        answer = await post(running.url, short)
        assert answer.status_code == 429, answer.text
    else:
        second = await RawStream.post(running.url, "/v1/audio/speech", short)
        await wait_for(lambda: speech.admission.queued == 1)
        await second.aclose()
        await wait_for(lambda: speech.admission.queued == 0)
    assert speech.generations == 1
    await first.aclose()
    await wait_for(lambda: speech.running == 0 and speech.stopped == 1, limit=30)
    await running.wait_idle()
    assert speech.generations == 1


async def test_the_deadline_stops_the_engine_and_says_so_in_an_event(
    talkative: tuple[Path, Path], nursery: trio.Nursery
) -> None:
    running = await serve_speech(nursery, talkative)
    speech, made = service(running), engine(running)
    text = " ".join([SENTENCE] * 40)  # (seconds of CPU: the deadline comes first)
    body = {
        "model": NAME,
        "voice": "default",
        "input": text,
        "response_format": "pcm",
        "stream_format": "sse",
    }
    events = []
    async with (
        httpx.AsyncClient(base_url=running.url, timeout=60) as http,
        http.stream("POST", "/v1/audio/speech", json=body, headers={"X-Request-Timeout": "1"}) as answer,
    ):
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    assert {event["type"] for event in events[:-1]} == {"speech.audio.delta"}
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "deadline_exceeded"
    await wait_for(lambda: speech.running == 0, limit=30)
    assert speech.stopped == 1
    assert made.frames_made < 3000  # (its budget: about 6,900)


async def post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post("/v1/audio/speech", json=body)


@pytest.mark.parametrize(
    ("field", "value", "status", "param", "says"),
    [
        ("voice", "alloy", 400, "voice", "'default'"),
        ("voice", {"id": "voice_1234"}, 400, "voice", "'default'"),
        ("speed", 2.0, 400, "speed", "one rate"),
        ("response_format", "mp3", 400, "response_format", "does not encode"),
        ("response_format", "opus", 400, "response_format", "'wav' or 'pcm'"),
        ("input", "", 400, "input", "empty"),
        ("input", "a" * (MAX_INPUT_CHARS + 1), 400, "input", str(MAX_INPUT_CHARS)),
        ("instructions", "Speak like a pirate.", 400, "instructions", "instructions"),
        ("stream_format", "ndjson", 400, "stream_format", "stream_format"),
        ("model", "tts-1", 404, "model", NAME),
        ("style", "calm", 400, None, "style"),
    ],
)
async def test_refusals_name_their_field(
    terse: tuple[Path, Path],
    nursery: trio.Nursery,
    field: str,
    value: object,
    status: int,
    param: str | None,
    says: str,
) -> None:
    running = await serve_speech(nursery, terse)
    body = {"model": NAME, "voice": "default", "input": "Hello.", field: value}
    response = await post(running.url, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error
    assert service(running).generations == 0


async def test_the_sdk_s_refusal_of_a_voice(terse: tuple[Path, Path], nursery: trio.Nursery) -> None:
    running = await serve_speech(nursery, terse)
    with pytest.raises(openai.BadRequestError) as caught:
        async with client(running.url) as sdk:
            await sdk.audio.speech.create(model=NAME, voice="alloy", input="Hello.")
    assert caught.value.code == "unsupported_voice"


async def test_a_server_without_a_speech_model_refuses_by_name(nursery: trio.Nursery) -> None:
    running = await serve_speech(nursery, None)
    with pytest.raises(openai.BadRequestError) as caught:
        async with client(running.url) as sdk:
            await sdk.audio.speech.create(model=NAME, voice="default", input="Hello.")
    assert caught.value.code == "speech_not_supported"
    assert "--tts-model" in caught.value.message


def test_the_flags_load_the_pair_in_trioserve_serve(terse: tuple[Path, Path]) -> None:
    model, mmproj = terse
    flags = ("--scripted", "--tts-model", str(model), "--tts-mmproj", str(mmproj), "--tts-model-id", NAME)
    with ServerProcess(*flags) as server:
        url = server.wait_ready()
        answer = httpx.post(
            f"{url}/v1/audio/speech",
            json={"model": NAME, "voice": "default", "input": "Hello.", "response_format": "wav"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        reader, pcm = read_wav(answer.content)
        assert reader.getframerate() == SAMPLE_RATE
        assert len(pcm) > 0
        assert len(pcm) % 2 == 0
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tts-model", "x.gguf"], "--tts-model needs --tts-mmproj"),
        (["--tts-mmproj", "x.gguf"], "--tts-mmproj needs --tts-model"),
        (["--tts-model", "/nonexistent.gguf", "--tts-mmproj", "/nonexistent.gguf"], "file not found"),
        (["--tts-model-id", "x"], "need --tts-model"),
    ],
)
def test_the_flags_refuse_what_cannot_load(argv: list[str], says: str) -> None:
    args = parser().parse_args(["serve", "--scripted", *argv])
    with pytest.raises(RuntimeError, match=says):
        speech_source(args)
