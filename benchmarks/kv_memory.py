"""KV cache types (issue 49; docs/models.md, "KV cache types"): the memory of f16 and
q8_0 K+V caches, and what q8_0 does to greedy texts.

Four servers, one after another, each with ``--slots`` sequences of ``--ctx-size``
tokens on the default GGUF: trioserve with f16 and with q8_0 K and V, llama-server
(matched: ``-np SLOTS -c SLOTS×CTX --no-kv-unified --no-cache-prompt``) with the same
two. For each: the KV cache as the server says it (trioserve: ``/health``
``batch.kv_cache``; llama-server logs no size at its default verbosity: llama.cpp's own
``llama_kv_cache: size = … MiB`` lines for a context made with llama-server's settings —
``swa_full`` off, the sliding-window layers' cache one window per sequence — through the
same llama.cpp's Python bindings), the
process's RSS once ready and after the prompts; then ``--prompts`` greedy completions
of ``--max-tokens`` tokens (the end tokens 1 and 106 banned, so every text has its full
length), one at a time. The report counts equal texts: q8_0 against f16 (each server),
and trioserve against llama-server (each type).

    python benchmarks/kv_memory.py --slots 8 --ctx-size 32768 --json artifacts/kv-memory.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.proc import rss_kib
from benchmarks.harness.servers import MATCHED, TRIOSERVE, Server, command, free_port
from trioserve import default_model_path

PROMPTS = [
    "The history of the lighthouse at the mouth of the river begins",
    "Write a short recipe for bread:\n1.",
    "def fibonacci(n):\n    ",
    "Q: Why is the sky blue?\nA:",
    "The three most important rules of writing clear code are",
    "Once upon a time, in a village at the edge of the forest,",
    "A list of the planets of the solar system, in order:",
    "Dear customer, thank you for your letter about",
    "The capital of France is Paris. The capital of Italy is",
    "Translate to French: 'The cat sleeps on the warm windowsill.'\nFrench:",
    "SELECT name, email FROM users WHERE",
    "In 1969, the first humans to walk on the Moon",
    "Here is a haiku about autumn rain:\n",
    "The difference between a list and a tuple in Python is",
    "Steps to change a flat tire:\n1.",
    "The mitochondria is often called",
    "import json\n\nwith open('data.json') as f:\n",
    "A good night's sleep helps the brain",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "Summary of the meeting: the team agreed to",
]

CONTESTANTS = [
    (TRIOSERVE, "f16"),
    (TRIOSERVE, "q8_0"),
    (MATCHED, "f16"),
    (MATCHED, "q8_0"),
]


def _llama_cpp_kv_mib(log: str) -> float:
    return sum(float(m) for m in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", log))


def _llama_server_kv_mib(kind: str, slots: int, ctx_size: int) -> float:
    """The KV cache llama.cpp allocates for llama-server's context (its log lines)."""
    import llama_cpp

    from trioserve._backends._llama._settings import KV_CACHE_TYPES

    lines: list[str] = []
    callback = llama_cpp.llama_log_callback(
        lambda _level, text, _data: lines.append(text.decode(errors="replace"))
    )
    llama_cpp.llama_log_set(callback, None)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(default_model_path(progress=False)).encode(), llama_cpp.llama_model_default_params()
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = ctx_size * slots, slots, False
    params.swa_full, params.n_batch, params.n_ubatch = False, 2048, 512  # (llama-server's defaults)
    params.type_k = params.type_v = KV_CACHE_TYPES[kind]
    ctx = llama_cpp.llama_init_from_model(model, params)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return _llama_cpp_kv_mib("".join(lines))


def run_one(name: str, kind: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    model = default_model_path(progress=False)
    port = free_port()
    types = ["--cache-type-k", kind, "--cache-type-v", kind]
    extra = ["--slots", str(args.slots), *types] if name == TRIOSERVE else types
    argv = command(
        name, model, port, threads=args.threads, ctx_size=args.ctx_size, slots=args.slots, extra=extra
    )
    server = Server(name, argv, port, log_dir, log_dir / f"{name}-{kind}.log")
    try:
        server.wait_ready(600)
        rss_ready = rss_kib(server.pid) / 1024
        if name == TRIOSERVE:
            kv = server.health()["batch"]["kv_cache"]
            kv_mib = kv["bytes"] / (1 << 20)
        else:
            kv_mib = _llama_cpp_kv_mib(server.log_text()) or _llama_server_kv_mib(
                kind, args.slots, args.ctx_size
            )
        texts = []
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for prompt in PROMPTS[: args.prompts]:
                body = {
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "logit_bias": {"1": -100, "106": -100},
                }
                answer = client.post("/v1/completions", json=body)
                answer.raise_for_status()
                texts.append(answer.json()["choices"][0]["text"])
        rss_after = rss_kib(server.pid) / 1024
    finally:
        server.stop()
    print(f"{name} {kind}: KV {kv_mib:.1f} MiB, RSS {rss_ready:.0f} → {rss_after:.0f} MiB", flush=True)
    return {
        "server": name,
        "type": kind,
        "kv_mib": kv_mib,
        "rss_ready_mib": rss_ready,
        "rss_after_mib": rss_after,
        "texts": texts,
    }


def _equal(a: list[str], b: list[str]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by = {(r["server"], r["type"]): r for r in results}
    lines = [
        f"{args.slots} slots × {args.ctx_size} tokens, {args.threads} threads, "
        f"{args.prompts} prompts × {args.max_tokens} tokens",
        "",
        "| server | K, V types | KV cache | RSS ready | RSS after the prompts |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['server']} | {r['type']} | {r['kv_mib']:.1f} MiB | {r['rss_ready_mib']:.0f} MiB "
            f"| {r['rss_after_mib']:.0f} MiB |"
        )
    lines += ["", "| texts equal | count |", "|---|---|"]
    for server in (TRIOSERVE, MATCHED):
        if (server, "f16") in by and (server, "q8_0") in by:
            pair = _equal(by[server, "q8_0"]["texts"], by[server, "f16"]["texts"])
            lines.append(f"| {server}: q8_0 = f16 | {pair} |")
    for kind in ("f16", "q8_0"):
        if (TRIOSERVE, kind) in by and (MATCHED, kind) in by:
            pair = _equal(by[TRIOSERVE, kind]["texts"], by[MATCHED, kind]["texts"])
            lines.append(f"| {kind}: trioserve = llama-server | {pair} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--ctx-size", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-llama-server", action="store_true", help="trioserve only")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--report", type=Path, default=None, help="print the report of a --json file, run nothing"
    )
    args = parser.parse_args()
    if args.report is not None:
        saved = json.loads(args.report.read_text())
        print(report(saved["results"], argparse.Namespace(**saved["args"])))
        return
    log_dir = Path(tempfile.mkdtemp(prefix="kv-memory-"))
    results = [
        run_one(name, kind, args, log_dir)
        for name, kind in CONTESTANTS
        if not (args.no_llama_server and name != TRIOSERVE)
    ]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1)
        )
    print(report(results, args))


if __name__ == "__main__":
    main()
