"""The prompt cache across a restart (issue 35): a ~4,000-token conversation, the server
stopped and started again, then the next turn.

Runs, each on a fresh server (streamed, greedy ``/v1/completions`` in Gemma's turn
format, ``--max-tokens`` a turn; a new tag per run, so that nothing is cached before):

- ``trioserve`` (``--cache-dir``, a new directory): turn 1 cold; SIGTERM; started
  again on the same directory; turn 2 = turn 1's prompt + its reply + a new question;
- ``trioserve, one request first``: the same, with one unrelated 1-token request to the
  restarted server before turn 2 (what a process pays once is then not in turn 2);
- ``trioserve kill -9``: the same, killed with SIGKILL instead;
- ``trioserve never stopped``: turn 1, then turn 2 on the same server (the bar's
  reference: the cells still hold turn 1);
- ``llama-server``: turn 1; SIGTERM; started again; turn 2 (it keeps no cache across a
  restart);
- exactness: turn 2 on ``trioserve --no-prompt-cache``; every trioserve turn 2 text
  must equal it.

Each trioserve server is given the time a user reads the answer before the next turn
or the stop: until ``/health`` shows the reply's pieces recomputed and (with a disk
tier) written. Reported per run: turn 2's TTFT, its prompt tokens, cached tokens (and trioserve's
split: cells, host, disk) and tokens evaluated. Bars: restarted TTFT ≤ 1.3 × never
stopped, ≤ 0.25 × llama-server restarted.

    python benchmarks/restart.py --json artifacts/restart.json
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.conversation import GEMMA_TEMPLATE, user_text
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import body
from benchmarks.harness.stats import fmt, median

TS, LS = servers.TRIOSERVE, servers.LLAMA_SERVER


def parse_args() -> Any:
    p = cli.parser(__doc__, ((TS, LS), (TS, LS)), threads=2, ctx_size=8192, max_tokens=16)
    cli.option(p, "--words", 2900, "words of turn 1 (about 4,000 tokens)")
    cli.option(p, "--reps", 1, "runs of each trioserve case but cache-off (alternating; medians reported)")
    return p.parse_args()


def prompt(tag: str, words: int) -> tuple[str, str]:
    first = ""
    turn = 0
    while len(first.split()) < words:
        first += f"<start_of_turn>user\n{user_text(0, turn, 85, tag)}<end_of_turn>\n"
        first += f"<start_of_turn>model\nNoted, part {turn} of the record.<end_of_turn>\n"
        turn += 1
    first += "<start_of_turn>user\nSummarise the record in one line.<end_of_turn>\n<start_of_turn>model\n"
    second = "<end_of_turn>\n<start_of_turn>user\nAnd which topic came up most often?<end_of_turn>\n"
    return first, second + "<start_of_turn>model\n"


def turn(client: httpx.Client, server: servers.Server, text: str, tokens: int) -> dict[str, Any]:
    payload = body(text, tokens, stream_options={"include_usage": True})
    out: dict[str, Any] = {"text": ""}
    t0 = time.perf_counter()
    with client.stream("POST", server.url + "/v1/completions", json=payload) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                if "ttft_ms" not in out and (choice.get("text") or choice.get("finish_reason")):
                    out["ttft_ms"] = (time.perf_counter() - t0) * 1e3
                out["text"] += choice.get("text") or ""
            if event.get("usage"):
                usage = event["usage"]
                out["prompt_tokens"] = usage["prompt_tokens"]
                out["cached"] = usage["prompt_tokens_details"]["cached_tokens"]
                out["split"] = (usage.get("trioserve") or {}).get("cached_tokens")
            if event.get("timings"):  # llama-server
                out["prompt_tokens"] = event["timings"].get("prompt_n", 0) + event["timings"].get(
                    "cache_n", 0
                )
                out["cached"] = event["timings"].get("cache_n")
    out["evaluated"] = (out.get("prompt_tokens") or 0) - (out.get("cached") or 0)
    return out


def start(name: str, args: Any, log_dir: Path, extra: list[str]) -> servers.Server:
    server = servers.Server.start(
        name, args.model, log_dir, threads=args.threads, ctx_size=args.ctx_size, extra=extra
    )
    server.wait_ready(300)
    return server


def wait_settled(server: servers.Server) -> None:
    """Until the server has nothing left to do: the reply's pieces recomputed (what a
    user reading the answer gives it time for) and, with a disk tier, written."""
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        cache = server.health().get("batch", {}).get("cache", {})
        idle = cache.get("idle_recompute") or {}
        disk = cache.get("disk")
        if not idle.get("pending") and (disk is None or disk.get("writes")):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{server.name} did not settle")


def disk_writes(server: servers.Server) -> int:
    disk = server.health().get("batch", {}).get("cache", {}).get("disk") or {}
    return int(disk.get("writes") or 0)


def run(name: str, args: Any, log_dir: Path, first: str, new: str) -> dict[str, Any]:
    cache_dir = Path(tempfile.mkdtemp(prefix="trioserve-restart-"))
    ts_flags = ["--slots", "2", "--cache-dir", str(cache_dir)]
    extra = {
        "trioserve": ts_flags,
        "trioserve, one request first": ts_flags,
        "trioserve kill -9": ts_flags,
        "trioserve never stopped": ts_flags,
        "trioserve --no-prompt-cache": ["--slots", "2", "--no-prompt-cache"],
        "llama-server": ["--chat-template", GEMMA_TEMPLATE],
    }[name]
    kind = LS if name == "llama-server" else TS
    try:
        with httpx.Client(timeout=600) as client:
            server = start(kind, args, log_dir, extra)
            one = turn(client, server, first, args.max_tokens)
            second = first + one["text"] + new
            if kind == TS:
                wait_settled(server)
            if name in ("trioserve", "trioserve, one request first", "llama-server"):
                server.stop()
                server = start(kind, args, log_dir, extra)
                if name == "trioserve, one request first":
                    # the new process's first request pays for what a process does once
                    # (first calls, allocations): this one is not the measured turn
                    turn(client, server, "Hello", 1)
            elif name == "trioserve kill -9":
                give_up = time.monotonic() + 60
                while disk_writes(server) < 1 and time.monotonic() < give_up:
                    time.sleep(0.05)
                server.proc.kill()
                server.proc.wait()
                server = start(kind, args, log_dir, extra)
            two = turn(client, server, second, args.max_tokens)
            if kind == TS:
                # the time the scheduler spent restoring cached prefixes (host or disk)
                ram = server.health().get("batch", {}).get("cache", {}).get("ram", {})
                two["restore_ms"] = 1e3 * float(ram.get("restore_seconds") or 0.0)
            server.stop()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"name": name, "turn1": one, "turn2": two}


def main() -> None:
    args = parse_args()
    args.model = cli.resolve_model(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    first, new = prompt(uuid.uuid4().hex[:8], args.words)
    repeated = ["trioserve", "trioserve, one request first", "trioserve kill -9", "trioserve never stopped"]
    once = ["llama-server", "trioserve --no-prompt-cache"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in repeated + once}
    for rep in range(args.reps):
        # (alternating: a slow spell of the machine falls on every case alike)
        for name in repeated:
            runs[name].append(run(name, args, log_dir, first, new))
            cli.log(f"rep {rep + 1}: {name}: turn 2 TTFT {fmt(runs[name][-1]['turn2'].get('ttft_ms'))} ms")
    for name in once:
        runs[name].append(run(name, args, log_dir, first, new))
    reference = runs["trioserve --no-prompt-cache"][0]["turn2"]["text"]
    for name, done in runs.items():
        for r in done:
            two = r["turn2"]
            exact = "exact" if two["text"] == reference else "DIFFERS"
            exact = exact if name.startswith("trioserve") else ""
            print(
                f"{name:28} turn 2: TTFT {fmt(two.get('ttft_ms'))} ms, prompt {two.get('prompt_tokens')}, "
                f"cached {two.get('cached')} {two.get('split') or ''}, evaluated {two['evaluated']} {exact}"
                + (f", restore {two['restore_ms']:.1f} ms" if "restore_ms" in two else "")
            )
    ttft = {name: median([r["turn2"].get("ttft_ms") for r in done]) for name, done in runs.items()}
    if args.reps > 1:
        print("medians: " + ", ".join(f"{name} {value:.1f} ms" for name, value in ttft.items()))
    ratios = {
        "restart / never stopped": ttft["trioserve"] / ttft["trioserve never stopped"],
        "kill -9 / never stopped": ttft["trioserve kill -9"] / ttft["trioserve never stopped"],
        "restart / llama-server restarted": ttft["trioserve"] / ttft["llama-server"],
    }
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    exact = all(
        r["turn2"]["text"] == reference for n, done in runs.items() if n.startswith("trioserve") for r in done
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": runs, "ratios": ratios, "exact": exact}, indent=1))


if __name__ == "__main__":
    main()
