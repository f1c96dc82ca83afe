"""LoRA adapters loaded and unloaded at run time (docs/lora.md, "Hot load and unload"):
vLLM's ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` and
llama-server's ``POST /lora-adapters`` on real servers — none of the streams decoding
meanwhile changed, a loaded adapter answering as one loaded at start, an unloaded one
freed only after its last stream, and a name reloaded from another file sharing no
cache entry with the old one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioserve import LlamaBackend, LlamaSettings

from .._helpers import RawStream, RunningServer, start_server, wait_for
from .._lora import tiny_lora
from ..conftest import THREADS

pytestmark = pytest.mark.model

BAN = {"1": -100, "106": -100}  # (no early end: every answer max_tokens long)
#: long enough for whole pieces (cached, reusable)
PROMPT = "".join(f"In year {1200 + 7 * i} the town built bridge {i} of stone.\n" for i in range(30))
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def _settings(
    model_path: str, lora: tuple[tuple[str, Path, float], ...] = (), **changes: Any
) -> LlamaSettings:
    options: dict[str, Any] = {"n_ctx": 1024, "n_threads": THREADS, "slots": 4, "lora": lora, "lora_max": 2}
    options.update(changes)
    return LlamaSettings(model_path, **options)


@pytest.fixture(scope="module")
def hot(model_path: str) -> Iterator[LlamaBackend]:
    """No adapter at start; batch-invariant: a stream's text beside others is its text alone."""
    backend = LlamaBackend.load(_settings(model_path, batch_invariant=True))
    yield backend
    backend.close()


@asynccontextmanager
async def _serving(backend: LlamaBackend, **settings: Any) -> AsyncIterator[RunningServer]:
    async with trio.open_nursery() as nursery:
        running = await start_server(nursery, backend, **settings)
        try:
            yield running
        finally:
            nursery.cancel_scope.cancel()


def _body(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": BAN, **fields}


async def _text(client: httpx.AsyncClient, prompt: str = PROMPT, max_tokens: int = 12, **fields: Any) -> str:
    answer = await client.post("/v1/completions", json=_body(prompt, max_tokens, **fields))
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


class _Stream:
    """A streaming completion read event by event (its first piece: it is decoding)."""

    def __init__(self, client: httpx.AsyncClient, prompt: str, max_tokens: int, **fields: Any) -> None:
        self.client, self.body = client, _body(prompt, max_tokens, stream=True, **fields)
        self.text = ""
        self.started = trio.Event()
        self.ended_at = 0.0

    async def run(self) -> None:
        async with self.client.stream("POST", "/v1/completions", json=self.body) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                self.text += json.loads(line[6:])["choices"][0]["text"]
                self.started.set()
        self.ended_at = trio.current_time()


async def _fresh_text(
    model_path: str, name: str, file: Path, prompt: str = PROMPT, max_tokens: int = 12
) -> str:
    """The text of a server started with ``--lora NAME=FILE`` for ``model: NAME``."""
    backend = await LlamaBackend.aload(_settings(model_path, ((name, file, 1.0),), slots=1))
    try:
        async with _serving(backend) as fresh, fresh.client() as client:
            return await _text(client, prompt, max_tokens, model=name)
    finally:
        await backend.aclose()


async def test_a_load_while_streams_decode_changes_none_of_them_and_answers_as_an_adapter_given_at_start(
    hot: LlamaBackend, model_path: str
) -> None:
    prompts = [f"Note {i}: the {word} of the river town.\n" for i, word in enumerate(("bells", "ships"))]
    async with _serving(hot) as server, server.client() as client:
        alone = [await _text(client, p, 64, cache_prompt=False) for p in prompts]
        streams = [_Stream(client, p, 64, cache_prompt=False) for p in prompts]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(stream.run)
            for stream in streams:
                await stream.started.wait()
            answer = await client.post(LOAD, json={"lora_name": "a", "lora_path": str(tiny_lora(1))})
            loaded_at = trio.current_time()
            assert answer.status_code == 200, answer.text
            assert answer.text == "Success: LoRA adapter 'a' added successfully."
        assert loaded_at < min(s.ended_at for s in streams)  # (loaded while both decoded)
        assert [s.text for s in streams] == alone
        assert hot.adapter_loads.inits == 1
        listed = (await client.get("/lora-adapters")).json()
        assert [(a["id"], a["name"], a["path"], a["scale"]) for a in listed] == [
            (0, "a", str(tiny_lora(1)), 1.0)
        ]
        models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert models["a"]["parent"] == hot.info.id
        adapted = await _text(client, model="a")
        assert adapted != await _text(client)  # (the adapter changes the text)
        assert await _text(client, model=f"{hot.info.id}:a") == adapted
        assert (await client.post(UNLOAD, json={"lora_name": "a"})).status_code == 200
    assert adapted == await _fresh_text(model_path, "a", tiny_lora(1))


async def test_an_unload_while_a_stream_uses_the_adapter_lets_it_finish_unchanged_then_frees_it(
    hot: LlamaBackend,
) -> None:
    adapters = hot.llama_model.adapters
    async with _serving(hot) as server, server.client() as client:
        path = str(tiny_lora(2))
        size = tiny_lora(2).stat().st_size
        assert (await client.post(LOAD, json={"lora_name": "u", "lora_path": path})).status_code == 200
        alone = await _text(client, max_tokens=96, model="u")
        stream = _Stream(client, PROMPT, 96, model="u")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.run)
            await stream.started.wait()
            answer = await client.post(UNLOAD, json={"lora_name": "u"})
            assert answer.status_code == 200, answer.text
            assert answer.text == "Success: LoRA adapter 'u' removed successfully."
            # off the list at once; its file still allocated: the stream uses it
            assert adapters.in_use
            assert adapters.hot_bytes == size
            refused = await client.post("/v1/completions", json=_body("x", 2, model="u"))
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["code"] == "model_not_found"
            assert "'u'" in refused.json()["error"]["message"]
            assert (await client.get("/lora-adapters")).json() == []
            again = await client.post(UNLOAD, json={"lora_name": "u"})
            assert again.status_code == 404
            assert again.json()["error"]["message"] == "The lora adapter 'u' cannot be found."
        assert stream.text == alone
        await wait_for(lambda: not adapters.in_use and adapters.hot_bytes == 0)  # (freed after it)


async def test_a_name_reloaded_from_another_file_shares_no_cache_entry_with_the_old_one(
    hot: LlamaBackend, model_path: str
) -> None:
    async with _serving(hot) as server, server.client() as client:
        texts = []
        for seed in (1, 2, 1):
            body = {"lora_name": "r", "lora_path": str(tiny_lora(seed))}
            assert (await client.post(LOAD, json=body)).status_code == 200
            texts.append(await _text(client, model="r"))  # (its prompt cached for the next)
            assert (await client.post(UNLOAD, json={"lora_name": "r"})).status_code == 200
    fresh = [await _fresh_text(model_path, "r", tiny_lora(seed)) for seed in (1, 2)]
    assert texts == [fresh[0], fresh[1], fresh[0]]
    assert fresh[0] != fresh[1]


async def test_bad_loads_are_refused_with_the_reason_and_change_nothing(
    hot: LlamaBackend, model_path: str, tmp_path: Path
) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a GGUF")
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "x", "lora_path": str(tmp_path / "none.gguf")}, 400, "LoRA adapter file not found"),
        ({"lora_name": "x", "lora_path": "relative.gguf"}, 400, "must be an absolute path"),
        ({"lora_name": "x", "lora_path": str(text_file)}, 400, "is not a GGUF file"),
        # the base model itself: llama.cpp's reason (general.type is not "adapter")
        ({"lora_name": "x", "lora_path": model_path}, 400, "general.type"),
        # an adapter of another base: llama.cpp's shape check
        ({"lora_name": "x", "lora_path": str(tiny_lora(1, wider=64))}, 400, "wrong base model"),
        ({"lora_name": "a:b", "lora_path": str(tiny_lora(1))}, 400, "an adapter's name"),
        ({"lora_name": hot.info.id, "lora_path": str(tiny_lora(1))}, 400, "is a model's name"),
        ({"lora_name": "x", "lora_path": str(tiny_lora(1)), "model": "nope"}, 404, "does not exist"),
        ({"lora_name": "x", "lora_path": str(tiny_lora(1)), "rank": 8}, 400, "rank"),
    ]
    async with _serving(hot) as server, server.client() as client:
        for body, status, message in cases:
            answer = await client.post(LOAD, json=body)
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert message in error["message"], (body, error)
        assert (await client.get("/lora-adapters")).json() == []
        assert hot.llama_model.adapters.hot_bytes == 0
        # twice under one name; past --lora-max (2 here)
        for name, seed in (("p", 1), ("q", 2)):
            body = {"lora_name": name, "lora_path": str(tiny_lora(seed))}
            assert (await client.post(LOAD, json=body)).status_code == 200
        twice = await client.post(LOAD, json={"lora_name": "p", "lora_path": str(tiny_lora(2))})
        assert twice.status_code == 400
        assert twice.json()["error"]["message"] == "The lora adapter 'p' has already been loaded."
        third = await client.post(LOAD, json={"lora_name": "s", "lora_path": str(tiny_lora(2))})
        assert third.status_code == 400
        assert "--lora-max 2" in third.json()["error"]["message"]
        for name in ("p", "q"):
            assert (await client.post(UNLOAD, json={"lora_name": name})).status_code == 200
        assert hot.llama_model.adapters.hot_bytes == 0


async def test_only_an_admin_key_may_load_unload_or_rescale(hot: LlamaBackend) -> None:
    body = {"lora_name": "k", "lora_path": str(tiny_lora(1))}
    keys = {"api_keys": ("sk-plain",), "admin_keys": ("sk-admin",)}
    async with _serving(hot, **keys) as server, server.client() as client:
        for path, sent in ((LOAD, body), (UNLOAD, {"lora_name": "k"}), ("/lora-adapters", [])):
            assert (await client.post(path, json=sent)).status_code == 401
            plain = await client.post(path, json=sent, headers={"Authorization": "Bearer sk-plain"})
            assert plain.status_code == 403, plain.text
            assert plain.json()["error"]["code"] == "admin_key_required"
        plain_key = {"Authorization": "Bearer sk-plain"}
        assert (await client.get("/lora-adapters", headers=plain_key)).json() == []
        admin = {"Authorization": "Bearer sk-admin"}
        assert (await client.post(LOAD, json=body, headers=admin)).status_code == 200
        assert (await client.post(UNLOAD, json={"lora_name": "k"}, headers=admin)).status_code == 200


async def test_post_lora_adapters_sets_default_scales_as_llama_server_does(hot: LlamaBackend) -> None:
    async with _serving(hot) as server, server.client() as client:
        for name, seed in (("d", 1), ("e", 2)):
            body = {"lora_name": name, "lora_path": str(tiny_lora(seed)), "scale": 0.5}
            assert (await client.post(LOAD, json=body)).status_code == 200
        base, half = await _text(client), await _text(client, model="d")
        assert half == await _text(client, lora=[{"id": 0, "scale": 0.5}])
        # (an adapter the list leaves out gets 0, as in llama-server)
        answer = await client.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}])
        assert answer.status_code == 200
        assert answer.json() == {"success": True}
        listed = (await client.get("/lora-adapters")).json()
        assert [(a["name"], a["scale"]) for a in listed] == [("d", 0.0), ("e", 1.0)]
        assert await _text(client, model="d") == base
        assert await _text(client, model="e") == await _text(client, lora=[{"id": 1, "scale": 1.0}])
        bad = await client.post("/lora-adapters", json=[{"id": 2, "scale": 1.0}])
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "no adapter with id 2 (ids 0 to 1)"
        for name in ("d", "e"):
            assert (await client.post(UNLOAD, json={"lora_name": name})).status_code == 200


async def test_a_load_whose_client_leaves_while_it_waits_in_line_loads_nothing(hot: LlamaBackend) -> None:
    loads = hot.adapter_loads
    inits = loads.inits
    async with _serving(hot) as server:
        async with loads.line:  # (another load holds the line)
            body = {"lora_name": "w", "lora_path": str(tiny_lora(1))}
            client = await RawStream.post(server.url, LOAD, body)
            await wait_for(lambda: loads.waiting == 1)
            await client.aclose()
            await wait_for(lambda: loads.waiting == 0)  # (it left the line)
        async with server.client() as http:
            assert (await http.get("/lora-adapters")).json() == []
    assert loads.inits == inits
    assert hot.llama_model.adapters.get("w") is None
