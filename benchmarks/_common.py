"""Helpers shared by the benchmark scripts ``bench_*.py`` in this folder.

Each script stays runnable on its own (``python benchmarks/bench_<name>.py``) and imports
this module by name, with its own folder on ``sys.path``. What lives here is what the
scripts had in common, unchanged in behaviour:

* the command line: the parser with ``--model``, the options every script words alike,
  resolving the model, the versions and machine facts in a result's config, ``main``'s
  scaffolding (SIGTERM → ``SystemExit``, the JSON file, the notes);
* the servers: free ports, the ``trioserve serve`` and ``python -m llama_cpp.server``
  command lines, :class:`ServerProcess` (start, readiness polling, log tail, stop), and
  :func:`stopping`, which prints the logs' tails on error and always stops the servers;
* HTTP: a raw ``POST /v1/completions`` request, and an httpx SSE reader with per-chunk
  timing (:class:`TimedStream`);
* ``/proc``: CPU time of a process and of the whole machine, a process's thread ids;
* markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

TRIOSERVE, LLAMA_SERVER = "trioserve", "llama-server"
#: llama.cpp's own C++ llama-server (what Ollama runs), built by scripts/build-llama-server
#: from the llama.cpp that llama-cpp-python vendors. ("llama-server" above is, in the
#: older scripts, llama-cpp-python's server.)
LLAMA_CPP = "llama.cpp"
SERVERS = (TRIOSERVE, LLAMA_SERVER)
#: the path that answers 200 once the server has loaded its model
READY_PATHS = {TRIOSERVE: "/health", LLAMA_SERVER: "/v1/models", LLAMA_CPP: "/health"}
DEFAULT_PROMPT = "Once upon a time"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- command line


def log(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser described by the first line of the script's docstring, with ``--model``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    p.add_argument("--model", type=Path, help="GGUF file (default: trioserve's default, Gemma 3 270M)")
    return p


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="threads for decode and prefill (default: 2)")


def add_request_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds one completion may take (default: 300)"
    )


def add_ready_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds a server may take to load")


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model``, checked to exist; without it trioserve's default model (downloaded once)."""
    if args.model is None:
        from trioserve import default_model_path

        return default_model_path(progress=False)
    model: Path = args.model.resolve()
    if not model.is_file():
        raise SystemExit(f"model file not found: {model}")
    return model


def environment(*, kernel: bool = False) -> dict[str, Any]:
    """The versions and machine facts that end every result's config, in this order
    (``kernel``: also the kernel release, after the Python version)."""
    from importlib.metadata import version

    import llama_cpp

    env: dict[str, Any] = {
        "llama_cpp_python": llama_cpp.__version__,
        "trioserve": version("trioserve"),
        "python": platform.python_version(),
    }
    if kernel:
        env["kernel"] = platform.release()
    env["cpu_count"] = os.cpu_count()
    env["loadavg_start"] = os.getloadavg()
    return env


def _sigterm(_signo: int, _frame: object) -> None:
    raise SystemExit(143)  # unwind through the finally blocks: the servers get stopped


def bench_main(
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[dict[str, Any], argparse.Namespace], None],
    *,
    to_json: Callable[[Any], Any] = lambda result: result,
) -> int:
    """A script's ``main``: parse, ``run``, write ``to_json(result)`` to ``--out`` if given,
    print the ``report`` and then the result's ``notes``; SIGTERM exits like Ctrl-C, through
    the ``finally`` blocks that stop the servers."""
    signal.signal(signal.SIGTERM, _sigterm)
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(to_json(result), indent=2) + "\n")
        log(f"wrote {args.out}")
    report(result, args)
    for note in result["notes"]:
        print(f"\nnote: {note}")
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


# ---------------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (as of now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _model_and_address(model: Path, port: int) -> list[str]:
    """The options both servers spell alike: the GGUF file, and listening on 127.0.0.1:``port``."""
    return ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]


def trioserve_command(model: Path, port: int, threads: int, ctx_size: int, *extra: str) -> list[str]:
    """``trioserve serve`` on 127.0.0.1:``port`` (the venv's script, else ``-m``), then ``extra``."""
    exe = Path(sys.executable).with_name("trioserve")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "trioserve._cli"]
    return [
        *launcher,
        "serve",
        *_model_and_address(model, port),
        "--threads",
        str(threads),
        "--ctx-size",
        str(ctx_size),
        *extra,
    ]


def llama_server_command(
    model: Path, port: int, threads: int, ctx_size: int, *extra: str, flash_attn: bool = True
) -> list[str]:
    """``python -m llama_cpp.server`` on 127.0.0.1:``port``, ``threads`` for decode and batch,
    ``--logits_all False`` (its default keeps every position's logits), ``extra`` and
    ``--verbose False``."""
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        *_model_and_address(model, port),
        "--n_ctx",
        str(ctx_size),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--flash_attn",
        str(flash_attn),
        "--logits_all",
        "False",
        *extra,
        "--verbose",
        "False",
    ]


def llama_cpp_server_binary() -> str:
    """The llama.cpp ``llama-server`` binary: ``$TRIOSERVE_LLAMA_SERVER``, else built (once,
    cached) by ``scripts/build-llama-server``."""
    given = os.environ.get("TRIOSERVE_LLAMA_SERVER")
    if given:
        return given
    script = Path(__file__).resolve().parent.parent / "scripts" / "build-llama-server"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(script)], check=True, capture_output=True, text=True, env=env)
    return done.stdout.strip().splitlines()[-1]


def llama_cpp_server_command(model: Path, port: int, threads: int, *extra: str) -> list[str]:
    """llama.cpp's ``llama-server`` with its defaults (as a new user runs it: its own
    context size, parallel slots, continuous batching and prompt cache), on 127.0.0.1,
    ``threads`` for decode and batch, then ``extra``."""
    return [
        llama_cpp_server_binary(),
        *_model_and_address(model, port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        *extra,
    ]


class ServerProcess:
    """A server subprocess on 127.0.0.1:``port`` with its log file; :meth:`stop` always
    leaves it dead."""

    def __init__(self, name: str, command: list[str], port: int, ready_path: str, log_dir: Path) -> None:
        self.name = name
        self.command = command
        self.port = port
        self.address = ("127.0.0.1", port)
        self.base_url = f"http://127.0.0.1:{port}"
        self.ready_url = self.base_url + ready_path
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, client: httpx.Client, timeout_s: float) -> None:
        """Poll ``ready_url`` until it answers 200 (the model is loaded)."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            self.check_alive()
            try:
                if client.get(self.ready_url, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def check_alive(self) -> None:
        """Raise, with the log's tail, if the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, 15 s to exit, then SIGKILL; closes the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()


def start_servers(
    servers: list[ServerProcess],
    model: Path,
    log_dir: Path,
    *,
    threads: int,
    ctx_size: int,
    names: Sequence[str] = SERVERS,
    trioserve_extra: Sequence[str] = (),
    flash_attn: bool = True,
) -> None:
    """Launch the ``names`` servers, each on a free port with the same model, ``threads``
    and ``ctx_size``; each is appended to ``servers`` at once, so the caller can stop them."""
    for name in names:
        port = free_port()
        if name == TRIOSERVE:
            command = trioserve_command(model, port, threads, ctx_size, *trioserve_extra)
        else:
            command = llama_server_command(model, port, threads, ctx_size, flash_attn=flash_attn)
        servers.append(ServerProcess(name, command, port, READY_PATHS[name], log_dir))


@contextmanager
def stopping(servers: list[ServerProcess]) -> Iterator[None]:
    """On an error (Ctrl-C and SIGTERM included) print each server's log tail and re-raise;
    in any case stop every server in ``servers`` (which may be filled in inside)."""
    try:
        yield
    except BaseException:
        for server in servers:
            log(f"--- {server.name} log (tail) ---\n{server.log_tail()}")
        raise
    finally:
        for server in servers:
            server.stop()


# ---------------------------------------------------------------------- HTTP


def completion_request(
    host: str, port: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> bytes:
    """The bytes of one HTTP/1.1 ``POST /v1/completions`` with a JSON ``body``, asking for
    an event stream, ``Connection: close``, and ``headers`` last."""
    payload = json.dumps(body).encode()
    head = [
        "POST /v1/completions HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(payload)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


def raw_sse_events(port: int, body: dict[str, Any]) -> Iterator[tuple[float, bytes]]:
    """POST ``body`` to ``/v1/completions`` on 127.0.0.1:``port`` over a raw socket and
    yield ``(arrival time, event)`` for every complete SSE event (``b"data: ..."``, the
    response head and chunk framing included in the first). The lightest client there is
    in Python: no HTTP library, no JSON parsing, so its CPU per token stays small."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(completion_request("127.0.0.1", port, body))
        pending = b""
        while chunk := sock.recv(1 << 20):
            now = time.perf_counter()
            pending += chunk
            *complete, pending = pending.split(b"\n\n")
            for event in complete:
                yield now, event


@dataclass
class Chunk:
    """One streamed event, whatever the contestant."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from a usage chunk


def http_stream(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    deadline_s: float,
    *,
    where: str | None = None,
    body_chars: int = 500,
) -> Iterator[Chunk]:
    """Stream one ``/v1/completions`` request; parse SSE ``data:`` lines.

    Errors start with ``where`` (default ``"POST <url>: "``) and quote at most ``body_chars``
    of an error response."""
    where = f"POST {url}: " if where is None else where
    give_up = time.monotonic() + deadline_s
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{where}HTTP {response.status_code}: {response.text[:body_chars]}")
        for line in response.iter_lines():
            if time.monotonic() > give_up:
                raise TimeoutError(f"{where}no end of stream after {deadline_s:.0f} s")
            if not line.startswith("data:"):
                continue  # blank separators, ": ping" comments
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            usage = event.get("usage") or {}
            for choice in event.get("choices") or [{}]:
                yield Chunk(
                    text=choice.get("text") or "",
                    finish_reason=choice.get("finish_reason"),
                    completion_tokens=usage.get("completion_tokens"),
                )


class TimedStream:
    """One streamed completion as it arrives, timed with ``time.perf_counter``: the call
    (when this object is made), the first and the last chunk with text, and the end
    (:meth:`end`); also the texts, the last ``finish_reason`` and ``usage.completion_tokens``."""

    def __init__(self) -> None:
        self.t_call = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.t_end = self.t_call
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.usage_tokens: int | None = None

    def read(self, chunks: Iterable[Chunk]) -> None:
        """Consume ``chunks``; if they raise, what arrived until then stays recorded."""
        for chunk in chunks:
            now = time.perf_counter()
            if chunk.text:
                if self.t_first is None:
                    self.t_first = now
                self.t_last = now
                self.texts.append(chunk.text)
            self.finish_reason = chunk.finish_reason or self.finish_reason
            if chunk.completion_tokens is not None:
                self.usage_tokens = chunk.completion_tokens

    def end(self) -> None:
        self.t_end = time.perf_counter()

    def tokens(self, max_tokens: int) -> tuple[int, str]:
        """The completion's token count and where it came from: ``usage.completion_tokens``
        when the stream carried it; else ``max_tokens`` when ``finish_reason`` is
        ``"length"`` (exact by definition); else the number of chunks with text."""
        if self.usage_tokens is not None:
            return self.usage_tokens, "usage"
        if self.finish_reason == "length":
            return max_tokens, "finish_reason=length"
        return len(self.texts), "text chunks"


# ---------------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads, also those that exited), in
    seconds: fields 14 and 15 of ``/proc/<pid>/stat``, in clock ticks."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()  # fields 3… (comm may hold spaces)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_ids(pid: int) -> list[str]:
    """The ids of the process's live threads (``/proc/<pid>/task``); none once it is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def system_busy_seconds() -> float:
    """CPU time all cores spent busy (not idle, not waiting for I/O), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


# ---------------------------------------------------------------------- output


def markdown_table(rows: list[list[str]]) -> str:
    """``rows[0]`` is the header; columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |" for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
