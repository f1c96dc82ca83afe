"""Issue 49: CPU seconds per thread of a trioserve process (2 threads, --no-swa-full) during one
cold random-token prompt of N tokens: which threads run beside llama.cpp compute threads.
    python scripts/probes/thread_cpu.py 4096
"""
import sys, time, json, random, subprocess, os, signal, glob
import httpx
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from benchmarks.harness import servers
N=int(sys.argv[1])
random.seed(5); toks=[2]+[random.randint(1000,200000) for _ in range(N-1)]
port=servers.free_port()
p=subprocess.Popen(servers.trioserve_command(port,"--threads","2","--slots","1","--ctx-size","32768","--no-swa-full"),stdout=subprocess.DEVNULL,stderr=open("/tmp/ts2.log","w"))
url=f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(url+"/health",timeout=1).status_code==200: break
    except Exception: pass
    time.sleep(0.2)
def cpu():
    out={}
    for t in glob.glob(f"/proc/{p.pid}/task/*"):
        try:
            comm=open(t+"/comm").read().strip(); f=open(t+"/stat").read().rsplit(")",1)[1].split()
            out[t.rsplit("/",1)[1]]=(comm,(int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK"))
        except OSError: pass
    return out
time.sleep(2)
a=cpu(); t0=time.perf_counter()
r=httpx.post(url+"/v1/completions",json={"prompt":toks,"max_tokens":64,"temperature":0,"logit_bias":{"1":-100,"106":-100},"stream":False},timeout=900)
wall=time.perf_counter()-t0
b=cpu()
print("wall",round(wall,2), r.json()["usage"])
for tid,(comm,c) in sorted(b.items(), key=lambda kv:-(kv[1][1]-a.get(kv[0],("",0))[1])):
    d=c-a.get(tid,("",0))[1]
    if d>0.005: print(f"{tid} {comm:20s} {d:8.3f}s")
p.send_signal(signal.SIGINT); p.wait(timeout=30)
