"""N concurrent streams: per-stream and total tokens/s, one server configuration at a time.

Contestants (same GGUF, context per sequence, prompts): ``trioserve`` (``--slots 4
--max-queue 8 --threads 2``), ``trioserve-t1`` (``--threads 1``), ``llama-cpp-python``
(one completion at a time behind a lock), ``llama-server`` (its defaults: 4 slots, prompt
cache), ``llama-server-matched`` (``--parallel`` = ``--slots``, no prompt cache); and the
scale-out ones, ``front-<kind>``: ``trioserve serve --upstream`` in front of
``--upstreams`` servers of that kind, the threads split between them. Each: a warm-up,
every prompt solo, then N streams at once per ``--streams``. Method: docs/benchmarks.md.

    python benchmarks/concurrency.py --markdown --json artifacts/concurrency.json
    python benchmarks/concurrency.py --contestants trioserve,front-trioserve,front-llama-server
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, groups, servers

T, LCP, LS, MATCHED = servers.TRIOSERVE, servers.LLAMA_CPP_PYTHON, servers.LLAMA_SERVER, servers.MATCHED
CONTESTANTS = (T, f"{T}-t1", LCP, LS, MATCHED, *(f"front-{kind}" for kind in (T, LCP, LS)))
#: what one upstream of each kind runs at once: the front's --slots per upstream
UPSTREAM_SLOTS = {T: 4, LCP: 1, LS: 4}


def parse_args() -> Any:
    defaults: dict[str, Any] = {"threads": 2, "ctx_size": 2048, "slots": 4, "max_tokens": 128, "reps": 1}
    defaults |= {"streams": [1, 2, 4], "prompts": list(cli.PROMPTS[:4]), "other_load_warn": 20.0}
    p = cli.parser(__doc__, (CONTESTANTS, CONTESTANTS[:5]), **defaults)
    cli.option(p, "--max-queue", 8, "trioserve --max-queue")
    cli.option(p, "--upstreams", 2, "front-*: upstream servers behind the front")
    return p.parse_args()


def start(name: str, model: Path, logs: Path, args: Any, running: list[servers.Server]) -> None:
    """Start the contestant's processes into ``running``; the last is the one clients talk to."""
    threads = args.threads // 2 if name.endswith("-t1") else args.threads
    queue = ["--max-queue", str(args.max_queue)]
    settings: dict[str, Any] = {"ctx_size": args.ctx_size, "slots": args.slots}
    if not name.startswith("front-"):
        extra = ["--slots", str(args.slots), *queue] if name.startswith(T) else []
        running.append(servers.Server.start(name, model, logs, threads=threads, extra=extra, **settings))
        return
    kind, each = name.removeprefix("front-"), max(1, args.threads // args.upstreams)
    settings["extra"] = ["--slots", str(UPSTREAM_SLOTS[kind])] if kind == T else []
    for i in range(args.upstreams):
        running.append(servers.Server.start(f"{kind}-{i}", model, logs, threads=each, **settings))
        running[-1].wait_ready(args.ready_timeout)
    port, upstreams = servers.free_port(), [a for up in running for a in ("--upstream", up.url)]
    argv = servers.trioserve_command(port, *upstreams, "--slots", str(UPSTREAM_SLOTS[kind]), *queue)
    running.append(servers.Server(name, argv, port, logs))


def label(name: str, args: Any) -> str:
    each = max(1, args.threads // args.upstreams)
    if name.startswith("front-"):
        k = name.removeprefix("front-")
        return f"trioserve --upstream × {args.upstreams} {servers.LABELS.get(k, k)}, {each} thread(s) each"
    slots = args.slots if name.startswith(T) or name == MATCHED else {LCP: 1, LS: "4 (auto)"}[name]
    threads = args.threads // 2 if "-t1" in name else args.threads
    return f"{servers.LABELS.get(name, name)}, {slots} slots × {threads} threads"


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    names = "contestants threads ctx_size slots max_queue upstreams max_tokens reps streams prompts"
    cfg = cli.environment(model, **cli.pick(args, names))
    cfg["labels"], cfg["commands"] = {n: label(n, args) for n in args.contestants}, {}
    all_groups, all_streams = [], []
    with tempfile.TemporaryDirectory() as logs:
        for name in args.contestants:
            with servers.running([]) as running:
                start(name, model, Path(logs), args, running)
                running[-1].wait_ready(args.ready_timeout)
                cfg["commands"][name] = [s.command for s in running]
                url, pids = running[-1].url + "/v1/completions", [p.pid for p in running]
                g, s = groups.measure(name, url, pids, args)
            all_groups += g
            all_streams += s
    out = {"config": cfg, "notes": groups.notes(all_groups, all_streams, args.other_load_warn)}
    return out | {"groups": [asdict(g) for g in all_groups], "streams": [asdict(s) for s in all_streams]}


def report(result: dict[str, Any], args: Any) -> None:
    cfg = result["config"]
    gs, ss = [groups.Group(**g) for g in result["groups"]], [groups.Stream(**s) for s in result["streams"]]
    what = f"{cfg['max_tokens']} tokens per stream, ctx {cfg['ctx_size']} per sequence, {cfg['reps']} rep(s)"
    print(cli.header(cfg, what))
    print(groups.summary_table(groups.summarize(gs, ss), cfg["labels"]))
    print("\nsolo runs (one request at a time):\n\n" + groups.streams_table(ss, solo=True))
    if args.markdown:
        print("\nevery stream:\n\n" + groups.streams_table(ss, solo=False))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
