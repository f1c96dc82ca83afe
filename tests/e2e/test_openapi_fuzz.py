"""schemathesis against a live server (a real process, scripted backend), driven by the
server's own ``/openapi.json``: every operation, valid and invalid data (its examples,
coverage, fuzzing and stateful phases), every answer checked against the document —
no 5xx, every status, content type and body as documented. The verdict is the test's:
schemathesis's exit status and its JSON report (operations, cases, failures, errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .._helpers import ServerProcess

#: cases per operation and phase: the run takes about 2 minutes on 2 cores
MAX_EXAMPLES = 10
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
    ]
)
#: the scripted backend computes no embeddings: its documented 501 is the answer there;
#: it adds no models (/api/create), keeps no blobs (--blobs-dir off) and reaches no
#: registry (/api/pull, /api/push) and loads no LoRA adapters (/lora-adapters, vLLM's
#: load and unload): 501 each, documented
CONFIG = "".join(
    f"""
[[operations]]
include-path = "{path}"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "501"]
"""
    for path in (
        "/v1/embeddings", "/api/embed", "/api/embeddings", "/api/create", "/api/pull", "/api/push",
        "/api/blobs/{digest}", "/lora-adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    )
)  # fmt: skip


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with ServerProcess(
        "--scripted", "--scripted-interval", "0", "--ctx-size", "512", "--blobs-dir", "off"
    ) as server:
        yield server.wait_ready()
        assert server.stop() == 0


def test_schemathesis_finds_nothing_on_any_route(url: str, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    report = tmp_path / "report.json"
    command = [
        str(Path(sys.executable).with_name("st")),
        "--config-file",
        str(config),
        "run",
        f"{url}/openapi.json",
        "--checks",
        CHECKS,
        "--max-examples",
        str(MAX_EXAMPLES),
        "--workers",
        "1",
        "--seed",
        "47",
        "--request-timeout",
        "20",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    started = time.monotonic()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
        cwd=tmp_path,  # (its cache folder, .schemathesis/, stays out of the checkout)
        check=False,
    )
    elapsed = time.monotonic() - started
    result = json.loads(report.read_text())
    operations, cases = result["operations"], result["test_cases"]
    print(
        f"\nschemathesis {result['schemathesis_version']}: {operations['tested']} operations, "
        f"{cases['generated']} cases in {elapsed:.0f} s (phases: "
        + ", ".join(f"{name} {phase['status']}" for name, phase in result["phases"].items())
        + ")"
    )
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-3000:]
    assert operations["tested"] == operations["total"] >= 30, operations
    assert cases["with_failures"] == cases["errored"] == 0, cases
    assert cases["generated"] >= 1000, cases
