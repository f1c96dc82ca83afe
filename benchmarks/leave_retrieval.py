"""A client that leaves mid-rerank, mid-infill or mid-image-encode: how soon the server's
CPU is idle.

Each case: the server as a process (2 threads), one request on a raw socket, closed
once the server has spent ``--busy`` seconds of CPU on it (the work is running, not
queued), then the time from the close until the process is idle (no CPU and no
run-queue wait for 100 ms: ``benchmarks/harness/proc.py``). Cases:

- ``rerank yes-no``: trioserve, the default Gemma 3 270M with ``--rerank yes-no``,
  400 documents (llama-server has no yes/no reranking of a generative model);
- ``rerank cross-encoder``: the tiny BERT reranker of ``tests/_models.py``, 1,000
  documents, trioserve and llama-server ``--reranking``;
- ``infill``: ``/infill`` with a long prefix (~3,000 tokens of code) on the default
  model with FIM tokens named (``tests/_models.py``), trioserve and llama-server.

    python benchmarks/leave_retrieval.py --reps 5 [--case "image encode"] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.proc import cpu_seconds, wait_cpu_idle
from benchmarks.harness.servers import LLAMA_SERVER, TRIOSERVE, Server, command, free_port
from tests._models import fim_model, tiny_reranker
from tests._vision_model import heavy_gemma3_projector, png_bytes, wide_gemma3_projector
from trioserve import default_model_path

DOCUMENT = "The river runs past the old market and under the stone bridge, towards the sea"
CODE = "".join(f"def function_{i}(value):\n    return value * {i} + {i % 7}\n\n\n" for i in range(150))


def post(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def image_chat(rep: int) -> dict[str, Any]:
    """A chat about a new image each time (a colour of its own: nothing cached)."""
    image = base64.b64encode(png_bytes(64, 64, (rep * 37 % 256, 90, 200 - rep))).decode()
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the picture?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                ],
            }
        ],
        "max_tokens": 32,
        "temperature": 0,
    }


def leave_once(server: Server, path: str, body: dict[str, Any], busy: float) -> dict[str, Any]:
    idle = wait_cpu_idle(server.pid, time.perf_counter(), cap=30)
    if idle.after_s is None:
        raise RuntimeError(f"{server.name} never went idle before the request")
    before = cpu_seconds(server.pid)
    sock = post(server.port, path, body)
    give_up = time.perf_counter() + 60
    while cpu_seconds(server.pid) - before < busy:
        if time.perf_counter() > give_up:
            raise RuntimeError(f"{server.name} spent no CPU on the request")
        time.sleep(0.002)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # (an RST, as a client that is killed or gives up sends)
    closed = time.perf_counter()
    idle = wait_cpu_idle(server.pid, closed, cap=30)
    return {
        "idle_after_ms": None if idle.after_s is None else idle.after_s * 1000,
        "cpu_after_close_ms": idle.cpu_s * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--busy", type=float, default=0.15, help="CPU seconds spent before the client leaves")
    p.add_argument("--json", type=Path)
    p.add_argument("--case", action="append", default=[], help="run only these cases (repeatable)")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-leave-retrieval-"))
    documents = [f"{DOCUMENT} ({i})." for i in range(1000)]
    cases: list[tuple[str, str, Path, list[str], str, dict[str, Any]]] = [
        (
            "rerank yes-no",
            TRIOSERVE,
            default_model_path(progress=False),
            ["--rerank", "yes-no"],
            "/v1/rerank",
            {"query": "Where does the river run?", "documents": documents[:400]},
        ),
        *(
            (
                "rerank cross-encoder",
                name,
                tiny_reranker(),
                extra,
                "/v1/rerank",
                {"query": "where does the river run", "documents": documents},
            )
            for name, extra in ((TRIOSERVE, []), (LLAMA_SERVER, ["--reranking"]))
        ),
        *(
            (
                "infill",
                name,
                fim_model("plain"),
                [],
                "/infill",
                {"input_prefix": CODE, "input_suffix": "\n", "n_predict": 64, "cache_prompt": False},
            )
            for name in (TRIOSERVE, LLAMA_SERVER)
        ),
        *(
            (
                case,
                name,
                default_model_path(progress=False),
                ["--mmproj", str(projector())]
                + (["--no-jinja", "--chat-template", "gemma"] if name == LLAMA_SERVER else []),
                "/v1/chat/completions",
                {},
            )
            for case, projector in (
                ("image encode", heavy_gemma3_projector),
                ("image encode (wide)", wide_gemma3_projector),
            )
            for name in (TRIOSERVE, LLAMA_SERVER)
        ),
    ]
    results: list[dict[str, Any]] = []
    for case, name, model, extra, path, body in cases:
        if args.case and case not in args.case:
            continue
        port = free_port()
        argv = command(name, model, port, threads=2, ctx_size=4096, extra=extra)
        server = Server(name, argv, port, logs, logs / f"{case.replace(' ', '-')}-{name}.log")
        try:
            server.wait_ready(timeout=180)
            samples = [
                leave_once(server, path, body or image_chat(rep), args.busy) for rep in range(args.reps)
            ]
        finally:
            server.proc.terminate()
            server.proc.wait(timeout=30)
        idle = [s["idle_after_ms"] for s in samples if s["idle_after_ms"] is not None]
        row = {
            "case": case,
            "server": name,
            "idle_after_ms_median": statistics.median(idle) if idle else None,
            "idle_after_ms_max": max(idle) if idle else None,
            "never_idle": len(samples) - len(idle),
            "cpu_after_close_ms_median": statistics.median(s["cpu_after_close_ms"] for s in samples),
            "samples": samples,
        }
        results.append(row)
        print(
            f"{case:22s} {name:13s} idle after close: median {row['idle_after_ms_median']:.0f} ms, "
            f"max {row['idle_after_ms_max']:.0f} ms; "
            f"CPU after close {row['cpu_after_close_ms_median']:.0f} ms",
            flush=True,
        )
    if args.json:
        args.json.write_text(
            json.dumps({"busy_s": args.busy, "reps": args.reps, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
