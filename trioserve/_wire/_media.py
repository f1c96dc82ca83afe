"""Images in a request's messages, sans-IO (docs/vision.md): each image part becomes a
marker in its message's text, in place (``_core/_media.py``), and the image joins the
request's list — decoded here when it is a data URL, left for the server to fetch when
it is a URL (:class:`~trioserve._core._media.RemoteImage`).

Text and markers are joined as llama-server joins content parts: the dialect's own
joiner between two texts, nothing before or after a marker (``common/chat.cpp``,
``concat_content_parts``)."""

from __future__ import annotations

import binascii
import urllib.parse
from collections.abc import Sequence

from .._core._exceptions import InvalidRequestError
from .._core._media import RemoteImage, image_marker
from ._limits import RequestLimits

__all__ = ["Marker", "MediaCollector", "join_parts"]


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
        self._images: list[bytes | RemoteImage] = []

    @property
    def images(self) -> tuple[bytes | RemoteImage, ...]:
        return tuple(self._images)

    def add(self, url: str, *, param: str, detail: str | None = None, detail_param: str = "") -> Marker:
        """Read one image reference (``url``: a data URL or an http(s)/file URL); the
        marker that stands for it. A 400 naming ``param`` for anything refused."""
        if detail not in (None, "auto", "high"):
            if detail == "low":
                raise InvalidRequestError(
                    "detail 'low' cannot be honoured: this model's projector sees every image at its one "
                    "fixed resolution; send detail 'auto' or 'high', or leave it out",
                    param=detail_param or param,
                    code="unsupported_detail",
                )
            raise InvalidRequestError(
                f"detail must be 'auto', 'high' or 'low', got {detail!r}", param=detail_param or param
            )
        limit = self.limits.max_images
        if len(self._images) >= limit:
            raise InvalidRequestError(
                f"this request holds more than {limit} images; this server accepts at most {limit} "
                "(--max-images)",
                param=param,
                code="too_many_images",
            )
        self._images.append(self._read(url, param))
        return Marker(image_marker(len(self._images) - 1))

    def add_base64(self, data: str, media_type: str | None, *, param: str) -> Marker:
        """An image given as base64 text and its media type (Anthropic's ``source``)."""
        return self.add(f"data:{media_type or ''};base64,{data}", param=param)

    def _read(self, url: str, param: str) -> bytes | RemoteImage:
        if not isinstance(url, str) or not url:
            raise InvalidRequestError("the image needs a URL (a data: URL or an http(s) URL)", param=param)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, param)
        if scheme in ("http", "https", "file"):
            parts = urllib.parse.urlsplit(url)
            if scheme != "file" and not parts.hostname:
                raise InvalidRequestError(
                    f"the image URL {url[:100]!r} names no host", param=param, code="invalid_image_url"
                )
            return RemoteImage(url, param)
        raise InvalidRequestError(
            f"the image URL must be a data: URL (data:image/png;base64,…) or an http(s) URL; got "
            f"{url[:40]!r}…",
            param=param,
            code="invalid_image_url",
        )

    def _data_url(self, url: str, param: str) -> bytes:
        header, comma, payload = url.partition(",")
        if not comma:
            raise InvalidRequestError(
                "a data URL needs a comma before its data (data:image/png;base64,…)",
                param=param,
                code="invalid_image",
            )
        kinds = header[5:].split(";")
        media_type = kinds[0].strip().lower()
        if not media_type.startswith("image/"):
            raise InvalidRequestError(
                f"the data URL's media type must be an image type (image/png, image/jpeg…), got "
                f"{media_type or 'none'!r}",
                param=param,
                code="invalid_image",
            )
        if "base64" not in (k.strip().lower() for k in kinds[1:]):
            raise InvalidRequestError(
                "the image's data URL must be base64 (data:image/png;base64,…)",
                param=param,
                code="invalid_image",
            )
        limit = self.limits.max_image_bytes
        if len(payload) // 4 * 3 > limit + 2:  # (before decoding: the size it would have)
            raise InvalidRequestError(
                f"the image is larger than {limit} bytes (--max-image-bytes)",
                param=param,
                code="image_too_large",
            )
        try:
            data = binascii.a2b_base64(payload.strip(), strict_mode=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(
                "the image's data URL holds invalid base64", param=param, code="invalid_image"
            ) from None
        if not data:
            raise InvalidRequestError("the image's data URL is empty", param=param, code="invalid_image")
        if len(data) > limit:
            raise InvalidRequestError(
                f"the image is larger than {limit} bytes (--max-image-bytes)",
                param=param,
                code="image_too_large",
            )
        return data
