"""Whether a reused prefix's window ring (--no-swa-full) gives the fresh evaluation's bits
(docs/prompt-cache.md, "The window's ring, exact").

    python scripts/probes/ring_exact.py [LENGTH] [EXTRA]

One context, window layers kept to their window, three sequences. A: a random-token
prompt of LENGTH tokens evaluated from an empty stream in pieces of 300/512/217/…, then six
one-token steps (their logits). B: the same prompt and EXTRA tokens more, trimmed back
to LENGTH, then the same steps — as llama.cpp leaves it, and with the ring laid out again
(trioserve's ``ring_layout``). C: A's state after the prompt restored into an empty
sequence — as saved, and laid out. Prints whether each case's logits equal A's, bit for
bit."""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

import llama_cpp as L
import numpy

from trioserve._backends._llama._ring_layout import ring_layout, ring_size
from trioserve._backends._models import default_model_path

PIECES = (300, 512, 217, 512, 400, 97, 512, 128, 333, 512)
FAR = 1 << 30


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 2600
    extra = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(default_model_path()).encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = 3 * 4096
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = 2
    params.n_seq_max = 3
    params.kv_unified = False
    params.swa_full = False
    ctx = L.llama_init_from_model(model, params)
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    window = L.llama_model_n_swa(model)
    ring = ring_size(L.llama_n_ctx_seq(ctx), window, 512)
    print(f"window {window}, ring {ring}, n_ctx_seq {L.llama_n_ctx_seq(ctx)}")
    rng = numpy.random.default_rng(7)
    tokens = rng.integers(100, n_vocab - 100, size=length + extra).tolist()
    steps = rng.integers(100, n_vocab - 100, size=6).tolist()
    batch = L.llama_batch_init(512, 0, 1)

    def decode(seq: int, toks: list[int], pos: int) -> bytes:
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i == len(toks) - 1
        assert L.llama_decode(ctx, batch) == 0
        return ctypes.string_at(L.llama_get_logits_ith(ctx, len(toks) - 1), 4 * n_vocab)

    def prompt(seq: int, upto: int, start: int = 0) -> None:
        pos, k = start, 0
        while pos < upto:
            n = min(PIECES[k % len(PIECES)], upto - pos)
            decode(seq, tokens[pos : pos + n], pos)
            pos += n
            k += 1

    def run_steps(seq: int) -> list[bytes]:
        return [decode(seq, [t], length + i) for i, t in enumerate(steps)]

    def laid(seq: int, data: Any, size: int, partial: bool) -> None:
        r = ring_layout(data, size, ring=ring, window=window, partial=partial)
        assert r is not None, "not laid out"
        L.llama_memory_seq_add(mem, seq, FAR, FAR + 1, 1)  # (the search head to cell 0)
        ok = (
            L.llama_state_seq_set_data_ext(ctx, r.buffer, r.size, seq, 1)
            if partial
            else L.llama_state_seq_set_data(ctx, r.buffer, r.size, seq)
        )
        assert ok
        if r.filler is not None:
            L.llama_memory_seq_rm(mem, seq, r.filler, r.filler + 1)

    def state(seq: int, flags: int) -> tuple[Any, int]:
        size = L.llama_state_seq_get_size_ext(ctx, seq, flags)
        buf = (ctypes.c_uint8 * size)()
        used = L.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags)
        return buf, used

    prompt(0, length)
    saved = state(0, 0)
    a = run_steps(0)
    results = {}
    for relay in (False, True):
        L.llama_memory_seq_rm(mem, 1, -1, -1)
        L.llama_memory_seq_add(mem, 1, FAR, FAR + 1, 1)
        prompt(1, length)
        prompt(1, length + extra, start=length)
        L.llama_memory_seq_rm(mem, 1, length, -1)
        if relay:
            started = time.perf_counter()
            buf, used = state(1, 1)
            laid(1, buf, used, partial=True)
            print(f"relay: {1000 * (time.perf_counter() - started):.1f} ms ({used / 1e6:.1f} MB)")
        results[f"trimmed, {'laid out' if relay else 'as left'}"] = run_steps(1)
    for layout in (False, True):
        L.llama_memory_seq_rm(mem, 2, -1, -1)
        L.llama_memory_seq_add(mem, 2, FAR, FAR + 1, 1)
        if layout:
            laid(2, saved[0], saved[1], partial=False)
        else:
            assert L.llama_state_seq_set_data(ctx, saved[0], saved[1], 2)
        results[f"restored, {'laid out' if layout else 'as saved'}"] = run_steps(2)
    for name, got in results.items():
        pairs = list(zip(a, got, strict=True))
        same = sum(x == y for x, y in pairs)
        worst = max(
            float(numpy.abs(numpy.frombuffer(x, "<f4") - numpy.frombuffer(y, "<f4")).max()) for x, y in pairs
        )
        print(f"{name}: {same}/{len(a)} steps equal bit for bit (largest difference {worst:.3g})")


if __name__ == "__main__":
    main()
