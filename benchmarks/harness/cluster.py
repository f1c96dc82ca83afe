"""trioserve workers and the Shepherd Model Gateway (SMG) in front of them, as processes:
the gateway benchmark's and tests/e2e/test_gateway.py's (docs/deployment.md)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import httpx

from trioserve._cli._cluster import GATEWAY_FAILOVER

from .servers import Server, free_port, trioserve_command


def smg_binary() -> str:
    """The ``smg`` executable: on PATH, or beside this Python's."""
    return shutil.which("smg") or str(Path(sys.executable).with_name("smg"))


def start_workers(count: int, cache_dir: Path, logs: Path, *flags: str) -> list[Server]:
    """``count`` trioserve workers (``flags``) sharing ``cache_dir``, each ready."""
    workers = []
    for i in range(count):
        port = free_port()
        argv = trioserve_command(port, *flags, "--cache-dir", str(cache_dir))
        workers.append(Server(f"worker{i + 1}", argv, port, logs))
    for worker in workers:
        worker.wait_ready(timeout=300)
    return workers


def start_gateway(workers: list[Server], policy: str, logs: Path) -> Server:
    """SMG in front of ``workers`` with ``policy`` and trioserve cluster's failover
    settings, its metrics on a free port; ready (its ``/v1/models`` answers)."""
    port = free_port()
    argv = [
        smg_binary(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-port",
        str(free_port()),
        *GATEWAY_FAILOVER,
        "--worker-urls",
        *[w.url for w in workers],
    ]
    gateway = Server("smg", argv, port, logs)
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up:
        gateway.check_alive()
        try:
            if httpx.get(gateway.url + "/v1/models", timeout=2).status_code == 200:
                return gateway
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # (another process's readiness: nothing to wait on but its answer)
    raise TimeoutError(f"smg not ready:\n{gateway.log_tail()}")
