"""n=4 against 4 separate requests (issue 15): one ~1,000-token prompt, cache_prompt false,
max_tokens 32, greedy, on ``trioserve serve --threads 2 --slots 4``. Time to first token,
total time, and the /metrics ``trioserve_prompt_tokens_evaluated_total`` delta of each (n=4
should evaluate the prompt once). Rounds alternate the two, the start rotating.

    flock /tmp/trioserve-cpu.lock .venv/bin/python scripts/probes/n_choices.py --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from constrained_cost import serve, stream, together

SENTENCE = "The history of the city is long and varied. "
EVALUATED = re.compile(rb"^trioserve_prompt_tokens_evaluated_total (\S+)$", re.M)


def evaluated(port: int) -> float:
    time.sleep(0.3)  # (the counter is bumped just after a request ends)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    found = EVALUATED.search(conn.getresponse().read())
    conn.close()
    return float(found[1]) if found else float("nan")


def part_n(port: int, args: Any) -> dict[str, Any]:
    def body(tag: str, n: int) -> dict[str, Any]:
        prompt = f"Record {tag}. " + SENTENCE * args.long_repeats
        return {"prompt": prompt, "max_tokens": 32, "temperature": 0, "n": n, "cache_prompt": False}

    out: dict[str, list[Any]] = {"n=4": [], "4 requests": []}
    stream(port, "/v1/completions", body("warm", 4))
    for r in range(args.reps):
        for kind in list(out)[r % 2 :] + list(out)[: r % 2]:
            before = evaluated(port)
            if kind == "n=4":
                s = stream(port, "/v1/completions", body(f"{r}", 4))
                rec = {
                    "ttft_ms": s["ttft_ms"],
                    "first_per_choice_ms": s["first_per_choice_ms"],
                    "total_ms": s["total_ms"],
                    "tokens": s["tokens"],
                    "finish": s["finish"],
                    "prompt_tokens": s["prompt_tokens"],
                }
            else:
                rows = together(port, "/v1/completions", [body(f"{r}", 1) for _ in range(4)])
                sent = min(s["sent"] for s in rows)
                rec = {
                    "ttft_ms": min(s["first"] - sent for s in rows) * 1e3,
                    "first_per_choice_ms": sorted((s["first"] - sent) * 1e3 for s in rows),
                    "total_ms": (max(s["end"] for s in rows) - sent) * 1e3,
                    "tokens": sum(s["tokens"] for s in rows),
                    "finish": sorted({f for s in rows for f in s["finish"]}),
                    "prompt_tokens": rows[0]["prompt_tokens"],
                }
            rec["evaluated_delta"] = evaluated(port) - before
            out[kind].append(rec)
            print(
                f"n {r} {kind:<10} ttft {rec['ttft_ms']:.0f} total {rec['total_ms']:.0f} "
                f"evaluated {rec['evaluated_delta']:.0f} {rec['finish']}",
                file=sys.stderr,
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="GGUF (default: trioserve's default model)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--long-repeats", type=int, default=100, help="sentences in the prompt (~1,000 tokens)")
    p.add_argument("--json", type=Path, help="write the results here")
    serve(p.parse_args(), {"n": (["--slots", "4"], part_n)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
