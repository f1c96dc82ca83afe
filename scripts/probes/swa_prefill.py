"""Issue 49: a long prompt's prefill and one-token steps with the window layers keeping
every cell (swa_full 1, trioserve's default) or their window (0, llama-server's), in calls
of CHUNK tokens: python scripts/probes/swa_prefill.py TOKENS CHUNK SWA_FULL [FLASH_ATTN]
(e.g. 16384 128 1, 16384 512 0)."""
import sys, time, ctypes, os
import llama_cpp as L
from trioserve import default_model_path
MODEL=str(default_model_path())
N=int(sys.argv[1]); chunk=int(sys.argv[2]); swa_full=sys.argv[3]=="1"; fa=int(sys.argv[4]) if len(sys.argv)>4 else -1
L.llama_backend_init()
mp=L.llama_model_default_params()
model=L.llama_model_load_from_file(MODEL.encode(), mp)
cp=L.llama_context_default_params()
cp.n_ctx=32768; cp.n_batch=max(chunk,512); cp.n_ubatch=int(os.environ.get("UBATCH", max(chunk,512) if chunk>=512 else chunk))
import os; cp.n_threads=int(os.environ.get("THREADS","2")); cp.n_threads_batch=cp.n_threads; cp.swa_full=swa_full; cp.flash_attn_type=fa
ctx=L.llama_init_from_model(model, cp)
vocab=L.llama_model_get_vocab(model)
import random; random.seed(0)
toks=[2]+[random.randint(1000,200000) for _ in range(N-1)]
batch=L.llama_batch_init(max(chunk,512),0,1)
def dec(start, ids, logits_last=True):
    batch.n_tokens=len(ids)
    for i,t in enumerate(ids):
        batch.token[i]=t; batch.pos[i]=start+i; batch.n_seq_id[i]=1; batch.seq_id[i][0]=0; batch.logits[i]= (i==len(ids)-1) and logits_last
    r=L.llama_decode(ctx,batch); assert r==0, r
t0=time.perf_counter()
marks={}
for s in range(0,N,chunk):
    dec(s,toks[s:s+chunk])
    if (s+chunk)%4096==0: marks[s+chunk]=round(time.perf_counter()-t0,2)
t1=time.perf_counter()
mem=L.llama_get_memory(ctx)
print("pos_min", L.llama_memory_seq_pos_min(mem,0), "pos_max", L.llama_memory_seq_pos_max(mem,0))
st=[]
for k in range(5):
    a=time.perf_counter(); dec(N+k,[500]); st.append(time.perf_counter()-a)
print(f"N={N} chunk={chunk} swa_full={swa_full} fa={fa} prefill={t1-t0:.2f}s marks={marks} step_ms={[round(x*1000) for x in st]}")
