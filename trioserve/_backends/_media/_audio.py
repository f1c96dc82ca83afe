"""Audio clips before libmtmd decodes them (docs/audio.md): each clip's length read from
its header (mutagen: nothing decoded), refused over the limit before any decode, and the
memory its decode takes (a share of the decode budget images use too)."""

from __future__ import annotations

import io

from ..._core._exceptions import InvalidRequestError
from ..._core._media import AudioClip

__all__ = ["DECODED_BYTES_PER_SECOND", "check_seconds", "decoded_bytes", "probe_seconds"]

#: what a second of audio takes decoded, at the rate libmtmd's audio projectors take
#: (Whisper's 16 kHz, mono f32), twice: miniaudio's samples and the bitmap libmtmd
#: copies them into are held together while the helper returns
DECODED_BYTES_PER_SECOND = 2 * 4 * 16_000


def decoded_bytes(seconds: float) -> int:
    """The decode budget a clip of ``seconds`` takes."""
    return int(DECODED_BYTES_PER_SECOND * max(seconds, 1.0))


def probe_seconds(clip: AudioClip, limit: int) -> float:
    """The clip's length in seconds, read from its header by mutagen (blocking: a worker
    thread's); a 400 naming ``--max-audio-seconds`` over ``limit``, a 400
    ``invalid_audio`` for a header mutagen cannot read or one that names no length."""
    import mutagen
    import mutagen.flac
    import mutagen.mp3
    import mutagen.wave

    reader = {"wav": mutagen.wave.WAVE, "mp3": mutagen.mp3.MP3, "flac": mutagen.flac.FLAC}[clip.format]
    try:
        info = reader(io.BytesIO(clip.data)).info  # type: ignore[no-untyped-call]
    except (mutagen.MutagenError, ValueError, EOFError, OverflowError) as exc:
        raise InvalidRequestError(
            f"the audio clip is not a {clip.format} file this server can read ({exc})",
            param=clip.param,
            code="invalid_audio",
        ) from None
    seconds = float(getattr(info, "length", 0.0) or 0.0)
    if seconds <= 0.0:
        raise InvalidRequestError(
            f"the audio clip's {clip.format} header names no length (a stream of unknown length "
            "cannot be bounded before it is decoded); send a file that states its length",
            param=clip.param,
            code="invalid_audio",
        )
    check_seconds(seconds, limit, clip.param)
    return seconds


def check_seconds(seconds: float, limit: int, param: str) -> None:
    """A 400 naming ``--max-audio-seconds`` for a clip longer than ``limit``."""
    if seconds > limit:
        raise InvalidRequestError(
            f"the audio clip is {seconds:,.1f} seconds long; this model takes clips of at most "
            f"{limit} seconds (--max-audio-seconds)",
            param=param,
            code="audio_too_long",
        )
