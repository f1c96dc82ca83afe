"""Embeddings throughput: inputs/s for one ``POST /v1/embeddings`` of ``--inputs`` texts
(64, ~12 tokens each), trioserve beside llama.cpp's llama-server ``--embeddings
--pooling mean`` with its default slots and with one (``--parallel 1``, which evaluates
each input alone, as trioserve does: docs/embeddings.md). Each round sends the same
request to each server in turn (the start rotating), ``--reps`` rounds after a warm-up;
reported: inputs/s median and min, and the largest cosine distance between trioserve's
vectors and each llama-server's.

    python benchmarks/embeddings.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.servers import LLAMA_SERVER, TRIOSERVE, Server, command, free_port
from trioserve import default_model_path

WORDS = ["river", "stone", "light", "market", "violin", "engine", "garden", "winter", "letter", "bridge"]


def texts(count: int) -> list[str]:
    return [
        f"Item {i}: the {WORDS[i % 10]} and the {WORDS[(i * 3) % 10]} near the {WORDS[(i * 7) % 10]}."
        for i in range(count)
    ]


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model = default_model_path(progress=False)
    body = {"input": texts(args.inputs)}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    contestants: dict[str, list[str]] = {}
    ports: dict[str, int] = {}
    for name, extra in (
        ("trioserve", []),
        ("llama-server", ["--embeddings", "--pooling", "mean"]),
        ("llama-server --parallel 1", ["--embeddings", "--pooling", "mean", "--parallel", "1"]),
    ):
        port = ports[name] = free_port()
        base = TRIOSERVE if name == "trioserve" else LLAMA_SERVER
        contestants[name] = command(base, model, port, threads=args.threads, ctx_size=2048, extra=extra)
    servers = [
        Server(name.replace(" ", "_"), argv, ports[name], log_dir) for name, argv in contestants.items()
    ]
    results: dict[str, Any] = {}
    try:
        for server in servers:
            server.wait_ready(timeout=120)
        with httpx.Client(timeout=600) as client:
            vectors = {}
            for server, name in zip(servers, contestants, strict=True):  # warm-up (and the vectors)
                data = client.post(server.url + "/v1/embeddings", json=body).json()["data"]
                vectors[name] = [item["embedding"] for item in data]
            times: dict[str, list[float]] = {name: [] for name in contestants}
            names = list(contestants)
            for rep in range(args.reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    server = servers[names.index(name)]
                    started = time.perf_counter()
                    response = client.post(server.url + "/v1/embeddings", json=body)
                    response.raise_for_status()
                    times[name].append(time.perf_counter() - started)
        for name in names:
            rates = [args.inputs / t for t in times[name]]
            distance = max(1 - cosine(a, b) for a, b in zip(vectors["trioserve"], vectors[name], strict=True))
            results[name] = {
                "inputs_per_s_median": statistics.median(rates),
                "inputs_per_s_min": min(rates),
                "max_cosine_distance_to_trioserve": distance,
            }
    finally:
        for server in servers:
            server.stop()
    print(f"{args.inputs} inputs per request, {args.reps} rounds, {args.threads} threads")
    print("| server | inputs/s (median) | min | max 1 − cosine vs trioserve |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['inputs_per_s_median']:.1f} | {r['inputs_per_s_min']:.1f} | "
            f"{r['max_cosine_distance_to_trioserve']:.1e} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
