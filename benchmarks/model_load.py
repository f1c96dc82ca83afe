"""A client that asks for an unloaded model and leaves during its load: trioserve
(``--models-dir``, the load aborted in llama.cpp's progress callback) beside llama.cpp's
llama-server in router mode (``--models-dir``: each model in a child process).

Both serve a directory of two hard links to the default GGUF. For each server: the
process tree's RSS with nothing loaded; one whole load (a 1-token completion of model
``a``: seconds, RSS loaded), unloaded again (``POST /models/unload``); then ``--reps``
rounds of: a streamed completion for model ``b`` whose client closes its connection
``--leave-ms`` after sending it (well inside the load), then the time from the leave
until the server's process tree is idle (no CPU for 100 ms), the CPU it spent after the
leave, whether ``b`` ended up loaded, and the tree's RSS 2 s after the leave beside the
unloaded level (``b`` is unloaded between rounds if it loaded).

    python benchmarks/model_load.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import contextlib

from benchmarks.harness.proc import cpu_seconds, rss_kib
from benchmarks.harness.servers import Server, free_port, llama_server_binary, trioserve_command
from trioserve import default_model_path

IDLE_WINDOW, IDLE_CPU = 0.1, 0.002  # idle: under 2 ms of CPU in 100 ms


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (llama-server's router runs each model in a child)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return found


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


def tree_rss_mib(pid: int) -> float:
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            total += rss_kib(p)
    return total / 1024


def wait_idle(pid: int, cap: float = 30.0) -> tuple[float | None, float]:
    """(seconds until the tree's CPU stops for IDLE_WINDOW, CPU seconds spent meanwhile)."""
    start, cpu0 = time.perf_counter(), tree_cpu(pid)
    samples = [(start, cpu0)]
    while time.perf_counter() - start < cap:
        time.sleep(0.01)
        samples.append((time.perf_counter(), tree_cpu(pid)))
        # the first sample after which a whole window added (almost) no CPU
        for i, (t, c) in enumerate(samples):
            later = [s for s in samples[i:] if s[0] >= t + IDLE_WINDOW]
            if not later:
                break
            if later[0][1] - c < IDLE_CPU:
                return t - start, c - cpu0
    return None, samples[-1][1] - cpu0


def leave_during_load(url: str, model: str, leave_ms: float) -> None:
    """Send a streamed completion for ``model`` on a raw socket and close it after ``leave_ms``."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        time.sleep(leave_ms / 1000)
    # (closed: the server sees the disconnect)


def state(client: httpx.Client, name: str, model: str) -> str:
    if name == "trioserve":
        for m in client.get("/v1/models").json()["data"]:
            if m["id"] == model:
                return str(m["status"]["state"])
    else:
        for m in client.get("/models").json()["data"]:
            if m["id"] == model:
                return str(m["status"]["value"])
    return "?"


def wait_state(client: httpx.Client, name: str, model: str, wanted: set[str], cap: float = 30.0) -> str:
    give_up = time.monotonic() + cap
    while True:
        now = state(client, name, model)
        if now in wanted or time.monotonic() > give_up:
            return now
        time.sleep(0.05)


def run(name: str, argv: list[str], port: int, log_dir: Path, reps: int, leave_ms: float) -> dict[str, Any]:
    server = Server(name, argv, port, log_dir)
    try:
        give_up = time.monotonic() + 120
        with httpx.Client(base_url=server.url, timeout=120) as client:
            while True:
                server.check_alive()
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > give_up:
                    raise TimeoutError(server.log_tail())
                time.sleep(0.1)
            wait_idle(server.pid)
            unloaded_rss = tree_rss_mib(server.pid)
            started = time.perf_counter()
            answer = client.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 1})
            answer.raise_for_status()
            load_s = time.perf_counter() - started
            wait_idle(server.pid)
            loaded_rss = tree_rss_mib(server.pid)
            client.post("/models/unload", json={"model": "a"}).raise_for_status()
            wait_state(client, name, "a", {"unloaded"})
            wait_idle(server.pid)
            time.sleep(0.5)
            base_rss = tree_rss_mib(server.pid)
            rounds = []
            for _ in range(reps):
                left = time.perf_counter()
                leave_during_load(server.url, "b", leave_ms)
                after = time.perf_counter()
                idle_s, cpu_s = wait_idle(server.pid)
                time.sleep(max(0.0, 2.0 - (time.perf_counter() - after)))
                final = state(client, name, "b")
                rounds.append(
                    {
                        "idle_after_leave_ms": None if idle_s is None else idle_s * 1000,
                        "cpu_after_leave_ms": cpu_s * 1000,
                        "loaded": final == "loaded",
                        "state_2s_later": final,
                        "rss_2s_later_mib": tree_rss_mib(server.pid),
                        "leave_ms": (after - left) * 1000,
                    }
                )
                if final != "unloaded":
                    wait_state(client, name, "b", {"loaded", "unloaded", "failed"})
                    client.post("/models/unload", json={"model": "b"})
                    wait_state(client, name, "b", {"unloaded"})
                    wait_idle(server.pid)
                    time.sleep(0.5)
        return {
            "rss_unloaded_mib": unloaded_rss,
            "rss_after_unload_mib": base_rss,
            "rss_loaded_mib": loaded_rss,
            "load_seconds": load_s,
            "rounds": rounds,
        }
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--leave-ms", type=float, default=150.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model = default_model_path(progress=False)
    models = Path(tempfile.mkdtemp(prefix="bench-models-"))
    for name in ("a", "b"):
        os.link(model, models / f"{name}.gguf")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-model-load-"))
    t = str(args.threads)
    contestants = {
        "trioserve": lambda port: trioserve_command(
            port, "--models-dir", str(models), "--threads", t, "--ctx-size", "4096", "--slots", "1"
        ),
        "llama-server": lambda port: [
            llama_server_binary(),
            "--models-dir",
            str(models),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            t,
            "--ctx-size",
            "4096",
            "--parallel",
            "1",
        ],
    }
    results: dict[str, Any] = {}
    for name, make in contestants.items():
        port = free_port()
        print(f"[{name}]", file=sys.stderr, flush=True)
        results[name] = run(name, make(port), port, log_dir, args.reps, args.leave_ms)
    summary = {
        name: {
            "load_s": round(r["load_seconds"], 3),
            "rss_unloaded_mib": round(r["rss_after_unload_mib"], 1),
            "rss_loaded_mib": round(r["rss_loaded_mib"], 1),
            "idle_after_leave_ms_median": statistics.median(
                x["idle_after_leave_ms"] for x in r["rounds"] if x["idle_after_leave_ms"] is not None
            ),
            "cpu_after_leave_ms_median": round(
                statistics.median(x["cpu_after_leave_ms"] for x in r["rounds"]), 1
            ),
            "loaded_anyway": f"{sum(x['loaded'] for x in r['rounds'])}/{len(r['rounds'])}",
            "rss_2s_later_mib_median": round(
                statistics.median(x["rss_2s_later_mib"] for x in r["rounds"]), 1
            ),
        }
        for name, r in results.items()
    }
    out = {"config": vars(args) | {"model": str(model)}, "results": results, "summary": summary}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    for name, s in summary.items():
        print(name, json.dumps(s))


if __name__ == "__main__":
    main()
