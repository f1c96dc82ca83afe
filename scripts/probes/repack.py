"""What the AMX guard costs: prefill and decode tokens/s with llama.cpp's extra buffer
types (repacked weights: ``use_extra_bufts = true``, trioserve's default on a build
without AMX) against without them (what the guard falls back to when the installed
llama.cpp has AMX kernels, and what llama-server's ``--no-repack`` does).

One process, both models loaded side by side, rounds alternating which goes first, so
drift hits both alike. Prefill: a ``--prompt-tokens`` prompt in one call of
``--prompt-tokens`` rows (llama.cpp's batch); decode: ``--decode-tokens`` greedy calls of
one row. docs/platforms.md has the run.

    .venv/bin/python scripts/probes/repack.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def _load(lib: Any, path: str, extra_buffers: bool) -> Any:
    params = lib.llama_model_default_params()
    params.use_extra_bufts = extra_buffers
    model = lib.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"could not load {path}")
    return model


def _context(lib: Any, model: Any, n_ctx: int, n_batch: int, threads: int) -> Any:
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
    params.n_threads = params.n_threads_batch = threads
    return lib.llama_init_from_model(model, params)


def _round(lib: Any, ctx: Any, vocab: Any, batch: Any, prompt: list[int], decode: int) -> tuple[float, float]:
    memory = lib.llama_get_memory(ctx)
    lib.llama_memory_seq_rm(memory, 0, -1, -1)
    n = len(prompt)
    for i, token in enumerate(prompt):
        batch.token[i], batch.pos[i], batch.seq_id[i][0], batch.logits[i] = token, i, 0, i == n - 1
    batch.n_tokens = n
    started = time.perf_counter()
    if lib.llama_decode(ctx, batch) != 0:
        raise RuntimeError("prefill failed")
    prefill = n / (time.perf_counter() - started)
    n_vocab = lib.llama_vocab_n_tokens(vocab)
    token = _argmax(lib.llama_get_logits_ith(ctx, n - 1), n_vocab)
    started = time.perf_counter()
    for step in range(decode):
        batch.token[0], batch.pos[0], batch.seq_id[0][0], batch.logits[0] = token, n + step, 0, 1
        batch.n_tokens = 1
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("decode failed")
        token = _argmax(lib.llama_get_logits_ith(ctx, 0), n_vocab)
    return prefill, decode / (time.perf_counter() - started)


def _argmax(row: Any, n_vocab: int) -> int:
    import numpy

    return int(numpy.ctypeslib.as_array(row, (n_vocab,)).argmax())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a GGUF (default: trioserve's default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=None, help="write the samples here")
    args = parser.parse_args()
    import llama_cpp as lib

    from trioserve import default_model_path

    path = args.model or str(default_model_path(progress=False))
    silent = lib.llama_log_callback(lambda _level, _text, _data: None)
    lib.llama_log_set(silent, None)
    lib.llama_backend_init()
    info = lib.llama_print_system_info().decode()
    contestants = {}
    for name, extra in (("repacked", True), ("no extra buffers", False)):
        model = _load(lib, path, extra)
        ctx = _context(
            lib, model, args.prompt_tokens + args.decode_tokens + 8, args.prompt_tokens, args.threads
        )
        contestants[name] = (model, ctx)
    vocab = lib.llama_model_get_vocab(contestants["repacked"][0])
    text = ("The quick brown fox jumps over the lazy dog. " * 200).encode()
    tokens = (lib.llama_token * len(text))()
    n = lib.llama_tokenize(vocab, text, len(text), tokens, len(text), True, False)
    prompt = list(tokens[: min(n, args.prompt_tokens)])
    batch = lib.llama_batch_init(args.prompt_tokens, 0, 1)
    for i in range(args.prompt_tokens):
        batch.n_seq_id[i] = 1
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in contestants}
    names = list(contestants)
    for name in names:  # warm-up, not counted
        _round(lib, contestants[name][1], vocab, batch, prompt, 8)
    for r in range(args.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            samples[name].append(_round(lib, contestants[name][1], vocab, batch, prompt, args.decode_tokens))
    print(f"llama.cpp: {info}")
    print(
        f"{len(prompt)}-token prompt, {args.decode_tokens} decoded tokens, {args.threads} threads, {args.rounds} rounds"
    )
    print("| weights | prefill tok/s (median, min–max) | decode tok/s (median, min–max) |")
    print("|---|---|---|")
    for name, rows in samples.items():
        pre, dec = [p for p, _ in rows], [d for _, d in rows]
        print(
            f"| {name} | {statistics.median(pre):.0f} ({min(pre):.0f}–{max(pre):.0f}) "
            f"| {statistics.median(dec):.1f} ({min(dec):.1f}–{max(dec):.1f}) |"
        )
    base = {k: statistics.median(v) for k, v in ((n, [p for p, _ in samples[n]]) for n in names)}
    dec = {k: statistics.median(v) for k, v in ((n, [d for _, d in samples[n]]) for n in names)}
    print(
        f"no extra buffers ÷ repacked: prefill {base[names[1]] / base[names[0]]:.2f}×, "
        f"decode {dec[names[1]] / dec[names[0]]:.2f}×"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"system_info": info, "samples": samples}, out, indent=1)
    lib.llama_batch_free(batch)
    for model, ctx in contestants.values():
        lib.llama_free(ctx)
        lib.llama_model_free(model)


if __name__ == "__main__":
    main()
