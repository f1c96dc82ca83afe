"""Probe libmtmd through llama_cpp.mtmd_cpp with the tiny gemma3 projector.

What it shows (docs/vision.md): the chunks of a prompt with one image, an encode and
its embeddings, the whole prompt evaluated by mtmd's helper, and an encode stopped
mid-graph through ``cb_eval`` (libmtmd has no abort callback; the stopped encode still
returns 0). Run from the repository root:

    python scripts/probes/mtmd_probe.py 2>/dev/null
"""

from __future__ import annotations

import ctypes
import math
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

import llama_cpp
from llama_cpp import mtmd_cpp as M

from tests._vision_model import IMAGE_TOKENS, png_bytes, tiny_gemma3_projector
from trioserve import default_model_path

THREADS = 2
TYPES = {
    M.MTMD_INPUT_CHUNK_TYPE_TEXT: "text",
    M.MTMD_INPUT_CHUNK_TYPE_IMAGE: "image",
    M.MTMD_INPUT_CHUNK_TYPE_AUDIO: "audio",
}


def make_ctx(model, projector, cb_eval=None):
    params = M.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = THREADS
    params.print_timings = False
    params.warmup = True
    if cb_eval is not None:
        params.cb_eval = cb_eval
    t0 = time.perf_counter()
    ctx = M.mtmd_init_from_file(str(projector).encode(), model, params)
    assert ctx, "mtmd_init_from_file failed"
    print(
        f"mtmd_init_from_file: {(time.perf_counter() - t0) * 1e3:.1f} ms"
        f" (vision={M.mtmd_support_vision(ctx)}, non_causal={M.mtmd_decode_use_non_causal(ctx, None)})"
    )
    return ctx


def tokenize(ctx, prompt: str, png: bytes):
    buf = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
    bitmap = M.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(png), False)
    assert bitmap, "bitmap decode failed"
    print(
        f"bitmap: {M.mtmd_bitmap_get_nx(bitmap)}x{M.mtmd_bitmap_get_ny(bitmap)} "
        f"id={M.mtmd_bitmap_get_id(bitmap)[:16]!r}…"
    )
    text = M.mtmd_input_text(
        text=prompt.encode(), text_len=len(prompt.encode()), add_special=True, parse_special=True
    )
    chunks = M.mtmd_input_chunks_init()
    bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    assert rc == 0, f"mtmd_tokenize -> {rc}"
    M.mtmd_bitmap_free(bitmap)  # the chunks hold their own copy
    return chunks


def describe(chunks):
    image_chunk = None
    n = M.mtmd_input_chunks_size(chunks)
    for i in range(n):
        chunk = M.mtmd_input_chunks_get(chunks, i)
        kind = M.mtmd_input_chunk_get_type(chunk)
        n_tok = M.mtmd_input_chunk_get_n_tokens(chunk)
        n_pos = M.mtmd_input_chunk_get_n_pos(chunk)
        extra = ""
        if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            count = ctypes.c_size_t()
            toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            extra = f" ids={[toks[j] for j in range(count.value)]}"
        else:
            image = M.mtmd_input_chunk_get_tokens_image(chunk)
            extra = f" grid={M.mtmd_image_tokens_get_nx(image)}x{M.mtmd_image_tokens_get_ny(image)}"
            image_chunk = chunk
        print(f"  chunk {i}: {TYPES[kind]} n_tokens={n_tok} n_pos={n_pos}{extra}")
    print(f"  total: n_tokens={M.mtmd_helper_get_n_tokens(chunks)} n_pos={M.mtmd_helper_get_n_pos(chunks)}")
    return image_chunk


def main() -> None:
    llama_cpp.llama_backend_init()
    model_path = default_model_path(progress=False)
    projector = tiny_gemma3_projector()
    print("model:", model_path, "\nprojector:", projector, f"(IMAGE_TOKENS={IMAGE_TOKENS})")
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    assert model
    n_embd = llama_cpp.llama_model_n_embd(model)

    ctx = make_ctx(model, projector)
    marker = M.mtmd_default_marker().decode()
    prompt = f"<start_of_turn>user\n{marker}\nDescribe the picture.<end_of_turn>\n<start_of_turn>model\n"
    print(f"marker={marker!r}")
    chunks = tokenize(ctx, prompt, png_bytes(64, 64))
    image_chunk = describe(chunks)

    # encode the image chunk, several times for timing
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        rc = M.mtmd_encode_chunk(ctx, image_chunk)
        times.append((time.perf_counter() - t0) * 1e3)
        assert rc == 0, f"mtmd_encode_chunk -> {rc}"
    embd = M.mtmd_get_output_embd(ctx)
    n_img = M.mtmd_input_chunk_get_n_tokens(image_chunk)
    values = [embd[j] for j in range(n_img * n_embd)]
    finite = all(math.isfinite(v) for v in values)
    rms = math.sqrt(sum(v * v for v in values) / len(values))
    print(f"encode ms: {', '.join(f'{t:.2f}' for t in times)} (first, then warm)")
    print(f"output embd: {n_img} x {n_embd} floats, finite={finite}, rms={rms:.4f}, first={values[:3]}")

    # the whole prompt through a llama context (mtmd_helper_eval_chunks encodes + decodes)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = 512, 512, THREADS, THREADS
    lctx = llama_cpp.llama_init_from_model(model, cparams)
    new_n_past = llama_cpp.llama_pos(0)
    t0 = time.perf_counter()
    rc = M.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(new_n_past))
    logits = llama_cpp.llama_get_logits_ith(lctx, -1)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    best = max(range(n_vocab), key=lambda j: logits[j])
    print(
        f"mtmd_helper_eval_chunks rc={rc} n_past={new_n_past.value} "
        f"in {(time.perf_counter() - t0) * 1e3:.1f} ms;"
        f" argmax next token={best}"
    )
    llama_cpp.llama_free(lctx)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_free(ctx)

    # abort: cb_eval (ggml_backend_sched_eval_callback) is called per graph node; when it
    # asks (ask=True) we say "yes, show me"; after the node (ask=False) returning False
    # stops the rest of that graph split. The encode still returns 0 (success), so the
    # caller must remember that it cancelled and throw the embeddings away.
    state = {"nodes": 0, "stop_after": None}

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb_eval(tensor, ask, user_data):
        if ask:
            return True
        state["nodes"] += 1
        return state["stop_after"] is None or state["nodes"] < state["stop_after"]

    ctx2 = make_ctx(model, projector, cb_eval)
    chunks = tokenize(ctx2, prompt, png_bytes(32, 32, (200, 30, 30)))
    image_chunk = describe(chunks)
    for stop_after in (None, 5):
        state["nodes"], state["stop_after"] = 0, stop_after
        t0 = time.perf_counter()
        rc = M.mtmd_encode_chunk(ctx2, image_chunk)
        ms = (time.perf_counter() - t0) * 1e3
        print(
            f"encode with cb_eval stop_after={stop_after}: rc={rc}, nodes run={state['nodes']}, {ms:.2f} ms"
        )
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_free(ctx2)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
