"""Probe libmtmd's audio generation (PocketTTS) through llama_cpp.mtmd_cpp with the tiny
random-weight pair of tests/_speech_model.py (docs/audio.md "Speech").

It loads the backbone (embeddings on: the helper reads hidden states), the mmproj
(``mtmd_init_from_file``), prints ``mtmd_gen_audio_get_info``, then runs the helper:
``set_input`` (PCM out), ``step_prompt`` until 0, ``step_gen`` until it stops, reading
``get_output`` every 8 frames (the helper's own decode window) to show the samples grow
as frames are made. Run from the repository root (a few seconds of CPU):

    python scripts/probes/tts_probe.py 2>/dev/null
"""

from __future__ import annotations

import ctypes
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

import llama_cpp
from llama_cpp import mtmd_cpp as M

from tests._speech_model import tiny_pockettts

THREADS = 2


def main(text: str = "Hello there, how are you?") -> None:
    backbone, mmproj = tiny_pockettts(talkative=True)  # (the head never ends speech: the budget does)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(backbone).encode(), mparams)
    assert model, "llama_model_load_from_file failed"
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 512
    cparams.n_batch = 64
    cparams.n_threads = cparams.n_threads_batch = THREADS
    cparams.embeddings = True
    lctx = llama_cpp.llama_init_from_model(model, cparams)
    assert lctx, "llama_init_from_model failed"

    params = M.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = THREADS
    params.print_timings = False
    t0 = time.perf_counter()
    mctx = M.mtmd_init_from_file(str(mmproj).encode(), model, params)
    assert mctx, "mtmd_init_from_file failed"
    info = M.mtmd_gen_audio_get_info(mctx)
    print(
        f"mtmd_init_from_file: {(time.perf_counter() - t0) * 1e3:.0f} ms; gen_audio_get_info: "
        f"type={info.type} (POCKETTTS={M.MTMD_GEN_AUDIO_TYPE_POCKETTTS}) rate={info.sample_rate} "
        f"variant={info.model_variant!r}; support_audio={M.mtmd_support_audio(mctx)}"
    )

    gen = M.mtmd_helper_gen_audio_init(lctx, mctx)
    raw = text.encode()
    inp = M.mtmd_helper_gen_audio_inp()
    inp.seq_id = 0
    inp.prompt = raw
    inp.prompt_len = len(raw)
    inp.speaker_ref = None
    inp.lang = None
    inp.seed = 1234
    inp.out_type = M.MTMD_HELPER_GEN_AUDIO_OUTTYPE_PCM
    assert M.mtmd_helper_gen_audio_set_input(gen, ctypes.byref(inp)) == 0, "set_input failed"
    while (left := M.mtmd_helper_gen_audio_step_prompt(gen, 64)) > 0:
        pass
    assert left == 0, f"step_prompt: {left}"
    h_state = llama_cpp.llama_get_embeddings_ith(lctx, -1)
    frames, stop, t0 = 0, ctypes.c_bool(False), time.perf_counter()
    rate, size, n_samples = ctypes.c_int32(), ctypes.c_size_t(), ctypes.c_int64()
    data = ctypes.POINTER(ctypes.c_char)()
    while not stop.value:
        out = ctypes.POINTER(ctypes.c_float)()
        rc = M.mtmd_helper_gen_audio_step_gen(gen, -1, h_state, ctypes.byref(out), ctypes.byref(stop))
        assert rc == 0, f"step_gen: {rc}"
        if not out:
            break
        frames += 1
        h_state = out
        if frames % 8 == 0:
            M.mtmd_helper_gen_audio_get_output(
                gen, ctypes.byref(rate), ctypes.byref(data), ctypes.byref(size), ctypes.byref(n_samples)
            )
            print(f"  frame {frames}: {n_samples.value} samples so far")
    took = time.perf_counter() - t0
    rc = M.mtmd_helper_gen_audio_get_output(
        gen, ctypes.byref(rate), ctypes.byref(data), ctypes.byref(size), ctypes.byref(n_samples)
    )
    assert rc == 0, f"get_output: {rc}"
    pcm = ctypes.cast(data, ctypes.POINTER(ctypes.c_float * n_samples.value)).contents
    peak = max((abs(v) for v in pcm), default=0.0)
    print(
        f"{frames} frames in {took * 1e3:.0f} ms; {n_samples.value} samples at {rate.value} Hz "
        f"({n_samples.value / max(rate.value, 1):.2f} s), {size.value} bytes, peak {peak:.3f}"
    )
    M.mtmd_helper_gen_audio_free(gen)
    M.mtmd_free(mctx)
    llama_cpp.llama_free(lctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main(*sys.argv[1:])
