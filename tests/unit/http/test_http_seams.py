"""The generation handler's seams, driven at the ASGI level with the scripted backend
(an ASGI ``send`` the test controls stands in for a client whose socket is full):
one writer per response, the end of a response sent whole, big bodies parsed off the
event loop, and the admission clock measuring slot time."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import trio

from trioserve import Engine, GenerationRequest, HTTPSettings, ScriptedBackend, ServerState, TextDelta
from trioserve._http import InFlightRequest, Phase
from trioserve._http._exchange import Exchange
from trioserve._http._generation import GenerationHandler

from ..._helpers import wait_for


def _state(backend: ScriptedBackend, **settings: Any) -> ServerState:
    state = ServerState(settings=HTTPSettings(**settings))
    state.set_engine(Engine(backend))
    return state


def _scope(headers: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "http_version": "1.1",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


class _Client:
    """The ASGI side of one request: the body, then nothing until told to disconnect;
    every ``send`` is recorded, and optionally blocked until released."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = json.dumps(body).encode()
        self.sent_body = False
        self.disconnect = trio.Event()
        self.messages: list[dict[str, Any]] = []
        self.sending = 0
        self.overlaps = 0
        self.block_final = False
        self.final_blocked = trio.Event()
        self.release_final = trio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sending += 1
        self.overlaps += self.sending > 1
        try:
            await trio.lowlevel.checkpoint()  # a real send yields: an overlapping writer runs here
            if self.block_final and message.get("type") == "http.response.body" and not message["more_body"]:
                self.final_blocked.set()
                await self.release_final.wait()
            await trio.lowlevel.checkpoint()
            self.messages.append(message)
        finally:
            self.sending -= 1

    def text(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


async def test_heartbeats_and_tokens_never_write_at_once() -> None:
    # a long "prefill" with heartbeats every millisecond, then tokens as fast as they come
    backend = ScriptedBackend(prefill_seconds_per_token=0.002, script=[b"x"] * 300)
    state = _state(backend, heartbeat_interval=0.001)
    client = _Client({"prompt": "p" * 50, "max_tokens": 300, "stream": True})
    await GenerationHandler(state)(_scope(), client.receive, client.send, "text")
    data = client.text()
    assert data.count(b": ping\n\n") >= 2  # heartbeats went out during the "prefill"
    assert data.endswith(b"data: [DONE]\n\n")
    assert client.overlaps == 0


async def test_a_deadline_at_the_final_send_does_not_cut_the_body(caplog: Any) -> None:
    caplog.set_level("INFO", logger="trioserve.requests")
    backend = ScriptedBackend(script=[b"a", b"b"])
    state = _state(backend)
    client = _Client({"prompt": "p", "max_tokens": 10, "stream": True})
    client.block_final = True
    handler = GenerationHandler(state)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            handler,
            _scope({"X-Request-Timeout": "60", "X-Request-Id": "final"}),
            client.receive,
            client.send,
            "text",
        )
        await client.final_blocked.wait()
        # the final send is blocked (a full socket); now the deadline passes
        (request,) = state.requests
        request.cancel_scope.deadline = trio.current_time()
        await wait_for(lambda: request.cancel_scope.cancel_called)
        client.release_final.set()
    data = client.text()
    assert data.endswith(b"data: [DONE]\n\n")  # the body was not cut
    assert client.messages[-1]["more_body"] is False
    (line,) = [r.getMessage() for r in caplog.records if "final" in r.getMessage()]
    assert "cause=stop" in line


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch: Any) -> None:
    threads: list[threading.Thread] = []
    real = GenerationHandler._parse

    def parse(self: GenerationHandler, kind: Any, body: bytes, chat_format: Any, stored: Any) -> Any:
        threads.append(threading.current_thread())
        return real(self, kind, body, chat_format, stored)

    monkeypatch.setattr(GenerationHandler, "_parse", parse)
    backend = ScriptedBackend(script=[b"a"], context_length=1 << 20)
    state = _state(backend)
    for prompt in ("short", "x" * 200_000):
        client = _Client({"prompt": prompt, "max_tokens": 1})
        await GenerationHandler(state)(_scope(), client.receive, client.send, "text")
        assert client.messages[0]["status"] == 200
    small, large = threads
    assert small is threading.main_thread()
    assert large is not threading.main_thread()


async def test_the_admission_clock_is_the_time_the_slot_was_held() -> None:
    backend = ScriptedBackend(script=[b"a", b"b", b"c"])
    engine = Engine(backend)
    async with engine.stream(GenerationRequest(prompt="p", max_tokens=10)) as events:
        async for event in events:
            assert isinstance(event, TextDelta)
            # inference has ended and given its slot back while this reader is still
            # inside the stream: the estimate is already recorded, from that moment
            await wait_for(lambda: engine.admission.in_use == 0)
            assert events.timings.released is not None
            assert engine.admission.expected_service_time == events.timings.released - events.timings.admitted
            break


def _record_phases(monkeypatch: Any) -> list[str]:
    phases: list[str] = []
    real = InFlightRequest.advance

    def advance(self: InFlightRequest, phase: Phase) -> None:
        real(self, phase)
        if not phases or phases[-1] != phase.name:
            phases.append(phase.name)

    monkeypatch.setattr(InFlightRequest, "advance", advance)
    return phases


async def test_a_streamed_request_goes_through_every_phase_in_order(monkeypatch: Any) -> None:
    phases = _record_phases(monkeypatch)
    state = _state(ScriptedBackend(script=[b"a", b"b"]))
    client = _Client({"prompt": "p", "max_tokens": 10, "stream": True})
    await GenerationHandler(state)(_scope(), client.receive, client.send, "text")
    assert client.text().endswith(b"data: [DONE]\n\n")
    assert phases == ["QUEUED", "STREAMING", "FINISHING", "DONE"]


async def test_a_refused_request_skips_from_receiving_to_finishing(monkeypatch: Any) -> None:
    phases = _record_phases(monkeypatch)
    state = _state(ScriptedBackend(script=[b"a"]))
    client = _Client({"prompt": "p", "max_tokens": -1})
    await GenerationHandler(state)(_scope(), client.receive, client.send, "text")
    assert client.messages[0]["status"] == 400
    assert phases == ["FINISHING", "DONE"]


async def test_a_client_that_leaves_mid_stream_ends_without_a_final_send(monkeypatch: Any) -> None:
    phases = _record_phases(monkeypatch)
    backend = ScriptedBackend(token_interval=0.001)  # never ends on its own
    state = _state(backend)
    client = _Client({"prompt": "p", "max_tokens": 4000, "stream": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(GenerationHandler(state), _scope(), client.receive, client.send, "text")
        await wait_for(lambda: len(client.messages) > 3)
        client.disconnect.set()
    assert phases == ["QUEUED", "STREAMING", "DONE"]
    assert backend.generations.running == 0


def test_a_request_never_goes_back_a_phase() -> None:
    request = InFlightRequest(_scope(), Exchange(_never_send, "id"), "text")
    request.advance(Phase.STREAMING)
    request.advance(Phase.STREAMING)  # staying is allowed
    with pytest.raises(RuntimeError, match="cannot go back from STREAMING to QUEUED"):
        request.advance(Phase.QUEUED)


async def _never_send(message: Any) -> None:
    raise AssertionError("nothing is sent")
