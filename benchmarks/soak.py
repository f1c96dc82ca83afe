"""Soak: thousands of mixed, hostile requests against ``trioserve serve``, then proof that
nothing leaked and that every request ended with a recorded cause.

The traffic and the checks are ``tests/soak_traffic.py`` (``tests/e2e/test_soak.py`` runs
them small); this script gives them a command line and a report, and exits 1 on any
problem. The kinds of request, the checks and the warnings: docs/benchmarks.md, "Soak".

    python benchmarks/soak.py --scripted --markdown --json artifacts/soak_scripted.json
    python benchmarks/soak.py --slots 4 --json artifacts/soak_model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli
from benchmarks.harness.stats import table
from tests.soak_traffic import DEFAULT_MIX, HEALTH_GAUGES, KINDS, SoakConfig, run_soak

OPTIONS: list[tuple[str, Any, Any, str]] = [  # flag, type, default, help
    ("--requests", int, None, "requests in all (default: 3000 scripted, 300 model)"),
    ("--concurrency", int, None, "jobs at once (default: 8 scripted, 4 model)"),
    ("--seed", int, 1, "seed for the plan and each job's choices (default: 1)"),
    ("--slots", int, None, "server --slots (default: 4 scripted, 1 model)"),
    ("--max-queue", int, 8, "server --max-queue (default: 8)"),
    ("--stall-timeout", float, 2.0, "server --stall-timeout (default: 2)"),
    ("--threads", int, 2, "server --threads with a model (default: 2)"),
    ("--scripted-interval", float, 0.002, "seconds per scripted token (default: 0.002)"),
    ("--max-slow", int, None, "slow readers at most (default: 8 scripted, 3 model)"),
    ("--settle", float, 15.0, "seconds to wait for threads and fds (default: 15)"),
    ("--linger", float, 90.0, "more seconds for sockets closed by the client only (default: 90; 0: report)"),
    ("--max-rss-growth-mib", float, None, "RSS growth allowed (default: 64 scripted, 160 model)"),
    ("--log-file", Path, None, "keep the server's log here (default: a temporary file)"),
    ("--cache-ram", int, None, "server --cache-ram MiB with a model (default: the server's, 1024)"),
]


def parse_mix(text: str) -> dict[str, float]:
    mix = dict(DEFAULT_MIX)
    for kind, _, weight in (part.partition("=") for part in text.split(",") if part):
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        mix[kind] = float(weight)
    return mix


def parse_args() -> Any:
    p = cli.parser(__doc__)
    p.add_argument("--scripted", action="store_true", help="serve the scripted backend (default: a model)")
    for flag, kind, default, text in OPTIONS:
        p.add_argument(flag, type=kind, default=default, help=text)
    mix = ",".join(f"{k}={v:g}" for k, v in DEFAULT_MIX.items())
    p.add_argument("--mix", type=parse_mix, default=dict(DEFAULT_MIX), help=f"job weights (default: {mix})")
    p.add_argument("--oversized-headers", action="store_true", help="also send headers over 16 KiB (431)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args()
    if args.scripted and args.model is not None:
        p.error("--scripted and --model exclude each other")
    return args


def run(args: Any) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(SoakConfig)} & set(vars(args))
    config = SoakConfig(**{name: getattr(args, name) for name in names}, verbose=not args.quiet)
    result = None

    async def until_signalled() -> None:  # SIGTERM cancels the soak; the server is stopped on the way out
        nonlocal result
        async with trio.open_nursery() as nursery:

            async def on_sigterm() -> None:
                with trio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()

            nursery.start_soon(on_sigterm)
            result = await run_soak(config)
            nursery.cancel_scope.cancel()

    trio.run(until_signalled)
    if result is None:
        raise SystemExit(143)
    return result.to_json()


def counts(values: list[Any]) -> str:
    found = Counter("none" if v is None else str(v) for v in values)
    return ", ".join(f"{k}×{n}" for k, n in sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def kinds_table(records: list[dict[str, Any]], by_variant: bool) -> str:
    key = (lambda r: f"{r['kind']} {r['variant']}") if by_variant else (lambda r: r["kind"])
    order = {kind: i for i, kind in enumerate(("warmup", *KINDS))}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: (order.get(r["kind"], 99), key(r))):
        groups.setdefault(key(r), []).append(r)
    rows = [["kind", "requests", "status (client)", "cause (server log)", "median s"]]
    for name, group in [*groups.items(), ("all", records)]:
        statuses, causes = counts([r["status"] for r in group]), counts([r["cause"] for r in group])
        rows.append(
            [name, str(len(group)), statuses, causes, f"{statistics.median(r['seconds'] for r in group):.3f}"]
        )
    return table(rows)


def leaks_table(result: dict[str, Any]) -> str:
    b, a, leaks, rss = result["baseline"], result["after"], result["leaks"], result["rss_mib"]
    busy = b["threads"] - b["idle_trio_threads"]
    rows = [
        ["check", "baseline", "after", "leaked"],
        ["threads", str(busy), str(a["threads"]), str(leaks["threads"])],
    ]
    rows.append(
        [
            "… not idle in Trio's cache",
            str(busy),
            str(a["threads"] - a["idle_trio_threads"]),
            str(leaks["busy_threads"]),
        ]
    )
    rows.append(["open fds (other)", str(b["fds"]), str(a["fds"] - leaks["peer_closed"]), str(leaks["fds"])])
    rows.append(
        [
            "sockets closed by the client only",
            "0",
            str(result["linger"]["peer_closed"]),
            str(leaks["peer_closed"]),
        ]
    )
    rows += [[f"/health {g}", "0", str(result["health"].get(g)), str(leaks[g])] for g in HEALTH_GAUGES]
    growth = f"{rss['growth']:+.1f} ({100 * rss['growth'] / rss['before']:+.1f} %)"
    return table(
        [*rows, ["RSS MiB", f"{rss['before']:.1f}", f"{rss['after']:.1f} (peak {rss['peak']:.1f})", growth]]
    )


def cache_table(cache: dict[str, Any]) -> str:
    """The prompt cache's figures: conversations, cut turns, the host tier against its budget, exactness."""
    ram, exact = (cache.get("end") or {}).get("ram", {}), cache["exact"]
    cuts = ", ".join(f"{k} {v}" for k, v in sorted(cache["cuts"].items())) or "none"
    causes = ", ".join(f"{k} {v}" for k, v in sorted(cache["cut_causes"].items())) or "—"
    host = ", ".join(f"{k} {ram[k]}" for k in ("saves", "restores", "evictions") if k in ram) or "—"
    rows = [
        ["prompt cache", ""],
        ["conversations (turns)", f"{cache['conversations']} ({cache['turns']})"],
        ["turns cut by the client: where (logged cause)", f"{cuts} ({causes})"],
        ["turns with cache_prompt: false", str(cache["no_cache_turns"])],
        ["host tier at the end", host],
        ["/health ram.bytes: max / budget", f"{cache['max_ram_bytes']:,} / {cache['budget_bytes']:,}"],
        ["… samples over budget", f"{cache['over_budget_samples']} of {cache['samples']}"],
        ["RSS growth MiB / bound", f"{cache['rss_growth_mib']:.1f} / {cache['rss_bound_mib']:.1f}"],
        ["exact turns: = cache_prompt false", f"{exact['equal']}/{exact['turns']}"],
    ]
    if exact["cached_tokens"]:
        rows.append(["… cached tokens", f"{min(exact['cached_tokens'])}–{max(exact['cached_tokens'])}"])
    return table(rows)


def report(result: dict[str, Any], args: Any) -> None:
    cfg, records = result["config"], result["records"]
    interval = f"scripted backend ({1000 * cfg['scripted_interval']:g} ms/token)"
    backend = interval if cfg["scripted"] else f"model {cfg['model'] or 'default'} ({cfg['threads']} threads)"
    sent, seconds = sum(r["kind"] != "warmup" for r in records), result["traffic_seconds"]
    where = f"{sent} requests (+{len(records) - sent} warm-up), concurrency {cfg['concurrency']}"
    print(f"soak: {backend}, {where}, seed {cfg['seed']}")
    print(f"{cfg['slots']} slot(s), queue {cfg['max_queue']}, stall timeout {cfg['stall_timeout']:g} s")
    print(
        f"traffic {seconds:.1f} s ({sent / seconds:.1f} requests/s), total {result['total_seconds']:.1f} s\n"
    )
    print(kinds_table(records, by_variant=False) + "\n")
    if args.markdown:
        print(kinds_table(records, by_variant=True) + "\n")
    print(leaks_table(result) + "\n")
    logged = sum(r["lines"] == 1 for r in records)
    print(f"log: {logged}/{len(records)} requests with exactly one line; causes {result['log_causes']}")
    print(f"metrics trioserve_stream_ends_total: {dict(sorted(result['stream_ends_total'].items()))}")
    print(f"server exit code after SIGTERM: {result['exit_code']}\n")
    if result["cache"]:  # figures: conversations, cuts, /health ram (max vs budget), exactness, the end
        print(cache_table(result["cache"]) + "\n")
    for warning in result["warnings"]:
        print(f"warning: {warning}")
    problems = result["problems"]
    ok = "OK: nothing leaked, every request ended with a recorded cause"
    print(f"FAILED: {len(problems)} problem(s)" if problems else ok)
    more = [f"- … and {len(problems) - 40} more (--json)"] if len(problems) > 40 else []
    print("\n".join([f"- {p}" for p in problems[:40]] + more))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
