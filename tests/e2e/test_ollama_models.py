"""Ollama's model routes (docs/models.md, "Ollama's model routes") on a real socket, with
the official ``ollama`` Python client and httpx: list, show, ps, copy, delete, create
(from a path, and from a blob the client uploads), embed and the legacy embeddings,
pull's clear error, VS Code Copilot Chat's probe (version → tags → show), and bad input
answered in Ollama's error shape. The models are the default Gemma 3 270M (no chat
template) and copies of it with a template (tests/_models.py)."""

from __future__ import annotations

import hashlib
import math
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from trioserve import HTTPSettings, LlamaSettings, Server, ServerSettings
from trioserve._backends._sources import LlamaSource
from trioserve._core._registry import ModelRegistry, ModelSpec
from trioserve._http._settings import ModelFileSettings

from .._models import reasoning_model, tools_model

pytestmark = pytest.mark.model

THREADS = min(2, os.cpu_count() or 1)
CTX = 1024
KEEP_ALIVE = 300.0


def _source(path: Path, ctx: int = CTX) -> LlamaSource:
    return LlamaSource(LlamaSettings(path, n_ctx=ctx, n_threads=THREADS, slots=1))


def _maker(name: str, path: Path, preset: Mapping[str, int]) -> LlamaSource:
    return _source(path, preset.get("ctx_size", CTX))


class Served:
    def __init__(self, server: Server, url: str, models: Path, blobs: Path) -> None:
        self.server = server
        self.url = url
        self.models = models
        self.blobs = blobs
        self.clients: list[ollama.AsyncClient] = []

    def client(self) -> ollama.AsyncClient:
        client = ollama.AsyncClient(host=self.url, timeout=120)
        self.clients.append(client)
        return client

    async def aclose(self) -> None:
        for client in self.clients:
            await client.close()

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=120)


def _link(source: Path, target: Path) -> Path:
    try:
        os.link(source, target)
    except OSError:
        import shutil

        shutil.copyfile(source, target)
    return target


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Path:
    directory = tmp_path_factory.mktemp("ollama-models")
    _link(Path(model_path), directory / "gemma.gguf")
    _link(tools_model(), directory / "toolsy.gguf")
    _link(reasoning_model(), directory / "thinker.gguf")
    return directory


async def _serve(nursery: trio.Nursery, models: Path, blobs: Path, **files: Any) -> tuple[Server, str]:
    found = sorted(name for name in os.listdir(models) if name.endswith(".gguf"))
    specs = [ModelSpec(name=name.removesuffix(".gguf"), source=_source(models / name)) for name in found]
    specs.sort(key=lambda spec: spec.name != "gemma")  # (the default first)
    registry = ModelRegistry(specs, keep_alive=KEEP_ALIVE, unload_grace=0.0)
    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        shutdown_grace=0.0,
        http=HTTPSettings(model_files=ModelFileSettings(blobs_dir=blobs, model_dirs=(models,), **files)),
    )
    server = Server(registry, settings, model_maker=_maker)
    binds = await nursery.start(server.run)
    await server.ready.wait()
    return server, binds[0]


@pytest.fixture
async def served(nursery: trio.Nursery, models_dir: Path, tmp_path: Path) -> AsyncIterator[Served]:
    server, url = await _serve(nursery, models_dir, tmp_path / "blobs", max_blob_bytes=1 << 30)
    running = Served(server, url, models_dir, tmp_path / "blobs")
    yield running
    await running.aclose()
    server.shutdown()


def _state(served: Served, name: str) -> str:
    return served.server.registry.snapshot().model(name).state


async def test_list_and_show_describe_each_model_from_its_file_without_loading_it(
    served: Served, model_path: str
) -> None:
    client = served.client()
    listed = await client.list()
    by_name = {m.model: m for m in listed.models}
    assert set(by_name) == {"gemma:latest", "toolsy:latest", "thinker:latest"}
    gemma = by_name["gemma:latest"]
    assert gemma.size == (await trio.Path(model_path).stat()).st_size
    assert re.fullmatch(r"[0-9a-f]{64}", gemma.digest or "")
    assert gemma.details is not None
    assert gemma.details.format == "gguf"
    assert gemma.details.family == "gemma3"
    assert gemma.details.families == ["gemma3"]
    assert gemma.details.parameter_size == "268.10M"  # (Ollama's figure for gemma3:270m)
    assert gemma.details.quantization_level == "Q4_K_M"
    assert gemma.modified_at is not None

    shown = await client.show("gemma")
    assert shown.capabilities == ["completion", "embedding"]  # no template: no tools, no thinking
    assert shown.template == ""
    assert shown.parameters == f"num_ctx {CTX}"
    info = shown.modelinfo or {}
    assert info["general.architecture"] == "gemma3"
    assert info["gemma3.context_length"] == CTX  # what a request gets here
    assert info["trioserve.training_context_length"] == 32768  # the file's own
    assert info["general.parameter_count"] == 268098176
    assert info["tokenizer.ggml.tokens"] is None  # (a long array: its key, no values)
    assert "tokenizer.chat_template" not in info
    assert _state(served, "gemma") == "unloaded"  # show and list never load a model

    tooled = await client.show("toolsy:latest")
    assert tooled.capabilities == ["completion", "tools", "embedding"]
    assert "tools" in (tooled.template or "")
    thinking = await client.show("thinker")
    assert thinking.capabilities == ["completion", "thinking", "embedding"]


async def test_copilot_chats_probe_lists_only_the_models_that_can_call_tools(served: Served) -> None:
    """VS Code Copilot Chat's Ollama provider: /api/version (numeric, at least 0.6.4),
    /api/tags, then /api/show per model; it offers a model only when ``capabilities``
    holds ``tools``, and sizes prompts by ``model_info["<arch>.context_length"]``."""
    async with served.http() as http:
        version = (await http.get("/api/version")).json()["version"]
        assert tuple(int(part) for part in version.split(".")) >= (0, 6, 4)
        tags = (await http.get("/api/tags")).json()["models"]
        offered = {}
        for model in tags:
            shown = (await http.post("/api/show", json={"model": model["model"]})).json()
            if "tools" in shown["capabilities"]:
                arch = shown["model_info"]["general.architecture"]
                offered[model["model"]] = shown["model_info"][f"{arch}.context_length"]
    assert offered == {"toolsy:latest": CTX}


async def test_copy_is_an_alias_and_delete_takes_names_away_never_the_file(
    served: Served, model_path: str
) -> None:
    client = served.client()
    assert (await client.copy("gemma", "my-gemma:v1")).status == "success"
    names = {m.model for m in (await client.list()).models}
    assert {"gemma:latest", "my-gemma:v1"} <= names
    async with served.http() as http:
        done = await http.post(
            "/v1/completions", json={"model": "my-gemma:v1", "prompt": "Hi", "max_tokens": 2}
        )
        assert done.status_code == 200, done.text
    assert served.server.registry.resolve("my-gemma:v1") is served.server.registry.resolve("gemma")

    assert (await client.delete("my-gemma:v1")).status == "success"
    assert "my-gemma:v1" not in {m.model for m in (await client.list()).models}
    # a model's last name: the model goes (unloaded first), its file stays
    loaded = served.server.registry.resolve("gemma")
    assert loaded.state == "loaded"
    assert (await client.delete("gemma:latest")).status == "success"
    assert loaded.state == "unloaded"
    assert (served.models / "gemma.gguf").is_file()
    with pytest.raises(ollama.ResponseError) as gone:
        await client.show("gemma")
    assert gone.value.status_code == 404
    assert 'model "gemma" not found' in gone.value.error
    assert "/api/create" in gone.value.error  # (how to add one)


async def test_create_from_a_path_and_from_a_blob_the_client_uploads(served: Served, model_path: str) -> None:
    client = served.client()
    created = await client.create("from-path", from_=model_path, parameters={"num_ctx": 512})
    assert created.status == "success"
    shown = await client.show("from-path")
    assert shown.parameters == "num_ctx 512"
    assert (shown.modelinfo or {})["gemma3.context_length"] == 512

    def upload() -> str:  # (the client's own upload: it hashes the file, then POSTs it)
        sync_client = ollama.Client(host=served.url)
        try:
            return sync_client.create_blob(model_path)
        finally:
            sync_client.close()

    digest = await trio.to_thread.run_sync(upload)
    expected = await trio.to_thread.run_sync(
        lambda: hashlib.sha256(Path(model_path).read_bytes()).hexdigest()
    )
    assert digest == f"sha256:{expected}"
    assert (served.blobs / f"sha256-{expected}").is_file()
    assert list(served.blobs.glob(".upload-*")) == []
    async with served.http() as http:
        assert (await http.head(f"/api/blobs/{digest}")).status_code == 200
        assert (await http.head(f"/api/blobs/sha256:{'0' * 64}")).status_code == 404
    statuses = [
        part.status async for part in await client.create("from-blob", files={"m.gguf": digest}, stream=True)
    ]
    assert statuses[-1] == "success"
    assert len(statuses) > 1
    embedded = await client.embed("from-blob", input="The cat sat on the mat.")
    assert len(embedded.embeddings[0]) == 640


def _cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


async def test_embed_and_the_legacy_embeddings_are_the_v1_embeddings_vectors(served: Served) -> None:
    client = served.client()
    texts = ["The cat sat on the mat.", "Stock markets fell sharply on Monday."]
    embedded = await client.embed("gemma", input=texts)
    assert len(embedded.embeddings) == 2
    assert all(len(vector) == 640 for vector in embedded.embeddings)
    assert embedded.prompt_eval_count is not None
    assert embedded.prompt_eval_count > 0
    assert embedded.total_duration is not None
    assert embedded.total_duration > 0
    assert embedded.load_duration is not None
    assert embedded.load_duration > 0
    async with served.http() as http:
        v1 = (await http.post("/v1/embeddings", json={"model": "gemma", "input": texts})).json()
    for mine, theirs in zip(embedded.embeddings, v1["data"], strict=True):
        assert _cosine(list(mine), theirs["embedding"]) > 0.9999
    legacy = await client.embeddings("gemma", prompt=texts[0])
    assert _cosine(list(legacy.embedding), list(embedded.embeddings[0])) > 0.9999
    short = await client.embed("gemma", input=texts[0], dimensions=64)
    assert len(short.embeddings[0]) == 64
    # an empty input loads the model and embeds nothing (Ollama's way to preload)
    assert (await client.embed("thinker", input="")).embeddings == []
    assert _state(served, "thinker") == "loaded"
    # too long for one input: cut by default (Ollama's truncate), refused with truncate false
    long = "word " * 4000
    assert len((await client.embed("gemma", input=long)).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as refused:
        await client.embed("gemma", input=long, truncate=False)
    assert refused.value.status_code == 400
    assert "tokens" in refused.value.error


async def test_ps_lists_the_loaded_models_with_their_expiry_and_context(served: Served) -> None:
    client = served.client()
    assert (await client.ps()).models == []
    await client.embed("gemma", input="hello")
    running = (await client.ps()).models
    assert [m.model for m in running] == ["gemma:latest"]
    model = running[0]
    assert model.context_length == CTX
    assert model.size_vram == 0
    assert model.size is not None
    assert model.size >= (await trio.Path(served.models / "gemma.gguf").stat()).st_size
    assert model.expires_at is not None
    # idle now: its idle timer's deadline, the registry's keep-alive after the request
    assert 0 < model.expires_at.timestamp() - time.time() <= KEEP_ALIVE


async def test_pull_says_how_to_add_a_model_and_push_has_nowhere_to_go(served: Served) -> None:
    client = served.client()
    with pytest.raises(ollama.ResponseError) as refused:
        await client.pull("llama3.2")
    assert refused.value.status_code == 501
    assert "no model registry is reachable" in refused.value.error
    assert "--models-dir" in refused.value.error
    assert "/api/create" in refused.value.error
    assert (await client.pull("gemma")).status == "success"  # served already: nothing to download
    with pytest.raises(ollama.ResponseError) as pushed:
        await client.push("gemma")
    assert pushed.value.status_code == 501


async def test_bad_input_gets_ollamas_error_shape(served: Served, tmp_path: Path) -> None:
    async with served.http() as http:

        async def error(method: str, path: str, **kwargs: Any) -> tuple[int, str]:
            response = await http.request(method, path, **kwargs)
            body = response.json()
            assert set(body) == {"error"}, body
            return response.status_code, body["error"]

        status, message = await error("POST", "/api/show", json={"model": "nope:7b"})
        assert status == 404
        assert message.startswith('model "nope:7b" not found')
        status, message = await error("POST", "/api/embed", json={"model": "nope", "input": "x"})
        assert status == 404
        assert "--models-dir" in message
        status, message = await error(
            "POST", "/api/copy", json={"source": "gemma", "destination": "bad name!"}
        )
        assert status == 400
        assert "destination" in message
        for body, field in (
            ({"model": "y", "from": model_file(served), "template": "{{ .Prompt }}"}, "template"),
            ({"model": "y", "from": model_file(served), "parameters": {"temperature": 0.2}}, "temperature"),
            ({"model": "y", "from": "relative.gguf"}, "absolute"),
            ({"model": "y"}, "from"),
        ):
            status, message = await error("POST", "/api/create", json=body)
            assert status == 400, (body, message)
            assert field in message, (body, message)
        not_gguf = tmp_path / "notes.gguf"
        not_gguf.write_text("hello")
        status, message = await error("POST", "/api/create", json={"model": "y", "from": str(not_gguf)})
        assert status == 400
        assert "not a GGUF" in message
        # blobs: a digest that does not match, one that is not a digest, one too large
        status, message = await error("POST", f"/api/blobs/sha256:{'0' * 64}", content=b"not those bytes")
        assert status == 400
        assert "digest mismatch" in message
        assert not list(served.blobs.glob("*"))  # (nothing left behind)
        status, message = await error("POST", "/api/blobs/md5:abc", content=b"x")
        assert status == 400
        assert "sha256" in message
        status, message = await error(
            "POST", "/api/create", json={"model": "z", "files": {"m.gguf": "sha256:" + "1" * 64}}
        )
        assert status == 400
        assert "POST /api/blobs/" in message


def model_file(served: Served) -> str:
    return str(served.models / "gemma.gguf")


async def test_an_oversized_blob_is_a_413_that_names_the_flag(
    nursery: trio.Nursery, models_dir: Path, tmp_path: Path
) -> None:
    server, url = await _serve(nursery, models_dir, tmp_path / "blobs", max_blob_bytes=1024)
    data = os.urandom(4096)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()

    async def chunks() -> AsyncIterator[bytes]:  # (no Content-Length: the count stops it)
        for i in range(0, len(data), 512):
            yield data[i : i + 512]

    async with httpx.AsyncClient(base_url=url) as http:
        declared = await http.post(f"/api/blobs/{digest}", content=data)
        streamed = await http.post(f"/api/blobs/{digest}", content=chunks())
    for response in (declared, streamed):
        assert response.status_code == 413
        assert "--max-blob-bytes" in response.json()["error"]
    assert not (tmp_path / "blobs").exists() or not list((tmp_path / "blobs").iterdir())
    server.shutdown()


async def test_delete_removes_a_file_only_with_the_flag_and_only_in_a_models_dir(
    nursery: trio.Nursery, model_path: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    _link(Path(model_path), models / "gemma.gguf")
    _link(Path(model_path), models / "spare.gguf")
    outside = _link(Path(model_path), tmp_path / "outside.gguf")
    server, url = await _serve(nursery, models, tmp_path / "blobs", delete_files=True)
    client = ollama.AsyncClient(host=url)
    try:
        await client.create("visitor", from_=str(outside))
        await client.delete("visitor")
        await client.delete("spare")
    finally:
        await client.close()
    assert outside.is_file()  # (not in a --models-dir: kept)
    assert not (models / "spare.gguf").exists()
    assert (models / "gemma.gguf").is_file()
    server.shutdown()


async def test_keys_hold_on_the_ollama_routes_and_keep_alive_is_an_admins(
    nursery: trio.Nursery, llama_backend: Any
) -> None:
    """With keys: 401 in Ollama's shape without one; a plain key embeds but may not set
    ``keep_alive`` (it changes the model's lifetime for everyone: 403, as
    ``X-Keep-Alive``) nor copy a model; an admin key may. The single-model server's
    model is shown from its loaded backend's file."""
    from .._helpers import start_server

    running = await start_server(nursery, llama_backend, api_keys=("sk-plain",), admin_keys=("sk-admin",))
    plain, admin = {"Authorization": "Bearer sk-plain"}, {"Authorization": "Bearer sk-admin"}
    body = {"model": running.engine.backend.info.id, "input": "hello", "keep_alive": "5m"}
    async with httpx.AsyncClient(base_url=running.url, timeout=120) as http:
        refused = await http.get("/api/tags")
        assert refused.status_code == 401
        assert set(refused.json()) == {"error"}
        assert (await http.post("/api/embed", json=body, headers=plain)).status_code == 403
        assert "keep_alive" in (await http.post("/api/embed", json=body, headers=plain)).json()["error"]
        del body["keep_alive"]
        assert (await http.post("/api/embed", json=body, headers=plain)).status_code == 200
        copy = {"source": body["model"], "destination": "mine"}
        assert (await http.post("/api/copy", json=copy, headers=plain)).status_code == 403
        assert (await http.post("/api/copy", json=copy, headers=admin)).status_code == 200
        shown = (await http.post("/api/show", json={"model": "mine"}, headers=plain)).json()
        assert shown["details"]["family"] == "gemma3"
        assert "embedding" in shown["capabilities"]
    running.server.shutdown()
