"""Issue 49: a cold random-token prompt of N tokens, then 16 tokens, on llama-server (ls) or
trioserve (ts; TS_FLAGS, default --no-swa-full), THREADS llama.cpp threads, one slot, 32k
context; SPY=1 records trioserve under py-spy --native (slows it: not for timings).
    THREADS=1 python scripts/probes/long_prefill_servers.py 8192 ls
"""
import sys, time, json, random, subprocess, os, signal
import httpx
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from benchmarks.harness import servers
from trioserve import default_model_path
N = int(sys.argv[1]); which = sys.argv[2:]
MODEL = default_model_path()
random.seed(int(time.time()))
toks = [2] + [random.randint(1000, 200000) for _ in range(N - 1)]
port = servers.free_port()
if "ls" in which:
    binary = servers.llama_server_binary()
    p = subprocess.Popen([binary, "-m", str(MODEL), "--port", str(port), "-t", os.environ.get("THREADS","2"), "-c", "32768", "-np", "1", "--no-webui"] , stdout=subprocess.DEVNULL, stderr=open("/tmp/ls.log","w"))
else:
    extra = os.environ.get("TS_FLAGS", "--no-swa-full").split()
    p = subprocess.Popen(servers.trioserve_command(port, "--threads", os.environ.get("THREADS","2"), "--slots", "1", "--ctx-size", "32768", *extra), stdout=subprocess.DEVNULL, stderr=open("/tmp/ts.log","w"))
url = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200: break
    except Exception: pass
    time.sleep(0.2)
print("ready", which, flush=True)
if os.environ.get("SPY"):
    spy = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "--native", "-r", "50", "-o", f"/tmp/spy_{which[0]}.txt", "-f", "raw", "-p", str(p.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
t0 = time.perf_counter()
body = {"prompt": toks, "max_tokens": 16, "temperature": 0, "logit_bias": {"1": -100, "106": -100}, "stream": True}
times = []
with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
    for line in r.iter_lines():
        if line.startswith("data:") and "[DONE]" not in line:
            ev = json.loads(line[5:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                times.append(time.perf_counter())
ttft = times[0] - t0
tps = (len(times) - 1) / (times[-1] - times[0])
print(f"{which} N={N} ttft={ttft:.2f}s decode={tps:.1f} tok/s events={len(times)}", flush=True)
if os.environ.get("SPY"):
    spy.send_signal(signal.SIGINT); spy.wait()
if "ls" not in which:
    print(httpx.get(url + "/health").json().get("cache", {}).get("window_checkpoints"))
p.send_signal(signal.SIGINT); p.wait(timeout=30)
