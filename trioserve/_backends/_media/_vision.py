"""A model's projector (``--mmproj``) through libmtmd: images into prompt tokens and
embeddings (docs/vision.md).

:class:`Projector` loads the projector beside its model and turns a prompt whose text
holds images (``_core/_media.py``'s markers) into a :class:`VisionPrompt`: the token ids
of its text, and at each image's positions a *placeholder id* made from the image's
content (≥ ``n_vocab``: never a real token), so the token list is an exact cache key;
and the image's libmtmd chunk, encoded only when its cells are evaluated (a second turn
about the same image restores them from the cache and encodes nothing). The token list
is laid out by the projector's :class:`~._layout.PromptLayout`.

Encoding stops on a cancel: libmtmd has no abort callback, but ggml's graph-evaluation
callback (``cb_eval``, the C check in ``_abort.c``) is asked after every node of the
vision tower and stops the graph when the scheduler's abort flag is up; the encode
then returns with garbage embeddings, which the caller (who raised the flag) drops.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import io
import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from ..._core._exceptions import BackendError, InvalidRequestError
from ..._core._media import AudioClip
from .._aborting import LoadAborted
from ._audio import check_seconds
from ._layout import Chunks, ImageSpan, PromptLayout, VisionPrompt

__all__ = ["ImageSpan", "Projector", "VisionPrompt", "check_media_support", "decode_bytes", "find_projector"]

logger = logging.getLogger("trioserve.vision")

#: the largest image (pixels, read from its header before it is decoded)
MAX_PIXELS = 50_000_000
#: what decoding holds per pixel: the RGB bitmap libmtmd keeps until the prompt is laid
#: out, and — for the one image being decoded — the decoder's working buffers (stb_image:
#: a 16-bit RGBA PNG's inflated rows and image, 8 + 8 bytes a pixel, the worst it reads)
HELD_PER_PIXEL, DECODING_PER_PIXEL = 3, 16


def decode_bytes(pixels: Sequence[int]) -> int:
    """The memory a request's images take while they are decoded and laid out (its share
    of the decode budget): every image's bitmap, held together, and the working buffers
    of the largest (one is decoded at a time)."""
    if not pixels:
        return 0
    return HELD_PER_PIXEL * sum(pixels) + DECODING_PER_PIXEL * max(pixels)


def check_media_support(projector: Projector | None, model_id: str, media: Sequence[object]) -> None:
    """A 400 for media the model cannot read: images without a vision projector
    (``images_not_supported``), audio without an audio one (``audio_not_supported``)."""
    audio = any(isinstance(m, AudioClip) for m in media)
    images = any(not isinstance(m, AudioClip) for m in media)
    if audio and (projector is None or not projector.audio):
        raise InvalidRequestError(
            f"the model {model_id!r} does not take audio: it has no audio projector (serve it with "
            "--mmproj FILE of an audio model — Ultravox, Voxtral, Qwen2-Audio… — or a preset's mmproj "
            "key); send text only",
            param="messages",
            code="audio_not_supported",
        )
    if images and (projector is None or not projector.vision):
        raise InvalidRequestError(
            f"the model {model_id!r} does not take images: it has no vision projector "
            "(serve it with --mmproj FILE, or a preset's mmproj key); send text only",
            param="messages",
            code="images_not_supported",
        )


def find_projector(model_path: Path) -> Path | None:
    """A projector beside a model in a models directory, by name (llama-server's and
    LM Studio's conventions): ``mmproj-<model>.gguf``, ``<model>-mmproj.gguf``,
    ``<model>.mmproj.gguf``, or one ``mmproj*.gguf`` whose name holds the model's."""
    stem = model_path.name.removesuffix(".gguf")
    folder = model_path.parent
    for name in (f"mmproj-{stem}.gguf", f"{stem}-mmproj.gguf", f"{stem}.mmproj.gguf"):
        if (folder / name).is_file():
            return folder / name
    matches = sorted(
        p for p in folder.glob("*.gguf") if "mmproj" in p.name.lower() and stem.lower() in p.name.lower()
    )
    return matches[0] if len(matches) == 1 else None


def is_projector_file(path: Path) -> bool:
    """A GGUF a models directory lists as a projector, not as a model of its own."""
    return "mmproj" in path.name.lower()


class Projector:
    """libmtmd's context for one model's projector (made in the model's load thread;
    encodes run on the scheduler thread, tokenizing on worker threads)."""

    def __init__(
        self,
        model: Any,
        path: Path,
        *,
        n_vocab: int,
        n_embd: int,
        n_threads: int,
        abort: threading.Event | None = None,
        log_callback: Any = None,
    ) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.mtmd = mtmd_cpp
        if log_callback is not None:
            mtmd_cpp.mtmd_log_set(log_callback, None)
            mtmd_cpp.mtmd_helper_log_set(log_callback, None)
        self.path = path
        self.n_vocab = n_vocab
        self.n_embd = n_embd
        if not path.is_file():
            raise FileNotFoundError(f"projector file not found: {path}")
        stat = path.stat()
        # what the placeholder ids are made from besides an image: the projector (a
        # cached image's cells are its embeddings; the disk tier's fingerprint holds
        # the projector's content hash too)
        seed = hashlib.blake2b(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).digest()
        #: the token list of a prompt's chunks, with the media's placeholder ids
        self._layout = PromptLayout(mtmd_cpp, n_vocab=n_vocab, seed=seed)
        # (libmtmd splits its text at this marker: one no client text can hold)
        self.marker = f"<__mtmd_{secrets.token_hex(8)}__>"
        self._marker_bytes = self.marker.encode()
        # the abort check reads the flag this slot points to (set by the scheduler)
        self._flag_slot = ctypes.c_void_p(None)
        abort_module = importlib.import_module("trioserve._backends._abort")
        self._eval_check = llama_cpp.ggml_backend_sched_eval_callback(abort_module.EVAL_CHECK_ADDRESS)

        def on_progress(_value: float, _data: object) -> bool:
            return abort is None or not abort.is_set()

        self._progress = mtmd_cpp.mtmd_progress_callback(on_progress)
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = n_threads
        params.warmup = True
        params.media_marker = self._marker_bytes
        params.cb_eval = self._eval_check
        params.cb_eval_user_data = ctypes.addressof(self._flag_slot)
        params.progress_callback = self._progress
        self.ctx = mtmd_cpp.mtmd_init_from_file(str(path).encode(), model, params)
        if not self.ctx:
            if abort is not None and abort.is_set():
                raise LoadAborted(f"the load of {path} was aborted")
            raise BackendError(f"libmtmd could not load the projector {path} for this model")
        #: what it encodes: images, audio (docs/audio.md), or both
        self.vision = bool(mtmd_cpp.mtmd_support_vision(self.ctx))
        self.audio = bool(mtmd_cpp.mtmd_support_audio(self.ctx))
        #: the sample rate libmtmd resamples clips to (Hz; 0: no audio)
        self.sample_rate = max(0, int(mtmd_cpp.mtmd_get_audio_sample_rate(self.ctx))) if self.audio else 0
        try:
            if not (self.vision or self.audio):
                raise BackendError(f"{path} is neither a vision nor an audio projector (libmtmd: no input)")
            if mtmd_cpp.mtmd_decode_use_mrope(self.ctx):
                raise BackendError(
                    f"{path} places media tokens with M-RoPE (Qwen2-VL, Qwen2.5-Omni and kin), which "
                    "trioserve does not support yet (docs/vision.md)"
                )
        except BaseException:
            self.free()
            raise
        #: gemma3 and kin attend inside an image both ways: its cells in one call
        #: (an audio chunk never: its attention is causal — libmtmd's own answer for
        #: every audio projector; the executor asks only for images)
        self.non_causal = self.vision and bool(mtmd_cpp.mtmd_decode_use_non_causal(self.ctx, None))
        #: images encoded, and encodes the abort flag stopped
        self.encodes = 0
        self.aborted_encodes = 0
        #: a test seam: called on the scheduler thread right before each encode
        self.before_encode: Callable[[], None] | None = None

    def free(self) -> None:
        if self.ctx:
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def watch(self, flag: ctypes.c_ubyte | None) -> None:
        """Stop encodes when ``flag`` is up (the scheduler's abort flag)."""
        self._flag_slot.value = ctypes.addressof(flag) if flag is not None else None

    @property
    def abort_requested(self) -> bool:
        """The watched abort flag is up (an encode now would stop at its first node)."""
        address = self._flag_slot.value
        return bool(address and ctypes.c_ubyte.from_address(address).value)

    # ------------------------------------------------------------- tokenizing

    def measure(self, data: bytes, what: str) -> int:
        """An image's pixels, read from its header by Pillow without decoding it; a 400
        for any image Pillow cannot read (every error Pillow raises, its decompression
        bomb check's included) or one over :data:`MAX_PIXELS`. Blocking (a worker
        thread's): a header can sit behind megabytes of metadata."""
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            # (Pillow's own cap, 2 × 89 M pixels — a warning from 89 M, raised where
            # warnings are errors): over ours in any case
            raise InvalidRequestError(
                f"{what} is larger than this server decodes ({exc}); images may have at most "
                f"{MAX_PIXELS:,} pixels",
                param="messages",
                code="image_too_large",
            ) from None
        except Exception as exc:  # (an untrusted file: whatever Pillow raises, it is unreadable)
            raise InvalidRequestError(
                f"{what} is not an image this server can read (PNG, JPEG, GIF, BMP…): "
                f"{type(exc).__name__}: {exc}",
                param="messages",
                code="invalid_image",
            ) from None
        pixels = width * height
        if pixels > MAX_PIXELS:
            raise InvalidRequestError(
                f"{what} is {width}×{height} pixels; images may have at most {MAX_PIXELS:,} pixels",
                param="messages",
                code="image_too_large",
            )
        return pixels

    def tokenize(
        self,
        pieces: Sequence[str | int],
        images: Sequence[bytes | AudioClip],
        pixels: Mapping[int, int],
        *,
        add_bos: bool,
        param: str = "messages",
        check: Callable[[], None] = lambda: None,
        max_audio_seconds: int = 0,
    ) -> VisionPrompt:
        """``pieces`` (text, and media indices into ``images``) as a :class:`VisionPrompt`
        (blocking: each image or clip is decoded; a worker thread's work, inside the
        request's share of the decode budget). ``pixels``: each image's, measured by
        :meth:`measure`; ``check``: called before each decode (raises to stop: the
        request was cancelled); ``max_audio_seconds``: a clip's decoded length's limit."""
        mtmd = self.mtmd
        parts: list[str] = []
        bitmaps: list[Any] = []
        digests: list[bytes] = []
        clips: dict[bytes, bytes] = {}
        made: dict[int, tuple[Any, bytes]] = {}
        try:
            for piece in pieces:
                if isinstance(piece, str):
                    parts.append(piece)
                    continue
                medium = images[piece]
                if piece not in made:
                    check()
                    if isinstance(medium, AudioClip):
                        made[piece] = self._audio_bitmap(medium, piece, max_audio_seconds)
                        clips[f"trioserve-audio-{piece}".encode()] = made[piece][1]
                    else:
                        made[piece] = self._bitmap(medium, f"{param} (image {piece})", pixels[piece])
                bitmap, digest = made[piece]
                bitmaps.append(bitmap)
                if not isinstance(medium, AudioClip):
                    digests.append(digest)
                parts.append(self.marker)
            text = "".join(parts).encode()
            handle = mtmd.mtmd_input_chunks_init()
            chunks = Chunks(mtmd, handle)
            given = mtmd.mtmd_input_text(
                text=text, text_len=len(text), add_special=add_bos, parse_special=True
            )
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self.ctx, handle, ctypes.byref(given), array, len(bitmaps))
        finally:
            for bitmap, _ in made.values():
                mtmd.mtmd_bitmap_free(bitmap)
        if rc != 0:
            raise InvalidRequestError(
                f"libmtmd could not lay out this prompt's {len(bitmaps)} image(s) or clip(s) "
                f"(mtmd_tokenize: {rc})",
                param=param,
                code="invalid_image",
            )
        return self._layout.lay_out(chunks, digests, clips)

    def _audio_bitmap(self, clip: AudioClip, piece: int, max_seconds: int) -> tuple[Any, bytes]:
        """One clip decoded by libmtmd's helper (miniaudio: resampled to the projector's
        rate, mono f32), its decoded length checked, and its digest: of its samples,
        read in place. Its id names the piece, so its chunks can be told from the next
        clip's (``PromptLayout.lay_out``)."""
        mtmd = self.mtmd
        if not self.audio:
            raise InvalidRequestError(
                f"{self.path.name} encodes images only; this model takes no audio (serve it with an "
                "audio projector: --mmproj FILE)",
                param=clip.param,
                code="audio_not_supported",
            )
        buffer = ctypes.cast(ctypes.c_char_p(clip.data), ctypes.POINTER(ctypes.c_uint8))
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, cast("Any", buffer), len(clip.data), False)
        if not bitmap:
            raise InvalidRequestError(
                f"the audio clip could not be decoded as {clip.format} (libmtmd: miniaudio)",
                param=clip.param,
                code="invalid_audio",
            )
        try:
            if not mtmd.mtmd_bitmap_is_audio(bitmap):  # (its signature was checked: never)
                raise InvalidRequestError("the audio clip was read as an image", param=clip.param)
            n = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
            seconds = n / 4 / max(1, self.sample_rate)
            if max_seconds:
                check_seconds(seconds, max_seconds, clip.param)
            view = memoryview(
                ctypes.cast(mtmd.mtmd_bitmap_get_data(bitmap), ctypes.POINTER(ctypes.c_uint8 * n)).contents
            )
            digest = hashlib.blake2b(view, digest_size=32, person=b"trioserve-audio")
            digest.update(f"|{self.sample_rate}".encode())
            mtmd.mtmd_bitmap_set_id(bitmap, f"trioserve-audio-{piece}".encode())
        except BaseException:
            mtmd.mtmd_bitmap_free(bitmap)
            raise
        return bitmap, digest.digest()

    def _bitmap(self, data: bytes, what: str, pixels: int) -> tuple[Any, bytes]:
        """One image decoded (``pixels``: what its header declared), and its digest: of
        its decoded pixels, read in place (no copy)."""
        # (the encoded bytes are read in place too: libmtmd's decoder only reads them)
        buffer = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        bitmap = self.mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, cast("Any", buffer), len(data), False)
        if not bitmap:
            raise InvalidRequestError(
                f"{what} could not be decoded (libmtmd reads PNG, JPEG, BMP, GIF, TGA, PSD…)",
                param="messages",
                code="invalid_image",
            )
        try:
            nx, ny = self.mtmd.mtmd_bitmap_get_nx(bitmap), self.mtmd.mtmd_bitmap_get_ny(bitmap)
            if nx * ny > pixels:  # (a file read one way by Pillow, another by the decoder)
                raise InvalidRequestError(
                    f"{what} decoded to {nx}×{ny} pixels, more than its header declared",
                    param="messages",
                    code="invalid_image",
                )
            n = self.mtmd.mtmd_bitmap_get_n_bytes(bitmap)
            data_pointer = self.mtmd.mtmd_bitmap_get_data(bitmap)
            view = memoryview(ctypes.cast(data_pointer, ctypes.POINTER(ctypes.c_uint8 * n)).contents)
            digest = hashlib.blake2b(view, digest_size=32, person=b"trioserve-image")
        except BaseException:
            self.mtmd.mtmd_bitmap_free(bitmap)
            raise
        digest.update(f"|{nx}x{ny}".encode())
        return bitmap, digest.digest()

    # --------------------------------------------------------------- encoding

    def encode(self, chunks: Chunks, span: ImageSpan, into: Any, aborted: Callable[[], bool]) -> bool:
        """Encode ``span``'s image and copy its ``length × n_embd`` floats to ``into``
        (a ctypes float pointer: the batch's ``embd``). False: stopped by the abort flag
        (``aborted()``), nothing usable written. Blocking: the scheduler thread's."""
        mtmd = self.mtmd
        if self.before_encode is not None:
            self.before_encode()
        rc = mtmd.mtmd_encode_chunk(self.ctx, chunks.get(span.chunk))
        if aborted():
            self.aborted_encodes += 1
            return False
        if rc != 0:
            raise BackendError(f"libmtmd could not encode an image (mtmd_encode_chunk: {rc})")
        out = mtmd.mtmd_get_output_embd(self.ctx)
        ctypes.memmove(into, out, span.length * self.n_embd * ctypes.sizeof(ctypes.c_float))
        self.encodes += 1
        return True
