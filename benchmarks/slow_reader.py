"""Slow reader: does a client that reads slowly stop the producer, or fill buffers?

Per server and client receive buffer (``default``, or ``--rcvbuf`` set before connecting),
one streamed completion (``max_tokens`` 3000, greedy) on the raw-socket client, which then
reads ``--read-bytes`` every ``--read-interval`` s for ``--duration`` s, never blocking.
Every second: the server's CPU (% of one core), RSS and the rest of the machine's CPU.
At the end: where the bytes are (read by the client, in the client's kernel buffer
(``FIONREAD``), in the server's Send-Q (``/proc/net/tcp``)) and the events among them;
then the client closes and the server must go idle (the one rule; trioserve's ``/health``
drained too). Columns and what to expect: docs/benchmarks.md, "Slow readers".

    python benchmarks/slow_reader.py --markdown --json artifacts/slow_reader.json
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import RawStream, body, slow_read
from benchmarks.harness.proc import cpu_seconds, cpu_split, rss_kib, tcp_tx_queue, wait_cpu_idle
from benchmarks.harness.stats import fmt, rows_table

SERVERS = (servers.TRIOSERVE, servers.LLAMA_CPP_PYTHON, servers.LLAMA_SERVER)
GAUGES = ("generations_running", "slots_in_use", "active_streams")
TEXT_COLUMNS = (("client read B", "client_read"), ("client kernel buffer B", "client_kernel_buffer"))
TEXT_COLUMNS += (("server Send-Q B", "server_send_q"), ("events", "events"))


def parse_args() -> Any:
    settings = {"threads": 2, "ctx_size": 4096, "max_tokens": 3000, "other_load_warn": 20.0}
    p = cli.parser(__doc__, (SERVERS, SERVERS), **settings)
    p.add_argument("--prompt", default=cli.DEFAULT_PROMPT, help="the prompt (default: %(default)r)")
    cli.option(p, "--duration", 10, "seconds of slow reading (keep it under trioserve's 30 s stall timeout)")
    cli.option(p, "--read-bytes", 64, "bytes per read")
    cli.option(p, "--read-interval", 0.25, "seconds between reads")
    cli.option(p, "--rcvbuf", 16384, "the small client SO_RCVBUF")
    cli.option(p, "--cpu-bar", 5.0, "the bar: CPU %% of one core after the first second")
    cli.option(p, "--rss-bar-kb", 1024, "the bar: RSS growth, KiB")
    cli.option(p, "--idle-cap", 20.0, "seconds to wait for idle after the close")
    return p.parse_args()


def sample(pid: int, t: float) -> dict[str, float]:
    return {"t": t, "cpu_s": cpu_seconds(pid), "rss_kib": rss_kib(pid), "other_cpu_s": cpu_split([pid])[2]}


def pct(samples: list[dict[str, float]], i: int, j: int, key: str = "cpu_s") -> float:
    return 100.0 * (samples[j][key] - samples[i][key]) / (samples[j]["t"] - samples[i]["t"])


def run_case(server: servers.Server, rcvbuf: int | None, args: Any) -> dict[str, Any]:
    samples = [sample(server.pid, 0.0)]
    stream = RawStream(server.port, body(args.prompt, args.max_tokens), rcvbuf=rcvbuf)
    rcvbuf_start = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    tick = lambda t: samples.append(sample(server.pid, t))  # noqa: E731
    closed_at = slow_read(stream, args.read_bytes, args.read_interval, args.duration, tick)
    read, unread = stream.received, stream.unread()  # where the bytes are, at the end of the read
    send_q = tcp_tx_queue(server.port, stream.sock.getsockname()[1])
    rcvbuf_end = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    health = server.health() if server.name == servers.TRIOSERVE else None
    stream.sock.setblocking(True)
    while stream.received < read + unread and stream.receive(time.perf_counter() + 5):
        pass  # drain the client's buffer, to count its events
    t_close = stream.close()
    drained = server.wait_drained(args.idle_cap, GAUGES) if health is not None else None
    idle = wait_cpu_idle(server.pid, t_close, args.idle_cap)
    per_second = [pct(samples, i, i + 1) for i in range(len(samples) - 1)]
    quiet = next((s for s in range(1, len(per_second)) if max(per_second[s:]) <= args.cpu_bar), None)
    rss = [s["rss_kib"] - samples[0]["rss_kib"] for s in samples]
    case = {"server": server.name, "rcvbuf": "default" if rcvbuf is None else str(rcvbuf)}
    case.update(rcvbuf_effective=f"{rcvbuf_start}" + (f"→{rcvbuf_end}" if rcvbuf_end != rcvbuf_start else ""))
    case.update(status=stream.status, cpu_first_s=per_second[0], cpu_after_first_s=pct(samples, 1, -1))
    case.update(quiet_from_s=quiet, rss_growth_kib=rss[-1], rss_growth_after_first_s_kib=rss[-1] - rss[1])
    case.update(client_read=read, client_kernel_buffer=unread, events=stream.data_events())
    case.update(other_cpu_pct=max(0.0, pct(samples, 0, -1, "other_cpu_s")), server_closed_at_s=closed_at)
    case.update(busy_after_close_s=idle.after_s, cpu_after_close_s=idle.cpu_s, health_drained_after_s=drained)
    case.update(server_send_q=send_q, health_at_end=health, per_second_cpu_pct=per_second, samples=samples)
    case["bar_met"] = case["cpu_after_first_s"] <= args.cpu_bar and case["rss_growth_kib"] <= args.rss_bar_kb
    return case


def run(args: Any) -> dict[str, Any]:
    model = cli.resolve_model(args)
    sysctl = {k: Path(f"/proc/sys/net/ipv4/{k}").read_text().strip() for k in ("tcp_rmem", "tcp_wmem")}
    names = "threads ctx_size max_tokens prompt duration read_bytes read_interval rcvbuf idle_cap cpu_bar"
    names += " rss_bar_kb"
    cfg = cli.environment(model, **cli.pick(args, names), **sysctl)
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        for name in args.contestants:
            settings = cli.pick(args, "threads ctx_size")
            running.append(servers.Server.start(name, model, Path(logs), **settings))
        for server in running:
            server.wait_ready(args.ready_timeout)
        cfg["commands"] = {s.name: s.command for s in running}
        for server in running:
            stream = RawStream(server.port, body(args.prompt, 16))  # warm-up: first-request allocations
            stream.read_until(stream.done, stream.sent_at + 60)
            wait_cpu_idle(server.pid, stream.close(), args.idle_cap)
            for rcvbuf in (None, args.rcvbuf):
                cases.append(c := run_case(server, rcvbuf, args))
                cpu = f"{c['rcvbuf']:>7}: CPU {c['cpu_first_s']:.0f} % then {c['cpu_after_first_s']:.1f} %"
                where = f"read {c['client_read']} B, buffer {c['client_kernel_buffer']} B"
                where += f", Send-Q {c['server_send_q']} B, {c['events']} events"
                cli.log(f"{server.name:<16} {cpu}, RSS {c['rss_growth_kib']:+d} KiB, {where}")
    return {"config": cfg, "cases": cases, "notes": notes(cases, args)}


def notes(cases: list[dict[str, Any]], args: Any) -> list[str]:
    out = []
    for c in cases:
        label = f"{c['server']}, SO_RCVBUF {c['rcvbuf']}"
        if c["other_cpu_pct"] > args.other_load_warn:
            out.append(f"{label}: other processes used {c['other_cpu_pct']:.0f} % of a core: rerun")
        if c["status"] != 200 or c["server_closed_at_s"] is not None:
            out.append(f"{label}: status {c['status']}, the server closed at {c['server_closed_at_s']} s")
        if c["busy_after_close_s"] is None or c["busy_after_close_s"] > 1.0:
            busy = fmt(c["busy_after_close_s"], ".1f", f"> {args.idle_cap:g}")
            busy += f" s after the client closed ({c['cpu_after_close_s']:.1f} CPU s)"
            out.append(f"{label}: computed {busy}")
        if (h := c["health_at_end"]) is not None:
            gauges = ", ".join(f"{g} {h.get(g)}" for g in GAUGES)
            out.append(f"{label}: /health at {args.duration} s: {gauges}")
    return out


def report(result: dict[str, Any], args: Any) -> None:
    cfg, cases, d = result["config"], result["cases"], result["config"]["duration"]
    for key in ("idle_cap", "cpu_bar", "rss_bar_kb"):  # the run's (an older JSON: the options')
        setattr(args, key, cfg.get(key, getattr(args, key)))
    read = f"client reads {cfg['read_bytes']} B every {cfg['read_interval']:g} s for {d} s"
    read += f"; tcp_rmem {cfg['tcp_rmem']}"
    print(cli.header(cfg, f"max_tokens {cfg['max_tokens']}, {cfg['threads']} threads; {read}"))
    columns = [
        ("server", lambda c: servers.LABELS.get(c["server"], c["server"])),
        ("client SO_RCVBUF (effective)", lambda c: f"{c['rcvbuf']} ({c['rcvbuf_effective']})"),
        ("CPU % 0–1 s", lambda c: f"{c['cpu_first_s']:.0f}"),
        (f"CPU % 1–{d} s", lambda c: f"{c['cpu_after_first_s']:.1f}"),
        ("quiet from s", lambda c: f"> {d}" if c["quiet_from_s"] is None else str(c["quiet_from_s"])),
        ("RSS growth KiB", lambda c: f"{c['rss_growth_kib']:+d}"),
        (f"… 1–{d} s", lambda c: f"{c['rss_growth_after_first_s_kib']:+d}"),
        *[(h, lambda c, k=k: str(c[k])) for h, k in TEXT_COLUMNS],
        ("busy after close s", lambda c: fmt(c["busy_after_close_s"], ".2f", f"> {args.idle_cap:g}")),
        ("other load %", lambda c: f"{c['other_cpu_pct']:.0f}"),
        (f"bar (≤ {args.cpu_bar:g} %, ≤ {args.rss_bar_kb} KiB)", lambda c: ("fail", "pass")[c["bar_met"]]),
    ]
    print(rows_table(cases, columns))
    if args.markdown:
        seconds = [(f"{i}–{i + 1}", lambda c, i=i: f"{c['per_second_cpu_pct'][i]:.0f}") for i in range(d)]
        print("\nserver CPU % of one core, per second of the read:\n")
        keys = [("server", lambda c: c["server"]), ("SO_RCVBUF", lambda c: c["rcvbuf"])]
        print(rows_table(cases, [*keys, *seconds]))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
