"""Every program in examples/ runs and does what its docstring says."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_stream_cli_streams_and_reports_the_end() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "stream_cli.py"),
            "Once upon a time",
            "--max-tokens",
            "20",
            "--temperature",
            "0",
            "--threads",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    text, _, tail = result.stdout.rpartition("\n[")
    assert text.strip()  # the continuation streamed out
    assert tail.startswith("length: 20 tokens]")


def test_stream_cli_stops_on_ctrl_c_and_exits_zero() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLES / "stream_cli.py"),
            "Once upon a time",
            "--max-tokens",
            "3000",
            "--threads",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    first = process.stdout.read(20)  # wait until text streams
    assert first
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert "[stopped by Ctrl-C; generations still running: 0]" in rest


def test_openai_stream_example_against_a_server() -> None:
    with ServerProcess("--threads", "2") as server:
        url = server.wait_ready()
        result = subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "openai_stream.py"),
                "Tell me a very long story about a dragon.",
                "--url",
                url + "/v1",
                "--max-tokens",
                "2000",
                "--timeout",
                "0.5",
                # greedy: a random sample could reach end-of-sequence before the deadline
                "--temperature",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert server.stop() == 0
    assert result.stdout.rstrip().endswith("[length: deadline]")


def test_two_generations_under_one_deadline() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "two_generations.py"), "--deadline", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "--- story (" in result.stdout
    assert "--- recipe (" in result.stdout
    assert "the deadline cancelled both; generations still running: 0" in result.stdout


def test_embed_server_serves_both_apps_and_stops() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "embed_server.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "your route: hello from your own app" in result.stdout
    assert "trioserve health: ok" in result.stdout
    assert "completion: hi there!" in result.stdout
    assert result.stdout.rstrip().endswith("stopped cleanly")
