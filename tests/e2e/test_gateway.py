"""trioserve workers behind the Shepherd Model Gateway (SMG, ``pip install smg``), as real
processes (docs/deployment.md, "Many workers behind a gateway"):

- ``round_robin`` moves every conversation between two workers at each turn; with one
  shared cache directory each later turn restores its previous prompt from the disk
  tier the other worker wrote, and every reply equals a fresh evaluation's;
- SMG polls the workers' ``/v1/loads`` and takes trioserve's figures;
- a client that leaves at the gateway mid-prefill frees the worker;
- a worker killed with a stream running and a request queued behind it: the stream
  ends with an error the SDK raises, the queued request is answered by the other
  worker, nothing hangs.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.harness.cluster import smg_binary, start_gateway
from benchmarks.harness.cluster import start_workers as launch_workers
from benchmarks.harness.servers import Server, free_port

pytestmark = pytest.mark.model

WORKER = ("--threads", "1", "--ctx-size", "4096", "--speculate", "off")
#: the prompt's last piece is always evaluated again (its logits are needed)
LAST_PIECE = 160


def start_workers(count: int, cache_dir: Path, logs: Path, *extra: str) -> list[Server]:
    if not Path(smg_binary()).exists():
        pytest.fail(
            "smg (the Shepherd Model Gateway) is not installed: pip install smg (the test extra has it)"
        )
    return launch_workers(count, cache_dir, logs, *WORKER, *extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[Server]]]:
    logs = tmp_path_factory.mktemp("gateway-logs")
    workers = start_workers(2, tmp_path_factory.mktemp("shared-cache"), logs, "--slots", "2")
    gateway = None
    try:
        gateway = start_gateway(workers, "round_robin", logs)
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.stop()


def user_text(conversation: int, turn: int) -> str:
    return " ".join(
        f"Part {turn}.{i} of talk {conversation}: how did the keepers of lighthouse {conversation} "
        f"live through the storms of winter {1900 + turn * 10 + i}?"
        for i in range(5)
    )


def chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def model_id(url: str) -> str:
    name: str = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return name


def test_round_robin_turns_restore_their_prompt_from_the_shared_tier(
    cluster: tuple[Server, list[Server]],
) -> None:
    gateway, workers = cluster
    model = model_id(gateway.url)
    # three conversations on two workers: round_robin moves each one at every turn
    histories: list[list[dict[str, str]]] = [[], [], []]
    turns = []
    for turn in range(3):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": user_text(c, turn)})
            body = {"model": model, "messages": history, "max_tokens": 12, "temperature": 0}
            answer = chat(gateway.url, body)
            # the same messages evaluated afresh on a worker: the text a fresh server gives
            fresh = chat(workers[0].url, {**body, "cache_prompt": False})
            assert answer["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            turns.append((c, turn, answer["usage"]))
    previous = {(c, t): usage["prompt_tokens"] for c, t, usage in turns}
    later = [(c, t, usage) for c, t, usage in turns if t > 0]
    for c, t, usage in later:
        assert usage["prompt_tokens_details"]["cached_tokens"] >= previous[(c, t - 1)] - LAST_PIECE, (
            c,
            t,
            usage,
        )
    # round_robin sent each later turn to the other worker: from the disk tier
    from_disk = [usage.get("trioserve", {}).get("cached_tokens", {}).get("disk", 0) for _, _, usage in later]
    assert all(from_disk), from_disk


def test_the_gateway_reads_the_workers_loads(cluster: tuple[Server, list[Server]]) -> None:
    gateway, workers = cluster
    for worker in workers:
        loads = httpx.get(worker.url + "/v1/loads", params={"model": model_id(worker.url)}, timeout=10).json()
        (rank,) = loads["loads"]
        assert rank["max_running_requests"] == 2
        assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == 0
    metrics_port = gateway.command[gateway.command.index("--prometheus-port") + 1]
    give_up = time.monotonic() + 30
    text = ""
    while time.monotonic() < give_up:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        if all("smg_engine_running_requests{" in text and w.url in text for w in workers):
            break
        time.sleep(0.2)  # (the gateway polls once a second)
    lines = [line for line in text.splitlines() if line.startswith("smg_engine_running_requests{")]
    assert {w.url for w in workers} <= {u for line in lines for u in [w.url for w in workers] if u in line}, (
        lines
    )


def _post_raw(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data) + data
    )
    return sock


def test_a_client_that_leaves_at_the_gateway_mid_prefill_frees_the_worker(
    cluster: tuple[Server, list[Server]],
) -> None:
    gateway, workers = cluster
    long = " ".join(
        f"Line {i}: the river passes the mill and the market, then the bridge." for i in range(160)
    )
    body = {"model": model_id(gateway.url), "messages": [{"role": "user", "content": long}], "stream": True}
    sock = _post_raw(gateway.port, {**body, "max_tokens": 8, "cache_prompt": False})
    give_up = time.monotonic() + 60
    busy = None
    while busy is None and time.monotonic() < give_up:
        busy = next((w for w in workers if w.health()["generations_running"]), None)
        time.sleep(0.005)  # (the worker's state, observed from outside)
    assert busy is not None, "no worker started the request"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    left = time.monotonic()
    drained = busy.wait_drained(cap=10)
    assert drained is not None, "the worker kept the request after its client left the gateway"
    print(f"\nworker free {(time.monotonic() - left) * 1000:.0f} ms after the client left the gateway")
    health = busy.health()
    assert health["requests_in_flight"] == 0


def test_a_killed_worker_its_stream_errors_and_its_queued_request_goes_elsewhere(
    tmp_path: Path,
) -> None:
    workers = start_workers(2, tmp_path / "cache", tmp_path, "--slots", "1")
    gateway = None
    try:
        gateway = start_gateway(workers, "round_robin", tmp_path)
        model = model_id(gateway.url)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        forever = {"1": -100, "106": -100}  # (no end of turn: the stream runs until killed)
        # round_robin: the first stream to one worker, a short one to the other, then
        # a plain request that queues behind the first (one slot each)
        long_stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count to a thousand."}],
            max_tokens=3000,
            stream=True,
            logit_bias=forever,
        )
        first = next(iter(long_stream))
        assert first is not None
        holder = next(w for w in workers if w.health()["generations_running"])
        other = next(w for w in workers if w is not holder)
        short = chat(
            gateway.url, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        assert short["choices"][0]["message"]["content"] is not None
        queued_answer: list[dict[str, Any]] = []

        import threading

        def queued() -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": 6,
            }
            queued_answer.append(chat(gateway.url, body))

        thread = threading.Thread(target=queued)
        thread.start()
        give_up = time.monotonic() + 30
        while holder.health()["queued"] == 0 and time.monotonic() < give_up:
            time.sleep(0.005)
        assert holder.health()["queued"] == 1, "the plain request did not queue behind the stream"
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait(timeout=10)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in long_stream:
                pass
        thread.join(timeout=120)
        assert not thread.is_alive(), "the queued request hung"
        assert queued_answer, "the queued request got no answer"
        assert queued_answer[0]["choices"][0]["message"]["content"] is not None
        # and the gateway goes on with the survivor: every later request answered
        for _ in range(4):
            after = chat(
                gateway.url,
                {"model": model, "messages": [{"role": "user", "content": "Bye"}], "max_tokens": 4},
            )
            assert after["choices"][0]["finish_reason"] in ("stop", "length")
        assert other.health()["status"] == "ok"
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.stop()


def test_the_cluster_command_serves_through_smg_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """``trioserve cluster``: SMG and two workers sharing a cache dir, one command."""
    port, metrics = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "trioserve",
        "cluster",
        "--workers",
        "2",
        "--policy",
        "round_robin",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--",
        *WORKER,
    ]
    cluster = Server("cluster", argv, port, tmp_path)
    try:
        give_up = time.monotonic() + 300
        while time.monotonic() < give_up:
            cluster.check_alive()
            try:
                if httpx.get(cluster.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # (another process's readiness: polled)
        body = {
            "model": model_id(cluster.url),
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
        assert chat(cluster.url, body)["choices"][0]["finish_reason"] == "length"
        cluster.proc.send_signal(signal.SIGINT)
        assert cluster.proc.wait(timeout=60) == 0
    finally:
        cluster.stop()
    log = cluster.log_text()
    assert "gateway on http://127.0.0.1:" in log
    assert log.count("trioserve.server: stopped") == 2  # (both workers drained and stopped)
