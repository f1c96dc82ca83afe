"""Batched decoding: total tokens/s against concurrent streams, and against llama.cpp's ceiling.

Contestants, each alone: ``decode-only`` (the ceiling, ``harness.decode_loop``, in this
process), ``trioserve`` (``--slots 8``), ``trioserve-invariant`` (``--batch-invariant``),
``llama-cpp-python`` (one completion at a time), ``llama-server`` (its defaults: 4 slots,
prompt cache), ``llama-server-matched`` (``--parallel`` = ``--slots``, context per
sequence, no prompt cache). The servers get ``harness.groups``: a warm-up, every prompt
solo, then ``--reps`` rounds of N streams for each N in ``--streams``. Columns, targets
and chart: docs/benchmarks.md, "Method" and "Batched decoding".

    python benchmarks/batched.py --json artifacts/batched.json   # chart: docs/images/batched-throughput.png
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, groups, plots, servers
from benchmarks.harness.decode_loop import DecodeLoop

DECODE_ONLY, T, INVARIANT = "decode-only", servers.TRIOSERVE, "trioserve-invariant"
CONTESTANTS = (DECODE_ONLY, T, INVARIANT, servers.LLAMA_CPP_PYTHON, servers.LLAMA_SERVER, servers.MATCHED)
TARGETS = (1.8, 1.2)  # × trioserve's N = 1 total tok/s
NAMES = "contestants threads ctx_size slots max_tokens reps streams prompts"
CHART = servers.REPO / "docs" / "images" / "batched-throughput.png"


def parse_args() -> Any:
    defaults = {"threads": os.cpu_count() or 1, "ctx_size": 2048, "slots": 8, "max_tokens": 128, "reps": 3}
    defaults |= {"streams": [1, 4, 8], "prompts": list(cli.PROMPTS), "other_load_warn": 20.0}
    p = cli.parser(__doc__, (CONTESTANTS, CONTESTANTS), **defaults)
    p.add_argument("--chart", type=Path, default=CHART, help="the PNG chart (default: docs/images/…)")
    p.add_argument("--no-chart", action="store_true", help="draw no chart")
    p.add_argument("--replot", type=Path, help="measure nothing: report (and chart) this earlier --json file")
    return p.parse_args()


def decode_only(model: Path, args: Any, notes: list[str]) -> tuple[list[groups.Group], list[groups.Stream]]:
    """The same procedure as the servers', on the bare loop (tokens: max_tokens each)."""
    loop, all_groups, streams = DecodeLoop(model, args.threads, args.ctx_size), [], []

    def streams_of(prompts: list[str], run: dict[str, Any], group: str, rep: int) -> list[groups.Stream]:
        rate, out = (args.max_tokens - 1) / run["loop_s"], []
        for i, (prompt, tokens) in enumerate(zip(prompts, run["tokens"], strict=True)):
            if group == "solo" and (at := loop.first_eog(tokens)) is not None:
                notes.append(f"{DECODE_ONLY}: {prompt!r}: end-of-generation at token {at}; decoding went on")
            ttft, total = run["ttft_s"][i] * 1e3, run["total_s"]
            s = groups.Stream(prompt, 0.0, ttft, rate, total, args.max_tokens, "decode loop", "length")
            s.text, s.contestant, s.group = loop.text(tokens), DECODE_ONLY, group
            s.n, s.rep, s.index = len(prompts), rep, i
            out.append(s)
        return out

    try:
        for i, prompt in enumerate(dict.fromkeys(groups.prompts_for(max(args.streams), args.prompts))):
            (solo,) = streams_of([prompt], loop.generate([prompt], args.max_tokens), "solo", 0)
            solo.index, solo.n = i, 1
            streams.append(solo)
        for rep in range(args.reps):
            for n in args.streams:
                prompts = groups.prompts_for(n, args.prompts)
                run = loop.generate(prompts, args.max_tokens)
                streams += groups.mark_solo(streams_of(prompts, run, f"N={n}", rep), streams)
                loop_s, tokens = run["loop_s"], n * (args.max_tokens - 1)
                cpu = (run["cpu_pct"], 0.0, run["other_cpu_pct"], 0.0, 0)
                all_groups.append(groups.Group(DECODE_ONLY, n, rep, loop_s, tokens, tokens / loop_s, *cpu))
                cli.log(f"{DECODE_ONLY:<22} N={n:<2} {all_groups[-1].total_tps:6.1f} tok/s (decode loop)")
    finally:
        loop.close()
    return all_groups, streams


def run(args: Any) -> dict[str, Any]:
    if args.replot:
        return json.loads(args.replot.read_text())
    cfg = cli.environment(model := cli.resolve_model(args), **cli.pick(args, NAMES))
    cfg["commands"], notes, all_groups, all_streams = {}, [], [], []
    with tempfile.TemporaryDirectory() as logs:
        for name in args.contestants:
            if name == DECODE_ONLY:
                g, s = decode_only(model, args, notes)
            else:
                with servers.running([]) as running:
                    extra = ["--slots", str(args.slots), *["--batch-invariant"] * (name == INVARIANT)]
                    settings = {"threads": args.threads, "ctx_size": args.ctx_size, "slots": args.slots}
                    settings["extra"] = extra if name.startswith(T) else []
                    running.append(server := servers.Server.start(name, model, Path(logs), **settings))
                    server.wait_ready(args.ready_timeout)
                    cfg["commands"][name] = server.command
                    g, s = groups.measure(name, server.url + "/v1/completions", [server.pid], args)
            all_groups += g
            all_streams += s
    summary = groups.summarize(all_groups, all_streams, DECODE_ONLY)
    base = next((r["total_tps"] for r in summary if r["contestant"] == T and r["n"] == 1), None)
    notes += groups.notes(all_groups, all_streams, args.other_load_warn)
    targets = {f"{f}x": f * base for f in TARGETS} if base else None
    out = {"config": cfg, "summary": summary, "targets": targets, "notes": notes}
    return out | {"groups": [asdict(g) for g in all_groups], "streams": [asdict(s) for s in all_streams]}


def report(result: dict[str, Any], args: Any) -> None:
    cfg, summary, goal = result["config"], result["summary"], result["targets"]
    what = f"{cfg['max_tokens']} tokens per stream, {cfg['threads']} threads, ctx {cfg['ctx_size']}"
    print(cli.header(cfg, f"{what} per sequence, trioserve --slots {cfg['slots']}, {cfg['reps']} rep(s)"))
    print(groups.summary_table(summary, servers.LABELS, DECODE_ONLY))
    if goal:
        print(f"\ntargets: 1.8× {T} N=1 = {goal['1.8x']:.1f} tok/s, 1.2× = {goal['1.2x']:.1f} tok/s")
    streams = [groups.Stream(**s) for s in result["streams"]]
    print("\nsolo runs (one request at a time):\n\n" + groups.streams_table(streams, solo=True))
    if args.markdown:
        print("\nevery stream:\n\n" + groups.streams_table(streams, solo=False))
    if not args.no_chart:
        try:
            cli.log(f"wrote {plots.batched_chart(cfg, summary, goal, args.chart)}")
        except ImportError:
            cli.log("no chart: matplotlib is missing (pip install -e '.[bench]')")


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
