"""Issue 23 probes: (1) what one llama_decode call of n prompt tokens costs (ms), at a
given context depth, best of 5; (2) whether a piece evaluated with an output row (a
prompt's last piece) leaves the same KV cells, bit for bit, as the same piece evaluated
without one (an inner piece); (3) how a prompt cut at a given place compares.

    python scripts/probes/piece_cost.py
"""
import ctypes, sys, time
from trioserve import LlamaBackend, LlamaSettings, default_model_path
from trioserve._backends._llama import Context as _Context

TEXT = "The history of the city is long and rich. In 1437 the people of the harbour met again. " * 60


def evaluate(lib, ctx, batch, tokens, start, seq=0, out_last=False):
    for i, t in enumerate(tokens):
        batch.token[i] = t; batch.pos[i] = start + i; batch.seq_id[i][0] = seq; batch.logits[i] = 0
    if out_last:
        batch.logits[len(tokens) - 1] = 1
    batch.n_tokens = len(tokens)
    assert lib.llama_decode(ctx, batch) == 0


def state(lib, ctx, seq=0):
    size = lib.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    n = lib.llama_state_seq_get_data(ctx, buf, size, seq)
    return bytes(buf[:n])


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    backend = LlamaBackend.load(LlamaSettings(default_model_path(), slots=1, n_threads=threads, warm_up=False))
    lib = backend.lib
    c = _Context(backend.llama_model, sequences=1)
    ctx, mem, batch = c.ctx, c.memory, c.batch
    toks = backend.tokenize(TEXT)
    print("tokens", len(toks))
    for depth in (0, 512):
        lib.llama_memory_seq_rm(mem, 0, -1, -1)
        for s in range(0, depth, 128):
            evaluate(lib, ctx, batch, toks[s:s + 128], s)
        print(f"depth {depth}:")
        for n in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256):
            best = 1e9
            for _ in range(5):
                lib.llama_memory_seq_rm(mem, 0, depth, -1)
                t = time.perf_counter()
                evaluate(lib, ctx, batch, toks[depth:depth + n], depth, out_last=True)
                best = min(best, time.perf_counter() - t)
            print(f"  n={n:4d}  {best*1e3:7.1f} ms  {best*1e3/n:6.2f} ms/token  {n/best:6.0f} tok/s")
    # (2) the same piece with and without an output row
    same = 0
    for trial, (a, b) in enumerate(((0, 77), (128, 203), (300, 428), (512, 515))):
        lib.llama_memory_seq_rm(mem, 0, -1, -1)
        for s in range(0, a, 128):
            evaluate(lib, ctx, batch, toks[s:min(s + 128, a)], s)
        evaluate(lib, ctx, batch, toks[a:b], a, out_last=True)
        with_out = state(lib, ctx)
        lib.llama_memory_seq_rm(mem, 0, a, -1)
        evaluate(lib, ctx, batch, toks[a:b], a, out_last=False)
        without = state(lib, ctx)
        print(f"piece [{a}, {b}): with an output row == without: {with_out == without} ({len(with_out)} bytes)")
        same += with_out == without
    print(f"bit-identical: {same}/4")
    c.free(lib)



main()
