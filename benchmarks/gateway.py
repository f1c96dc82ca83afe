"""Many workers as one: two trioserve workers behind the Shepherd Model Gateway (SMG),
sharing one prompt-cache directory (docs/deployment.md, issue 39).

Five interleaved conversations of five turns (each turn ~180 new tokens of user text,
the reply 24 tokens at temperature 0), sent through SMG with a policy, and the same
conversations sent to one trioserve alone: for each later turn, whether it reused its
whole previous prompt (the prompt-cache tokens it reports ≥ the previous turn's prompt
less the last piece, which is always evaluated), where from (cells, host, disk), and
whether every reply equals the single server's.

    python benchmarks/gateway.py --policy round_robin --policy cache_aware [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.cluster import start_gateway, start_workers
from benchmarks.harness.servers import Server, free_port, trioserve_command

#: turns whose reuse counts as "its whole previous prompt": all but the last piece
#: (the prompt's last piece is evaluated again: its logits are needed)
LAST_PIECE = 160
WORKER_FLAGS = ("--threads", "1", "--slots", "4", "--ctx-size", "4096")
TOPICS = ("lighthouses", "bridges", "orchards", "glaciers", "printing presses")


def user_turn(conversation: int, turn: int) -> str:
    topic = TOPICS[conversation]
    return " ".join(
        f"Question {turn}.{i} about {topic}: how were {topic} built, kept and used in the years of "
        f"region {conversation}, and what changed after the storm of year {1800 + 10 * turn + i}?"
        for i in range(5)
    )


def converse(url: str, conversations: int = 5, turns: int = 5) -> list[dict[str, Any]]:
    """The conversations, interleaved (turn t of each, then turn t + 1): each turn's
    reply, prompt tokens and cached tokens (and the trioserve split, when given)."""
    histories: list[list[dict[str, str]]] = [[] for _ in range(conversations)]
    rows = []
    with httpx.Client(base_url=url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for turn in range(turns):
            for c in range(conversations):
                histories[c].append({"role": "user", "content": user_turn(c, turn)})
                body = {"model": model, "messages": histories[c], "max_tokens": 24, "temperature": 0}
                response = client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                answer = response.json()
                text = answer["choices"][0]["message"]["content"]
                histories[c].append({"role": "assistant", "content": text})
                usage = answer["usage"]
                rows.append(
                    {
                        "conversation": c,
                        "turn": turn,
                        "text": text,
                        "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                        "split": (usage.get("trioserve") or {}).get("cached_tokens"),
                    }
                )
    return rows


def reuse(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(later turns that reused their whole previous prompt, later turns)."""
    previous = {(r["conversation"], r["turn"]): r for r in rows}
    later = [r for r in rows if r["turn"] > 0]
    hits = sum(
        1
        for r in later
        if r["cached_tokens"] >= previous[(r["conversation"], r["turn"] - 1)]["prompt_tokens"] - LAST_PIECE
    )
    return hits, len(later)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", action="append", default=[])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    policies = args.policy or ["round_robin", "cache_aware"]
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    results: dict[str, Any] = {}
    # the single server: the texts every policy must give
    port = free_port()
    single = Server("single", trioserve_command(port, *WORKER_FLAGS), port, logs)
    try:
        single.wait_ready(timeout=300)
        reference = converse(single.url)
    finally:
        single.stop()
    results["single"] = {"reuse": reuse(reference)}
    print(f"single server: {reuse(reference)[0]}/{reuse(reference)[1]} later turns reused their prompt")
    for policy in policies:
        cache_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-cache-"))
        workers = start_workers(2, cache_dir, logs, *WORKER_FLAGS)
        gateway = None
        try:
            gateway = start_gateway(workers, policy, logs)
            rows = converse(gateway.url)
        finally:
            if gateway is not None:
                gateway.stop()
            for worker in workers:
                worker.stop()
            shutil.rmtree(cache_dir, ignore_errors=True)
        hits, later = reuse(rows)
        same = sum(a["text"] == b["text"] for a, b in zip(rows, reference, strict=True))
        disk = sum((r["split"] or {}).get("disk", 0) for r in rows)
        results[policy] = {
            "reuse": [hits, later],
            "same_texts": [same, len(rows)],
            "disk_tokens": disk,
            "rows": rows,
        }
        print(
            f"{policy:12s}: {hits}/{later} later turns reused their whole previous prompt; "
            f"{same}/{len(rows)} replies equal the single server's; {disk} cached tokens from disk",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
