"""Issue 49 / the window-cell rewrite (docs/prompt-cache.md, "Window cells in their places"):
what restoring an N-token Gemma 3 state costs as llama.cpp wrote it, and rewritten with its
window cells in their places (the rewrite, then the restore). Raw llama.cpp, 2 threads.
    python scripts/probes/restore_layout_cost.py 8192
"""
import sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import llama_cpp as L
from trioserve._backends._llama._state_layout import aligned
from trioserve._backends._cache._memory import StateBuffer
L.llama_log_set(lambda *a: None, None) if False else None
L.llama_backend_init()
model = L.llama_model_load_from_file(b"/root/.cache/trioserve/gemma-3-270m-q4_k_m.gguf", L.llama_model_default_params())
cp = L.llama_context_default_params(); cp.n_ctx = 2*9000; cp.n_batch=512; cp.n_ubatch=512; cp.n_seq_max = 2; cp.swa_full = True; cp.kv_unified=False; cp.n_threads=cp.n_threads_batch=2
ctx = L.llama_init_from_model(model, cp)
n = int(sys.argv[1])
batch = L.llama_batch_init(512, 0, 1)
pos = 0
while pos < n:
    m = min(512, n - pos); batch.n_tokens = m
    for i in range(m):
        batch.token[i] = 100 + (pos + i) % 5000; batch.pos[i] = pos + i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 0
    assert L.llama_decode(ctx, batch) == 0
    pos += m
size = L.llama_state_seq_get_size(ctx, 0)
st = StateBuffer(size); st.used = L.llama_state_seq_get_data(ctx, st.array, size, 0)
for k in range(3):
    t0 = time.perf_counter(); L.llama_state_seq_set_data(ctx, st.array, st.used, 1); t1 = time.perf_counter()
    lay = aligned(st.array, st.used); t2 = time.perf_counter()
    L.llama_state_seq_set_data(ctx, lay.buffer, lay.size, 1); t3 = time.perf_counter()
    print(f"{n} tokens: state {st.used/1e6:.1f} MB, as written restore {1e3*(t1-t0):.1f} ms; aligned {lay.size/1e6:.1f} MB: rewrite {1e3*(t2-t1):.1f} ms + restore {1e3*(t3-t2):.1f} ms", flush=True)
