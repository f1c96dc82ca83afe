"""What Ollama's model routes say about a model (docs/models.md, "Ollama's model
routes"): its file (path, size, time), its GGUF header — read once per file stamp
(device, inode, size, mtime) in a worker thread and cached, never on the event loop —
and what it can do (``capabilities``): the loaded backend's facts once it is loaded,
else the file's."""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from .._core._backend import Backend
from .._core._exceptions import InvalidRequestError, NotFoundError
from .._core._registry import ModelEntry
from .._wire import chat_format_for
from .._wire._gguf import GGUFError, GGUFHeader, read_header
from .._wire._ollama_names import ollama_model_name
from ._props import context_length
from ._state import ServerState

__all__ = ["FileFacts", "ModelFacts", "embeds", "model_path", "resolve_ollama"]

#: the FIM token keys llama.cpp reads from a GGUF (an unloaded model's ``insert``)
_FIM_KEYS = (
    "tokenizer.ggml.fim_pre_token_id",
    "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.fim_mid_token_id",
)
#: a chat template that renders the tools it is given (Ollama: a template using .Tools)
_TOOLS = re.compile(r"\btools\b")
#: headers read at once (a listing of a large models directory)
_READERS = 4
#: ``expires_at`` of a model kept loaded forever: Go's ``time.Now().Add(math.MaxInt64)``,
#: as Ollama answers it
_FOREVER = (2**63 - 1) / 1e9


def embeds(backend: Backend) -> bool:
    """Whether ``backend`` computes embeddings (or forwards them: the upstream relay)."""
    return backend.embedding_size is not None or type(backend).embed_inputs is not Backend.embed_inputs


def model_path(entry: ModelEntry) -> Path | None:
    """The model's GGUF (its first shard), as its source or loaded backend names it;
    ``None``: it has no file here (the scripted backend, an upstream relay)."""
    settings = getattr(entry.spec.source, "settings", None)
    if settings is None and entry.engine is not None:
        settings = getattr(entry.engine.backend, "settings", None)
    path = getattr(settings, "model_path", None)
    return Path(path) if path is not None else None


def resolve_ollama(state: ServerState, name: str | None, param: str = "model") -> ModelEntry:
    """The model an Ollama client names (``name:tag``; ``:latest`` implied); 404 in
    Ollama's words, saying how a model is added here."""
    if not name:
        raise InvalidRequestError(f"{param} is required", param=param)
    registry = state.serving_registry()
    known = set(registry.names())
    try:
        return state.resolve(ollama_model_name(name, known.__contains__))
    except NotFoundError:
        raise NotFoundError(
            f'model "{name}" not found; this server serves {", ".join(sorted(known)) or "none"}. Add one '
            'with --model NAME=PATH or --models-dir DIR, or POST /api/create {"model": NAME, "from": '
            '"/path/to/model.gguf"}',
            param=param,
            code="model_not_found",
        ) from None


@dataclass(frozen=True, slots=True)
class FileFacts:
    path: Path
    header: GGUFHeader
    size: int
    modified: float
    #: its chat template writes reasoning markers (the chat format's rule)
    reasons: bool


def _read(path: Path) -> FileFacts:
    """Blocking: the file's header and what its chat template does."""
    with open(path, "rb") as file:
        st = os.fstat(file.fileno())
        header = read_header(file, st.st_size)
    template = header.get_str("tokenizer.chat_template")
    reasons = False
    if template:
        reasons = chat_format_for(template=template, architecture=header.architecture).reasoning is not None
    return FileFacts(path, header, st.st_size, st.st_mtime, reasons)


class ModelFacts:
    """The file facts of the served models, cached by file stamp."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._cache: dict[tuple[str, int, int, int, int], FileFacts] = {}
        self._locks: dict[str, trio.Lock] = {}
        self._limit = trio.CapacityLimiter(_READERS)

    async def file(self, path: Path) -> FileFacts:
        """``path``'s facts (read in a worker thread on first use, and again when the
        file changes). Raises :class:`GGUFError` for a file that is not a GGUF and
        :class:`OSError` for one that cannot be read. Cancellation: waits for a read in
        flight (a fraction of a second)."""
        lock = self._locks.setdefault(str(path), trio.Lock())
        async with lock:
            st = await trio.to_thread.run_sync(os.stat, path)
            key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._cache.get(key)
            if cached is None:
                cached = await trio.to_thread.run_sync(_read, path, limiter=self._limit)
                for old in [k for k in self._cache if k[0] == key[0]]:
                    del self._cache[old]
                self._cache[key] = cached
            return cached

    async def of(self, entry: ModelEntry) -> FileFacts | None:
        """``entry``'s file facts; ``None``: it has no GGUF here, or it cannot be read
        now (moved, not a GGUF: its load says why)."""
        path = model_path(entry)
        if path is None:
            return None
        try:
            return await self.file(path)
        except (OSError, GGUFError):
            return None

    async def of_all(self, entries: list[ModelEntry]) -> list[FileFacts | None]:
        """:meth:`of` of each, read side by side (at most :data:`_READERS` at once)."""
        found: list[FileFacts | None] = [None] * len(entries)

        async def one(i: int) -> None:
            found[i] = await self.of(entries[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(entries)):
                nursery.start_soon(one, i)
        return found

    def capabilities(self, entry: ModelEntry, facts: FileFacts | None) -> list[str]:
        """Ollama's ``capabilities``, from what the model really does: the loaded
        backend's facts, else its file's. ``tools``: its chat template renders tools
        (trioserve serves ``tools`` on every model, through its fallback format and the
        constraint: docs/structured-output.md — this says the model was made for them,
        as Ollama's does); ``thinking``: its template writes reasoning markers;
        ``insert``: it has FIM tokens; ``embedding``: it computes vectors."""
        engine = entry.engine
        if engine is not None:
            info = engine.backend.info
            generates, infill, vision = info.generates, bool(info.infill), info.vision
            template = info.chat_template or ""
            reasons = self._state.chat_format(engine).reasoning is not None
            vectors = embeds(engine.backend)
        elif facts is not None:
            header = facts.header
            causal = header.metadata.get(f"{header.architecture}.attention.causal")
            generates = causal is not False
            infill = all(key in header.metadata for key in _FIM_KEYS)
            vision = "image" in getattr(entry.spec.source, "input_modalities", ())
            template = header.get_str("tokenizer.chat_template") or ""
            reasons = facts.reasons
            vectors = True  # (every GGUF served by the llama backend embeds)
        else:
            return ["completion"]
        found = []
        if generates:
            found.append("completion")
            if _TOOLS.search(template):
                found.append("tools")
            if infill:
                found.append("insert")
            if vision:
                found.append("vision")
            if reasons:
                found.append("thinking")
        if vectors:
            found.append("embedding")
        return found

    def expires_at(self, entry: ModelEntry, idle_deadline: float | None) -> float:
        """When the idle timer will unload ``entry`` (Unix seconds): its timer's
        ``idle_deadline`` (the registry's snapshot); in use, its keep-alive from now;
        kept forever: Ollama's far date."""
        now = time.time()
        if idle_deadline is not None:
            return now + max(0.0, idle_deadline - trio.current_time())
        registry = self._state.registry
        keep = entry.spec.keep_alive
        if keep is None and registry is not None:
            keep = registry.keep_alive
        if entry.spec.pinned or keep is None or not math.isfinite(keep):
            return now + _FOREVER
        return now + keep

    @staticmethod
    def context_length(entry: ModelEntry) -> int | None:
        return context_length(entry)
