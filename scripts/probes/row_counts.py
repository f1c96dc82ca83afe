"""Issue 49: what one llama_decode call of n prompt rows costs in trioserve's own context
(repacked weights, n_ubatch 512), at a given depth, best of REPS — to find which row
counts the CPU's kernels take a slow path for (a text prompt's pieces end wherever a
sentence ends: ~96–128 rows).

    python scripts/probes/row_counts.py DEPTH N1,N2,... [REPS]
"""
import sys, time
from trioserve import LlamaBackend, LlamaSettings, default_model_path
from trioserve._backends._llama import Context as _Context

TEXT = "The history of the city is long and rich. In 1437 the people of the harbour met again. " * 400


def evaluate(lib, ctx, batch, tokens, start, out_last=False):
    for i, t in enumerate(tokens):
        batch.token[i] = t; batch.pos[i] = start + i; batch.seq_id[i][0] = 0; batch.logits[i] = 0
    if out_last:
        batch.logits[len(tokens) - 1] = 1
    batch.n_tokens = len(tokens)
    assert lib.llama_decode(ctx, batch) == 0


def main():
    depth = int(sys.argv[1]); sizes = [int(x) for x in sys.argv[2].split(",")]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    backend = LlamaBackend.load(LlamaSettings(default_model_path(), slots=1, n_threads=2, warm_up=False, n_ctx=16384))
    lib = backend.lib
    c = _Context(backend.llama_model, sequences=1)
    ctx, mem, batch = c.ctx, c.memory, c.batch
    toks = backend.tokenize(TEXT)
    for s in range(0, depth, 512):
        evaluate(lib, ctx, batch, toks[s:min(s + 512, depth)], s)
    for n in sizes:
        best = 1e9
        for _ in range(reps):
            lib.llama_memory_seq_rm(mem, 0, depth, -1)
            t = time.perf_counter()
            evaluate(lib, ctx, batch, toks[depth:depth + n], depth, out_last=True)
            best = min(best, time.perf_counter() - t)
        print(f"depth {depth} n={n:4d} {best*1e3:7.1f} ms {best*1e3/n:6.3f} ms/row", flush=True)
    c.free(lib)


main()
