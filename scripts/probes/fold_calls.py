"""Issue 49: can a next turn fold two pieces of the canonical cut (the reply's recompute
and the new text) into one llama_decode call and keep the bits? For prefixes of 300,
1,000 and 2,500 tokens, pieces a then b evaluated as two calls vs one call of a + b: the
sequence state (llama_state_seq_get_data) and the last row's logits compared bit for bit.
Argument: 1 (default) repacked weights, 0 not.

    python scripts/probes/fold_calls.py 1
"""
import sys, ctypes, random
import numpy as np
import llama_cpp as L
from trioserve import default_model_path
MODEL=str(default_model_path())
L.llama_backend_init()
mp=L.llama_model_default_params()
repack = sys.argv[1] == "1" if len(sys.argv) > 1 else True
mp.use_extra_bufts = repack
model=L.llama_model_load_from_file(MODEL.encode(), mp)
n_vocab=L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
cp=L.llama_context_default_params()
cp.n_ctx=8192; cp.n_batch=512; cp.n_ubatch=512; cp.n_threads=2; cp.n_threads_batch=2; cp.swa_full=True
ctx=L.llama_init_from_model(model, cp)
mem=L.llama_get_memory(ctx)
batch=L.llama_batch_init(512,0,1)
def dec(start, ids, seq=0):
    batch.n_tokens=len(ids)
    for i,t in enumerate(ids):
        batch.token[i]=t; batch.pos[i]=start+i; batch.n_seq_id[i]=1; batch.seq_id[i][0]=seq; batch.logits[i]= i==len(ids)-1
    assert L.llama_decode(ctx,batch)==0
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(ids)-1), (n_vocab,)).copy()
def state(seq=0):
    n=L.llama_state_seq_get_size(ctx, seq); buf=(ctypes.c_uint8*n)(); w=L.llama_state_seq_get_data(ctx, buf, n, seq); return bytes(buf[:w])
random.seed(1)
results=[]
for depth in (300, 1000, 2500):
    for a, b in ((25, 45), (37, 103), (16, 33), (5, 60), (64, 64), (128, 40)):
        prefix=[2]+[random.randint(1000,200000) for _ in range(depth-1)]
        x=[random.randint(1000,200000) for _ in range(a)]
        y=[random.randint(1000,200000) for _ in range(b)]
        L.llama_memory_clear(mem, True)
        for s in range(0, depth, 128): dec(s, prefix[s:s+128])
        base = state()
        # two calls
        dec(depth, x); la = dec(depth+a, y); sa = state()
        # one call
        L.llama_memory_seq_rm(mem, 0, depth, -1)
        lb = dec(depth, x+y); sb = state()
        same_logits = np.array_equal(la, lb); same_state = sa == sb
        results.append((depth, a, b, same_logits, same_state, float(np.abs(la-lb).max())))
        print(depth, a, b, "logits equal" if same_logits else "logits DIFFER", "state equal" if same_state else "state DIFFERS", round(float(np.abs(la-lb).max()),4), flush=True)
print("repack", repack, "all equal:", all(r[3] and r[4] for r in results))
