"""Media through libmtmd: images and audio into a prompt, speech out (docs/vision.md,
docs/audio.md).

One job per module, from the face down::

    _vision   Projector (--mmproj): images and audio clips into prompt tokens and
              embeddings (VisionPrompt, ImageSpan); finding a model's projector file
    _layout   PromptLayout: a tokenized prompt's ids, placeholder ids at each image's
              or clip's positions (VisionPrompt, ImageSpan)
    _audio    an audio clip's length read from its header, refused over the limit before
              any decode, and the bytes its decode takes
    _speech   SpeechEngine: speech from text, one generation at a time

Imports :mod:`trioserve._core` and the backends' abort callback, nothing of a backend.
"""

from ._audio import DECODED_BYTES_PER_SECOND, decoded_bytes, probe_seconds
from ._speech import SpeechEngine
from ._vision import (
    DECODING_PER_PIXEL,
    HELD_PER_PIXEL,
    ImageSpan,
    Projector,
    VisionPrompt,
    check_media_support,
    decode_bytes,
    find_projector,
    is_projector_file,
)

__all__ = [
    "DECODED_BYTES_PER_SECOND",
    "DECODING_PER_PIXEL",
    "HELD_PER_PIXEL",
    "ImageSpan",
    "Projector",
    "SpeechEngine",
    "VisionPrompt",
    "check_media_support",
    "decode_bytes",
    "decoded_bytes",
    "find_projector",
    "is_projector_file",
    "probe_seconds",
]
