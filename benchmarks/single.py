"""One stream, paired against the bare decode loop: decode tok/s of each server ÷ the loop's.

Each round runs, the same minute, the in-process decode-only loop for one sequence
(``harness.decode_loop``), then every server contestant in turn (the starting one
rotating), each read by the raw-socket client, which only splits events: rate =
(max_tokens − 1) ÷ (last − first token event). Only one computes at a time. Method and
contestants: docs/benchmarks.md, "Method".

    python benchmarks/single.py --reps 5
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import RawStream, body
from benchmarks.harness.decode_loop import DecodeLoop
from benchmarks.harness.stats import median, table

SERVERS = (servers.TRIOSERVE, servers.LLAMA_SERVER, servers.MATCHED, servers.LLAMA_CPP_PYTHON)


def parse_args() -> Any:
    p = cli.parser(__doc__, (SERVERS, SERVERS[:2]), threads=2, ctx_size=2048, max_tokens=128, reps=5)
    p.add_argument("--prompt", default=cli.DEFAULT_PROMPT, help="the prompt (default: %(default)r)")
    return p.parse_args()


def stream_rate(server: servers.Server, prompt: str, max_tokens: int) -> tuple[float, int]:
    """tok/s between the first and the last token event, and the token events seen."""
    stream = RawStream(server.port, body(prompt, max_tokens))
    for _ in stream.iter_events():
        pass
    times = stream.token_times()
    if stream.status != 200 or len(times) < 2:
        raise RuntimeError(f"{server.name}: status {stream.status}, {len(times)} token events")
    return (max_tokens - 1) / (times[-1] - times[0]), len(times)


def run(args: Any) -> dict[str, Any]:
    model, settings = cli.resolve_model(args), {"threads": args.threads, "ctx_size": args.ctx_size}
    cfg = cli.environment(model, **settings, max_tokens=args.max_tokens, contestants=args.contestants)
    loop = DecodeLoop(model, args.threads, args.ctx_size)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        for name in args.contestants:
            running.append(servers.Server.start(name, model, Path(logs), **settings))
        for server in running:
            server.wait_ready(args.ready_timeout)
            stream_rate(server, args.prompt, 8)  # warm-up
        cfg["commands"] = {s.name: s.command for s in running}
        for i in range(args.reps):
            run_ = loop.generate([args.prompt], args.max_tokens)
            row: dict[str, Any] = {"decode-only": (args.max_tokens - 1) / run_["loop_s"]}
            shift, tokens = i % len(running), args.max_tokens
            for server in running[shift:] + running[:shift]:
                row[server.name], row[f"{server.name} events"] = stream_rate(server, args.prompt, tokens)
            rounds.append(row)
            cli.log(f"round {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if " " not in k))
    loop.close()
    ratios = {name: median(r[name] / r["decode-only"] for r in rounds) for name in args.contestants}
    return {"config": cfg, "rounds": rounds, "median_ratio": ratios, "notes": []}


def report(result: dict[str, Any], args: Any) -> None:
    names = result["config"]["contestants"]
    what = f"{result['config']['max_tokens']} tokens, one stream, tok/s (÷ decode-only)"
    print(cli.header(result["config"], what))
    rows = [["round", "decode-only", *(servers.LABELS.get(n, n) for n in names)]]
    for i, r in enumerate(result["rounds"]):
        cells = [f"{r[n]:.1f} ({r[n] / r['decode-only']:.3f}×)" for n in names]
        rows.append([str(i + 1), f"{r['decode-only']:.1f}", *cells])
    rows.append(["median ratio", "", *(f"{result['median_ratio'][n]:.3f}×" for n in names)])
    print(table(rows))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
