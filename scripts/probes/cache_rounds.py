"""The speculation benchmark's prompts, twice, on one trioserve server: cached tokens per request (round 2: what the prompt cache gives back after 14 other prompts).

    .venv/bin/python scripts/probes/cache_rounds.py --speculate off
"""
import sys, time, json, httpx, subprocess
sys.path.insert(0, '.')
from benchmarks.speculation import WORKLOADS
from benchmarks.harness import servers
from pathlib import Path
port = 8617
argv = servers.command("trioserve", Path.home()/".cache/trioserve/gemma-3-270m-q4_k_m.gguf", port, threads=2, ctx_size=2048, extra=sys.argv[1:])
print(argv)
log = open('/tmp/cache_rounds.log','wb')
p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
for _ in range(600):
    try:
        if c.get('/health').status_code == 200: break
    except Exception: pass
    time.sleep(0.5)
def idle():
    for _ in range(300):
        h = c.get('/health').json()
        b = h.get('batch', {})
        if int(b.get('cache', {}).get('idle_recompute', {}).get('pending', 0)) == 0 and b.get('running',0)==0: return h
        time.sleep(0.2)
order = [(w,i) for w in ('edit','quote','free') for i in range(5)]
try:
    for rnd in (1,2):
        for w,i in order:
            t=time.perf_counter()
            r = c.post('/v1/completions', json={"prompt": WORKLOADS[w][i], "max_tokens": 160, "temperature": 0}).json()
            u = r['usage']
            print(rnd, w, i, u['prompt_tokens'], (u.get('prompt_tokens_details') or {}).get('cached_tokens'), round(time.perf_counter()-t,2), flush=True)
            h = idle()
    print(json.dumps(h['batch']['cache'], indent=0)[:1500])
finally:
    p.terminate(); p.wait()
