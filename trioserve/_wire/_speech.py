"""``POST /v1/audio/speech``, sans-IO (docs/audio.md, "Speech"): OpenAI's body read and
checked, and the bytes of the answer — a WAV header of unknown length, PCM, or
``speech.audio.delta`` / ``speech.audio.done`` events.

What a request may ask is what the engine can do: one voice (the model's own,
unconditioned: :data:`VOICE`), no ``instructions``, ``speed`` 1.0 only (libmtmd has no
rate control), ``wav`` or ``pcm`` (16-bit little-endian mono at the model's rate); every
other value is refused naming its field. ``seed`` is an extension (the flow net's noise;
docs/audio.md, "Speech", for when it repeats)."""

from __future__ import annotations

import base64
import struct
from typing import Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from ._codec import decode as _decode
from ._codec import encode_json
from ._sse import encode_data

__all__ = [
    "MAX_INPUT_CHARS",
    "VOICE",
    "SpeechRequest",
    "decode_speech_request",
    "speech_delta_event",
    "speech_done_event",
    "speech_error_event",
    "streaming_wav_header",
]

#: the longest ``input`` (characters), OpenAI's limit
MAX_INPUT_CHARS = 4096
#: the one voice a PocketTTS model speaks without a reference clip
VOICE = "default"
#: OpenAI's formats this server cannot encode (it makes PCM only)
_ENCODED_FORMATS = ("mp3", "opus", "aac", "flac")


class VoiceId(msgspec.Struct, kw_only=True):
    """OpenAI's custom voice reference: ``{"id": "voice_1234"}``."""

    id: str


class SpeechRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: the text to speak (1 to :data:`MAX_INPUT_CHARS` characters)
    input: str
    #: the speech model's name (none: the server's speech model)
    model: str | None = None
    #: :data:`VOICE` only (a string, or ``{"id": …}``)
    voice: str | VoiceId = VOICE
    #: refused when given: the model takes no instructions
    instructions: str | None = None
    #: ``wav`` (default here; OpenAI's is ``mp3``, which this server does not encode) or ``pcm``
    response_format: str = "wav"
    #: 1.0 only
    speed: float = 1.0
    #: ``audio`` (the bytes, chunked as they are made) or ``sse`` (base64 events)
    stream_format: Literal["audio", "sse"] = "audio"
    #: an extension: the flow net's noise seed (none: a random one)
    seed: int | None = None


_decoder = msgspec.json.Decoder(SpeechRequest)


def decode_speech_request(body: bytes) -> SpeechRequest:
    """The body, decoded and checked: each refusal a 400 naming its field."""
    request = _decode(_decoder, body)
    text = request.input
    if not text.strip():
        raise InvalidRequestError("input is empty: give the text to speak", param="input")
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidRequestError(
            f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}",
            param="input",
            code="input_too_long",
        )
    voice = request.voice.id if isinstance(request.voice, VoiceId) else request.voice
    if voice != VOICE:
        raise InvalidRequestError(
            f"voice {voice!r} is not served: this model speaks one voice, {VOICE!r} "
            "(it takes no reference clip)",
            param="voice",
            code="unsupported_voice",
        )
    if request.instructions is not None:
        raise InvalidRequestError(
            "instructions are not supported: this speech model takes only the text", param="instructions"
        )
    fmt = request.response_format
    if fmt not in ("wav", "pcm"):
        known = fmt in _ENCODED_FORMATS
        raise InvalidRequestError(
            f"response_format {fmt!r} is not served"
            + (": this server does not encode audio" if known else "")
            + "; use 'wav' or 'pcm' (16-bit little-endian mono PCM)",
            param="response_format",
            code="unsupported_response_format",
        )
    if request.speed != 1.0:
        raise InvalidRequestError(
            f"speed {request.speed:g} is not supported: this speech model speaks at one rate (1.0)",
            param="speed",
        )
    if request.seed is not None and not 0 <= request.seed < 0xFFFFFFFF:
        raise InvalidRequestError(f"seed must be in [0, {0xFFFFFFFF - 1}], got {request.seed}", param="seed")
    return request


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 44-byte WAV header for 16-bit mono PCM of unknown length: the RIFF and data
    sizes 0xFFFFFFFF, as servers that stream WAV write them (the answer begins before its
    length is known); a reader that trusts the sizes reads to the end of the stream."""
    channels, bits = 1, 16
    block = channels * bits // 8
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


def speech_delta_event(audio: bytes) -> bytes:
    """One ``speech.audio.delta`` event: ``audio`` (the answer's bytes) in base64."""
    return encode_data(encode_json({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()}))


def speech_done_event(input_tokens: int, output_tokens: int) -> bytes:
    """The ``speech.audio.done`` event; ``output_tokens``: the frames made."""
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }
    return encode_data(encode_json({"type": "speech.audio.done", "usage": usage}))


def speech_error_event(error: dict[str, object]) -> bytes:
    """A failure after the events began: OpenAI's error object as an event."""
    return encode_data(encode_json({"type": "error", **error}))
