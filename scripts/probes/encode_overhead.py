"""What stopping an image encode costs when nothing stops it: libmtmd's encode of one
image with and without trioserve's graph-evaluation check (``_abort.c``'s
``trioserve_eval_check``, asked at every node: each node then runs as a graph of its
own), on the benchmark projectors of ``tests/_vision_model.py``. Run from the
repository root (docs/benchmarks.md, "A client that leaves mid-encode"):

    python scripts/probes/encode_overhead.py 2>/dev/null
"""

from __future__ import annotations

import ctypes
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import llama_cpp
from llama_cpp import mtmd_cpp as M

from tests._vision_model import heavy_gemma3_projector, png_bytes, wide_gemma3_projector
from trioserve import default_model_path

REPS = 3


def encode_ms(model: object, projector: Path, *, check: bool) -> list[float]:
    params = M.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 2, False
    slot = ctypes.c_void_p(None)  # (no flag: the check never stops, it only asks)
    if check:
        address = importlib.import_module("trioserve._backends._abort").EVAL_CHECK_ADDRESS
        callback = llama_cpp.ggml_backend_sched_eval_callback(address)
        params.cb_eval = callback
        params.cb_eval_user_data = ctypes.addressof(slot)
    ctx = M.mtmd_init_from_file(str(projector).encode(), model, params)
    png = png_bytes(64, 64, (120, 40, 200))
    buf = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
    bitmap = M.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(png), False)
    marker = M.mtmd_default_marker()
    text = M.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
    chunks = M.mtmd_input_chunks_init()
    M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
    image = next(
        M.mtmd_input_chunks_get(chunks, i)
        for i in range(M.mtmd_input_chunks_size(chunks))
        if M.mtmd_input_chunk_get_type(M.mtmd_input_chunks_get(chunks, i)) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE
    )
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        assert M.mtmd_encode_chunk(ctx, image) == 0
        times.append((time.perf_counter() - start) * 1e3)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bitmap)
    M.mtmd_free(ctx)
    return times


def main() -> None:
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(default_model_path(progress=False)).encode(), llama_cpp.llama_model_default_params()
    )
    for name, projector in (("heavy", heavy_gemma3_projector()), ("wide", wide_gemma3_projector())):
        plain = encode_ms(model, projector, check=False)
        checked = encode_ms(model, projector, check=True)
        print(
            f"{name:6s} encode: {statistics.median(plain):7.1f} ms plain, {statistics.median(checked):7.1f} ms "
            f"with the check ({statistics.median(checked) / statistics.median(plain):.3f}×; "
            f"{REPS} each: {[round(t) for t in plain]} / {[round(t) for t in checked]})"
        )
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
