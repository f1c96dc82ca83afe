"""The drafter's length policy, simulated: the speculation benchmark's 15 prompts decoded
greedily once (160 tokens, plain llama.cpp), then every verify call the drafter would
make replayed against those tokens, priced by the measured cost of a call of r rows.

It compares policies without a server (relative figures: the prefill, the HTTP path
and the texts that fast mode changes are left out), so a policy change can be judged
in seconds; the benchmark (benchmarks/speculation.py) is the measurement.

    .venv/bin/python scripts/probes/draft_sim.py [--width 16] [--policy ngram-simple] [--tokens /tmp/draft_sim.json]

Row costs: scripts/probes/spec_exact.py --timing --widths 1,4,8,12,16 (repacked,
context 7, 2026-12-02); 2 and 3 rows from docs/speculation.md's table, scaled by
15.4 / 17.7 (that table's one-row time). Costs differ by CPU (the 2026-12-03 machine:
docs/speculation.md). Fast mode's full width needs an empty channel (a reader that
keeps up), which the replay assumes: its figures are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trioserve._backends._decoding import Drafter

#: 2026-12-05, AMD EPYC (AVX-512), 2 threads, repacked, context 899:
#: scripts/probes/spec_exact.py --timing --widths 1,2,3,4,8,16,32,48,64
#: (the first machine's, 2026-12-02: 1: 15.4, 2: 30.0, 3: 34.0, 4: 36.1, 8: 58.9, 12: 75.7, 16: 89.5)
COST_MS = {1: 13.4, 2: 24.2, 3: 29.6, 4: 32.3, 8: 51.1, 16: 82.5, 32: 164.9, 48: 240.9, 64: 291.9}


def cost(rows: int) -> float:
    keys = sorted(COST_MS)
    if rows in COST_MS:
        return COST_MS[rows]
    for a, b in zip(keys, keys[1:], strict=False):
        if a < rows < b:
            return COST_MS[a] + (COST_MS[b] - COST_MS[a]) * (rows - a) / (b - a)
    raise ValueError(rows)


def greedy_tokens(path: Path, max_tokens: int) -> dict[str, list[dict[str, list[int]]]]:
    if path.exists():
        return json.loads(path.read_text())
    import llama_cpp

    from benchmarks.speculation import WORKLOADS
    from trioserve import default_model_path

    llm = llama_cpp.Llama(
        str(default_model_path(progress=False)), n_ctx=2048, n_threads=2, verbose=False, flash_attn=True
    )
    out: dict[str, list[dict[str, list[int]]]] = {}
    for workload, prompts in WORKLOADS.items():
        out[workload] = []
        for prompt in prompts:
            tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
            made: list[int] = []
            for token in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
                if token == llm.token_eos() or len(made) >= max_tokens:
                    break
                made.append(token)
            out[workload].append({"prompt": tokens, "made": made})
    path.write_text(json.dumps(out))
    return out


class NgramSimple:
    """llama-server's ``--spec-type ngram-simple`` (common/ngram-map.cpp,
    ``common_ngram_simple_draft``): the last 12 tokens (the current one included) looked
    up backwards in the context, the 48 tokens after the most recent match proposed —
    or nothing when fewer than 12 follow it. No state, no back-off."""

    def __init__(self, prompt: list[int], size_n: int = 12, size_m: int = 48) -> None:
        self.context = list(prompt)
        self.n, self.m = size_n, size_m

    def extend(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def propose(self, current: int, limit: int) -> list[int]:
        tokens, n = self.context, self.n
        cur = len(tokens)
        if cur <= n + self.m + 1:
            return []
        pattern = tokens[cur - n + 1 :] + [current]
        for j in range(cur - n - 1, 0, -1):
            if tokens[j : j + n] == pattern:
                copy = min(self.m, cur - (j + n))
                if copy < n:
                    return []
                return tokens[j + n : j + n + min(copy, limit)]
        return []

    def settle(self, proposed: int, accepted: int) -> None:
        pass


POLICIES = {
    "trioserve": lambda prompt, width: Drafter(prompt, longest=width - 1),
    "ngram-simple": lambda prompt, width: NgramSimple(prompt),
}


def replay(prompt: list[int], made: list[int], width: int, policy: str = "trioserve") -> tuple[int, float]:
    """(tokens decoded after the first, milliseconds) for one prompt."""
    drafter = POLICIES[policy](prompt, width)
    i, ms = 0, 0.0  # made[i]: the token about to be decoded
    while i < len(made) - 1:
        done = len(drafter.context) - len(prompt)
        if done < i:
            drafter.extend(made[done:i])
        limit = min(width - 1, len(made) - 1 - i)
        draft = drafter.propose(made[i], limit) if limit > 0 else []
        ms += cost(1 + len(draft))
        accepted = 0
        for j, guess in enumerate(draft):
            if i + 1 + j >= len(made) or made[i + 1 + j] != guess:
                break
            accepted += 1
        if draft:
            drafter.settle(len(draft), accepted)
        i += 1 + accepted
    return len(made) - 1, ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--width", type=int, default=16, help="verify call width (16: fast; auto: the probed one)"
    )
    parser.add_argument("--tokens", type=Path, default=Path("/tmp/draft_sim.json"))
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--policy", default="trioserve", choices=sorted(POLICIES))
    args = parser.parse_args()
    data = greedy_tokens(args.tokens, args.max_tokens)
    one_row = 1000 / cost(1)
    for workload, items in data.items():
        tokens = ms = 0.0
        for item in items:
            t, m = replay(item["prompt"], item["made"], args.width, args.policy)
            tokens += t
            ms += m
        tps = tokens / ms * 1000
        print(
            f"{args.policy} {workload:10s} width {args.width:2d}: {tps:6.1f} tok/s decode, {tps / one_row:.2f}x one row a call"
        )


if __name__ == "__main__":
    main()
