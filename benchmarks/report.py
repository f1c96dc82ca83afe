"""docs/benchmarks.md from one run of the harness: run the scenarios, then render the page.

One command runs a chosen set of scenario scripts one after another, each with its
profile's arguments and ``--json ARTIFACTS/<scenario>.json`` (its stdout and progress in
``<scenario>.txt`` and ``.log`` beside it), records each run (command, times, exit status,
the machine's facts) in ``ARTIFACTS/run.json``, then renders ``--out`` from those files:
the page ``benchmarks/report_page.md`` (the prose: edit it there, not in the output) with
the machine facts, a table of headline figures, and per scenario its command, the
tables its script's own ``report`` prints from its JSON, its notes and its chart
(``benchmarks/harness/plots.py``, PNGs beside the page in ``images/``). A scenario that has
not been run says so; one that failed shows its log's tail. ``--only`` runs some
scenarios and renders the page with every scenario's latest JSON, each section naming
its own run.

    python benchmarks/report.py                  # every scenario, the default profile (~40 min, 2 cores)
    python benchmarks/report.py --quick          # fewer reps and tokens (~20 min)
    python benchmarks/report.py --only health,cancel --quick
    python benchmarks/report.py --render-only    # the page again from the JSON in artifacts/report
    python benchmarks/report.py --list           # the scenarios and their commands
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import html
import importlib
import io
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import plots, servers
from benchmarks.harness.proc import system_busy_seconds
from benchmarks.harness.stats import dist, fmt, median, table

REPO = servers.REPO
PAGE = REPO / "benchmarks" / "report_page.md"
QUICK, DEFAULT = "quick", "default"
#: before and after each scenario: the machine's CPU use over OTHER_LOAD_SECONDS with nothing
#: of this run computing; above OTHER_LOAD_WARN % of a core the page calls it a busy machine
OTHER_LOAD_SECONDS, OTHER_LOAD_WARN = 3.0, 20.0


@dataclass
class Scenario:
    """One scenario script run with a profile's arguments (``--json`` is added)."""

    name: str  # the artifact's stem and the page's placeholder, {{name}}
    script: str  # relative to the repository root
    args: dict[str, str]  # profile → arguments (split as the shell does)
    minutes: dict[str, float]  # profile → expected minutes on 2 idle cores
    headline: Callable[[dict[str, Any]], str]  # the "at a glance" figure
    module: str | None = None  # the module whose report() prints the tables (None: render())
    render: Callable[[dict[str, Any]], str] | None = None
    fold: tuple[str, ...] = ()  # report blocks shown folded (<details>), by their title
    what: str = ""  # the question it answers, for the "at a glance" table


def label(name: str) -> str:
    return servers.LABELS.get(name, name)


def join(parts: list[str]) -> str:
    return "; ".join(p for p in parts if p) or "—"


# -- the headline figures, one function per scenario, from its JSON ------------------------------------


def single_headline(r: dict[str, Any]) -> str:
    loop = median(x["decode-only"] for x in r["rounds"])
    ratios = [f"{label(n)} {v:.3f}×" for n, v in r["median_ratio"].items()]
    return f"decode tok/s ÷ the bare loop's ({loop:.1f} tok/s), median of {len(r['rounds'])}: " + ", ".join(
        ratios
    )


def overhead_headline(r: dict[str, Any]) -> str:
    interval = r["config"]["interval"]
    how = "producing as fast as it can" if not interval else f"paced at {1 / interval:,.0f} tokens/s"
    return f"{r['median_us']:.1f} µs of server CPU per token, {how} ({r['config']['tokens']} tokens a stream)"


def cancel_p50(r: dict[str, Any], cause: str) -> dict[str, float]:
    out = {}
    for s in r["samples"]:
        if s["cause"] == cause and not s.get("excluded") and "idle_ms" in s:
            out.setdefault(s["server"], []).append(s["idle_ms"] if s["idle_ms"] is not None else float("inf"))
    return {name: (dist(v) or {}).get("p50", float("nan")) for name, v in out.items()}


def cancel_headline(r: dict[str, Any]) -> str:
    parts = []
    for cause, what in (("decode", "mid-decode"), ("prefill", "mid-prefill")):
        if p50 := cancel_p50(r, cause):
            parts.append(f"{what}: " + ", ".join(f"{label(n)} {fmt(v, '.0f')} ms" for n, v in p50.items()))
    return "CPU idle after the client leaves, p50 — " + join(parts)


def cancel_messages_headline(r: dict[str, Any]) -> str:
    return "streamed POST /v1/messages: " + cancel_headline(r)


def slow_reader_headline(r: dict[str, Any]) -> str:
    small = [c for c in r["cases"] if c["rcvbuf"] != "default"]
    cells = [f"{label(c['server'])} {c['cpu_after_first_s']:.0f} %" for c in small]
    d = r["config"]["duration"]
    return f"server CPU (% of a core) over 1–{d} s for a client reading 256 B/s, 16 KiB buffer: " + ", ".join(
        cells
    )


def batched_headline(r: dict[str, Any]) -> str:
    top = max(row["n"] for row in r["summary"])
    rows = [row for row in r["summary"] if row["n"] == top]
    cells = [
        f"{label(x['contestant'])} {x['total_tps']:.0f}"
        + (f" ({x['vs_n1']:.2f}× N=1)" if x.get("vs_n1") else "")
        for x in rows
    ]
    return f"total tok/s at {top} streams: " + ", ".join(cells)


def conversation_headline(r: dict[str, Any]) -> str:
    from benchmarks.conversation import verdicts

    parts = []
    for v in verdicts(r):
        if v["phase"] != "multi" or not v["ratios"]:
            continue
        figures = f"median {median(v['ratios']):.2f}×, max {max(v['ratios']):.2f}×"
        parts.append(f"{v['endpoint']}, reads {v['read_time']:g} s: {figures}")
    mine = [t for t in r["turns"] if t["server"] == "trioserve" and "equal_cache_off" in t]
    exact = f"trioserve's texts = cache off: {sum(t['equal_cache_off'] for t in mine)}/{len(mine)}" * bool(
        mine
    )
    return "TTFT trioserve ÷ llama-server from turn 2, one conversation — " + join([*parts, exact])


def health_headline(r: dict[str, Any]) -> str:
    busy, bar, d = r["summary"][-1], r["bar"], r["ram_delta"]
    figures = f"p50 {fmt(busy.get('p50'))}, p99 {fmt(busy.get('p99'))}, max {fmt(busy.get('max'))} ms"
    verdict = f"bar p99 ≤ {bar['limit_ms']:g} ms: {'met' if bar['met'] else 'not met'}"
    ram = f"host tier: {d['saves']} saves, {d['restores']} restores"
    return f"{busy['polls']} polls, {r['config']['clients']} streams running: {figures} ({verdict}); {ram}"


def soak_headline(r: dict[str, Any]) -> str:
    sent = sum(x["kind"] != "warmup" for x in r["records"])
    verdict = (
        "nothing leaked, every request has a cause"
        if not r["problems"]
        else f"{len(r['problems'])} problem(s)"
    )
    return f"{sent:,} requests in {r['traffic_seconds']:.0f} s: {verdict}"


def constrained_headline(r: dict[str, Any]) -> str:
    cost = r.get("cost") or {}
    cells = [
        f"{v} {cost[v]['diff_ms']:+.2f} ms ({100 * cost[v]['fraction']:+.1f} %)" for v in cost if v != "none"
    ]
    return "per-token cost against none, one stream: " + ", ".join(cells) if cells else "—"


# -- renderers for JSON whose script has no report() ------------------------------------------------------


def constrained_render(r: dict[str, Any]) -> str:
    out = []
    if cost := r.get("cost"):
        head = "variant|decode tok/s, median (min–max)|ms / token|Δ ms / token|Δ ÷ a step|median gap ms"
        head += "|Δ gap ms|TTFT ms|tokens|finish|texts equal"
        rows = ["| " + head.replace("|", " | ") + " |", "|---" * 11 + "|"]
        for v, x in cost.items():
            rates = sorted(x["decode_tps"])
            spread_ = f"{median(rates):.1f} ({rates[0]:.1f}–{rates[-1]:.1f})"
            delta = "—" if v == "none" else f"{x['diff_ms']:+.2f}"
            frac = "—" if v == "none" else f"{100 * x['fraction']:+.1f} %"
            gap = "—" if v == "none" else f"{x['gap_diff_ms']:+.2f}"
            cells = [v, spread_, f"{x['ms_per_token']:.2f}", delta, frac, f"{x['gap_ms']:.2f}", gap]
            cells += [f"{x['ttft_ms']:.0f}", ", ".join(map(str, x["tokens"])), ", ".join(x["finish"])]
            rows.append("| " + " | ".join([*cells, "yes" if x["texts_equal"] else "no"]) + " |")
        out.append("**One stream** (`--parts cost`):\n\n" + "\n".join(rows))
    if conc := r.get("concurrent"):
        rows = [
            "| variant | total tok/s, median (min–max) | Σ decode tok/s | median step ms | ÷ none (total) |"
        ]
        rows.append("|---|---|---|---|---|")
        base = median(x["total_tps"] for x in conc.get("none", []))
        for v, reps in conc.items():
            totals = sorted(x["total_tps"] for x in reps)
            cells = [v, f"{median(totals):.1f} ({totals[0]:.1f}–{totals[-1]:.1f})"]
            cells += [
                f"{median(x['decode_tps'] for x in reps):.1f}",
                f"{median(x['gap_ms'] for x in reps):.2f}",
            ]
            rows.append("| " + " | ".join([*cells, f"{median(totals) / base:.2f}"]) + " |")
        out.append("**Four streams, `--slots 4`** (`--parts concurrent`):\n\n" + "\n".join(rows))
    return "\n\n".join(out)


ALL_SERVERS = "trioserve,llama-server,llama-server-matched,llama-cpp-python"


def embeddings_render(r: dict[str, Any]) -> str:
    rows = [["server", "inputs/s (median)", "min", "max 1 − cosine vs trioserve"]]
    for name, x in r.items():
        rows.append(
            [
                name,
                f"{x['inputs_per_s_median']:.1f}",
                f"{x['inputs_per_s_min']:.1f}",
                f"{x['max_cosine_distance_to_trioserve']:.1e}",
            ]
        )
    return table(rows)


def embeddings_headline(r: dict[str, Any]) -> str:
    ours = r["trioserve"]["inputs_per_s_median"]
    return join(
        [f"trioserve {ours:.1f} inputs/s"]
        + [f"{name} {x['inputs_per_s_median']:.1f}" for name, x in r.items() if name != "trioserve"]
    )


def model_load_render(r: dict[str, Any]) -> str:
    head = "server|whole load (s)|RSS unloaded → loaded (MiB)|CPU idle after the leave (ms, median)"
    head += "|CPU spent after the leave (ms)|loaded anyway|RSS 2 s after (MiB)"
    rows = [head.split("|")]
    for name, x in r["summary"].items():
        rows.append(
            [
                name,
                f"{x['load_s']:.2f}",
                f"{x['rss_unloaded_mib']:.0f} → {x['rss_loaded_mib']:.0f}",
                f"{x['idle_after_leave_ms_median']:.0f}",
                f"{x['cpu_after_leave_ms_median']:.0f}",
                x["loaded_anyway"],
                f"{x['rss_2s_later_mib_median']:.0f}",
            ]
        )
    return table(rows)


def model_load_headline(r: dict[str, Any]) -> str:
    parts = []
    for name, x in r["summary"].items():
        idle = f"idle {x['idle_after_leave_ms_median']:.0f} ms after the leave"
        parts.append(f"{name}: {idle}, loaded anyway {x['loaded_anyway']}")
    return join(parts)


SCENARIOS = [
    Scenario(
        "single",
        "benchmarks/single.py",
        {DEFAULT: f"--reps 5 --contestants {ALL_SERVERS}", QUICK: "--reps 3"},
        {DEFAULT: 3, QUICK: 1.5},
        single_headline,
        "benchmarks.single",
        what="one stream, against the bare decode loop",
    ),
    Scenario(
        "overhead",
        "benchmarks/overhead.py",
        {DEFAULT: "--runs 5 --tokens 4000", QUICK: "--runs 3 --tokens 4000"},
        {DEFAULT: 0.5, QUICK: 0.5},
        overhead_headline,
        "benchmarks.overhead",
        what="the stack's CPU per token",
    ),
    Scenario(
        "overhead_paced",
        "benchmarks/overhead.py",
        {
            DEFAULT: "--runs 5 --tokens 4000 --interval 0.0005",
            QUICK: "--runs 3 --tokens 4000 --interval 0.0005",
        },
        {DEFAULT: 0.5, QUICK: 0.5},
        overhead_headline,
        "benchmarks.overhead",
        what="the same, a client that keeps up",
    ),
    Scenario(
        "cancel",
        "benchmarks/cancel.py",
        {DEFAULT: "", QUICK: "--reps 6 --prefill-reps 3"},
        {DEFAULT: 5, QUICK: 2},
        cancel_headline,
        "benchmarks.cancel",
        what="cancel latency per server",
    ),
    Scenario(
        "cancel_messages",
        "benchmarks/cancel.py",
        {
            DEFAULT: "--endpoint messages --contestants trioserve,llama-server --reps 10",
            QUICK: "--endpoint messages --contestants trioserve,llama-server --causes prefill --reps 4",
        },
        {DEFAULT: 3, QUICK: 1},
        cancel_messages_headline,
        "benchmarks.cancel",
        what="cancel latency, Anthropic Messages",
    ),
    Scenario(
        "slow_reader",
        "benchmarks/slow_reader.py",
        {DEFAULT: "", QUICK: "--duration 6"},
        {DEFAULT: 2, QUICK: 1.5},
        slow_reader_headline,
        "benchmarks.slow_reader",
        what="a slow reader",
    ),
    Scenario(
        "batched",
        "benchmarks/batched.py",
        {DEFAULT: "--no-chart", QUICK: "--no-chart --reps 1 --max-tokens 64"},
        {DEFAULT: 11, QUICK: 4},
        batched_headline,
        "benchmarks.batched",
        fold=("solo runs",),
        what="tokens/s against concurrent streams",
    ),
    Scenario(
        "conversation",
        "benchmarks/conversation.py",
        {DEFAULT: "", QUICK: "--turns 4 --conversations 2"},
        {DEFAULT: 26, QUICK: 12},
        conversation_headline,
        "benchmarks.conversation",
        what="conversations and the prompt cache",
    ),
    Scenario(
        "health",
        "benchmarks/health.py",
        {DEFAULT: "", QUICK: "--duration 30"},
        {DEFAULT: 2.5, QUICK: 1.5},
        health_headline,
        "benchmarks.health",
        what="/health while 8 streams run",
    ),
    Scenario(
        "soak_scripted",
        "benchmarks/soak.py",
        {DEFAULT: "--scripted", QUICK: "--scripted --requests 1000"},
        {DEFAULT: 1.5, QUICK: 1},
        soak_headline,
        "benchmarks.soak",
        what="soak, the stack alone",
    ),
    Scenario(
        "soak_model",
        "benchmarks/soak.py",
        {DEFAULT: "--slots 4 --cache-ram 64", QUICK: "--slots 4 --cache-ram 64 --requests 120"},
        {DEFAULT: 3, QUICK: 2},
        soak_headline,
        "benchmarks.soak",
        what="soak, the model and the prompt cache",
    ),
    Scenario(
        "constrained",
        "scripts/probes/constrained_cost.py",
        {DEFAULT: "--parts cost,concurrent --reps 5", QUICK: "--parts cost --reps 3 --max-tokens 100"},
        {DEFAULT: 4, QUICK: 1},
        constrained_headline,
        render=constrained_render,
        what="constrained decoding and logprobs",
    ),
    Scenario(
        "embeddings",
        "benchmarks/embeddings.py",
        {DEFAULT: "--reps 5", QUICK: "--reps 3"},
        {DEFAULT: 2, QUICK: 1.5},
        embeddings_headline,
        render=embeddings_render,
        what="/v1/embeddings, 64 inputs",
    ),
    Scenario(
        "model_load",
        "benchmarks/model_load.py",
        {DEFAULT: "--reps 5", QUICK: "--reps 3"},
        {DEFAULT: 2, QUICK: 1.5},
        model_load_headline,
        render=model_load_render,
        what="a client that leaves during its model's load",
    ),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def names(text: str) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    if not chosen or set(chosen) - set(BY_NAME):
        raise argparse.ArgumentTypeError(f"pick from {','.join(BY_NAME)}")
    return [s.name for s in SCENARIOS if s.name in chosen]


def parse_args() -> Any:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", type=names, default=list(BY_NAME), help=f"scenarios, of {','.join(BY_NAME)}")
    p.add_argument("--quick", action="store_true", help="the quick profile: fewer reps and tokens")
    p.add_argument("--render-only", action="store_true", help="run nothing: render from the JSON there is")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md", help="the page")
    p.add_argument("--artifacts", type=Path, default=REPO / "artifacts" / "report", help="the JSON and logs")
    p.add_argument("--images", type=Path, help="the charts (default: images/ beside --out)")
    help_ = "hold this lock file around each scenario, as the probes do (''): none"
    p.add_argument("--lock", default="/tmp/trioserve-cpu.lock", help=help_)
    p.add_argument(
        "--timeout-factor", type=float, default=4.0, help="stop a scenario after this × its minutes"
    )
    p.add_argument("--list", action="store_true", help="print the scenarios' commands and exit")
    args = p.parse_args()
    args.profile = QUICK if args.quick else DEFAULT
    args.images = args.images or args.out.parent / "images"
    return args


# -- the run -------------------------------------------------------------------------------------------------


def shown(path: Path | str) -> str:
    """A path as the page shows it: relative to the repository when inside it."""
    path = Path(path)
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(REPO))
    return str(path)


def python() -> str:
    """This interpreter as the page shows it: the venv's, relative to the repository."""
    here = Path(sys.executable).absolute()
    return str(here.relative_to(REPO)) if here.is_relative_to(REPO) else "python"


def argv_of(s: Scenario, profile: str, artifacts: Path) -> list[str]:
    return [*shlex.split(s.args[profile]), "--json", shown(artifacts / f"{s.name}.json")]


def command_line(script: str, argv: list[str]) -> str:
    return shlex.join([python(), script, *argv])


def git(*argv: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def machine() -> dict[str, Any]:
    """The machine's facts, read now."""
    from importlib.metadata import version

    import llama_cpp

    cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    facts = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    facts |= {"cpu": cpu[1].strip() if cpu else platform.processor(), "cpu_count": os.cpu_count()}
    facts |= {"cpus_usable": len(os.sched_getaffinity(0)), "memory_gib": int(mem[1]) / 2**20 if mem else None}
    facts |= {"kernel": platform.release(), "python": platform.python_version()}
    facts |= {"llama_cpp_python": llama_cpp.__version__, "trioserve": version("trioserve")}
    facts |= {"system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    facts |= {"matplotlib": version("matplotlib"), "loadavg": os.getloadavg()}
    try:
        binary = servers.llama_server_binary()
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
        found = re.search(r"version: (.*)", out.stdout + out.stderr)
        facts["llama_server"] = found[1].strip() if found else None
    except (OSError, subprocess.SubprocessError) as exc:
        facts["llama_server"] = f"unavailable ({type(exc).__name__})"
    from trioserve import default_model_path

    model = default_model_path(progress=False)
    sha = model.with_suffix(".sha256")
    facts["model"] = {"file": model.name, "bytes": model.stat().st_size}
    facts["model"]["sha256"] = sha.read_text().split()[0] if sha.exists() else None
    dirty = git("status", "--porcelain", "--", "trioserve", "benchmarks", "scripts", "pyproject.toml")
    return facts | {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty)}


def load_runs(artifacts: Path) -> dict[str, Any]:
    path = artifacts / "run.json"
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def save_runs(artifacts: Path, runs: dict[str, Any]) -> None:
    (artifacts / "run.json").write_text(json.dumps(runs, indent=2) + "\n")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def other_load(seconds: float = OTHER_LOAD_SECONDS) -> float:
    """% of one core the machine was busy for ``seconds`` while this run computes nothing."""
    busy, started = system_busy_seconds(), time.perf_counter()
    time.sleep(seconds)
    return 100 * (system_busy_seconds() - busy) / (time.perf_counter() - started)


@contextlib.contextmanager
def locked(path: str) -> Any:
    """The lock file held (waiting for it); nothing when ``path`` is empty."""
    if not path:
        yield 0.0
        return
    with open(path, "a") as f:
        started = time.perf_counter()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {path} (another run holds it)")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - started
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_one(s: Scenario, args: Any, facts: dict[str, Any]) -> dict[str, Any]:
    """Run the scenario's script to its JSON (stopped after its time limit); its record for run.json."""
    argv, path = argv_of(s, args.profile, args.artifacts), args.artifacts / f"{s.name}.json"
    path.unlink(missing_ok=True)  # no stale result passes for this run's
    record = {
        "script": s.script,
        "argv": argv,
        "command": command_line(s.script, argv),
        "profile": args.profile,
    }
    limit = 60 * s.minutes[args.profile] * args.timeout_factor + 300
    txt, log_path = args.artifacts / f"{s.name}.txt", args.artifacts / f"{s.name}.log"
    with locked(args.lock) as waited, open(txt, "w") as stdout, open(log_path, "w") as stderr:
        log(f"== {s.name}: {record['command']}")
        record |= {"lock_wait_s": round(waited, 1), "machine": facts | {"loadavg": os.getloadavg()}}
        before = other_load()
        record["started"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        started, command = time.perf_counter(), [sys.executable, str(REPO / s.script), *argv]
        proc = subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=subprocess.PIPE, text=True)

        def tee() -> None:  # the progress into the log, and here
            assert proc.stderr is not None
            for line in proc.stderr:
                stderr.write(line)
                stderr.flush()
                print(f"  {s.name}: {line}", end="", file=sys.stderr, flush=True)

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            log(f"== {s.name}: over {limit:.0f} s: stopping it (SIGTERM stops its servers)")
            record["timed_out"] = True
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            reader.join(timeout=10)
        seconds, after = time.perf_counter() - started, other_load()
    record |= {"seconds": round(seconds, 1), "exit": proc.returncode, "loadavg_end": os.getloadavg()}
    record["other_cpu_pct"] = [round(before, 1), round(after, 1)]
    if path.exists():
        record["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    missing = " (no JSON)" * (not path.exists())
    log(f"== {s.name}: exit {proc.returncode} in {record['seconds']:.0f} s{missing}")
    return record


def _sigterm(_signo: int, _frame: object) -> None:
    raise SystemExit(143)  # through run_one's finally: the running scenario is stopped, its servers too


# -- the page ------------------------------------------------------------------------------------------------


def escape(text: str) -> str:
    """Plain text for markdown: no emphasis, code, links, HTML or table cells out of it."""
    return re.sub(r"([\\`*_\[\]<>|#])", r"\\\1", text)


HEADER = re.compile(r"llama-cpp-python \S+, \d+ CPUs, load [\d.]+→[\d.]+$")


def to_markdown(text: str, fold: tuple[str, ...] = ()) -> str:
    """A script's report as markdown: tables and lists kept, the configuration line as code,
    ``title:`` lines bold (those in ``fold`` and their table folded), other lines a list."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    paragraphs = [p.strip("\n") for p in re.split(r"\n\n+", text) if p.strip()]
    out, i = [], 0
    while i < len(paragraphs):
        p, lines = paragraphs[i], paragraphs[i].splitlines()
        if all(line.startswith("|") for line in lines) or all(line.startswith("- ") for line in lines):
            out.append(p)
        elif len(lines) == 1 and HEADER.search(p):
            out.append(f"`{' '.join(p.split())}`")
        elif len(lines) == 1 and p.endswith(":"):
            if p.startswith(fold) and fold and i + 1 < len(paragraphs):
                summary = html.escape(p.removesuffix(":"))
                out.append(f"<details><summary>{summary}</summary>\n\n{paragraphs[i + 1]}\n\n</details>")
                i += 2
                continue
            out.append(f"**{escape(p)}**")
        elif len(lines) > 1:
            out.append("\n".join(f"- {escape(line.strip())}" for line in lines))
        else:
            out.append(escape(p))
        i += 1
    return "\n\n".join(out)


def script_report(s: Scenario, result: dict[str, Any], record: dict[str, Any] | None) -> str:
    """What the scenario's own ``report()`` prints for ``result``, with the arguments of its run."""
    module = importlib.import_module(s.module or "")
    argv = [a for a in (record or {}).get("argv", shlex.split(s.args[DEFAULT])) if a != "--markdown"]
    with mock.patch.object(sys, "argv", [s.script, *argv]):
        args = module.parse_args()
    args.markdown, args.no_chart = False, True
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        module.report(result, args)
    return printed.getvalue()


def when(record: dict[str, Any]) -> str:
    started = datetime.datetime.fromisoformat(record["started"])
    return f"{started:%Y-%m-%d %H:%M} UTC"


def section(s: Scenario, result: dict[str, Any] | None, record: dict[str, Any] | None, args: Any) -> str:
    """The scenario's part of the page: its command, its run, its tables, chart and notes."""
    argv = argv_of(s, args.page_profile, args.artifacts)
    out = [f"```sh\n{(record or {}).get('command') or command_line(s.script, argv)}\n```"]
    if result is None and record is None:
        return "\n\n".join([*out, "> **Not run yet.** The command above measures it."])
    if result is None:
        log_path = args.artifacts / f"{s.name}.log"
        lines = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.exists() else []
        failed = f"> **Failed** on {when(record)}: exit {record.get('exit')}, no JSON"
        failed += " (stopped: over its time limit)" * bool(record.get("timed_out"))
        tail = "\n".join(lines).replace("```", "'''")
        return "\n\n".join(
            [*out, failed, f"<details><summary>log tail</summary>\n\n```\n{tail}\n```\n\n</details>"]
        )
    json_name = shown(args.artifacts / f"{s.name}.json")
    if record:
        facts, minutes = record["machine"], record["seconds"] / 60
        ran = f"Run {when(record)}, profile {record['profile']}, {minutes:.1f} min, exit {record['exit']}"
        ran += f", load {facts['loadavg'][0]:.2f}→{record['loadavg_end'][0]:.2f}, commit `{facts['commit']}`"
        ran += " (with uncommitted changes)" * facts["dirty"]
        if (other := record.get("other_cpu_pct")) is not None:
            ran += f", other load {other[0]:.0f} % of a core before, {other[1]:.0f} % after"
        ran += " — **a busy machine** (see the top)" * busy_start(record)
        ran += f"; rendered from `{json_name}` (sha256 `{record.get('sha256', '?')[:12]}`)."
    else:
        ran = f"Rendered from `{json_name}`, whose run is not in run.json: the command above is the"
        ran += f" {args.page_profile} profile's, not necessarily the one that made it."
    out.append(ran)
    out.append(s.render(result) if s.render else to_markdown(script_report(s, result, record), s.fold))
    if s.name in plots.CHARTS:
        file_name, chart = plots.CHARTS[s.name]
        try:
            path = chart(result, args.images / file_name)
            out.append(f"![{s.what}]({os.path.relpath(path, args.out.parent)})")
        except ImportError:
            out.append("(no chart: matplotlib is missing: `pip install -e '.[bench]'`)")
    notes = result.get("notes") or []
    if notes:
        items = "\n".join(f"- {escape(n)}" for n in notes[:60])
        items += f"\n- … and {len(notes) - 60} more (the JSON)" * (len(notes) > 60)
        summary = f"{len(notes)} note(s) from the run"
        out.append(
            f"<details><summary>{summary}</summary>\n\n{items}\n\n</details>"
            if len(notes) > 5
            else f"Notes from the run:\n\n{items}"
        )
    return "\n\n".join(out)


def intro(runs: dict[str, Any], results: dict[str, Any]) -> str:
    """What was run, when, on what: the machine's facts as read at the start of the run."""
    records = [runs["runs"][n] for n in BY_NAME if n in runs["runs"] and n in results]
    if not records:
        if results:
            return "Rendered from results whose runs are not in run.json: the machine is unknown here."
        return "> **Not run yet**: no scenario has a result. `python benchmarks/report.py` runs them all."
    first, last = min(records, key=lambda r: r["started"]), max(records, key=lambda r: r["started"])
    facts = last["machine"]
    end = datetime.datetime.fromisoformat(last["started"]) + datetime.timedelta(seconds=last["seconds"])
    same_day = first["started"][:10] == end.isoformat()[:10]
    span = f"{when(first)} – {end:%H:%M} UTC" if same_day else f"{when(first)} – {end:%Y-%m-%d %H:%M} UTC"
    profiles = sorted({r["profile"] for r in records})
    dirty = " (with uncommitted changes)"
    commits = sorted({f"`{r['machine']['commit']}`" + dirty * r["machine"]["dirty"] for r in records})
    quick = " --quick" * (profiles == [QUICK])
    model = facts["model"]
    sha = f", sha256 `{model['sha256'][:16]}…`" if model.get("sha256") else ""
    rows = [
        ("CPU", f"{escape(facts['cpu'])}, {facts['cpu_count']} cores ({facts['cpus_usable']} usable)"),
        ("memory", f"{fmt(facts['memory_gib'])} GiB"),
        ("OS", f"Linux {escape(facts['kernel'])}"),
        ("Python", facts["python"]),
        ("llama-cpp-python", f"{facts['llama_cpp_python']} (llama.cpp's system info below)"),
        ("llama-server", f"{escape(str(facts.get('llama_server')))}, built from that llama.cpp"),
        ("trioserve", facts["trioserve"]),
        ("model", f"{model['file']} ({model['bytes'] / 1e6:.0f} MB{sha})"),
        ("load average", ", ".join(f"{x:.2f}" for x in facts["loadavg"]) + " (1, 5, 15 min) at the start"),
    ]
    text = [
        f"Results of one run of the harness, {span}, profile {' and '.join(profiles)}, commit"
        f" {', '.join(commits)}: {len(records)} of {len(SCENARIOS)} scenarios. The command:",
        f"```sh\n{python()} benchmarks/report.py{quick}\n```",
        "Every table and chart is rendered by [`benchmarks/report.py`](../benchmarks/report.py) from"
        " that run's JSON (each section names its file and its command); the prose is"
        " [`benchmarks/report_page.md`](../benchmarks/report_page.md): edit that, not this file."
        " Earlier results: this file's git history.",
        table([["machine", ""], *[[k, v] for k, v in rows]]),
        f"llama.cpp's system info: `{facts['system_info']}`",
    ]
    busy = [n for n in BY_NAME if n in runs["runs"] and n in results and busy_start(runs["runs"][n])]
    if busy:
        text.append(
            f"> **A busy machine**: other work shared the cores with {', '.join(busy)} (over"
            f" {OTHER_LOAD_WARN:g} % of a core just before or after it; a run recorded without that"
            " check: a load average above 1.5 × the cores at its start). Read their figures as that"
            " machine's, not comparable; rerun on an idle machine."
        )
    if missing := [s.name for s in SCENARIOS if s.name not in results]:
        text.append(f"> **Not run yet** in this run: {', '.join(missing)} (their sections say so).")
    return "\n\n".join(text)


def busy_start(record: dict[str, Any]) -> bool:
    """Other work shared the machine: over ``OTHER_LOAD_WARN`` % of a core just before or just
    after the scenario (a record without that check: a load average above 1.5 × the cores)."""
    if (other := record.get("other_cpu_pct")) is not None:
        return bool(max(other) > OTHER_LOAD_WARN)
    facts = record["machine"]
    return bool(facts["loadavg"][0] > 1.5 * (facts.get("cpus_usable") or facts["cpu_count"]))


def glance(runs: dict[str, Any], results: dict[str, Any]) -> str:
    rows = ["| scenario | figure | section |", "|---|---|---|"]
    for s in SCENARIOS:
        anchor = SECTIONS.get(s.name, "")
        if s.name not in results:
            figure = "not run yet"
        else:
            try:
                figure = s.headline(results[s.name])
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                figure = f"(no headline: {type(exc).__name__})"
        rows.append(f"| {escape(s.what)} | {escape(figure)} | [{s.name}](#{anchor}) |")
    return "\n".join(rows)


#: scenario → the anchor of its page section (the headings of report_page.md)
SECTIONS = {
    "single": "one-stream-against-the-bare-decode-loop",
    "overhead": "cpu-per-streamed-token",
    "overhead_paced": "cpu-per-streamed-token",
    "cancel": "cancel-latency",
    "cancel_messages": "cancel-latency-anthropic-messages",
    "slow_reader": "slow-readers",
    "batched": "batched-decoding",
    "conversation": "conversations-and-the-prompt-cache",
    "health": "health-under-load",
    "soak_scripted": "soak-hostile-traffic-then-proof-that-nothing-leaked",
    "soak_model": "soak-hostile-traffic-then-proof-that-nothing-leaked",
    "constrained": "constrained-decoding-and-logprobs",
    "embeddings": "embeddings",
    "model_load": "a-client-that-leaves-during-its-models-load",
}


def render(args: Any) -> str:
    runs, results = load_runs(args.artifacts), {}
    for s in SCENARIOS:
        path = args.artifacts / f"{s.name}.json"
        if path.exists():
            results[s.name] = json.loads(path.read_text())
    profiles = {r["profile"] for name, r in runs["runs"].items() if name in results}
    args.page_profile = profiles.pop() if len(profiles) == 1 else args.profile  # (for "not run yet")
    page = PAGE.read_text()
    blocks = {"intro": intro(runs, results), "glance": glance(runs, results)}
    for s in SCENARIOS:
        blocks[s.name] = section(s, results.get(s.name), runs["runs"].get(s.name), args)
    slugs = {
        re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", page, re.M)
    }
    if lost := sorted(set(SECTIONS.values()) - slugs):
        raise SystemExit(f"{shown(PAGE)} has no heading for #{lost[0]}")
    missing = [k for k in blocks if "{{" + k + "}}" not in page]
    if missing:
        raise SystemExit(f"{shown(PAGE)} has no {{{{{missing[0]}}}}}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: blocks[m[1]], page)


def main() -> int:
    args = parse_args()
    if args.list:
        for s in SCENARIOS:
            argv = argv_of(s, args.profile, args.artifacts)
            print(f"{s.name:<15} ~{s.minutes[args.profile]:>4g} min  {command_line(s.script, argv)}")
        total = sum(s.minutes[args.profile] for s in SCENARIOS)
        print(f"every scenario, profile {args.profile}: ~{total:g} min on 2 idle cores")
        return 0
    failed = []
    if not args.render_only:
        signal.signal(signal.SIGTERM, _sigterm)
        args.artifacts.mkdir(parents=True, exist_ok=True)
        facts, runs = machine(), load_runs(args.artifacts)
        total = sum(BY_NAME[n].minutes[args.profile] for n in args.only)
        log(f"{len(args.only)} scenario(s), profile {args.profile}: ~{total:g} min on 2 idle cores")
        for name in args.only:
            runs["runs"][name] = record = run_one(BY_NAME[name], args, facts)
            save_runs(args.artifacts, runs)
            if "sha256" not in record:
                failed.append(name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args))
    log(f"wrote {shown(args.out)}" + (f"; no result from {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
