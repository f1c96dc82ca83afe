"""Images inside a prompt's text (docs/vision.md): where each image goes, as a marker
the wire writes in place of an image part and the backend finds again after the chat
template has rendered the conversation.

A marker names its image by index (``GenerationRequest.images[k]``) and carries a
random per-process nonce, so text a client writes can never pass for one; a template
that reorders or repeats messages keeps each image where its message went. The backend
hands libmtmd the images in the order their markers appear.

:class:`ImageBudget`: the bytes of decoded pixels a server holds at once, all requests
and models together (``--image-decode-budget``): a request waits for its share before
its images are decoded (cancellable while it waits), first come first served."""

from __future__ import annotations

import re
import secrets
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

__all__ = [
    "AUDIO_FORMATS",
    "DEFAULT_IMAGE_BUDGET_BYTES",
    "AudioClip",
    "ImageBudget",
    "Media",
    "RemoteImage",
    "default_image_budget",
    "image_marker",
    "marker_indices",
    "split_at_markers",
]

_NONCE = secrets.token_hex(6)
_PATTERN = re.compile(rf"<__image_{_NONCE}_(\d+)__>")


@dataclass(frozen=True, slots=True)
class RemoteImage:
    """An image the server fetches before the prompt is prepared: an ``http(s)://``
    URL (``--media-fetch``) or a ``file://`` one (``--media-dir``), named by the field it
    came in (``param``, for the 400 that refuses it)."""

    url: str
    param: str


#: the audio formats a clip may be in (libmtmd's helper decodes them: miniaudio)
AUDIO_FORMATS = ("wav", "mp3", "flac")


@dataclass(frozen=True, slots=True)
class AudioClip:
    """An audio clip in a prompt (docs/audio.md): an encoded file of ``format`` (one of
    :data:`AUDIO_FORMATS`, its signature checked), named by the field it came in."""

    data: bytes
    format: str
    param: str = "messages"


#: one of a request's media: an encoded image, an image URL to fetch, an audio clip
type Media = bytes | RemoteImage | AudioClip


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


class ImageBudget:
    """At most ``capacity`` bytes held at once by :meth:`hold`: a byte semaphore served in
    arrival order (a large request at the head is not overtaken, so it never starves).

    The event loop's only (no locks): :meth:`hold` is entered by the request's task, and
    the decoding thread runs inside it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an image decode budget must be at least 1 byte, got {capacity}")
        self.capacity = capacity
        #: bytes held now
        self.in_use = 0
        #: the most bytes ever held at once (for tests and /metrics)
        self.peak = 0
        self._waiters: deque[tuple[int, trio.Event]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for their share."""
        return len(self._waiters)

    @asynccontextmanager
    async def hold(self, amount: int) -> AsyncIterator[None]:
        """Hold ``amount`` bytes (≤ :attr:`capacity`: the caller refuses more) for the
        body; wait in line while they are not free. Cancelled while waiting, nothing is
        held and the line moves on."""
        if not 0 <= amount <= self.capacity:
            raise ValueError(f"{amount} bytes can never fit a budget of {self.capacity}")
        if not self._waiters and self.in_use + amount <= self.capacity:
            self._take(amount)
            try:
                await trio.lowlevel.checkpoint()
            except BaseException:
                self._give_back(amount)
                raise
        else:
            granted = trio.Event()
            entry = (amount, granted)
            self._waiters.append(entry)
            try:
                await granted.wait()
            except BaseException:
                if granted.is_set():  # (granted as the cancel came: given back)
                    self._give_back(amount)
                else:
                    self._waiters.remove(entry)
                    self._wake()  # (the ones behind it may fit now)
                raise
        try:
            yield
        finally:
            self._give_back(amount)

    def _take(self, amount: int) -> None:
        self.in_use += amount
        self.peak = max(self.peak, self.in_use)

    def _give_back(self, amount: int) -> None:
        self.in_use -= amount
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            amount, granted = self._waiters.popleft()
            self._take(amount)
            granted.set()


#: ``--image-decode-budget``'s default (bytes): a request of 16 photos of 12 M pixels fits,
#: or one image at the 50 M-pixel limit
DEFAULT_IMAGE_BUDGET_BYTES = 1 << 30
_default_budget: ImageBudget | None = None


def default_image_budget() -> ImageBudget:
    """The budget of models whose settings name none (``LlamaSettings.image_budget``):
    one per process, as ``--image-decode-budget`` makes one per server."""
    global _default_budget
    if _default_budget is None:
        _default_budget = ImageBudget(DEFAULT_IMAGE_BUDGET_BYTES)
    return _default_budget
