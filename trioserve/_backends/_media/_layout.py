"""A tokenized prompt with media, laid out (docs/vision.md): the token ids of its text,
and at each image's or clip's positions *placeholder ids* made from the projector, the
medium's content and the position (≥ ``n_vocab``: never a real token), so the token
list is an exact cache key; and libmtmd's chunks, which :class:`~._vision.Projector`
encodes when their cells are evaluated.
"""

from __future__ import annotations

import ctypes
import hashlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._core._exceptions import InvalidRequestError

__all__ = ["Chunks", "ImageSpan", "PromptLayout", "VisionPrompt"]

#: placeholder ids lie in [n_vocab, _ID_CEILING): llama_token is an int32
_ID_CEILING = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image's positions in a prompt: ``start``, ``length`` tokens, its chunk."""

    start: int
    length: int
    #: the chunk's index in :attr:`VisionPrompt.chunks`
    chunk: int
    #: an audio chunk (docs/audio.md: 30 seconds of a clip), not an image
    audio: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


class Chunks:
    """libmtmd's tokenized chunks of one prompt (freed when the last holder lets go:
    the prepared prompt, and the sequence that evaluates it)."""

    def __init__(self, mtmd: Any, handle: Any) -> None:
        self.mtmd = mtmd
        self.handle = handle
        self._finalizer = weakref.finalize(self, mtmd.mtmd_input_chunks_free, handle)

    def get(self, index: int) -> Any:
        return self.mtmd.mtmd_input_chunks_get(self.handle, index)


@dataclass(frozen=True, slots=True)
class VisionPrompt:
    """A prompt with images, tokenized: ``tokens`` (placeholders at image positions),
    the images' spans in order, and the chunks that encode them."""

    tokens: list[int]
    spans: tuple[ImageSpan, ...]
    chunks: Chunks

    @property
    def image_tokens(self) -> int:
        return sum(span.length for span in self.spans if not span.audio)


class PromptLayout:
    """Lays out libmtmd's chunks of a prompt as a :class:`VisionPrompt`: text chunks'
    ids, and each medium's placeholder ids (``n_vocab``: the model's; ``seed``: what
    the ids are made from besides a medium — the projector)."""

    __slots__ = ("_seed", "mtmd", "n_vocab")

    def __init__(self, mtmd: Any, *, n_vocab: int, seed: bytes) -> None:
        self.mtmd = mtmd
        self.n_vocab = n_vocab
        self._seed = seed

    def lay_out(self, chunks: Chunks, digests: list[bytes], clips: Mapping[bytes, bytes]) -> VisionPrompt:
        mtmd = self.mtmd
        tokens: list[int] = []
        spans: list[ImageSpan] = []
        n = mtmd.mtmd_input_chunks_size(chunks.handle)
        images = iter(digests)
        #: the clip the last chunk was of, and that chunk's index in it
        clip, part = b"", 0
        for index in range(n):
            chunk = chunks.get(index)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                tokens.extend(ids[i] for i in range(count.value))
                clip = b""
                continue
            length = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                # a clip is one chunk per 30 seconds begun: each chunk's ids from the
                # clip's samples and the chunk's index in it
                named = mtmd.mtmd_input_chunk_get_id(chunk) or b""
                part = part + 1 if named == clip else 0
                clip = named
                digest = hashlib.blake2b(part.to_bytes(4, "little"), key=clips[named][:64]).digest()
                spans.append(ImageSpan(len(tokens), length, index, audio=True))
                tokens.extend(self.placeholders(digest, length))
                continue
            if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                raise InvalidRequestError(
                    f"libmtmd laid out a chunk of unknown type {kind}", param="messages"
                )
            clip = b""
            spans.append(ImageSpan(len(tokens), length, index))
            tokens.extend(self.placeholders(next(images), length))
        return VisionPrompt(tokens, tuple(spans), chunks)

    def placeholders(self, digest: bytes, length: int) -> list[int]:
        """An image's placeholder ids: one per position, each from the projector, the
        image's content and the position (two different images agree at a position
        with probability ~2⁻³⁰, at all of an image's positions never in practice). The
        first sits at an even offset from ``n_vocab``, the others at odd ones: where one
        image ends and the next starts shows in the ids (``_pieces.image_runs``)."""
        half = (_ID_CEILING - self.n_vocab) // 2
        base = hashlib.blake2b(digest, digest_size=32, key=self._seed).digest()
        out = []
        for i in range(length):
            value = int.from_bytes(hashlib.blake2b(i.to_bytes(4, "little"), key=base).digest()[:8], "little")
            out.append(self.n_vocab + 2 * (value % half) + (1 if i else 0))
        return out
