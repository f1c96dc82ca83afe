"""Tracing (docs/operations.md, "Tracing"): real ``trioserve serve`` processes exporting
over OTLP/HTTP to a real receiver in the test (an HTTP server decoding OpenTelemetry's
protobuf messages): a request's server span parented to the client's ``traceparent``,
its phase spans under it, and the trace carried through ``--upstream`` to the server
behind — where, without an OTLP endpoint, the client's ``traceparent`` passes through
unchanged."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


class Receiver:
    """An OTLP/HTTP traces receiver on 127.0.0.1: every span it is sent, by service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        received = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                for resource in message.resource_spans:
                    service = next(
                        a.value.string_value for a in resource.resource.attributes if a.key == "service.name"
                    )
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            received.append(
                                {
                                    "service": service,
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "span_id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(),
                                    "start": span.start_time_unix_nano,
                                    "end": span.end_time_unix_nano,
                                    "attributes": {a.key: a.value for a in span.attributes},
                                }
                            )
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.close()


def _one(spans: list[dict[str, Any]], **match: object) -> dict[str, Any]:
    found = [s for s in spans if all(s[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def test_a_request_s_spans_reach_the_receiver_and_follow_it_upstream(receiver: Receiver) -> None:
    back_args = ("--threads", "2", "--otlp-endpoint", receiver.url, "--service-name", "back")
    with ServerProcess(*back_args) as back:
        back_url = back.wait_ready()
        front_args = ("--upstream", back_url, "--otlp-endpoint", receiver.url, "--service-name", "front")
        with ServerProcess(*front_args) as front, ServerProcess("--upstream", back_url) as plain:
            body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
            headers = {"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"}
            with httpx.stream(
                "POST", front.wait_ready() + "/v1/completions", json=body, headers=headers, timeout=120
            ) as r:
                assert r.status_code == 200
                assert b"[DONE]" in r.read()
            # without an OTLP endpoint the client's traceparent passes through unchanged
            headers = {"traceparent": TRACEPARENT, "X-Request-Id": "passed-1"}
            answer = httpx.post(
                plain.wait_ready() + "/v1/completions",
                json=body | {"stream": False},
                headers=headers,
                timeout=120,
            )
            assert answer.status_code == 200
            assert front.stop() == 0  # (its spans are flushed on the way out)
            assert plain.stop() == 0
        assert back.stop() == 0
    front_log, back_log = "".join(front.log), "".join(back.log)
    assert "request traced-1 " in front_log
    assert f"trace_id={TRACE_ID}" in front_log

    spans = receiver.spans
    server = _one(spans, service="front", name="POST /v1/completions")
    assert server["trace_id"] == TRACE_ID
    assert server["parent"] == CLIENT_SPAN
    assert server["attributes"]["trioserve.request_id"].string_value == "traced-1"
    assert server["attributes"]["trioserve.end_cause"].string_value == "length"
    assert server["attributes"]["gen_ai.usage.output_tokens"].int_value == 8
    phases = {s["name"]: s for s in spans if s["service"] == "front" and s["parent"] == server["span_id"]}
    assert {"queue", "prefill", "decode"} <= set(phases)
    assert server["start"] <= phases["queue"]["start"] <= phases["prefill"]["start"]
    assert phases["prefill"]["start"] <= phases["decode"]["start"] <= phases["decode"]["end"] <= server["end"]
    # the server behind: its span is a child of the front's, in the same trace
    behind = [s for s in spans if s["service"] == "back" and s["name"] == "POST /v1/completions"]
    traced = [s for s in behind if s["trace_id"] == TRACE_ID]
    assert len(traced) == 2, behind
    (relayed,) = [s for s in traced if s["parent"] == server["span_id"]]
    assert {"queue", "prefill", "decode"} <= {s["name"] for s in spans if s["parent"] == relayed["span_id"]}
    # and the one passed through unchanged hangs from the client's own span
    (passed,) = [s for s in traced if s["parent"] == CLIENT_SPAN]
    assert passed["attributes"]["gen_ai.usage.output_tokens"].int_value == 8
    assert back_log.count(f"trace_id={TRACE_ID}") == 2
