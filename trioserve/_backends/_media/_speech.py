"""Speech from text through libmtmd's generation helper (docs/audio.md, "Speech").

A speaking model is two files: a backbone (``pockettts``, ``qwen3tts``) and an mmproj
whose generator libmtmd reports in ``mtmd_gen_audio_get_info``. :class:`SpeechEngine`
holds both (the backbone's context with embeddings on: the helper reads its hidden
states) and runs one generation at a time, in the calling thread (a worker thread: every
call here is CPU work): ``set_input``, ``step_prompt`` until done, then one
``step_gen`` a frame, the samples read back (``get_output``, float PCM) every
:data:`WINDOW_FRAMES` frames — the helper's own decode window, so reading adds no decode
call — and at the end. Each window's new samples go to ``emit`` as 16-bit little-endian
PCM as soon as they exist; ``cancelled`` is asked before every frame, so a client that
leaves stops the generation within one frame.

Only PocketTTS is driven: it needs no token from the backbone (its frames come from the
hidden state). Qwen3-TTS samples a codec token from the backbone's logits each frame, a
sampler this engine does not run: such an mmproj is refused at load, by name.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

from ..._core._exceptions import BackendError, InvalidRequestError

__all__ = ["WINDOW_FRAMES", "SpeechEngine", "SpeechResult"]

#: frames the PocketTTS helper decodes at once (``window_frames`` in mtmd-helper-gen.cpp)
WINDOW_FRAMES = 8


class SpeechResult:
    """What one generation made: frames, samples, and whether it was stopped."""

    __slots__ = ("frames", "samples", "stopped", "tokens")

    def __init__(self, frames: int, samples: int, tokens: int, stopped: bool) -> None:
        self.frames, self.samples, self.tokens, self.stopped = frames, samples, tokens, stopped


class SpeechEngine:
    """A loaded text-to-speech pair (module docstring). Not thread-safe: one generation
    at a time (the caller serializes)."""

    def __init__(self, model_path: Path, mmproj_path: Path, *, threads: int, n_ctx: int = 4096) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self._lib, self._mtmd = llama_cpp, mtmd_cpp
        self._model = self._ctx = self._mctx = self._gen = None
        #: frames made since the load, all generations together (read from any thread:
        #: a generation's progress)
        self.frames_made = 0
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self._model:
            raise BackendError(f"the speech model could not be loaded: {model_path}")
        try:
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = cparams.n_ubatch = 512
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.embeddings = True  # the helper reads the backbone's hidden states
            self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise BackendError(f"no context for the speech model {model_path}")
            self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
            params = mtmd_cpp.mtmd_context_params_default()
            params.use_gpu = False
            params.n_threads = threads
            params.print_timings = False
            self._mctx = mtmd_cpp.mtmd_init_from_file(str(mmproj_path).encode(), self._model, params)
            if not self._mctx:
                raise BackendError(f"libmtmd could not load the speech projector {mmproj_path}")
            info = mtmd_cpp.mtmd_gen_audio_get_info(self._mctx)
            if info.type != mtmd_cpp.MTMD_GEN_AUDIO_TYPE_POCKETTTS:
                kind = "none" if info.type == mtmd_cpp.MTMD_GEN_AUDIO_TYPE_NONE else "Qwen3-TTS"
                raise BackendError(
                    f"{mmproj_path} is not a PocketTTS generator (libmtmd reports {kind}); only "
                    'PocketTTS is served (docs/audio.md, "Speech")'
                )
            self.sample_rate = int(info.sample_rate)
            self.variant = (info.model_variant or b"").decode("utf-8", "replace")
            self._gen = mtmd_cpp.mtmd_helper_gen_audio_init(self._ctx, self._mctx)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        lib, mtmd = self._lib, self._mtmd
        if self._gen:
            mtmd.mtmd_helper_gen_audio_free(self._gen)
        if self._mctx:
            mtmd.mtmd_free(self._mctx)
        if self._ctx:
            lib.llama_free(self._ctx)
        if self._model:
            lib.llama_model_free(self._model)
        self._model = self._ctx = self._mctx = self._gen = None

    def generate(
        self,
        text: str,
        *,
        emit: Callable[[bytes], None],
        cancelled: Callable[[], bool] | threading.Event,
        seed: int | None = None,
        max_frames: int | None = None,
    ) -> SpeechResult:
        """Speak ``text``; ``emit`` gets each new stretch of 16-bit PCM (module docstring)."""
        lib, mtmd = self._lib, self._mtmd
        if self._gen is None:
            raise BackendError("the speech model is closed")
        stop_asked = cancelled.is_set if isinstance(cancelled, threading.Event) else cancelled
        raw = text.encode()
        tokens = self.check_input(text)
        # a generation starts from empty cells (the helper restarts its positions at 0)
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        inp = mtmd.mtmd_helper_gen_audio_inp()
        inp.seq_id = 0
        inp.prompt, inp.prompt_len = raw, len(raw)
        inp.speaker_ref = None
        inp.lang = None
        inp.seed = 0xFFFFFFFF if seed is None else seed & 0xFFFFFFFF
        inp.out_type = mtmd.MTMD_HELPER_GEN_AUDIO_OUTTYPE_PCM
        if mtmd.mtmd_helper_gen_audio_set_input(self._gen, ctypes.byref(inp)) != 0:
            raise InvalidRequestError("the speech model could not read this input", param="input")
        while (left := mtmd.mtmd_helper_gen_audio_step_prompt(self._gen, 512)) > 0:
            if stop_asked():
                return SpeechResult(0, 0, tokens, True)
        if left < 0:
            raise BackendError("the speech model's prompt evaluation failed")
        h_state = lib.llama_get_embeddings_ith(self._ctx, -1)
        done = ctypes.c_bool(False)
        frames = sent = 0
        stopped = False
        while not done.value:
            if stop_asked():
                stopped = True
                break
            if max_frames is not None and frames >= max_frames:
                break
            out = ctypes.POINTER(ctypes.c_float)()
            step = mtmd.mtmd_helper_gen_audio_step_gen
            if step(self._gen, -1, h_state, ctypes.byref(out), ctypes.byref(done)) != 0:
                raise BackendError("the speech model's frame generation failed")
            if out:
                frames += 1
                self.frames_made += 1
                h_state = out
            if done.value or frames % WINDOW_FRAMES == 0:
                sent = self._send_new(sent, emit)
        if not stopped:
            sent = self._send_new(sent, emit)
        return SpeechResult(frames, sent, tokens, stopped)

    def check_input(self, text: str) -> int:
        """The tokens of ``text``; a 400 naming ``input`` if the context cannot hold
        them (what :meth:`generate` checks first; a caller may check before it answers)."""
        if self._model is None:
            raise BackendError("the speech model is closed")
        raw = text.encode()
        vocab = self._lib.llama_model_get_vocab(self._model)
        tokens = max(int(-self._lib.llama_tokenize(vocab, raw, len(raw), None, 0, False, False)), 0)
        if tokens + 1 > self.n_ctx:
            raise InvalidRequestError(
                f"the input is {tokens} tokens; this speech model's context holds {self.n_ctx - 1}",
                param="input",
                code="input_too_long",
            )
        return tokens

    def _send_new(self, sent: int, emit: Callable[[bytes], None]) -> int:
        """Emit the samples made since ``sent`` (as 16-bit PCM); return the new count."""
        import numpy

        rate, size, count = ctypes.c_int32(), ctypes.c_size_t(), ctypes.c_int64()
        data = ctypes.POINTER(ctypes.c_char)()
        if (
            self._mtmd.mtmd_helper_gen_audio_get_output(
                self._gen, ctypes.byref(rate), ctypes.byref(data), ctypes.byref(size), ctypes.byref(count)
            )
            != 0
        ):
            raise BackendError("the speech model's audio decode failed")
        total = count.value
        if total > sent:
            samples = ctypes.cast(data, ctypes.POINTER(ctypes.c_float))
            floats = numpy.ctypeslib.as_array(samples, shape=(total,))
            # (the helper's own WAV writer: clamp to [-1, 1], scale by 32767, truncate)
            pcm = (numpy.clip(floats[sent:], -1.0, 1.0) * 32767.0).astype("<i2")
            emit(pcm.tobytes())
        return total
