"""``POST /v1/audio/transcriptions``, sans-IO (docs/audio.md, "Transcriptions"): the
form's fields as the chat request llama-server's ``convert_transcriptions_to_chatcmpl``
builds (one user message: the prompt, ``(language: XX)``, the clip), and the answer in
OpenAI's transcription shapes — ``json`` (``{"text", "usage"}``), ``text``, or, streamed,
``transcript.text.delta`` / ``transcript.text.done`` events.

The HTTP layer parses the multipart body (``_http/_transcriptions.py``) into a
:class:`TranscriptionForm`; :func:`chat_body` turns it into the JSON body the
``transcription`` dialect reads (:func:`read_transcription_body`; the reader is
``_inbound.py``'s): a chat completion's body
with ``transcription_format`` beside it."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from .._core._exceptions import InvalidRequestError, TrioserveError
from .._core._types import EndCause, TokenLogprob, Usage
from ._openai_writer import ChoiceResult, error_event
from ._sse import HEARTBEAT

__all__ = [
    "ASR_PROMPT",
    "RESPONSE_FORMATS",
    "TranscriptionDialect",
    "TranscriptionForm",
    "audio_format_of",
    "chat_body",
    "read_transcription_body",
]

#: llama-server's ASR preset's user prompt (``common_chat_get_asr_prompt``)
ASR_PROMPT = "Transcribe audio to text"
#: the response formats served; OpenAI's others need segment timestamps
RESPONSE_FORMATS = ("json", "text")
_TIMESTAMPED = ("verbose_json", "srt", "vtt", "diarized_json")


@dataclass(frozen=True, slots=True)
class TranscriptionForm:
    """A transcription request's fields, as its multipart form sent them (text)."""

    file: bytes
    filename: str = ""
    content_type: str = ""
    fields: tuple[tuple[str, str], ...] = ()

    def get(self, name: str) -> str | None:
        for key, value in self.fields:
            if key == name:
                return value
        return None


#: fields of OpenAI's transcription request this server reads, and the ones it refuses
#: unless they ask for nothing it cannot do
_READ = {"model", "prompt", "language", "temperature", "response_format", "stream", "max_tokens"}
_INERT = {"timestamp_granularities[]": ("segment",), "include[]": (), "chunking_strategy": ("auto",)}


def audio_format_of(form: TranscriptionForm) -> str:
    """The clip's format, from its bytes (what libmtmd's helper goes by): ``wav``,
    ``mp3`` or ``flac``; a 400 naming ``file`` for anything else."""
    head = form.file[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if len(head) >= 12 and (head[:3] == b"ID3" or (head[0] == 0xFF and head[1] & 0xE0 == 0xE0)):
        return "mp3"
    raise InvalidRequestError(
        f"the file {form.filename or '(unnamed)'!r} is not an audio file this server reads "
        "(WAV, MP3 or FLAC: others — m4a, ogg, webm — convert first)",
        param="file",
        code="invalid_audio",
    )


def _number(form: TranscriptionForm, name: str, kind: type[int] | type[float]) -> int | float | None:
    raw = form.get(name)
    if raw is None or raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be a number, got {raw!r}", param=name) from None


def chat_body(form: TranscriptionForm) -> bytes:
    """The ``transcription`` dialect's JSON body for ``form``: the chat request
    llama-server builds (``convert_transcriptions_to_chatcmpl``), and the format its
    answer is written in. 400s naming each field refused."""
    for name, value in form.fields:
        if name in _READ:
            continue
        if name in _INERT:
            if value and value not in _INERT[name]:
                raise InvalidRequestError(
                    f"{name} {value!r} cannot be honoured: this server's transcripts are a chat "
                    "model's text, with no timestamps, log-probabilities or chunking to choose",
                    param=name,
                )
            continue
        raise InvalidRequestError(f"unknown field {name!r} in the transcription form", param=name)
    response_format = form.get("response_format") or "json"
    if response_format in _TIMESTAMPED:
        raise InvalidRequestError(
            f"response_format {response_format!r} needs segment timestamps, which a chat model's "
            f"transcript does not have; send one of {', '.join(RESPONSE_FORMATS)}",
            param="response_format",
            code="unsupported_response_format",
        )
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequestError(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}",
            param="response_format",
        )
    stream = (form.get("stream") or "false").strip().lower()
    if stream not in ("true", "false"):
        raise InvalidRequestError(f"stream must be true or false, got {stream!r}", param="stream")
    if stream == "true" and response_format != "json":
        raise InvalidRequestError(
            "a streamed transcript is sent as transcript.text.* events: send response_format json "
            "(or leave it out) with stream true",
            param="response_format",
        )
    prompt = form.get("prompt") or ASR_PROMPT
    language = form.get("language")
    if language:
        prompt += f" (language: {language})"
    audio = {"data": base64.b64encode(form.file).decode(), "format": audio_format_of(form)}
    chat: dict[str, object] = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": prompt}, {"type": "input_audio", "input_audio": audio}],
            }
        ],
        "stream": stream == "true",
    }
    model = form.get("model")
    if model:
        chat["model"] = model
    temperature = _number(form, "temperature", float)
    if temperature is not None:
        chat["temperature"] = temperature
    max_tokens = _number(form, "max_tokens", int)
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    return msgspec.json.encode({"transcription_format": response_format, "chat": chat})


class _Body(msgspec.Struct):
    transcription_format: str
    chat: msgspec.Raw


def read_transcription_body(body: bytes) -> tuple[str, bytes]:
    """The ``transcription`` dialect's body: its response format, and the chat body."""
    try:
        outer = msgspec.json.decode(body, type=_Body)
    except msgspec.DecodeError as e:  # (made by the form's handler: a bug, said as a 400)
        raise InvalidRequestError(f"the transcription's request could not be read: {e}") from None
    return outer.transcription_format, bytes(outer.chat)


def _sse(event: dict[str, object]) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


def _usage(usage: Usage) -> dict[str, object]:
    return {
        "type": "tokens",
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Writer:
    def __init__(self, dialect: TranscriptionDialect) -> None:
        self.dialect = dialect

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes:
        return self.dialect.plain_delta(text)

    def finish(self, cause: EndCause, message: str | None = None, stop_sequence: str | None = None) -> bytes:
        return b""


class TranscriptionDialect:
    """A transcript: ``json`` or ``text`` whole, or ``transcript.text.*`` events."""

    heartbeat = HEARTBEAT

    def __init__(self, response_format: str) -> None:
        self.response_format = response_format
        self.request_id: str | None = None
        self._text: list[str] = []
        self.writers = [_Writer(self)]

    def plain_delta(self, text: str) -> bytes:
        self._text.append(text)
        return _sse({"type": "transcript.text.delta", "delta": text})

    def opening(self, prompt_tokens: int) -> bytes:
        return b""

    def end(self, usage: Usage) -> bytes:
        return _sse({"type": "transcript.text.done", "text": "".join(self._text), "usage": _usage(usage)})

    def stream_error(self, error: TrioserveError) -> bytes:
        return error_event(error.to_dict())

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        text = choices[0].text if choices else ""
        if self.response_format == "text":
            return (text or "").encode()
        return msgspec.json.encode({"text": text or "", "usage": _usage(usage)})

    def limit_max_tokens(self, limit: int) -> None:
        """(Refused above the limit, as a chat's.)"""
