"""Probe (issue 40): what verify rows cost when several streams decode in one call — the
model side of "speculation for several streams, where does it pay?".

For ``s`` streams (each with a ~200-token context of its own, one sequence each), times a
decode call where every stream decodes 1 row (a plain step) against one where every
stream carries ``d`` guesses (1 + d rows each, all with logits), and prints the
acceptance at which the guesses pay: a call of s·(1 + d) rows makes s·(1 + a·d) tokens
on average (a = the fraction of guesses accepted, the run stopping at the first miss
ignored), so it pays when 1 + a·d > cost(1 + d) ÷ cost(1), i.e. a > (ratio − 1) ÷ d.

    .venv/bin/python scripts/probes/spec_streams_cost.py [--streams 1,2,4,8] [--drafts 2,15]
"""

from __future__ import annotations

import argparse
import statistics
import time

from trioserve import LlamaBackend, LlamaSettings, default_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--drafts", default="2,15")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    drafts = [int(d) for d in args.drafts.split(",")]
    most = max(streams)
    backend = LlamaBackend.load(
        LlamaSettings(default_model_path(), slots=most, n_threads=2, warm_up=False, n_batch=512)
    )
    s = backend._scheduler
    lib, ctx, batch, memory = backend.lib, s.context.ctx, s.context.batch, s.context.memory
    prompt = backend.tokenize("The old harbor town kept its lighthouse burning every night. " * 16)
    P = len(prompt)

    def decode(rows: list[tuple[int, int, int, int]]) -> None:
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(rows)
        assert lib.llama_decode(ctx, batch) == 0

    for seq in range(most):  # each stream's context, 64 rows a call
        for start in range(0, P, 64):
            end = min(P, start + 64)
            decode([(prompt[i], i, seq, 0) for i in range(start, end)])
    print(f"context {P} tokens a stream; ms per call (median of {args.reps})")
    for n in streams:
        costs = {}
        for d in [0, *drafts]:
            times = []
            for _ in range(args.reps):
                rows = [(prompt[-1], P + j, seq, 1) for seq in range(n) for j in range(1 + d)]
                started = time.perf_counter()
                decode(rows)
                times.append(time.perf_counter() - started)
                for seq in range(n):
                    lib.llama_memory_seq_rm(memory, seq, P, -1)
            costs[d] = statistics.median(times) * 1000
        line = f"{n} stream(s): 1 row each {costs[0]:.1f} ms"
        for d in drafts:
            ratio = costs[d] / costs[0]
            line += f"; {1 + d} rows each {costs[d]:.1f} ms ({ratio:.2f}x: pays above {100 * (ratio - 1) / d:.0f} % accepted)"
        print(line)
    backend._free()


if __name__ == "__main__":
    main()
