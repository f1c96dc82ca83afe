"""N concurrent streams against one server: the procedure, the records and the summary
(docs/benchmarks.md, "Method": concurrent streams)."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from .cli import log
from .clients import Timed, body, sse_chunks, timed_stream
from .proc import RunnableSampler, cpu_split
from .stats import dict_table, first_difference, median, ratio, rows_table, spread


@dataclass
class Stream(Timed):
    contestant: str = ""
    group: str = ""  # "solo" or "N=<n>"
    n: int = 1
    rep: int = 0
    index: int = 0
    start_ms: float = 0.0  # request sent, after the group's first
    matches_solo: bool | None = None


@dataclass
class Group:
    contestant: str
    n: int
    rep: int
    wall_s: float  # first request sent → last stream ended
    tokens: int
    total_tps: float
    server_cpu_pct: float  # % of one core
    client_cpu_pct: float  # this process
    other_cpu_pct: float  # everything else on the machine
    runnable_mean: float  # the servers' runnable threads, sampled every 0.1 s
    runnable_max: int


def prompts_for(n: int, prompts: list[str]) -> list[str]:
    return [prompts[i % len(prompts)] for i in range(n)]


def one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> Stream:
    payload = body(prompt, max_tokens, stream_options={"include_usage": True})
    return Stream(**asdict(timed_stream(prompt, max_tokens, lambda: sse_chunks(client, url, payload))))


def run_group(name: str, url: str, pids: list[int], prompts: list[str], rep: int, args: Any) -> Any:
    """``len(prompts)`` streams at once: one thread and ``httpx.Client`` each, released by a barrier."""
    n, barrier = len(prompts), threading.Barrier(len(prompts) + 1)
    streams, timeout = [None] * n, httpx.Timeout(10.0, read=args.request_timeout)

    def worker(i: int) -> None:
        with httpx.Client(timeout=timeout) as client:
            barrier.wait(timeout=30)
            streams[i] = one(client, url, prompts[i], args.max_tokens)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    before = cpu_split(pids)
    with RunnableSampler(pids) as sampler:
        barrier.wait(timeout=30)
        give_up = time.monotonic() + args.request_timeout + 30
        for thread in threads:
            while thread.is_alive() and time.monotonic() < give_up:
                thread.join(timeout=0.5)  # short joins: Ctrl-C gets through
    after, done = cpu_split(pids), [s for s in streams if s is not None]
    if len(done) < n:
        raise RuntimeError(f"{name}: N={n}: {n - len(done)} stream(s) did not finish")
    t0 = min(s.t_call for s in done)
    wall = max(s.t_call + s.total_s for s in done) - t0
    for i, s in enumerate(done):
        s.contestant, s.group, s.n, s.rep, s.index = name, f"N={n}", n, rep, i
        s.start_ms = (s.t_call - t0) * 1e3
    tokens = sum(s.tokens for s in done if s.error is None)
    cpu = [100.0 * (a - b) / wall for a, b in zip(after, before, strict=True)]
    threads_seen = statistics.mean(sampler.counts), max(sampler.counts)
    cpu[2] = max(0.0, cpu[2])
    return Group(name, n, rep, wall, tokens, tokens / wall, *cpu, *threads_seen), done


def measure(name: str, url: str, pids: list[int], args: argparse.Namespace) -> tuple[list[Group], list[Any]]:
    """A warm-up, every prompt solo (the reference text), then ``--reps`` rounds over ``--streams``."""
    streams, groups = [], []
    with httpx.Client(timeout=httpx.Timeout(10.0, read=args.request_timeout)) as client:
        if (warm := one(client, url, args.prompts[0], 8)).error:
            raise RuntimeError(f"{name}: warm-up failed: {warm.error}")
        for i, prompt in enumerate(dict.fromkeys(prompts_for(max(args.streams), args.prompts))):
            streams.append(solo := one(client, url, prompt, args.max_tokens))
            solo.contestant, solo.group, solo.index = name, "solo", i
            log(f"{name:<22} solo {describe(solo)}")
    for rep in range(args.reps):
        for n in args.streams:
            group, mine = run_group(name, url, pids, prompts_for(n, args.prompts), rep, args)
            groups.append(group)
            streams += mark_solo(mine, streams)
            equal = sum(bool(s.matches_solo) for s in mine)
            rate = f"{group.total_tps:6.1f} tok/s in {group.wall_s:.2f} s"
            log(f"{name:<22} N={n:<2} {rate}, server CPU {group.server_cpu_pct:.0f} %, = solo {equal}/{n}")
    return groups, streams


def mark_solo(streams: list[Stream], every: list[Stream]) -> list[Stream]:
    solo = {s.prompt: s.text for s in every if s.group == "solo" and s.contestant == streams[0].contestant}
    for s in streams:
        s.matches_solo = s.text == solo[s.prompt] if s.prompt in solo and s.error is None else None
    return streams


def describe(s: Stream) -> str:
    if s.error:
        return f"#{s.index} {s.prompt!r}: ERROR {s.error}"
    rates = f"ttft {s.ttft_ms:6.0f} ms, decode {s.decode_tps:5.1f} tok/s"
    return f"#{s.index} {s.prompt!r}: {rates}, {s.tokens} tokens ({s.token_source}), {s.finish_reason}"


def summarize(groups: list[Group], streams: list[Stream], ceiling: str | None = None) -> list[dict[str, Any]]:
    """One row per contestant and N (medians over the reps; per-stream ranges over all streams)."""
    keys = list(dict.fromkeys((g.contestant, g.n) for g in groups))
    totals = {key: median(g.total_tps for g in groups if (g.contestant, g.n) == key) for key in keys}
    rows = []
    for name, n in keys:
        gs = [g for g in groups if (g.contestant, g.n) == (name, n)]
        ss = [s for s in streams if s.contestant == name and s.group == f"N={n}"]
        ok = [s for s in ss if s.error is None]
        base, top, total = totals.get((name, 1)), totals.get((ceiling or "", n)), totals[name, n]
        row = {"contestant": name, "n": n, "total_tps": total, "total_tps_reps": [g.total_tps for g in gs]}
        row.update(vs_n1=total / base if base else None, vs_ceiling=total / top if top else None)
        row.update(decode_tps=[s.decode_tps for s in ok], ttft_ms=[s.ttft_ms for s in ok])
        row["equal_solo"] = [sum(s.rep == g.rep and s.matches_solo is True for s in ss) for g in gs]
        row.update({k: median(getattr(g, k) for g in gs) for k in ("server_cpu_pct", "client_cpu_pct")})
        row["other_cpu_pct_max"] = max(g.other_cpu_pct for g in gs)
        mean, most = statistics.mean(g.runnable_mean for g in gs), max(g.runnable_max for g in gs)
        rows.append(row | {"runnable": f"{mean:.1f} (max {most})", "errors": len(ss) - len(ok)})
    return rows


def summary_table(rows: list[dict[str, Any]], labels: dict[str, str], ceiling: str | None = None) -> str:
    def equal(r: dict[str, Any]) -> str:
        k = r["equal_solo"]
        return f"{k[0]}/{r['n']}" if len(set(k)) == 1 else " ".join(f"{x}/{r['n']}" for x in k)

    columns = [("contestant", lambda r: labels.get(r["contestant"], r["contestant"]))]
    columns += [("N", lambda r: str(r["n"])), ("total tok/s", lambda r: spread(r["total_tps_reps"]))]
    columns += [("÷ N=1", lambda r: ratio(r["vs_n1"]))]
    columns += [(f"÷ {ceiling}", lambda r: ratio(r["vs_ceiling"]))] if ceiling else []
    columns += [("decode tok/s per stream", lambda r: spread(r["decode_tps"]))]
    columns += [("TTFT ms", lambda r: spread(r["ttft_ms"], ".0f")), ("= solo", equal)]
    columns += [(f"{k} CPU %", lambda r, k=k: f"{r[f'{k}_cpu_pct']:.0f}") for k in ("server", "client")]
    columns += [("runnable threads", lambda r: r["runnable"]), ("errors", lambda r: str(r["errors"]))]
    return rows_table(rows, columns)


def streams_table(streams: list[Stream], solo: bool) -> str:
    keys = "contestant group rep index prompt start_ms ttft_ms decode_tps tokens finish_reason matches_solo"
    return dict_table([asdict(s) for s in streams if (s.group == "solo") == solo], keys)


def notes(groups: list[Group], streams: list[Stream], other_load_warn: float) -> list[str]:
    out = []
    for g in (g for g in groups if g.other_cpu_pct > other_load_warn):
        share = f"other processes used {g.other_cpu_pct:.0f} % of a core: rerun"
        out.append(f"{g.contestant} N={g.n} rep {g.rep}: {share}")
    solo = {(s.contestant, s.prompt): s.text for s in streams if s.group == "solo"}
    for s in streams:
        where = f"{s.contestant} {s.group} rep {s.rep} #{s.index} {s.prompt!r}"
        if s.error or s.finish_reason != "length":
            out.append(f"{where}: {s.error or f'finish_reason {s.finish_reason}, {s.tokens} tokens'}")
        if s.matches_solo is False:
            out.append(f"{where}: differs from solo {first_difference(s.text, solo[s.contestant, s.prompt])}")
    return out
