"""The ``**options`` of the backend seam's methods (``rerank``, ``embed_inputs``) and of a
model load take their ``TypedDict``'s keywords only: a library caller's misspelled
keyword is a ``TypeError``, as a plain signature makes it — never silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve import LlamaSettings, ScriptedBackend, UpstreamBackend
from trioserve._backends._llama._loading import LoadControls, load
from trioserve._core._backend import EmbeddingOptions, ModelInfo, RerankOptions, check_options


def test_known_keywords_pass_and_an_unknown_one_is_named() -> None:
    check_options({}, RerankOptions)
    check_options({"instruction": None, "max_tokens_per_doc": 3, "max_tokens": None}, RerankOptions)
    check_options({"dimensions": 8, "max_tokens": 10}, EmbeddingOptions)
    with pytest.raises(TypeError, match="max_token ") as refused:
        check_options({"max_token": 3}, RerankOptions)
    assert "instruction, max_tokens, max_tokens_per_doc" in str(refused.value)


async def test_the_default_rerank_and_embeddings_refuse_a_misspelled_keyword() -> None:
    backend = ScriptedBackend()
    with pytest.raises(TypeError, match="max_token"):
        await backend.rerank("q", ["d"], max_token=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="dimension"):
        await backend.embed_inputs(["a"], dimension=8)  # type: ignore[call-arg]


async def test_the_upstream_relay_refuses_a_misspelled_keyword_before_any_call() -> None:
    backend = UpstreamBackend(["http://127.0.0.1:9"], info=ModelInfo(id="m", context_length=100))
    with pytest.raises(TypeError, match="instructions"):
        await backend.rerank("q", ["d"], instructions="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="dimension"):
        await backend.embed_inputs(["a"], dimension=8)  # type: ignore[call-arg]


def test_a_load_refuses_a_misspelled_control_before_reading_the_file(tmp_path: Path) -> None:
    settings = LlamaSettings(model_path=tmp_path / "absent.gguf")
    with pytest.raises(TypeError, match="progres"):
        load(object, settings, progres=print)  # type: ignore[call-arg, arg-type, type-var]
    controls: LoadControls = {"progress": None, "abort": None}
    with pytest.raises(FileNotFoundError):  # (the known ones pass the check)
        load(object, settings, **controls)  # type: ignore[arg-type, type-var]
