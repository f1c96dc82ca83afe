"""The charts, one function per scenario, each drawn from that scenario's JSON (its ``--json``
result) into a PNG with matplotlib's Agg backend: ``batched`` (total tokens/s against
streams), ``conversation`` (time to first token per turn), ``cancel`` (every cancel's
CPU-idle latency), ``health`` (every ``/health`` poll). ``benchmarks/report.py`` draws them
for docs/benchmarks.md; ``batched.py`` draws its own."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .servers import LABELS
from .stats import nearest_rank

DECODE_ONLY, TRIOSERVE, INVARIANT = "decode-only", "trioserve", "trioserve-invariant"
#: one colour, line and marker per contestant, the same in every chart
STYLES = {
    DECODE_ONLY: ("k", ":", "s"),
    TRIOSERVE: ("C0", "-", "o"),
    INVARIANT: ("C2", "-", "^"),
    "llama-server": ("C1", "-", "D"),
    "llama-server-matched": ("C3", "-", "v"),
    "llama-cpp-python": ("C4", "-", "P"),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style(name: str, i: int = 0) -> dict[str, Any]:
    color, line, marker = STYLES.get(name, (f"C{(i + 5) % 10}", "-", "x"))
    return {"color": color, "linestyle": line, "marker": marker, "label": LABELS.get(name, name)}


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _log_axis(ax: Any) -> None:
    """A log y axis labelled in plain numbers (1, 2, 5 × 10ⁿ)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _title(cfg: dict[str, Any], what: str) -> str:
    model = Path(cfg["model"]).name if cfg.get("model") else "scripted backend"
    return f"{model}: {what}, {cfg.get('threads', '?')} threads, {cfg['cpu_count']} CPUs"


def batched_chart(cfg: dict[str, Any], summary: list[dict[str, Any]], goal: Any, path: Path) -> Path:
    """Median total tok/s against N (min–max bars), one line per contestant; targets dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    top = 1.0
    for i, name in enumerate(dict.fromkeys(r["contestant"] for r in summary)):
        rows = sorted((r for r in summary if r["contestant"] == name), key=lambda r: r["n"])
        ys = [r["total_tps"] for r in rows]
        low, high = [min(r["total_tps_reps"]) for r in rows], [max(r["total_tps_reps"]) for r in rows]
        bars = [[y - v for y, v in zip(ys, low, strict=True)], [v - y for y, v in zip(ys, high, strict=True)]]
        ax.errorbar([r["n"] for r in rows], ys, yerr=bars, capsize=3, **style(name, i))
        top = max(top, *high)
    for (key, value), dashes in zip((goal or {}).items(), ((6, 3), (2, 2), (1, 1)), strict=False):
        label = f"target: {key.removesuffix('x')}× {TRIOSERVE} N=1"
        ax.axhline(value, color="0.4", dashes=dashes, linewidth=1, label=label)
        top = max(top, value)
    labels = {"xlabel": "concurrent streams (N)", "ylabel": "total tokens/s"}
    ax.set(xticks=cfg["streams"], ylim=(0, 1.1 * top), **labels)
    what = f"{cfg['max_tokens']} tokens per stream, median of {cfg['reps']}"
    ax.set_title(_title(cfg, what), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def batched(result: dict[str, Any], path: Path) -> Path:
    return batched_chart(result["config"], result["summary"], result.get("targets"), path)


def conversation(result: dict[str, Any], path: Path) -> Path:
    """TTFT against the turn, per server: one row per endpoint and read time; one
    conversation (left), interleaved ones (right: the median over the conversations,
    every conversation's turn a dot)."""
    plt, cfg = _pyplot(), result["config"]
    turns_of = result["turns"]
    rows = list(dict.fromkeys((t.get("endpoint", "completions"), t.get("read_time", 0.0)) for t in turns_of))
    phases = [p for p in ("multi", "interleaved") if any(t["phase"] == p for t in turns_of)]
    fig, axes = plt.subplots(
        len(rows), len(phases), figsize=(5.5 * len(phases), 4.0 * len(rows)), dpi=120, squeeze=False
    )
    titles = {"multi": "one conversation", "interleaved": f"{cfg['conversations']} interleaved conversations"}
    for r, (endpoint, read) in enumerate(rows):
        for ax, phase in zip(axes[r], phases, strict=True):
            turns = [
                t
                for t in turns_of
                if t["phase"] == phase
                and (t.get("endpoint", "completions"), t.get("read_time", 0.0)) == (endpoint, read)
                and t["ttft_ms"] == t["ttft_ms"]
            ]
            for i, name in enumerate(dict.fromkeys(t["server"] for t in turns)):
                mine = [t for t in turns if t["server"] == name]
                by_turn: dict[int, list[float]] = {}
                for t in mine:
                    by_turn.setdefault(t["turn"], []).append(t["ttft_ms"])
                xs = sorted(by_turn)
                ys = [statistics.median(by_turn[x]) for x in xs]
                line = style(name, i)
                ax.plot(xs, ys, **line)
                if phase == "interleaved":
                    dots = {"color": line["color"], "marker": line["marker"], "alpha": 0.35, "s": 14}
                    ax.scatter([t["turn"] for t in mine], [t["ttft_ms"] for t in mine], **dots)
            title = f"{titles[phase]} — {endpoint}, reads {read:g} s"
            ax.set(xlabel="turn", ylabel="time to first token, ms", ylim=(0, None), title=title)
            ax.set_xticks(range(1, cfg["turns"] + 1))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
    what = f"{cfg['max_tokens']}-token replies, ~140 tokens of new user text a turn"
    fig.suptitle(_title(cfg, what), fontsize=10)
    return _save(fig, path)


def cancel(result: dict[str, Any], path: Path) -> Path:
    """Every run's CPU idle − cause, per server, one panel per cause (log scale), the bars dashed."""
    plt, cfg = _pyplot(), result["config"]
    samples = [s for s in result["samples"] if "idle_ms" in s and not s.get("excluded")]  # (None: > cap)
    causes = [c for c in ("decode", "prefill") if any(s["cause"] == c for s in samples)]
    fig, axes = plt.subplots(1, max(1, len(causes)), figsize=(5.5 * max(1, len(causes)), 4.5), dpi=120)
    axes = axes if len(causes) > 1 else [axes]
    titles = {"decode": "client leaves mid-decode", "prefill": "client leaves mid-prefill"}
    cap = cfg.get("idle_cap", 15.0) * 1e3
    for ax, cause in zip(axes, causes, strict=False):
        names = list(dict.fromkeys(s["server"] for s in samples if s["cause"] == cause))
        for i, name in enumerate(names):
            values = [s["idle_ms"] for s in samples if s["server"] == name and s["cause"] == cause]
            values = [cap if v is None else max(v, 0.5) for v in values]  # (0: already idle; log scale)
            spread = [i + 0.25 * ((k * 0.618) % 1 - 0.5) for k in range(len(values))]
            line = style(name, i)
            ax.scatter(spread, values, color=line["color"], marker=line["marker"], alpha=0.6, s=22)
            mid = nearest_rank(values, 0.5)  # (the tables' p50)
            ax.hlines(mid, i - 0.3, i + 0.3, color=line["color"], linewidth=2)
        if cause == "prefill":
            ax.axhline(100, color="0.4", dashes=(6, 3), linewidth=1, label="bar: 100 ms")
            ax.legend(fontsize=8, loc="upper left")
        _log_axis(ax)
        ax.set_xticks(range(len(names)), [LABELS.get(n, n) for n in names], fontsize=8)
        ax.set(ylabel="CPU idle − cause, ms (log)", title=titles[cause], xlim=(-0.6, len(names) - 0.4))
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(_title(cfg, "every run a dot, the p50 a bar"), fontsize=10)
    return _save(fig, path)


def health(result: dict[str, Any], path: Path) -> Path:
    """Every ``/health`` poll's latency against time: idle, the ramp, the measured window
    (shaded); the bar dashed."""
    plt, cfg, bar = _pyplot(), result["config"], result["bar"]
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    phases = [("idle", "0.5", "idle server"), ("ramp", "C9", "ramp: the conversations' first turns")]
    phases.append(("busy", "C0", f"{cfg['clients']} streams: the window"))
    for phase, color, label in phases:
        polls = [p for p in result["polls"] if p["phase"] == phase]
        ok = [p for p in polls if p["status"] == 200]
        ax.scatter([p["t"] for p in ok], [p["ms"] for p in ok], s=6, color=color, alpha=0.6, label=label)
        if failed := [p for p in polls if p["status"] != 200]:
            ax.scatter([p["t"] for p in failed], [p["ms"] for p in failed], s=20, color="C3", marker="x")
    ax.axvspan(*result["window"], color="C0", alpha=0.06)
    limit = f"bar: p99 ≤ {bar['limit_ms']:g} ms"
    ax.axhline(bar["limit_ms"], color="C3", dashes=(6, 3), linewidth=1, label=limit)
    if bar.get("p99_ms") is not None:
        ax.axhline(bar["p99_ms"], color="C0", linewidth=1, label=f"p99 in the window: {bar['p99_ms']:.1f} ms")
    ax.set(xlabel="s since the streams started", ylabel="GET /health, ms (log)")
    _log_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    what = f"--slots {cfg['slots']} --cache-ram {cfg['cache_ram']}, every {cfg['interval'] * 1e3:g} ms"
    ax.set_title(_title(cfg, what), fontsize=10)
    return _save(fig, path)


#: scenario → its chart's file name and its function
CHARTS: dict[str, tuple[str, Callable[[dict[str, Any], Path], Path]]] = {
    "batched": ("batched-throughput.png", batched),
    "conversation": ("conversation-ttft.png", conversation),
    "cancel": ("cancel-latency.png", cancel),
    "health": ("health-latency.png", health),
}
