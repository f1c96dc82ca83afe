"""A client leaving mid-encode of a 30-second clip (issue 52): how soon the server's CPU is
idle, trioserve beside llama-server on the same files.

Both serve the default Gemma 3 270M with the heavy random-weight ultravox projector of
``tests/_audio_model.py`` (:data:`HEAVY`: 8 encoder layers of 512; a 30-second chunk's
encode takes seconds on 2 cores), ``--threads`` each. Each run sends a streamed
``POST /v1/chat/completions`` holding one ``input_audio`` WAV part: 30 seconds of a tone
(16 kHz mono; libmtmd counts 3,001 mel frames: two chunks, the second nearly all
silence), its pitch new in every run (no cache holds it). The client waits until the
server's process has used ``--close-cpu`` CPU-seconds since the send (``/proc/PID/stat``,
sampled every ~1 ms: the clip's decode, its mel spectrogram and the text before it take a
small part of that; the rest is the first chunk's encode), closes the connection (an RST
by default), and measures how long until the server's CPU is idle (the harness's rule,
``benchmarks/harness/proc.py``: the next 100 ms add under 5 % of a core) and the CPU-time
it used after the close. trioserve's ``/health`` counts the encodes the cancel stopped
(``aborted_encodes``). Then one more question about a clip whose encode was finished
(trioserve only): its ``encodes`` count must not move (the cells were cached).

    python benchmarks/cancel_audio.py --reps 5 --markdown
    python benchmarks/cancel_audio.py --contestants trioserve --reps 3 --json artifacts/cancel_audio.json
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import servers
from benchmarks.harness.clients import RawStream
from benchmarks.harness.proc import cpu_seconds, wait_cpu_idle
from benchmarks.harness.stats import dist, fmt
from tests._audio_model import HEAVY, heavy_ultravox_projector, sine_wav
from trioserve import default_model_path

TS, LS = servers.TRIOSERVE, servers.LLAMA_SERVER
CHAT = "/v1/chat/completions"
#: Gemma's turn format (the base model has no template of its own; tests/e2e/test_audio.py)
GEMMA_TEMPLATE = (
    "{%- for message in messages -%}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\\n' + message['content'] + '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def chat(clip: bytes, *, stream: bool, max_tokens: int = 4) -> dict[str, Any]:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
    text = {"type": "text", "text": "What do you hear?"}
    return {
        "messages": [{"role": "user", "content": [text, part]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def start(name: str, projector: Path, folder: Path, threads: int) -> servers.Server:
    extra = ["--mmproj", str(projector)]
    if name == LS:
        template = folder / "gemma.jinja"
        template.write_text(GEMMA_TEMPLATE)
        extra += ["--jinja", "--chat-template-file", str(template), "--parallel", "1"]
    else:
        extra += ["--max-audio-seconds", "60"]
    model = default_model_path()
    server = servers.Server.start(name, model, folder, threads=threads, ctx_size=4096, extra=extra)
    server.wait_ready(timeout=300)
    return server


def encodes(server: servers.Server) -> dict[str, Any]:
    """trioserve's projector counters, from ``/health``."""

    def find(node: Any) -> dict[str, Any] | None:
        if isinstance(node, dict):
            if "aborted_encodes" in node:
                return node
            for value in node.values():
                if (found := find(value)) is not None:
                    return found
        return None

    return find(server.health()) or {}


def one_run(server: servers.Server, clip: bytes, args: argparse.Namespace) -> dict[str, Any]:
    pid = server.proc.pid
    wait_cpu_idle(pid, time.perf_counter(), 120)  # (the previous run's work, if any)
    before = encodes(server) if server.name == TS else {}
    cpu_at_send = cpu_seconds(pid)
    stream = RawStream(server.port, chat(clip, stream=True, max_tokens=64), path=CHAT)
    give_up = stream.sent_at + 120
    while cpu_seconds(pid) - cpu_at_send < args.close_cpu and time.perf_counter() < give_up:
        if not stream.receive(time.perf_counter() + 0.001) and stream.eof:
            time.sleep(0.001)
    events = len(stream.events)
    closed = stream.close(args.close)
    idle = wait_cpu_idle(pid, closed, args.idle_cap)
    run: dict[str, Any] = {
        "server": server.name,
        "events_before_close": events,
        "close_after_ms": (closed - stream.sent_at) * 1e3,
        "cpu_before_close_ms": (idle.cpu_at_start - cpu_at_send) * 1e3,
        "idle_ms": math.inf if idle.after_s is None else idle.after_s * 1e3,
        "cpu_after_close_ms": idle.cpu_s * 1e3,
    }
    if server.name == TS:
        after = encodes(server)
        run["encodes"] = after.get("encodes", 0) - before.get("encodes", 0)
        run["aborted_encodes"] = after.get("aborted_encodes", 0) - before.get("aborted_encodes", 0)
    return run


def second_question(server: servers.Server, clip: bytes) -> dict[str, Any]:
    """The clip asked about whole, then again: the second answer encodes nothing."""
    with httpx.Client(base_url=server.url, timeout=600) as client:
        first = encodes(server)
        answer = client.post(CHAT, json=chat(clip, stream=False))
        answer.raise_for_status()
        middle = encodes(server)
        again = client.post(CHAT, json=chat(clip, stream=False))
        again.raise_for_status()
        last = encodes(server)
    return {
        "first_encodes": middle["encodes"] - first["encodes"],
        "second_encodes": last["encodes"] - middle["encodes"],
        "second_cached_tokens": again.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        "prompt_tokens": again.json()["usage"]["prompt_tokens"],
    }


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--contestants", default=f"{TS},{LS}")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0, help="the clip's length")
    parser.add_argument("--close-cpu", type=float, default=1.0, help="CPU-s the server uses before the close")
    parser.add_argument("--close", choices=["rst", "fin"], default="rst")
    parser.add_argument("--idle-cap", type=float, default=120.0)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    projector = heavy_ultravox_projector()
    names = args.contestants.split(",")
    config = vars(args) | {"json": None}
    results: dict[str, Any] = {"projector": {**HEAVY, "path": str(projector)}, "config": config}
    with tempfile.TemporaryDirectory(prefix="cancel-audio-") as tmp:
        for name in names:
            folder = Path(tmp) / name
            folder.mkdir()
            server = start(name, projector, folder, args.threads)
            try:
                runs = []
                for i in range(args.reps):
                    clip = sine_wav(args.seconds, 300.0 + 37.0 * i + (1000.0 if name == LS else 0.0))
                    runs.append(one_run(server, clip, args))
                    print(json.dumps(runs[-1]), file=sys.stderr)
                results[name] = {"runs": runs, "idle_ms": dist([r["idle_ms"] for r in runs])}
                if name == TS:
                    results[name]["second_question"] = second_question(server, sine_wav(args.seconds, 250.0))
            finally:
                server.stop(grace=10)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.markdown:
        print("| server | runs | CPU-s before the close | idle after the close: p50 | max |", end="")
        print(" CPU after the close (p50) |")
        print("|---|---|---|---|---|---|")
        for name in names:
            runs = results[name]["runs"]
            idle = sorted(r["idle_ms"] for r in runs)
            after = sorted(r["cpu_after_close_ms"] for r in runs)
            before = sorted(r["cpu_before_close_ms"] for r in runs)
            print(
                f"| {name} | {len(runs)} | {fmt(before[len(before) // 2] / 1e3, '.2f')} | "
                f"{fmt(idle[len(idle) // 2], '.0f')} ms | {fmt(idle[-1], '.0f')} ms | "
                f"{fmt(after[len(after) // 2], '.0f')} ms |"
            )
        if TS in results:
            print(f"\ntrioserve's second question: {results[TS]['second_question']}")
    else:
        print(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
