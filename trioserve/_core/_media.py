"""Images inside a prompt's text (docs/vision.md): where each image goes, as a marker
the wire writes in place of an image part and the backend finds again after the chat
template has rendered the conversation.

A marker names its image by index (``GenerationRequest.images[k]``) and carries a
random per-process nonce, so text a client writes can never pass for one; a template
that reorders or repeats messages keeps each image where its message went. The backend
hands libmtmd the images in the order their markers appear."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

__all__ = ["RemoteImage", "image_marker", "marker_indices", "split_at_markers"]

_NONCE = secrets.token_hex(6)
_PATTERN = re.compile(rf"<__image_{_NONCE}_(\d+)__>")


@dataclass(frozen=True, slots=True)
class RemoteImage:
    """An image the server fetches before the prompt is prepared: an ``http(s)://``
    URL (``--media-fetch``) or a ``file://`` one (``--media-dir``), named by the field it
    came in (``param``, for the 400 that refuses it)."""

    url: str
    param: str


def image_marker(index: int) -> str:
    """The text that stands for ``GenerationRequest.images[index]`` in a prompt."""
    return f"<__image_{_NONCE}_{index}__>"


def marker_indices(text: str) -> list[int]:
    """The image indices of the markers in ``text``, in order (an image may repeat)."""
    return [int(m) for m in _PATTERN.findall(text)]


def split_at_markers(text: str) -> list[str | int]:
    """``text`` as its pieces: strings between markers, and each marker's index."""
    out: list[str | int] = []
    start = 0
    for match in _PATTERN.finditer(text):
        out.append(text[start : match.start()])
        out.append(int(match.group(1)))
        start = match.end()
    out.append(text[start:])
    return out
