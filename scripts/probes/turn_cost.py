"""Where a conversation turn's prefill time goes (issue 35, "turns 5–7"): the cost of
evaluating a turn's new tokens at position P, as one call or in pieces, in a context
shaped like trioserve's (8 sequences, non-unified KV, n_batch 512) or llama-server's
(one unified KV, n_ubatch 512), and the cost of the reply recomputed with them.

Low-level llama.cpp on the default model, nothing else running. For each prefix length
P: a prefix of P tokens evaluated in sequence 0, then ``--new`` tokens at P timed (best
of ``--reps``; the cells past P cleared between reps).

    python scripts/probes/turn_cost.py --prefixes 200,500,800,1100 --new 200
"""

from __future__ import annotations

import argparse
import time

import llama_cpp as lib

from trioserve import default_model_path


def context(model: object, sequences: int, threads: int) -> object:
    params = lib.llama_context_default_params()
    params.n_ctx = 4096 * sequences
    params.n_batch = 512
    params.n_ubatch = 512
    params.n_threads = threads
    params.n_threads_batch = threads
    params.n_seq_max = sequences
    params.swa_full = True
    if sequences > 1:
        params.kv_unified = False
    return lib.llama_init_from_model(model, params)


def decode(ctx: object, batch: lib.llama_batch, tokens: list[int], start: int) -> float:
    for i, token in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 0
    batch.logits[len(tokens) - 1] = 1
    batch.n_tokens = len(tokens)
    began = time.perf_counter()
    assert lib.llama_decode(ctx, batch) == 0
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefixes", default="200,500,800,1100")
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--pieces", default="512,128,64", help="piece widths to compare")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    lib.llama_backend_init()
    mparams = lib.llama_model_default_params()
    model = lib.llama_model_load_from_file(str(default_model_path()).encode(), mparams)
    vocab = lib.llama_model_get_vocab(model)
    text = ("The harbour trade grew with every ship that came up the river. " * 400).encode()
    buf = (lib.llama_token * 8192)()
    n = lib.llama_tokenize(vocab, text, len(text), buf, 8192, True, False)
    tokens = list(buf[:n])
    batch = lib.llama_batch_init(512, 0, 1)
    widths = [int(w) for w in args.pieces.split(",")]
    print(f"new tokens: {args.new}; best of {args.reps}; ms per call (ms per token)")
    for label, sequences in (("trioserve-shaped (8 seqs, non-unified)", 8), ("one sequence (unified)", 1)):
        ctx = context(model, sequences, args.threads)
        memory = lib.llama_get_memory(ctx)
        print(label)
        for prefix in (int(p) for p in args.prefixes.split(",")):
            lib.llama_memory_clear(memory, True)
            for start in range(0, prefix, 512):
                decode(ctx, batch, tokens[start : min(prefix, start + 512)], start)
            row = [f"  P={prefix:5d}"]
            for width in widths:
                best = float("inf")
                for _ in range(args.reps):
                    lib.llama_memory_seq_rm(memory, 0, prefix, -1)
                    total = 0.0
                    for at in range(0, args.new, width):
                        piece = tokens[prefix + at : prefix + min(args.new, at + width)]
                        total += decode(ctx, batch, piece, prefix + at)
                    best = min(best, total)
                row.append(f"pieces of {width:3d}: {best * 1000:6.1f} ({best * 1000 / args.new:.2f})")
            print("  ".join(row), flush=True)
        lib.llama_free(ctx)
    lib.llama_batch_free(batch)
    lib.llama_model_free(model)


if __name__ == "__main__":
    main()
