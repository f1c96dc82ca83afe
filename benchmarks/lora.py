"""LoRA adapters (issue 51): 8 streams over 1, 2 and 4 adapter sets against all on the
base model, trioserve beside llama.cpp's llama-server with the same adapters.

Both servers: the default model, 8 sequences (trioserve ``--slots 8``, llama-server
``-np 8 --no-kv-unified``, the same context per sequence), ``--threads`` each, four tiny
random-weight adapters of the default model (``tests/_lora.py``: rank 8 on every
layer's query and value projections), loaded at start. Each scenario sends 8 greedy
``/v1/completions`` at once (``--max-tokens`` each, the end of sequence banned: every
stream that long), each stream's adapter chosen round-robin from the scenario's sets
(``base``: none; ``1 set``: all on adapter 0; ``2 sets``: 0 and 1; ``4 sets``: 0–3), by
llama-server's ``lora`` field on both (every other adapter at scale 0). Reported: total
completion tokens ÷ wall time (first send → last end), median of ``--reps``.

    python benchmarks/lora.py --json artifacts/lora.json

``--alora``: activated LoRA's shared prefix instead (docs/lora.md, "Activated LoRA").
Four tiny aLoRAs turned on by ``<start_of_turn>model\n`` (``tests/_lora.py``), both
servers with 4 sequences; a ~1,000-token prompt sent once on the base model, then with
the invocation appended for each aLoRA in turn, ``--max-tokens`` each. Reported per
server: the prompt tokens each aLoRA request evaluated (trioserve: ``usage``'s
``prompt_tokens - cached_tokens``; llama-server: its ``timings.prompt_n``) and the four
requests' wall time, with the prompt cache on and off (``cache_prompt: false``), median
of ``--reps`` (each rep on a fresh prompt: the years shifted).

    python benchmarks/lora.py --alora --json artifacts/lora-alora.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import servers
from tests._lora import tiny_lora
from trioserve import default_model_path

SCENARIOS = {"base": [], "1 set": [0], "2 sets": [0, 1], "4 sets": [0, 1, 2, 3]}
PROMPTS = [
    f"Chapter {i}: the {w} of the old harbour town, told from the start.\n"
    for i, w in enumerate(["story", "history", "weather", "markets", "songs", "roads", "ships", "bells"])
]


def parse_args() -> Any:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-size", type=int, default=1024, help="per sequence")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--alora", action="store_true", help="the aLoRA shared-prefix case instead")
    return p.parse_args()


def lora_field(adapter: int | None) -> list[dict[str, float]]:
    return [{"id": i, "scale": 1.0 if i == adapter else 0.0} for i in range(4)]


def round_of(url: str, sets: list[int], max_tokens: int) -> float:
    """One round of 8 streams at once: total completion tokens/s."""

    def one(i: int) -> int:
        adapter = sets[i % len(sets)] if sets else None
        body = {"prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0}
        body |= {"logit_bias": {"1": -100, "106": -100}, "lora": lora_field(adapter), "cache_prompt": False}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
        answer.raise_for_status()
        return int(answer.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        tokens = sum(pool.map(one, range(8)))
    return tokens / (time.perf_counter() - started)


#: the test aLoRAs' invocation (``<start_of_turn>model\n`` in the default model's vocabulary)
INVOKE = (105, 4368, 107)
INVOCATION = "<start_of_turn>model\n"


def long_prompt(rep: int) -> str:
    """~1,000 tokens, another for each rep (nothing cached from the last)."""
    return "".join(f"In year {1000 + 97 * rep + 7 * i} the river town built bridge {i}.\n" for i in range(70))


def alora_round(url: str, rep: int, max_tokens: int, cache: bool) -> tuple[list[int], float]:
    """The base on a long prompt, then each aLoRA on it with the invocation: the prompt
    tokens each aLoRA request evaluated, and their wall time."""
    prompt = long_prompt(rep)

    def send(text: str, adapter: int | None) -> int:
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": cache}
        body |= {"logit_bias": {"1": -100, "106": -100}, "lora": lora_field(adapter)}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
        answer.raise_for_status()
        data = answer.json()
        if "timings" in data:  # (llama-server)
            return int(data["timings"]["prompt_n"])
        usage = data["usage"]
        return int(
            usage["prompt_tokens"] - ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        )

    send(prompt, None)
    started = time.perf_counter()
    evaluated = [send(prompt + INVOCATION, i) for i in range(4)]
    return evaluated, time.perf_counter() - started


def alora_main(args: Any) -> None:
    model = default_model_path(progress=False)
    adapters = [tiny_lora(seed, invocation=INVOKE) for seed in (3, 4, 5, 6)]
    logs = Path(tempfile.mkdtemp(prefix="alora-bench-"))
    result: dict[str, dict[str, Any]] = {}
    for name in (servers.TRIOSERVE, servers.LLAMA_SERVER):
        port = servers.free_port()
        if name == servers.TRIOSERVE:
            extra = ["--slots", "4", *(f for i, a in enumerate(adapters) for f in ("--lora", f"l{i}={a}"))]
            argv = servers.command(
                name, model, port, threads=args.threads, ctx_size=args.ctx_size * 2, extra=extra
            )
        else:
            extra = ["--parallel", "4", "--no-kv-unified", "--ctx-size", str(args.ctx_size * 2 * 4)]
            extra += [f for a in adapters for f in ("--lora", str(a))]
            where = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
            argv = [servers.llama_server_binary(), *where, "--threads", str(args.threads), *extra]
            argv += ["--threads-batch", str(args.threads)]
        server = servers.Server(name, argv, port, logs)
        try:
            server.wait_ready(300)
            alora_round(server.url, 99, 4, True)  # (a warm-up)
            result[name] = {}
            for cache in (True, False):
                rounds = [
                    alora_round(server.url, rep + 2 * cache, args.max_tokens, cache)
                    for rep in range(args.reps)
                ]
                label = "cache on" if cache else "cache off"
                wall = statistics.median(t for _, t in rounds)
                evaluated = [e for e, _ in rounds]
                result[name][label] = {"seconds": wall, "evaluated": evaluated}
                print(f"{name:<14} {label:<9} {wall:6.2f} s for 4 aLoRA requests; evaluated {evaluated}")
        finally:
            server.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "result": result})
        )


def main() -> None:
    args = parse_args()
    if args.alora:
        alora_main(args)
        return
    model = default_model_path(progress=False)
    adapters = [tiny_lora(seed) for seed in (1, 2, 3, 4)]
    logs = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    result: dict[str, dict[str, float]] = {}
    for name in (servers.TRIOSERVE, servers.LLAMA_SERVER):
        port = servers.free_port()
        if name == servers.TRIOSERVE:
            extra = ["--slots", "8", *(f for i, a in enumerate(adapters) for f in ("--lora", f"l{i}={a}"))]
            argv = servers.command(
                name, model, port, threads=args.threads, ctx_size=args.ctx_size, extra=extra
            )
        else:
            extra = ["--parallel", "8", "--no-kv-unified", "--ctx-size", str(args.ctx_size * 8)]
            extra += [f for a in adapters for f in ("--lora", str(a))]
            argv = [
                servers.llama_server_binary(),
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--threads",
                str(args.threads),
                "--threads-batch",
                str(args.threads),
                *extra,
            ]
        server = servers.Server(name, argv, port, logs)
        try:
            server.wait_ready(300)
            round_of(server.url, [0], 8)  # (a warm-up)
            result[name] = {}
            for scenario, sets in SCENARIOS.items():
                rates = [round_of(server.url, sets, args.max_tokens) for _ in range(args.reps)]
                result[name][scenario] = statistics.median(rates)
                each = ", ".join(f"{r:.1f}" for r in rates)
                print(f"{name:<14} {scenario:<7} {result[name][scenario]:7.1f} tok/s  ({each})")
        finally:
            server.stop()
    print()
    print(
        "| adapter sets | trioserve tok/s | × its base | llama-server tok/s | × its base | ÷ llama-server |"
    )
    print("|---|---|---|---|---|---|")
    ts, ls = result[servers.TRIOSERVE], result[servers.LLAMA_SERVER]
    for scenario in SCENARIOS:
        print(
            f"| {scenario} | {ts[scenario]:.1f} | {ts[scenario] / ts['base']:.2f} | {ls[scenario]:.1f} | "
            f"{ls[scenario] / ls['base']:.2f} | {ts[scenario] / ls[scenario]:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "result": result})
        )


if __name__ == "__main__":
    main()
