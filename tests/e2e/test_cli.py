"""``trioserve serve`` as a process: startup logs, Ctrl-C and SIGTERM exit cleanly."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from .._helpers import ServerProcess
from .._vision_model import tiny_gemma3_projector

pytestmark = pytest.mark.model


def test_startup_logs_and_ctrl_c_exits_zero() -> None:
    with ServerProcess("--threads", "2", "--ctx-size", "2048") as server:
        url = server.wait_ready()
        assert httpx.get(url + "/health").json()["status"] == "ok"
        exit_code = server.stop(signal.SIGINT)
    log = "".join(server.log)
    assert "gemma-3-270m" in log
    assert "context 2048" in log
    assert "2 threads" in log
    assert url.startswith("http://127.0.0.1:")
    assert exit_code == 0
    assert "stopped" in "".join(server.log)


def test_the_default_context_is_sized_to_the_training_length_and_the_memory_and_said_at_start() -> None:
    # (one slot: 32,768 cells of the default model's cache are 0.56 GiB — the figure the
    # line states is the one /v1/models serves, whatever this machine's memory)
    with ServerProcess("--threads", "2", "--slots", "1", "--ctx-size", "auto") as server:
        url = server.wait_ready()
        served = httpx.get(url + "/v1/models").json()["data"][0]["context_length"]
        server.stop()
    line = r"context (\d+) tokens per sequence, ([^(]*)\(([^\n]*)\(--ctx-size auto\)"
    said = re.search(line, "".join(server.log))
    assert said is not None, "".join(server.log)
    n_ctx = int(said.group(1))
    assert served == n_ctx
    assert 4096 <= n_ctx <= 32768
    if said.group(2).startswith("the model's training length"):
        assert n_ctx == 32768
        assert "1 × 32768 cells of KV cache take 0.56 GiB" in said.group(3)


def test_sigterm_with_a_stream_in_flight_ends_it_with_a_final_event() -> None:
    with ServerProcess("--threads", "2", "--shutdown-grace", "0.5") as server:
        url = server.wait_ready()
        _stream_then_sigterm(server, url)


def _stream_then_sigterm(server: ServerProcess, url: str) -> None:
    parts = urlsplit(url)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3000, "stream": True}).encode()
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        sock.settimeout(10)
        while chunk := sock.recv(65536):
            received += chunk
            if received.endswith(b"0\r\n\r\n"):  # the end of the chunked body
                break
    assert server.process.wait(timeout=10) == 0
    elapsed = time.monotonic() - started
    assert b'"finish_reason":"length"' in received  # OpenAI's value; why, in trioserve's field
    assert b'"end_cause":"shutdown"' in received
    assert b"data: [DONE]" in received
    assert elapsed < 0.5 + 1.0 + 0.5  # grace + 1 s (+ slack for process start-up noise)


def test_json_logs_have_one_line_per_request_with_its_id() -> None:
    with ServerProcess("--scripted", "--log-format", "json") as server:
        url = server.wait_ready()
        response = httpx.post(
            url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers={"X-Request-Id": "req-42"}
        )
        assert response.headers["x-request-id"] == "req-42"
        assert server.stop() == 0
    records = [json.loads(line) for line in "".join(server.log).splitlines() if line.startswith("{")]
    assert records, server.log
    assert {"time", "level", "logger", "message"} <= set(records[0])
    lines = [r["message"] for r in records if r["logger"] == "trioserve.requests"]
    assert len(lines) == 1
    assert "request req-42 /v1/completions" in lines[0]
    assert "cause=length" in lines[0]
    assert "completion_tokens=3" in lines[0]


def test_mmproj_flags_that_cannot_work_exit_2(
    tmp_path: object, model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trioserve._cli import main

    assert main(["serve", "--port", "0", "--mmproj", f"{tmp_path}/none.gguf"]) == 2
    assert "projector file not found" in capsys.readouterr().err
    many = ["--model", f"a={model_path}", "--model", f"b={model_path}"]
    assert main(["serve", "--port", "0", *many, "--mmproj", str(tiny_gemma3_projector())]) == 2
    assert "--mmproj is for one model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-chunk", "0"], "prefill_chunk must be in [1, n_batch=512], got 0"),
        (["--prefill-chunk", "1024"], "prefill_chunk must be in [1, n_batch=512], got 1024"),
        (["--slots", "0"], "--slots must be at least 1, got 0"),
        (["--deep-chunk", "64"], "deep_chunk must be 0 or in [prefill_chunk=128, n_batch=512], got 64"),
        (["--deep-chunk", "1024"], "deep_chunk must be 0 or in [prefill_chunk=128, n_batch=512], got 1024"),
        (["--deep-from", "-1"], "deep_from must be at least 0, got -1"),
        (["--backlog", "0"], "--backlog must be at least 1, got 0"),
    ],
)
def test_flags_that_cannot_work_exit_2_with_the_reason(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trioserve._cli import main

    assert main(["serve", "--port", "0", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--cache-type-k", "-ctv"])
def test_an_unknown_cache_type_exits_2_listing_the_accepted_ones(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trioserve._cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "0", flag, "q9"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'q9'" in err
    assert "'f32', 'f16', 'bf16', 'q8_0', 'q4_0', 'q4_1', 'iq4_nl', 'q5_0', 'q5_1'" in err


def test_a_preset_s_cache_types_reach_its_model_s_settings(tmp_path: object, model_path: str) -> None:
    from pathlib import Path

    from trioserve._cli import _models, _parser

    path = Path(str(tmp_path)) / "p.toml"
    path.write_text("[defaults]\ncache_type_k = 'q8_0'\n\n[models.y]\ncache_type_v = 'q4_0'\n")
    args = _parser().parse_args(
        ["serve", "--model", f"x={model_path}", "--model", f"y={model_path}", "--models-preset", str(path)]
    )
    _, registry = _models.registry(args, max_queue=8)
    settings = {entry.name: entry.spec.source.settings for entry in registry.entries}  # type: ignore[attr-defined]
    assert (settings["x"].cache_type_k, settings["x"].cache_type_v) == ("q8_0", "f16")
    assert (settings["y"].cache_type_k, settings["y"].cache_type_v) == ("q8_0", "q4_0")


def test_default_flags_serve_many_sequences_and_report_the_batch_in_health() -> None:
    with ServerProcess("--slots", "4", "--threads", "2", "--ctx-size", "1024") as server:
        url = server.wait_ready()
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        health = httpx.get(url + "/health").json()
        exit_code = server.stop(signal.SIGINT)
    assert answer["usage"]["completion_tokens"] == 8
    assert health["slots"] == 4
    assert health["batch"]["sequences"] == 0
    assert health["batch"]["max_call_width"] == 4
    assert "4 sequences of 1024 tokens" in "".join(server.log)
    assert exit_code == 0


def test_the_old_batch_flag_is_accepted_with_a_warning() -> None:
    with ServerProcess("--batch", "--slots", "2", "--threads", "2", "--ctx-size", "512") as server:
        server.wait_ready()
        exit_code = server.stop(signal.SIGINT)
    assert exit_code == 0
    assert "--batch is the default now" in "".join(server.log)


def test_upstream_body_is_a_json_object_merged_into_upstream_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trioserve._cli import _loader, _parser

    args = _parser().parse_args(
        ["serve", "--upstream", "http://127.0.0.1:9", "--upstream-body", '{"repeat_penalty": 1.0}']
    )
    _, load = _loader(args)
    assert load.keywords["extra_body"] == {"repeat_penalty": 1.0}  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["serve", "--upstream", "http://x", "--upstream-body", "[1]"])
    assert exited.value.code == 2
    assert "--upstream-body: must be a JSON object" in capsys.readouterr().err


def test_a_models_dir_with_a_preset_serves_each_model_with_its_settings(
    tmp_path: object, model_path: str
) -> None:
    """The command line a user types for many models (docs/models.md): a directory of
    GGUFs, a preset giving one another context, an alias and a pin."""
    import os
    from pathlib import Path

    directory = Path(str(tmp_path)) / "models"
    directory.mkdir()
    for name in ("alpha", "beta"):
        os.link(model_path, directory / f"{name}.gguf")
    # a projector beside alpha, found by its name (docs/vision.md); never a model itself
    os.link(tiny_gemma3_projector(), directory / "mmproj-alpha.gguf")
    preset = Path(str(tmp_path)) / "models.toml"
    preset.write_text(
        '[defaults]\nslots = 2\n\n[models.beta]\nctx_size = 512\naliases = ["b"]\npinned = true\n'
    )
    args = (
        "--models-dir",
        str(directory),
        "--models-preset",
        str(preset),
        "--models-max",
        "1",
        "--threads",
        "2",
    )
    with ServerProcess(*args, "--ctx-size", "1024") as server:
        url = server.wait_ready()
        models = httpx.get(url + "/v1/models").json()["data"]
        listed = {m["id"]: m["status"]["state"] for m in models}
        modalities = {m["id"]: m["input_modalities"] for m in models}
        body = {"model": "b", "prompt": "Once upon a time", "max_tokens": 3, "logit_bias": {"1": -100}}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        beta = httpx.get(url + "/v1/models/beta").json()
        # alpha cannot load: beta is pinned and --models-max is 1
        refused = httpx.post(url + "/v1/completions", json={**body, "model": "alpha"}, timeout=120)
        exit_code = server.stop(signal.SIGINT)
    assert listed == {"alpha": "unloaded", "beta": "unloaded", "b": "unloaded"}
    assert modalities == {"alpha": ["text", "image"], "beta": ["text"], "b": ["text"]}
    assert answer["model"] == "beta"
    assert answer["usage"]["completion_tokens"] == 3
    assert beta["context_length"] == 512
    assert beta["status"]["pinned"] is True
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "model_does_not_fit"
    log = "".join(server.log)
    assert "2 model(s) on demand, at most 1 loaded: alpha, beta" in log
    assert "load_wait_ms=" in log
    assert exit_code == 0


@pytest.mark.parametrize(
    ("preset", "message"),
    [
        ("[models.x]\nctx = 1\n", "[x] has unknown key(s) ['ctx']"),
        ("[model.x]\n", "unknown table(s) ['model']"),
        ("[models.nowhere]\nslots = 1\n", "[models.nowhere] names no model found"),
        ("[defaults]\nkeep_alive = 'soon'\n", "keep_alive must be seconds or a duration"),
        ('[models.x]\npinned = "false"\n', "pinned must be bool, got 'false'"),
        ("[models.x]\nctx_size = true\n", 'ctx_size must be a number of tokens or "auto", got True'),
        ("[models.x]\nrepack = 'yes'\n", "repack must be one of auto, on, off"),
        ("[defaults]\npath = 'a.gguf'\n", "[defaults] cannot have a path"),
        ("[models.x]\nrerank = 'maybe'\n", "rerank must be one of yes-no, off"),
        ("[models.x]\nrerank_template = 'no query here'\n", "must hold {query} exactly once"),
        ("[defaults]\nmmproj = 'p.gguf'\n", "[defaults] cannot have a mmproj"),
        ("[models.x]\nmax_image_tokens = 'many'\n", "max_image_tokens must be int"),
        (
            "[models.x]\ncache_type_k = 'q9'\n",
            "cache_type_k must be one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, got 'q9'",
        ),
        ("[defaults]\ncache_type_v = 8\n", "cache_type_v must be str, got 8"),
        ('[defaults]\nctx_size = "big"\n', "ctx_size must be a number of tokens or \"auto\", got 'big'"),
    ],
)
def test_a_preset_that_cannot_work_exits_2_naming_what_is_wrong(
    preset: str, message: str, tmp_path: object, model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    from trioserve._cli import main

    path = Path(str(tmp_path)) / "p.toml"
    path.write_text(preset)
    assert main(["serve", "--port", "0", "--model", f"x={model_path}", "--models-preset", str(path)]) == 2
    assert message in capsys.readouterr().err
