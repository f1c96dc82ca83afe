"""``trioserve cluster``: the Shepherd Model Gateway (SMG) in front of N trioserve workers
on one machine, sharing one prompt-cache directory (docs/deployment.md, "Many workers
behind a gateway").

The workers start first (each ``trioserve serve`` on a free local port, with the
``serve`` flags given after ``--`` and ``--cache-dir`` the shared directory); once every
one answers ``/health``, SMG starts (``smg launch --worker-urls … --policy …``). The
command supervises them: SIGINT or SIGTERM stops the gateway first (no new request
reaches a worker), then sends SIGTERM to every worker (each drains its streams: its
``--shutdown-grace``); a child that exits on its own stops the others, and the command
exits 1."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["add_cluster_command", "run_cluster"]

logger = logging.getLogger("trioserve.cluster")

#: SMG's settings for a worker that dies or drains (docs/deployment.md): a failed
#: connection opens the worker's breaker at once, one failed health check (a draining
#: worker's /health is 503) takes it out of the rotation within a second
GATEWAY_FAILOVER = (
    "--cb-failure-threshold",
    "1",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--load-monitor-interval",
    "1",
)

POLICIES = ("cache_aware", "round_robin", "power_of_two", "least_load", "random", "consistent_hashing")


def add_cluster_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = commands.add_parser(
        "cluster",
        help="SMG (the Shepherd Model Gateway) in front of N trioserve workers sharing one cache dir",
        description="Start N trioserve workers and the Shepherd Model Gateway in front of them; flags "
        "after -- go to every worker's `trioserve serve` (docs/deployment.md).",
    )
    cluster.add_argument("--workers", type=int, default=2, help="trioserve workers to start (default: 2)")
    cluster.add_argument("--policy", choices=POLICIES, default="cache_aware", help="SMG's routing policy")
    cluster.add_argument("--host", default="127.0.0.1", help="the gateway's address (default: 127.0.0.1)")
    cluster.add_argument("--port", type=int, default=8080, help="the gateway's port (default: 8080)")
    cluster.add_argument(
        "--cache-dir",
        default="auto",
        help="the prompt-cache directory every worker shares (default: auto, the per-user one)",
    )
    cluster.add_argument(
        "--metrics-port", type=int, default=29000, help="SMG's Prometheus port (default: 29000)"
    )
    cluster.add_argument("--smg", default=None, metavar="PATH", help="the smg executable (default: on PATH)")
    cluster.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for each process to be ready"
    )
    cluster.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `trioserve serve` flags")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _smg(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not os.access(found, os.X_OK):
        raise RuntimeError(
            "smg (the Shepherd Model Gateway) is not installed: pip install smg, or give --smg PATH"
        )
    return found


def _wait_ready(url: str, process: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # (a child process's readiness: nothing to wait on but its answer)
    raise RuntimeError(f"{what} was not ready within {timeout:g} s")


def run_cluster(args: argparse.Namespace) -> int:
    """Start, supervise and stop the cluster (blocking); the exit code."""
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    if args.workers < 1:
        logger.error("--workers must be at least 1, got %d", args.workers)
        return 2
    if any(
        a in ("--port", "--host", "--cache-dir") or a.startswith(("--port=", "--host=")) for a in serve_args
    ):
        logger.error("--port, --host and --cache-dir are the cluster's to set: drop them after --")
        return 2
    try:
        smg = _smg(args.smg)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 2
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        urls = []
        for i in range(args.workers):
            port = _free_port()
            argv = [
                sys.executable,
                "-m",
                "trioserve",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--cache-dir",
                args.cache_dir,
                *serve_args,
            ]
            children.append((f"worker {i + 1} (:{port})", subprocess.Popen(argv)))
            urls.append(f"http://127.0.0.1:{port}")
        for (what, process), url in zip(children, urls, strict=True):
            _wait_ready(url + "/health", process, what, args.ready_timeout)
        gateway = [
            smg,
            "launch",
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--policy",
            args.policy,
            "--prometheus-port",
            str(args.metrics_port),
            *GATEWAY_FAILOVER,
        ]
        children.insert(0, ("smg", subprocess.Popen([*gateway, "--worker-urls", *urls])))
        _wait_ready(f"http://127.0.0.1:{args.port}/health", children[0][1], "smg", args.ready_timeout)
        logger.info(
            "gateway on http://%s:%d (%s) in front of %s; cache dir %s",
            args.host,
            args.port,
            args.policy,
            ", ".join(urls),
            args.cache_dir,
        )
        code = 0
        while not stopping:
            exited = [(what, p.returncode) for what, p in children if p.poll() is not None]
            if exited:
                logger.error("%s exited with code %s: stopping the cluster", *exited[0])
                code = 1
                break
            time.sleep(0.2)  # (supervising child processes: polled, a few times a second)
        return code
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        _stop(children)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """The gateway first, then the workers (SIGTERM: each drains), then whatever is left."""
    for what, process in children:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            if what == "smg":
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
    for _, process in children:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
