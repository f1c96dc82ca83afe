"""Server launchers, and :class:`Server`: a server subprocess with its log.

Names, in every result: ``trioserve``; ``llama-cpp-python`` (its ``llama_cpp.server``);
``llama-server`` (llama.cpp's C++ server, with its defaults as a new user runs it:
``llama-server -m MODEL --port P``, threads given); ``llama-server-matched`` (the same,
with trioserve's context per sequence, slots, non-unified KV cache and no prompt cache).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from .cli import log

TRIOSERVE, LLAMA_CPP_PYTHON, LLAMA_SERVER = "trioserve", "llama-cpp-python", "llama-server"
MATCHED = "llama-server-matched"
LABELS = {LLAMA_SERVER: "llama-server (defaults)", MATCHED: "llama-server (matched)"}
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def kind(name: str) -> str:
    """The server program behind a contestant's name."""
    return next((k for k in (LLAMA_CPP_PYTHON, LLAMA_SERVER, TRIOSERVE) if name.startswith(k)), name)


def trioserve_command(port: int, *options: str) -> list[str]:
    """``trioserve serve`` on ``port``; its context is 4,096 tokens per sequence unless
    ``options`` say (the default, ``auto``, would size it to this machine's memory: a
    run's figures would depend on it)."""
    pinned = (
        ()
        if any(o == "--ctx-size" or o.startswith("--ctx-size=") for o in options)
        else ("--ctx-size", "4096")
    )
    return [
        sys.executable,
        "-m",
        "trioserve",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *pinned,
        *options,
    ]


def llama_server_binary() -> str:
    """``$TRIOSERVE_LLAMA_SERVER``, else built once (and cached) by ``scripts/build-llama-server``."""
    if given := os.environ.get("TRIOSERVE_LLAMA_SERVER"):
        return given
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(REPO / "scripts" / "build-llama-server")], check=True, capture_output=True, text=True, env=env
    )
    return done.stdout.strip().splitlines()[-1]


def command(
    name: str,
    model: Path,
    port: int,
    *,
    threads: int,
    ctx_size: int,
    slots: int = 1,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of a contestant called ``name`` (see the module doc), then ``extra``."""
    t, where = str(threads), ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    if kind(name) == TRIOSERVE:
        return trioserve_command(
            port, "--model", str(model), "--threads", t, "--ctx-size", str(ctx_size), *extra
        )
    if kind(name) == LLAMA_CPP_PYTHON:
        options = ["--n_ctx", str(ctx_size), "--n_threads", t, "--n_threads_batch", t, "--flash_attn", "True"]
        options += ["--logits_all", "False", "--interrupt_requests", "False", *extra, "--verbose", "False"]
        return [sys.executable, "-m", "llama_cpp.server", *where, *options]
    matched = ["--ctx-size", str(ctx_size * slots), "--parallel", str(slots), "--no-kv-unified"]
    matched.append("--no-cache-prompt")
    options = [*where, "--threads", t, "--threads-batch", t, *(matched if name == MATCHED else ()), *extra]
    return [llama_server_binary(), *options]


class Server:
    """A server subprocess on 127.0.0.1:``port``, its output in ``log_path`` (default:
    ``log_dir``/``name``.log)."""

    def __init__(
        self, name: str, argv: list[str], port: int, log_dir: Path, log_path: Path | None = None
    ) -> None:
        self.name, self.command, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path or log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )

    @classmethod
    def start(cls, name: str, model: Path, log_dir: Path, **settings: Any) -> Server:
        """The contestant ``name`` on a free port (``settings``: those of :func:`command`)."""
        port = free_port()
        return cls(name, command(name, model, port, **settings), port, log_dir)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Poll until the server answers 200 (its model loaded): ``/health``, or ``/v1/models``
        for llama-cpp-python."""
        path = "/v1/models" if kind(self.name) == LLAMA_CPP_PYTHON else "/health"
        give_up = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < give_up:
                self.check_alive()
                try:
                    if client.get(self.url + path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def health(self) -> dict[str, Any]:
        """trioserve's ``/health``."""
        health: dict[str, Any] = httpx.get(self.url + "/health", timeout=5.0).json()
        return health

    def wait_drained(
        self, cap: float, gauges: Sequence[str] = ("generations_running", "slots_in_use")
    ) -> float | None:
        """Seconds until trioserve's ``/health`` shows every gauge 0; ``None`` after ``cap``."""
        started = time.perf_counter()
        while time.perf_counter() - started < cap:
            health = self.health()
            if not any(health.get(gauge) for gauge in gauges):
                return time.perf_counter() - started
            time.sleep(0.02)
        return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM, ``grace`` s to exit, then SIGKILL; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode


@contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """On an error (Ctrl-C and SIGTERM too) print each server's log tail; in any case stop
    every server in ``servers`` (which may be filled in inside)."""
    try:
        yield servers
    except BaseException:
        for server in servers:
            log(f"--- {server.name} log (tail) ---\n{server.log_tail()}")
        raise
    finally:
        for server in servers:
            server.stop()
