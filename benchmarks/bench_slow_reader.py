"""Slow reader: does a client that reads slowly slow the producer, or fill buffers?

Two servers on the same GGUF, thread count and context size, each a subprocess started
once for the whole run:

``trioserve``
    ``trioserve serve --threads T --ctx-size C``. Between the inference thread and the
    HTTP response there is a zero-capacity channel, and its sockets carry
    ``TCP_NOTSENT_LOWAT`` 16 KiB: a send blocks once 16 KiB wait in the kernel unsent, the
    blocked send blocks the channel, and the blocked channel blocks the next decode step.
``llama-server``
    ``python -m llama_cpp.server --n_threads T --n_threads_batch T --n_ctx C``, with
    ``--flash_attn True`` and ``--logits_all False`` as in ``bench_throughput.py``.

Each case is one server and one client receive-buffer setting:

``default``
    the client socket as the OS makes it (on Linux ``net.ipv4.tcp_rmem``'s default,
    131072 bytes, which autotuning may grow);
``16384``
    ``setsockopt(SOL_SOCKET, SO_RCVBUF, 16384)`` on the client socket *before* ``connect``
    (so the window scale is negotiated for it). Linux doubles the value for its own
    bookkeeping and turns autotuning off for that socket; the effective value
    (``getsockopt``) is recorded.

The client is a raw TCP socket (no HTTP library that could read ahead): it connects,
sends one ``POST /v1/completions`` with ``"prompt": "Once upon a time"``, ``max_tokens``
3000 (``--max-tokens``), ``temperature`` 0, ``stream: true`` (and ``repeat_penalty`` 1.0 for
llama-server), then reads ``--read-bytes`` (64) bytes every ``--read-interval`` (0.25 s) —
256 bytes/s — for ``--duration`` (10 s), without blocking (a read with nothing there reads
nothing). The request is sent at t = 0; reads happen at t = 0.25, 0.5, …, 10.

Measured on the *server* process, all its threads together, sampled at t = 0, 1, …, 10 s:

* **CPU %** of one core: ``utime + stime`` from ``/proc/<pid>/stat`` (fields 14 and 15, in
  clock ticks of 1/``SC_CLK_TCK`` s) over each interval ÷ the interval. Reported for
  seconds 0–1 (prefill, the first burst) and 1–10 (steady state), plus **quiet from**: the
  first whole second from which every later 1-s interval stays ≤ ``--cpu-bar`` (5 %) — when
  the producer stopped; "> 10" if it never did.
* **RSS growth**: ``VmRSS`` from ``/proc/<pid>/status`` at t = 10 minus at t = 0, in KB;
  also from t = 1 to t = 10, which leaves out what a request allocates as it starts:
  llama-server's RSS grows ~3 MB in the first second of every request, trioserve's in
  some runs in its first case — about one vocabulary-sized sampling array (Gemma 3:
  262,144 entries × 12 bytes), likely, not buffered bytes; it does not grow after that.
* **other load**: the CPU time of everything else on the machine (``/proc/stat`` busy time
  minus the server and this process) over the read, in % of one core. The server competes
  with it for the cores; above ``--other-load-warn`` (20 %) a note says so: rerun.

And where the bytes went, at t = 10 before the client closes:

* **client read**: bytes the client's reads returned (HTTP headers included);
* **client kernel buffer**: bytes received by the client's kernel but not read —
  ``ioctl(FIONREAD)`` on the client socket;
* **server Send-Q**: bytes the server process has written that are still in its own
  socket's send queue (``tx_queue`` of the server-side socket in ``/proc/net/tcp``:
  unsent, because the client's window is closed, or unacknowledged);
* **events**: SSE ``data:`` events among the bytes read plus the client's buffer (the
  buffer is drained after the t = 10 measurement to count them) — about one per token.

Their sum is everything the server handed to the kernel. A server Send-Q that is not 0
means the client's window is closed: its buffer is full, and the server's send is what
waits.

What to expect, and why the two buffer settings differ: trioserve bounds *its* buffers —
the channel holds no token, the kernel's unsent queue for the socket holds at most ~16 KiB
(``TCP_NOTSENT_LOWAT``, about 80 events of ~200 bytes) — but the client's kernel receive
buffer belongs to the client, and bytes in it have left the server: the server's send
cannot block until the client's window closes. With ``default`` the buffer on Linux
loopback takes well over 100 KB (~600 events; receive autotuning may even grow it while
the client reads), so at tens of tokens/s the producer runs at full speed for 10 s or more
and the CPU stays high for the whole read, though nothing inside trioserve buffers a
token: the bytes are in the client's buffer (see the columns). With ``16384`` (32 KiB
effective, ~20 KB of window) the window closes after ~100 events, the server's Send-Q
fills to ~16 KiB, and the producer stops after ~200 events (~40 KB) in all: a few
seconds in, at the decode rates of a 2-core machine. The issue's bar for trioserve — CPU
over seconds 1–10 ≤ 5 % of one core and RSS growth ≤ 1 MB (``--cpu-bar``,
``--rss-bar-kb``) — is judged per case; "quiet from" and the per-second CPU
(``--markdown``) show when the producer stopped, which is what the bar is about: it can
only be met when the client's buffer plus the 16 KiB fill within the first second.
llama-server has no such bound of its own: uvicorn queues up to 64 KiB in user space
above an autotuned kernel send buffer (up to ``net.ipv4.tcp_wmem``'s maximum) before its
send waits.

After the client closes (an orderly ``close()``; its buffer was drained, so a FIN, not a
RST) the benchmark waits for the server to go idle before the next case, and records how
long that took: the first moment from which the server's CPU stays under 5 % of one core
for ``--idle-window`` (0.5 s), sampled every 50 ms, capped at ``--idle-cap`` (20 s) —
llama-server may keep generating after its client has gone. For trioserve it also waits
until ``GET /health`` shows ``inference_threads``, ``slots_in_use`` and ``active_streams``
all 0 (same cap), and records that time too. The same idle rule is applied before the
first case, after one short warm-up completion per server (so first-request allocations
do not count as RSS growth).

Caveats: trioserve resets a connection whose peer accepts no bytes for 30 s
(``TCP_USER_TIMEOUT``), so ``--duration`` much above 30 s may end in a reset with a small
client buffer. The CPU counter has 10 ms resolution, 1 % of a core over 1 s. The server's
CPU includes its HTTP stack, not just inference. Servers are terminated at the end, also on
error, Ctrl-C and SIGTERM.

Run ``python benchmarks/bench_slow_reader.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import struct
import sys
import tempfile
import termios
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_PROMPT,
    LLAMA_SERVER,
    SERVERS,
    TRIOSERVE,
    ServerProcess,
    add_ready_timeout,
    add_threads,
    argument_parser,
    bench_main,
    completion_request,
    cpu_seconds,
    environment,
    log,
    markdown_table,
    resolve_model,
    start_servers,
    stopping,
    system_busy_seconds,
)

# ---------------------------------------------------------------------- /proc


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def tcp_tx_queue(local_port: int, remote_port: int) -> int | None:
    """``tx_queue`` of the IPv4 socket 127.0.0.1:local_port ↔ 127.0.0.1:remote_port."""
    local, remote = f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}"
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[1] == local and parts[2] == remote:
                return int(parts[4].split(":")[0], 16)
    return None


def unread_bytes(sock: socket.socket) -> int:
    """Bytes in the socket's kernel receive queue, not yet read (``FIONREAD``)."""
    buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    value: int = struct.unpack("i", buf)[0]
    return value


@dataclass
class IdleResult:
    after_s: float | None  # None: not idle within the cap
    cpu_s: float  # CPU time burnt meanwhile


def wait_cpu_idle(pid: int, t_from: float, args: argparse.Namespace) -> IdleResult:
    """Wait until ``pid`` has used < 5 % of one core for ``--idle-window`` s; return when that
    quiet window began, relative to ``t_from``."""
    cpu_from = cpu_seconds(pid)
    samples: list[tuple[float, float]] = []
    give_up = time.perf_counter() + args.idle_cap
    while True:
        now, cpu = time.perf_counter(), cpu_seconds(pid)
        samples.append((now, cpu))
        # the earliest sample that opens a quiet window ending at this sample
        for t_i, cpu_i in samples:
            if now - t_i < args.idle_window:
                break
            if cpu - cpu_i < 0.05 * (now - t_i):
                return IdleResult(max(0.0, t_i - t_from), cpu_i - cpu_from)
        if now > give_up:
            return IdleResult(None, cpu - cpu_from)
        samples = [s for s in samples if now - s[0] < 4 * args.idle_window + 1.0] or samples
        time.sleep(0.05)


# ---------------------------------------------------------------------- servers


def trioserve_health(server: ServerProcess, client: httpx.Client) -> dict[str, Any]:
    response = client.get(server.base_url + "/health", timeout=5.0)
    health: dict[str, Any] = response.json()
    return health


def wait_trioserve_drained(
    server: ServerProcess, client: httpx.Client, t_from: float, cap_s: float
) -> float | None:
    """Seconds from ``t_from`` until /health shows no inference thread, slot or stream."""
    give_up = time.perf_counter() + cap_s
    while time.perf_counter() < give_up:
        health = trioserve_health(server, client)
        if not (
            health.get("inference_threads") or health.get("slots_in_use") or health.get("active_streams")
        ):
            return time.perf_counter() - t_from
        time.sleep(0.05)
    return None


@dataclass
class IdleWait:
    cpu_idle_after_s: float | None
    cpu_s: float
    health_drained_after_s: float | None = None  # trioserve only


def wait_idle(
    server: ServerProcess, client: httpx.Client, t_from: float, args: argparse.Namespace
) -> IdleWait:
    drained = None
    if server.name == TRIOSERVE:
        drained = wait_trioserve_drained(server, client, t_from, args.idle_cap)
    idle = wait_cpu_idle(server.pid, t_from, args)
    server.check_alive()
    return IdleWait(idle.after_s, idle.cpu_s, drained)


# ---------------------------------------------------------------------- one case


def request_bytes(server: ServerProcess, args: argparse.Namespace) -> bytes:
    body: dict[str, Any] = {
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if server.name == LLAMA_SERVER:
        body["repeat_penalty"] = 1.0  # its default is 1.1
    return completion_request("127.0.0.1", server.port, body)


@dataclass
class Case:
    server: str
    rcvbuf: str  # "default" or the requested SO_RCVBUF
    rcvbuf_effective_start: int
    rcvbuf_effective_end: int
    status_line: str
    cpu_pct_first_s: float
    cpu_pct_after_first_s: float
    other_cpu_pct: float  # everything but the server and this benchmark, over the read
    quiet_from_s: int | None  # None: the CPU never settled
    rss_growth_kb: int
    rss_growth_after_first_s_kb: int
    rss_max_growth_kb: int
    client_read_bytes: int
    client_unread_bytes: int
    server_send_q_bytes: int | None
    events_delivered: int
    server_closed_at_s: float | None  # the server ended the response within the read
    idle: IdleWait | None = None
    samples: list[dict[str, float]] = field(default_factory=list)  # t, cpu_s, rss_kb
    per_second_cpu_pct: list[float] = field(default_factory=list)
    health_at_end: dict[str, Any] | None = None


def connect(server: ServerProcess, rcvbuf: int | None, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", server.port))
    except BaseException:
        sock.close()
        raise
    return sock


def sample(pid: int, t: float) -> dict[str, float]:
    """The server's CPU time and RSS, and the CPU time of everything else (this process
    excluded) — to tell a busy machine from a busy server."""
    server = cpu_seconds(pid)
    other = system_busy_seconds() - server - cpu_seconds(os.getpid())
    return {"t": t, "cpu_s": server, "rss_kb": float(rss_kb(pid)), "other_cpu_s": other}


def slow_read(
    sock: socket.socket, server: ServerProcess, args: argparse.Namespace
) -> tuple[bytes, list[dict[str, float]], float | None]:
    """Send the request, then read slowly; sample the server every second.

    Returns the bytes read, the samples (``t``, ``cpu_s``, ``rss_kb``) and when the server
    closed the connection, if it did."""
    pid = server.pid
    sample_times = [float(i) for i in range(int(args.duration) + 1)]
    reads = round(args.duration / args.read_interval)
    read_times = [args.read_interval * k for k in range(1, reads + 1)]
    # at the same instant: sample first (kind 0), then read (kind 1)
    timeline = sorted([(t, 0) for t in sample_times] + [(t, 1) for t in read_times])
    received = bytearray()
    samples: list[dict[str, float]] = []
    closed_at = None
    t0 = time.perf_counter()
    first = sample(pid, 0.0)
    sock.sendall(request_bytes(server, args))
    sock.setblocking(False)
    for at, kind in timeline:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if kind == 0:
            if at == 0.0:
                samples.append(first)
            else:
                now = time.perf_counter() - t0
                samples.append(sample(pid, now))
        elif closed_at is None:
            try:
                data = sock.recv(args.read_bytes)
            except BlockingIOError:
                continue  # nothing there yet (prefill)
            if not data:
                closed_at = time.perf_counter() - t0
            received += data
    return bytes(received), samples, closed_at


def drain(sock: socket.socket, count: int, timeout_s: float = 5.0) -> bytes:
    """Read ``count`` bytes already in the kernel buffer (or what comes before EOF)."""
    sock.settimeout(timeout_s)
    out = bytearray()
    while len(out) < count:
        data = sock.recv(min(65536, count - len(out)))
        if not data:
            break
        out += data
    return bytes(out)


def cpu_pct(samples: list[dict[str, float]], i: int, j: int, key: str = "cpu_s") -> float:
    a, b = samples[i], samples[j]
    return 100.0 * (b[key] - a[key]) / (b["t"] - a["t"])


def quiet_from(per_second: list[float], bar_pct: float) -> int | None:
    """First second ``s`` (≥ 1) from which every 1-s interval is ≤ ``bar_pct``."""
    for s in range(1, len(per_second) + 1):
        if all(p <= bar_pct for p in per_second[s:]):
            return s if s < len(per_second) else None
    return None


def run_case(
    server: ServerProcess, rcvbuf: int | None, client: httpx.Client, args: argparse.Namespace
) -> Case:
    sock = connect(server, rcvbuf, args.connect_timeout)
    try:
        eff_start = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        client_port = sock.getsockname()[1]
        received, samples, closed_at = slow_read(sock, server, args)
        # where the bytes are, right at the end of the read
        unread = unread_bytes(sock)
        send_q = tcp_tx_queue(server.port, client_port)
        eff_end = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        health = trioserve_health(server, client) if server.name == TRIOSERVE else None
        buffered = drain(sock, unread) if unread else b""
    finally:
        sock.close()
    t_close = time.perf_counter()
    idle = wait_idle(server, client, t_close, args)
    per_second = [cpu_pct(samples, i, i + 1) for i in range(len(samples) - 1)]
    rss = [s["rss_kb"] for s in samples]
    status_line = bytes(received).split(b"\r\n", 1)[0].decode(errors="replace")
    return Case(
        server=server.name,
        rcvbuf="default" if rcvbuf is None else str(rcvbuf),
        rcvbuf_effective_start=eff_start,
        rcvbuf_effective_end=eff_end,
        status_line=status_line,
        cpu_pct_first_s=cpu_pct(samples, 0, 1),
        cpu_pct_after_first_s=cpu_pct(samples, 1, len(samples) - 1),
        # three counters rounded to ticks: "other" can come out a little below 0
        other_cpu_pct=max(0.0, cpu_pct(samples, 0, len(samples) - 1, "other_cpu_s")),
        quiet_from_s=quiet_from(per_second, args.cpu_bar),
        rss_growth_kb=int(rss[-1] - rss[0]),
        rss_growth_after_first_s_kb=int(rss[-1] - rss[1]),
        rss_max_growth_kb=int(max(rss) - rss[0]),
        client_read_bytes=len(received),
        client_unread_bytes=unread,
        server_send_q_bytes=send_q,
        events_delivered=(received + buffered).count(b"data:"),
        server_closed_at_s=closed_at,
        idle=idle,
        samples=samples,
        per_second_cpu_pct=per_second,
        health_at_end=health,
    )


# ---------------------------------------------------------------------- warm-up


def warm_up(server: ServerProcess, client: httpx.Client, args: argparse.Namespace) -> None:
    """One short streamed completion, read to the end (not measured)."""
    body: dict[str, Any] = {"prompt": args.prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    if server.name == LLAMA_SERVER:
        body["repeat_penalty"] = 1.0
    with client.stream("POST", server.base_url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{server.name} warm-up: HTTP {response.status_code}: {response.text[:300]}")
        for _ in response.iter_bytes():
            pass


# ---------------------------------------------------------------------- summary


def _s(value: float | None, spec: str = ".1f", none: str = "—") -> str:
    return none if value is None else f"{value:{spec}}"


def meets_bar(case: Case, args: argparse.Namespace) -> bool:
    cpu_bar: float = args.cpu_bar
    rss_bar_kb: int = args.rss_bar_kb
    return case.cpu_pct_after_first_s <= cpu_bar and case.rss_growth_kb <= rss_bar_kb


def summary_table(cases: list[Case], args: argparse.Namespace) -> str:
    d = int(args.duration)
    rows = [
        [
            "server",
            "client SO_RCVBUF (effective)",
            "CPU % 0–1 s",
            f"CPU % 1–{d} s",
            "quiet from s",
            "RSS growth KB",
            f"… 1–{d} s",
            "client read B",
            "client kernel buffer B",
            "server Send-Q B",
            "sum B",
            "events",
            "busy after close s",
            "other load %",
            f"bar (≤ {args.cpu_bar:g} %, ≤ {args.rss_bar_kb} KB)",
        ]
    ]
    for c in cases:
        eff = str(c.rcvbuf_effective_start)
        if c.rcvbuf_effective_end != c.rcvbuf_effective_start:
            eff += f"→{c.rcvbuf_effective_end}"
        idle = c.idle
        busy = (
            "—"
            if idle is None
            else (f"> {args.idle_cap:g}" if idle.cpu_idle_after_s is None else f"{idle.cpu_idle_after_s:.2f}")
        )
        rows.append(
            [
                c.server,
                f"{c.rcvbuf} ({eff})",
                f"{c.cpu_pct_first_s:.0f}",
                f"{c.cpu_pct_after_first_s:.1f}",
                f"> {d}" if c.quiet_from_s is None else str(c.quiet_from_s),
                f"{c.rss_growth_kb:+d}",
                f"{c.rss_growth_after_first_s_kb:+d}",
                str(c.client_read_bytes),
                str(c.client_unread_bytes),
                _s(c.server_send_q_bytes, "d"),
                str(c.client_read_bytes + c.client_unread_bytes + (c.server_send_q_bytes or 0)),
                str(c.events_delivered),
                busy,
                f"{c.other_cpu_pct:.0f}",
                "pass" if meets_bar(c, args) else "fail",
            ]
        )
    return markdown_table(rows)


def per_second_table(cases: list[Case]) -> str:
    n = max(len(c.per_second_cpu_pct) for c in cases)
    rows = [["server", "SO_RCVBUF", *[f"{i}–{i + 1}" for i in range(n)]]]
    for c in cases:
        rows.append([c.server, c.rcvbuf, *[f"{p:.0f}" for p in c.per_second_cpu_pct]])
    return markdown_table(rows)


def result_notes(cases: list[Case], args: argparse.Namespace) -> list[str]:
    notes = []
    for c in cases:
        label = f"{c.server}, SO_RCVBUF {c.rcvbuf}"
        if c.other_cpu_pct > args.other_load_warn:
            notes.append(
                f"{label}: other processes used {c.other_cpu_pct:.0f} % of a core during the read: "
                "the server competed for the cores; rerun on an idle machine"
            )
        if not c.status_line.startswith("HTTP/1.1 200"):
            notes.append(f"{label}: response began {c.status_line!r}, not HTTP/1.1 200")
        if c.server_closed_at_s is not None:
            notes.append(f"{label}: the server ended the response at {c.server_closed_at_s:.1f} s")
        if c.idle is not None:
            if c.idle.cpu_idle_after_s is None:
                notes.append(f"{label}: still busy {args.idle_cap:g} s after the client closed")
            elif c.idle.cpu_idle_after_s > 1.0:
                notes.append(
                    f"{label}: kept computing {c.idle.cpu_idle_after_s:.1f} s after the client closed "
                    f"({c.idle.cpu_s:.1f} CPU s)"
                )
            if c.server == TRIOSERVE and c.idle.health_drained_after_s is None:
                notes.append(f"{label}: /health still showed work {args.idle_cap:g} s after the close")
        if c.health_at_end is not None:
            h = c.health_at_end
            notes.append(
                f"{label}: /health at {args.duration:g} s: active_streams {h.get('active_streams')}, "
                f"slots_in_use {h.get('slots_in_use')}, inference_threads {h.get('inference_threads')}"
            )
    return notes


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_threads(p)
    p.add_argument("--ctx-size", type=int, default=4096, help="context size (default: 4096)")
    p.add_argument("--max-tokens", type=int, default=3000, help="tokens requested (default: 3000)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--duration", type=int, default=10, help="seconds of slow reading (default: 10)")
    p.add_argument("--read-bytes", type=int, default=64, help="bytes per read (default: 64)")
    p.add_argument("--read-interval", type=float, default=0.25, help="seconds between reads (default: 0.25)")
    p.add_argument(
        "--rcvbuf",
        type=int,
        default=16384,
        help="the small client SO_RCVBUF, set before connect (default: 16384)",
    )
    p.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help=f"comma-separated subset of {','.join(SERVERS)} (default: both)",
    )
    p.add_argument(
        "--cpu-bar", type=float, default=5.0, help="CPU %% of one core after the first second (default: 5)"
    )
    p.add_argument("--rss-bar-kb", type=int, default=1024, help="RSS growth bar in KB (default: 1024)")
    p.add_argument(
        "--other-load-warn",
        type=float,
        default=20.0,
        help="flag cases where other processes used more CPU %% (default: 20)",
    )
    p.add_argument(
        "--idle-window", type=float, default=0.5, help="quiet seconds that count as idle (default: 0.5)"
    )
    p.add_argument("--idle-cap", type=float, default=20.0, help="most seconds to wait for idle (default: 20)")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to connect and send (default: 10)"
    )
    add_ready_timeout(p)
    p.add_argument("--out", type=Path, help="write config, every case and its samples to this JSON file")
    p.add_argument("--markdown", action="store_true", help="also print per-second CPU %% as a markdown table")
    args = p.parse_args(argv)
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.server_list or any(s not in SERVERS for s in args.server_list):
        p.error(f"--servers: choose from {', '.join(SERVERS)}")
    if args.duration < 2 or args.read_bytes < 1 or args.read_interval <= 0 or args.threads < 1:
        p.error("need --duration >= 2, --read-bytes >= 1, --read-interval > 0, --threads >= 1")
    return args


def config(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    def sysctl(name: str) -> str | None:
        try:
            return Path("/proc/sys/" + name.replace(".", "/")).read_text().strip()
        except OSError:
            return None

    return {
        "model": str(model),
        "prompt": args.prompt,
        "threads": args.threads,
        "ctx_size": args.ctx_size,
        "max_tokens": args.max_tokens,
        "duration_s": args.duration,
        "read_bytes": args.read_bytes,
        "read_interval_s": args.read_interval,
        "small_rcvbuf": args.rcvbuf,
        "servers": args.server_list,
        "net.ipv4.tcp_rmem": sysctl("net.ipv4.tcp_rmem"),
        "net.ipv4.tcp_wmem": sysctl("net.ipv4.tcp_wmem"),
        **environment(kernel=True),
    }


def describe(c: Case) -> str:
    idle = c.idle
    busy = "?" if idle is None or idle.cpu_idle_after_s is None else f"{idle.cpu_idle_after_s:.2f} s"
    return (
        f"{c.server:<12} rcvbuf {c.rcvbuf:>7}: CPU {c.cpu_pct_first_s:5.0f} % then "
        f"{c.cpu_pct_after_first_s:5.1f} %, RSS {c.rss_growth_kb:+d} KB, read {c.client_read_bytes} B, "
        f"client buffer {c.client_unread_bytes} B, "
        f"Send-Q {c.server_send_q_bytes} B, {c.events_delivered} events, busy after close {busy}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    cfg = config(args, model)
    log(f"config: {json.dumps(cfg)}")
    servers: list[ServerProcess] = []
    cases: list[Case] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-") as log_dir,
        httpx.Client(timeout=httpx.Timeout(10.0, read=120.0)) as client,
        stopping(servers),
    ):
        start_servers(
            servers,
            model,
            Path(log_dir),
            threads=args.threads,
            ctx_size=args.ctx_size,
            names=[name for name in SERVERS if name in args.server_list],
        )
        for server in servers:
            server.wait_ready(client, args.ready_timeout)
        log("servers ready: " + ", ".join(f"{s.name} {s.base_url}" for s in servers))
        for server in servers:
            warm_up(server, client, args)
            idle = wait_idle(server, client, time.perf_counter(), args)
            log(f"{server.name}: warmed up, idle after {_s(idle.cpu_idle_after_s, '.2f', '?')} s")
            for rcvbuf in (None, args.rcvbuf):
                case = run_case(server, rcvbuf, client, args)
                cases.append(case)
                log(describe(case))
    cfg["loadavg_end"] = os.getloadavg()
    return {"config": cfg, "notes": result_notes(cases, args), "cases": [asdict(c) for c in cases]}


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cfg = result["config"]
    cases = [Case(**{**c, "idle": IdleWait(**c["idle"]) if c["idle"] else None}) for c in result["cases"]]
    print(
        f"{Path(cfg['model']).name}, prompt {cfg['prompt']!r}, max_tokens {cfg['max_tokens']}, "
        f"{cfg['threads']} threads, ctx {cfg['ctx_size']}; client reads {cfg['read_bytes']} B every "
        f"{cfg['read_interval_s']:g} s for {cfg['duration_s']} s; tcp_rmem {cfg['net.ipv4.tcp_rmem']}; "
        f"llama-cpp-python {cfg['llama_cpp_python']}, {cfg['cpu_count']} CPUs, load "
        f"{cfg['loadavg_start'][0]:.2f}→{cfg['loadavg_end'][0]:.2f}\n"
    )
    print(summary_table(cases, args))
    if args.markdown:
        print("\nserver CPU % of one core, per second of the read:\n")
        print(per_second_table(cases))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
