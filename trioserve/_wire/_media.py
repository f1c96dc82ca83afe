"""Images and audio clips in a request's messages, sans-IO (docs/vision.md, docs/audio.md):
each image or audio part becomes a
marker in its message's text, in place (``_core/_media.py``), and the image joins the
request's list — decoded here when it is a data URL, left for the server to fetch when
it is a URL (:class:`~trioserve._core._media.RemoteImage`).

Text and markers are joined as llama-server joins content parts for a template that
takes a string: the dialect's own joiner between two texts, nothing before or after a
marker (``common/chat.cpp``, ``concat_content_parts``; its ``--no-jinja`` path puts a
newline between every two parts instead)."""

from __future__ import annotations

import binascii
import urllib.parse
from collections.abc import Sequence

from .._core._exceptions import InvalidRequestError
from .._core._media import AUDIO_FORMATS, AudioClip, Media, RemoteImage, image_marker
from ._limits import RequestLimits

__all__ = ["Marker", "MediaCollector", "check_audio_signature", "join_parts"]


class Marker(str):
    """A part's text that is an image's marker (joined without separators)."""

    __slots__ = ()


def join_parts(parts: Sequence[str], joiner: str) -> str:
    """Texts joined by ``joiner``; a :class:`Marker` joined to its neighbours as it is."""
    out: list[str] = []
    after_marker = False
    for part in parts:
        marker = isinstance(part, Marker)
        if out and not marker and not after_marker:
            out.append(joiner)
        out.append(part)
        after_marker = marker
    return "".join(out)


class MediaCollector:
    """One request's images, in the order their parts were read."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self._images: list[Media] = []

    @property
    def images(self) -> tuple[Media, ...]:
        return tuple(self._images)

    def add(
        self, url: str, *, param: str, detail: str | None = None, detail_param: str | None = None
    ) -> Marker:
        """Read one image reference (``url``: a data URL, or an http(s) or file URL that
        the server fetches later); the marker that stands for it. A 400 naming ``param``
        (``detail_param`` for ``detail``) for anything refused."""
        _check_detail(detail, detail_param or param)
        self._check_count(param)
        return self._append(self._read(url, param))

    def add_base64(self, data: str, media_type: str | None, *, param: str) -> Marker:
        """An image given as base64 text and its media type (Anthropic's ``source``:
        ``param`` names it; a refusal names its ``media_type`` or its ``data``)."""
        self._check_count(param)
        _check_media_type(media_type, f"{param}.media_type", "source.media_type")
        return self._append(self._decode(data, f"{param}.data"))

    def add_bare_base64(self, data: str, *, param: str) -> Marker:
        """An image given as bare base64, its type read from its bytes (Ollama's
        ``images``)."""
        self._check_count(param)
        return self._append(self._decode(data, param))

    def add_audio(self, data: str | None, audio_format: str | None, *, param: str) -> Marker:
        """An audio clip given as base64 text and its format (OpenAI's ``input_audio``:
        ``param`` names it; a refusal names its ``data`` or its ``format``)."""
        limit = self.limits.max_audio_parts
        if sum(isinstance(m, AudioClip) for m in self._images) >= limit:
            raise InvalidRequestError(
                f"this request holds more than {limit} audio parts; this server accepts at most {limit} "
                "(--max-audio-parts)",
                param=param,
                code="too_many_audio_parts",
            )
        if audio_format not in AUDIO_FORMATS:
            raise InvalidRequestError(
                f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)}; got {audio_format!r}",
                param=f"{param}.format",
                code="invalid_audio",
            )
        where = f"{param}.data"
        if not data:
            raise InvalidRequestError(
                "input_audio.data needs the clip, base64", param=where, code="invalid_audio"
            )
        limit_bytes = self.limits.max_audio_bytes
        payload = data.strip()
        if len(payload) // 4 * 3 > limit_bytes + 2:
            raise _audio_too_large(limit_bytes, where)
        try:
            clip = binascii.a2b_base64(payload, strict_mode=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(
                "input_audio.data is not valid base64", param=where, code="invalid_audio"
            ) from None
        if len(clip) > limit_bytes:
            raise _audio_too_large(limit_bytes, where)
        check_audio_signature(clip, audio_format, where)
        return self._append(AudioClip(clip, audio_format, where))

    def _append(self, image: Media) -> Marker:
        self._images.append(image)
        return Marker(image_marker(len(self._images) - 1))

    def _check_count(self, param: str) -> None:
        limit = self.limits.max_images
        if sum(not isinstance(m, AudioClip) for m in self._images) >= limit:
            raise InvalidRequestError(
                f"this request holds more than {limit} images; this server accepts at most {limit} "
                "(--max-images)",
                param=param,
                code="too_many_images",
            )

    def _read(self, url: str, param: str) -> Media:
        if not url:
            raise InvalidRequestError(
                "the image needs a URL (a data: URL or an http(s) URL)", param=param, code="invalid_image_url"
            )
        scheme, colon, rest = url.partition(":")
        scheme = scheme.lower() if colon else ""
        if scheme == "data":
            return self._data_url(rest, param)
        if scheme in ("http", "https", "file"):
            _check_url(url, scheme, param)
            return RemoteImage(url, param)
        raise InvalidRequestError(
            f"the image URL must be a data: URL (data:image/png;base64,…), an http(s) URL or a file:// URL; "
            f"got {url[:40]!r}",
            param=param,
            code="invalid_image_url",
        )

    def _data_url(self, rest: str, param: str) -> bytes:
        header, comma, payload = rest.partition(",")
        if not comma:
            raise _invalid("a data URL needs a comma before its data (data:image/png;base64,…)", param)
        kinds = header.split(";")
        _check_media_type(kinds[0], param, "the data URL's media type")
        if "base64" not in (k.strip().lower() for k in kinds[1:]):
            raise _invalid("the image's data URL must be base64 (data:image/png;base64,…)", param)
        return self._decode(payload, param)

    def _decode(self, payload: str, param: str) -> bytes:
        """Strict base64 (surrounding whitespace aside), at most ``max_image_bytes``
        decoded: a payload too long for that is refused before it is decoded."""
        limit = self.limits.max_image_bytes
        payload = payload.strip()
        if len(payload) // 4 * 3 > limit + 2:  # (at least this many bytes once decoded)
            raise _too_large(limit, param)
        try:
            data = binascii.a2b_base64(payload, strict_mode=True)
        except (binascii.Error, ValueError):
            raise _invalid("the image's data is not valid base64", param) from None
        if not data:
            raise _invalid("the image's data is empty", param)
        if len(data) > limit:
            raise _too_large(limit, param)
        return data


def check_audio_signature(clip: bytes, audio_format: str, param: str) -> None:
    """Refuse a clip whose first bytes are not its format's (libmtmd's helper tells audio
    from images by them: a clip it did not take for audio it would decode as an image)."""
    head = clip[:12]
    if audio_format == "wav":
        ok = len(head) == 12 and head[:4] == b"RIFF" and head[8:12] == b"WAVE"
    elif audio_format == "flac":
        ok = head[:4] == b"fLaC"
    else:  # mp3: an ID3 tag or an MPEG frame's sync word
        ok = len(head) >= 12 and (head[:3] == b"ID3" or (head[0] == 0xFF and head[1] & 0xE0 == 0xE0))
    if not ok:
        raise InvalidRequestError(
            f"the audio clip is not a {audio_format} file (its first bytes are not a {audio_format} file's)",
            param=param,
            code="invalid_audio",
        )


def _audio_too_large(limit: int, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the audio clip is larger than {limit} bytes, this server's limit for one clip (--max-audio-bytes)",
        param=param,
        code="audio_too_large",
    )


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_image")


def _too_large(limit: int, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the image is larger than {limit} bytes, this server's limit for one image (--max-image-bytes)",
        param=param,
        code="image_too_large",
    )


def _check_detail(detail: str | None, param: str) -> None:
    if detail in (None, "auto", "high"):
        return
    if detail == "low":
        raise InvalidRequestError(
            "detail 'low' cannot be honoured: this model's projector sees every image at its one "
            "fixed resolution, there is no lower one; send detail 'auto' or 'high', or leave it out",
            param=param,
            code="unsupported_detail",
        )
    raise InvalidRequestError(f"detail must be 'auto', 'high' or 'low', got {detail!r}", param=param)


def _check_media_type(media_type: str | None, param: str, what: str) -> None:
    kind = (media_type or "").strip().lower()
    if not kind.startswith("image/") or kind == "image/":
        raise _invalid(
            f"{what} must be an image type (image/png, image/jpeg…), got {kind or 'none'!r}", param
        )


def _check_url(url: str, scheme: str, param: str) -> None:
    """Refuse an http(s) or file URL that is not one (the server decides later whether
    it may fetch it)."""
    problem = None
    if any(c <= " " or c == "\x7f" for c in url):
        problem = "holds whitespace or control characters (percent-encode them)"
    else:
        try:
            parts = urllib.parse.urlsplit(url)
            _ = parts.port  # (a port out of range raises)
        except ValueError as exc:
            problem = f"is malformed ({exc})"
        else:
            if scheme != "file" and not parts.hostname:
                problem = "names no host"
    if problem is not None:
        raise InvalidRequestError(
            f"the image URL {url[:100]!r} {problem}", param=param, code="invalid_image_url"
        )
