"""Ollama's model routes (docs/models.md, "Ollama's model routes"; the fields:
docs/api.md): ``GET /api/version``, ``GET /api/tags``, ``POST /api/show``,
``GET /api/ps``, ``POST /api/copy``, ``DELETE /api/delete``, ``POST /api/create``,
``POST /api/pull`` and ``POST /api/push``, in quart, answered in Ollama's shapes (errors:
``{"error": "…"}``). The names are the registry's (copy and delete change its names,
create adds a model); no file is read on the event loop, and none is ever deleted
unless the server was started with ``--delete-model-files``."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import InvalidRequestError, NotSupportedError, TrioserveError
from .._core._registry import ModelEntry, ModelSpec
from .._wire import encode_json
from .._wire._gguf import GGUFError
from .._wire._ollama_models import (
    OLLAMA_VERSION,
    CopyRequest,
    CreateRequest,
    DeleteRequest,
    PullRequest,
    ShowRequest,
    check_model_name,
    create_settings,
    decode_ollama,
    file_details,
    model_info,
    ollama_time,
)
from .._wire._ollama_names import LATEST, ollama_listed_name, ollama_model_name
from ._access import AccessPolicy
from ._errors import render_ollama
from ._ollama_facts import FileFacts, ModelFacts, model_path, resolve_ollama
from ._props import BUILD_PREFIX, _version
from ._route_io import error_response
from ._state import ServerState

__all__ = ["add_ollama_routes", "blob_path"]

#: a blob's digest, as Ollama's clients write it (``sha256:<hex>``; ``sha256-<hex>`` too)
DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_NDJSON = "application/x-ndjson"

JsonBody = Callable[[Callable[[bytes], Any]], Awaitable[Any]]


def blob_path(blobs_dir: Path, digest: str, param: str = "digest") -> Path:
    """Where the blob ``digest`` is kept; 400 naming ``param`` for a malformed digest."""
    match = DIGEST.match(digest)
    if match is None:
        raise InvalidRequestError(
            f"{param}: {digest!r} is not a blob digest (sha256:<64 lowercase hex digits>)", param=param
        )
    return blobs_dir / f"sha256-{match.group(1)}"


def _json(body: object, status: int = 200) -> Response:
    return Response(encode_json(body), status=status, content_type="application/json")


def _error(exc: TrioserveError) -> Response:
    return error_response(exc, render_ollama)


def _statuses(lines: list[str], stream: bool | None) -> Response:
    """A model operation's answer: Ollama's status lines (NDJSON) unless ``stream`` is
    false, then the last one alone."""
    if stream is False:
        return _json({"status": lines[-1]})
    body = b"".join(encode_json({"status": line}) + b"\n" for line in lines)
    return Response(body, content_type=_NDJSON)


def add_ollama_routes(
    app: QuartTrio, state: ServerState, access: AccessPolicy | None, json_body: JsonBody
) -> None:
    """Serve Ollama's model routes on ``app`` (``json_body``: the app's body reader,
    with its limits and timeout)."""
    facts = ModelFacts(state)
    #: the license text ``/api/create`` was given, per model
    licenses: dict[ModelEntry, str] = {}

    def served_names(entry: ModelEntry) -> list[str]:
        return [name for name in entry.names if name]

    def listed(entry: ModelEntry, name: str, found: FileFacts | None) -> dict[str, object]:
        header = found.header if found is not None else None
        shown = ollama_listed_name(name)
        return {
            "name": shown,
            "model": shown,
            "modified_at": ollama_time(
                found.modified if found is not None else entry.loaded_at or time.time()
            ),
            "size": max(entry.spec.source.footprint(), found.size if found is not None else 0),
            "digest": header.identity if header is not None else "",
            "details": file_details(header),
        }

    @app.get("/api/version")
    async def version() -> Response:
        """The Ollama API release served (numeric: clients compare it), and trioserve's
        own version."""
        return _json({"version": OLLAMA_VERSION, "trioserve": f"{BUILD_PREFIX} {_version()}"})

    @app.get("/api/tags")
    async def tags() -> Response:
        """Every served name (aliases too), as ``ollama list`` shows them."""
        try:
            entries = list(state.serving_registry().entries)
        except TrioserveError as exc:
            return _error(exc)
        found = await facts.of_all(entries)
        models = [
            listed(entry, name, entry_facts)
            for entry, entry_facts in zip(entries, found, strict=True)
            for name in served_names(entry)
        ]
        return _json({"models": models})

    @app.post("/api/show")
    async def show() -> Response:
        """One model: its details, its GGUF's metadata, its chat template, what it can
        do. Never loads it."""
        try:
            request = await json_body(lambda body: decode_ollama(ShowRequest, body))
            if request.verbose:
                raise InvalidRequestError(
                    "verbose is not supported: the vocabulary's arrays are not sent (model_info holds "
                    "their keys, as null); send show without it",
                    param="verbose",
                )
            entry = resolve_ollama(state, request.model or request.name)
        except TrioserveError as exc:
            return _error(exc)
        found = await facts.of(entry)
        header = found.header if found is not None else None
        context = facts.context_length(entry)
        engine = entry.engine
        template = engine.backend.info.chat_template if engine is not None else None
        if template is None and header is not None:
            template = header.get_str("tokenizer.chat_template")
        parameters = f"num_ctx {context}" if context is not None else ""
        source = model_path(entry) or entry.spec.source.description
        modelfile = f"# Modelfile generated by trioserve\nFROM {source}\n"
        license_text = licenses.get(entry) or (
            header.get_str("general.license") if header is not None else None
        )
        return _json(
            {
                "license": license_text or "",
                "modelfile": modelfile + (f"PARAMETER {parameters}\n" if parameters else ""),
                "parameters": parameters,
                "template": template or "",
                "details": file_details(header),
                "model_info": model_info(header, context) if header is not None else {},
                "capabilities": facts.capabilities(entry, found),
                "modified_at": ollama_time(found.modified if found is not None else time.time()),
            }
        )

    @app.get("/api/ps")
    async def ps() -> Response:
        """The loaded models: when each is unloaded (its idle timer), its size (the
        larger of its files and what its load added: everything is in host memory,
        ``size_vram`` 0), its context per sequence."""
        try:
            registry = state.serving_registry()
        except TrioserveError as exc:
            return _error(exc)
        snapshot = {model.name: model for model in registry.snapshot().models}
        loaded = [entry for entry in registry.entries if entry.state == "loaded" and served_names(entry)]
        found = await facts.of_all(loaded)
        models = []
        for entry, entry_facts in zip(loaded, found, strict=True):
            body = listed(entry, served_names(entry)[0], entry_facts)
            model = snapshot.get(entry.name)
            deadline = model.idle_deadline if model is not None else None
            body.update(
                size=max(entry.footprint(), int(body["size"])),  # type: ignore[call-overload]
                expires_at=ollama_time(facts.expires_at(entry, deadline)),
                size_vram=0,
                context_length=facts.context_length(entry),
            )
            del body["modified_at"]
            models.append(body)
        return _json({"models": models})

    @app.post("/api/copy")
    async def copy() -> Response:
        """A second name for a model: an alias (nothing is copied or loaded)."""
        try:
            request = await json_body(lambda body: decode_ollama(CopyRequest, body))
            check_model_name(request.destination, "destination")
            entry = resolve_ollama(state, request.source, "source")
            registry = state.serving_registry()
            registry.add_alias(served_names(entry)[0], request.destination.removesuffix(LATEST))
        except TrioserveError as exc:
            return _error(exc)
        return _json({"status": "success"})

    @app.delete("/api/delete")
    async def delete() -> Response:
        """Take a name away; with a model's last name, the model (unloaded, its streams
        given the unload grace). Its file stays, unless ``--delete-model-files`` and it
        lies in a ``--models-dir`` or the blob store."""
        try:
            request = await json_body(lambda body: decode_ollama(DeleteRequest, body))
            name = request.model or request.name
            entry = resolve_ollama(state, name)
            registry = state.serving_registry()
            assert name is not None
            served = ollama_model_name(name, set(registry.names()).__contains__)
            path = model_path(entry)
            _, gone = await registry.remove_name(served)
        except TrioserveError as exc:
            return _error(exc)
        body: dict[str, object] = {"status": "success", "model_deleted": gone}
        if gone:
            licenses.pop(entry, None)
            if path is not None:
                body["file_deleted"] = await delete_file(path, registry.entries)
        return _json(body)

    async def delete_file(path: Path, entries: list[ModelEntry]) -> bool:
        """Delete a forgotten model's file, only where the operator allowed it."""
        files = state.settings.model_files
        if not files.delete_files or any(model_path(e) == path for e in entries):
            return False
        roots = [*files.model_dirs, *([files.blobs_dir] if files.blobs_dir is not None else [])]
        resolved = await trio.to_thread.run_sync(path.resolve)
        if not any(resolved.is_relative_to(root.resolve()) for root in roots):
            return False
        with contextlib.suppress(FileNotFoundError):
            await trio.to_thread.run_sync(resolved.unlink)
        return True

    @app.post("/api/pull")
    async def pull() -> Response:
        """No registry is reachable: a model served already answers success (nothing
        to download); any other, 501 saying how to add a local model."""
        try:
            request = await json_body(lambda body: decode_ollama(PullRequest, body))
            name = request.model or request.name
            try:
                resolve_ollama(state, name)
            except TrioserveError:
                raise NotSupportedError(
                    f'no model registry is reachable from this server: "{name}" cannot be pulled. Add a '
                    "local GGUF instead: start the server with --model NAME=PATH or --models-dir DIR, or "
                    'POST /api/create {"model": NAME, "from": "/path/to/model.gguf"} (or upload '
                    "the file with POST /api/blobs/sha256:<digest> and create it from files)",
                    code="no_registry",
                ) from None
        except TrioserveError as exc:
            return _error(exc)
        return _statuses(["pulling manifest", "success"], request.stream)

    @app.post("/api/push")
    async def push() -> Response:
        try:
            await json_body(lambda body: decode_ollama(PullRequest, body))
        except TrioserveError as exc:
            return _error(exc)
        return _error(
            NotSupportedError(
                "no model registry is reachable from this server: nothing can be pushed; the models it "
                "serves are GGUF files on its disk (GET /api/show names each one's file)",
                code="no_registry",
            )
        )

    @app.post("/api/create")
    async def create() -> Response:
        """A new model from a GGUF on the server (``from``: a path, or a served model's
        name) or an uploaded blob (``files``), with its load settings (``parameters``);
        loaded on its first request."""
        try:
            request = await json_body(lambda body: decode_ollama(CreateRequest, body))
            lines, _ = await create_model(request)
        except TrioserveError as exc:
            return _error(exc)
        return _statuses(lines, request.stream)

    async def create_model(request: CreateRequest) -> tuple[list[str], ModelEntry]:
        name = request.model or request.name
        if not name:
            raise InvalidRequestError("model is required: the new model's name", param="model")
        check_model_name(name, "model")
        settings = create_settings(request)
        registry = state.serving_registry()
        if state.model_maker is None:
            raise NotSupportedError(
                "this server cannot add models: it serves one backend it was given (--scripted, "
                "--upstream, or a library's Server); run trioserve serve with GGUF models",
                code="cannot_add_models",
            )
        path, lines = await source_file(request)
        try:
            found = await facts.file(path)
        except GGUFError as exc:
            raise InvalidRequestError(f"{path} is not a GGUF model: {exc}", param=lines[0]) from None
        except OSError as exc:
            raise InvalidRequestError(
                f"{path} cannot be read: {exc.strerror or exc}", param=lines[0]
            ) from None
        if found.header.architecture is None:
            raise InvalidRequestError(
                f"{path} is a GGUF without general.architecture: not a model llama.cpp can load",
                param=lines[0],
            )
        source = state.model_maker(name.removesuffix(LATEST), path, settings)
        entry = registry.add(ModelSpec(name=name.removesuffix(LATEST), source=source))
        license_text = request.license
        if isinstance(license_text, list):
            license_text = "\n".join(license_text)
        if license_text:
            licenses[entry] = license_text
        return ["parsing GGUF", f"using existing layer sha256:{found.header.identity}", "writing manifest",
                "success"], entry  # fmt: skip

    async def source_file(request: CreateRequest) -> tuple[Path, list[str]]:
        """The new model's GGUF, and the field that named it (first of the list)."""
        if (request.from_ is None) == (request.files is None):
            raise InvalidRequestError(
                "send from (a GGUF path on the server, or a served model's name) or files (an uploaded "
                "blob), one of the two",
                param="from",
            )
        if request.from_ is not None:
            registry = state.serving_registry()
            served = ollama_model_name(request.from_, set(registry.names()).__contains__)
            if served in registry.names():
                path = model_path(registry.resolve(served))
                if path is None:
                    raise InvalidRequestError(
                        f"from: the model {request.from_!r} has no GGUF file here (a scripted or upstream "
                        "backend's)",
                        param="from",
                    )
                return path, ["from"]
            path = await trio.to_thread.run_sync(lambda: Path(str(request.from_)).expanduser())
            if not path.is_absolute():
                raise InvalidRequestError(
                    f"from: {request.from_!r} is not a served model, nor an absolute path to a GGUF file on "
                    "the server",
                    param="from",
                )
            return path, ["from"]
        files = request.files or {}
        if len(files) != 1:
            raise InvalidRequestError(
                f"files: one GGUF per model here (a multi-file or projector model: use --models-dir); got "
                f"{len(files)} file(s)",
                param="files",
            )
        ((file_name, digest),) = files.items()
        blobs = state.settings.model_files.blobs_dir
        if blobs is None:
            raise NotSupportedError("this server keeps no blobs (no blob directory)", code="no_blobs")
        path = blob_path(blobs, digest, param=f"files.{file_name}")
        if not await trio.to_thread.run_sync(path.is_file):
            raise InvalidRequestError(
                f"files.{file_name}: the blob {digest} is not on this server; upload it first: "
                f"POST /api/blobs/{digest}",
                param=f"files.{file_name}",
            )
        return path, [f"files.{file_name}"]
