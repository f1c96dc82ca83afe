"""Issue 49: decode tok/s of trioserve (two threads, one slot, speculation off) on a short
prompt, 300 tokens, streamed (per-event work on the event loop) against whole (one body),
alternating 3 times; extra arguments go to trioserve (e.g. --stream-interval-ms 100).
    python scripts/probes/stream_vs_whole.py ts [--stream-interval-ms 100]
"""
import sys, time, json, subprocess, os, signal
import httpx
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from benchmarks.harness import servers
from trioserve import default_model_path
which=sys.argv[1]; extra=sys.argv[2:]
port=servers.free_port()
if which=="ls":
    p=subprocess.Popen([servers.llama_server_binary(),"-m",str(default_model_path()),"--port",str(port),"-t","2","-c","4096","-np","1","--no-webui"],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
else:
    p=subprocess.Popen(servers.trioserve_command(port,"--threads","2","--slots","1","--speculate","off",*extra),stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
url=f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(url+"/health",timeout=1).status_code==200: break
    except Exception: pass
    time.sleep(0.2)
body={"prompt":"The history of the old harbour town, as told by","max_tokens":300,"temperature":0,"logit_bias":{"1":-100,"106":-100}}
def run(stream):
    t0=time.perf_counter(); times=[]
    if stream:
        with httpx.stream("POST",url+"/v1/completions",json={**body,"stream":True},timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line: times.append(time.perf_counter())
        return 299/(times[-1]-times[1])
    r=httpx.post(url+"/v1/completions",json=body,timeout=300).json()
    return 300/(time.perf_counter()-t0)
run(False)
res={"stream":[], "whole":[]}
for k in range(3):
    res["stream"].append(round(run(True),1)); res["whole"].append(round(run(False),1))
print(which, extra, res, flush=True)
p.send_signal(signal.SIGINT); p.wait(timeout=30)
