"""libmtmd's PocketTTS helper on the tiny random-weight pair (docs/audio.md, "Speech"):
the engine loads it, streams 16-bit PCM a decode window at a time, and stops at the
next frame when asked."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from tests._speech_model import SAMPLE_RATE, SAMPLES_PER_FRAME, tiny_pockettts
from tests._vision_model import tiny_gemma3_projector
from trioserve import default_model_path
from trioserve._backends._media._speech import WINDOW_FRAMES, SpeechEngine
from trioserve._core._exceptions import BackendError


@pytest.fixture(scope="module")
def terse() -> Iterator[SpeechEngine]:
    engine = SpeechEngine(*tiny_pockettts(), threads=1, n_ctx=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def talkative() -> Iterator[SpeechEngine]:
    engine = SpeechEngine(*tiny_pockettts(talkative=True), threads=1, n_ctx=256)
    yield engine
    engine.close()


def test_the_pair_loads_as_libmtmd_s_pockettts_at_24_khz(terse: SpeechEngine) -> None:
    assert terse.sample_rate == SAMPLE_RATE
    assert terse.variant == "english"


def test_a_sentence_ends_at_the_end_of_speech_head_its_samples_its_frames(terse: SpeechEngine) -> None:
    chunks: list[bytes] = []
    never = threading.Event()
    result = terse.generate("Hello there, how are you?", emit=chunks.append, cancelled=never, seed=7)
    # the head fires on the first frame; the helper then keeps its tail (3 frames for a
    # chunk of more than 6 tokens) and drops the stopping frame
    assert (result.frames, result.stopped) == (3, False)
    pcm = numpy.frombuffer(b"".join(chunks), dtype="<i2")
    assert result.samples == pcm.size == 3 * SAMPLES_PER_FRAME
    assert numpy.abs(pcm).max() > 0  # (sound, not silence: random weights, real computation)


def test_samples_arrive_a_decode_window_at_a_time(talkative: SpeechEngine) -> None:
    sizes: list[int] = []
    result = talkative.generate(
        "A longer sentence that runs to its budget.",
        emit=lambda b: sizes.append(len(b)),
        cancelled=threading.Event(),
        seed=7,
        max_frames=2 * WINDOW_FRAMES + 3,
    )
    window = WINDOW_FRAMES * SAMPLES_PER_FRAME * 2
    assert sizes == [window, window, 3 * SAMPLES_PER_FRAME * 2]
    assert result.frames == 2 * WINDOW_FRAMES + 3
    assert not result.stopped


def test_a_cancel_stops_the_generation_before_the_next_frame(talkative: SpeechEngine) -> None:
    stop = threading.Event()
    sizes: list[int] = []

    def emit(data: bytes) -> None:
        sizes.append(len(data))
        stop.set()  # (the client left after its first audio)

    text = "Keep talking until someone leaves the room."
    result = talkative.generate(text, emit=emit, cancelled=stop, seed=7)
    assert result.stopped
    assert result.frames == WINDOW_FRAMES  # not one frame more than the window emitted
    assert sizes == [WINDOW_FRAMES * SAMPLES_PER_FRAME * 2]


def test_a_projector_without_a_generator_is_refused_by_name() -> None:
    with pytest.raises(BackendError, match="not a PocketTTS generator"):
        SpeechEngine(Path(default_model_path(progress=False)), tiny_gemma3_projector(), threads=1, n_ctx=256)
