"""Tiny random-weight LoRA adapters for the default model, made with ``gguf`` (no hub
downloads): written once, cached beside the model (docs/lora.md)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy

from trioserve._backends._models import default_model_path

__all__ = ["tiny_lora"]

#: the base tensors an adapter changes in every layer
_TARGETS = ("attn_q", "attn_v")


def tiny_lora(
    seed: int,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    amplitude: float = 0.04,
    wider: int = 0,
    invocation: tuple[int, ...] = (),
) -> Path:
    """The path of a LoRA adapter of the default model with random A and B matrices
    (``seed``), for every layer's query and value projections: its greedy text differs
    from the base model's. ``wider``: its A matrices take that many more inputs than the
    model's (an adapter of another base: llama.cpp refuses its shapes). ``invocation``:
    an activated LoRA (aLoRA) turned on by these tokens (the key
    ``convert_lora_to_gguf.py`` writes: ``adapter.alora.invocation_tokens``, uint32)."""
    import gguf

    source = default_model_path(progress=False)
    recipe = f"{source.stat().st_size}:{source.name}:lora:{seed}:{rank}:{alpha}:{amplitude}:{_TARGETS}:v1"
    if wider:
        recipe += f":wider{wider}"
    if invocation:
        recipe += f":alora{','.join(map(str, invocation))}"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    kind = "alora" if invocation else "lora"
    target = source.parent / "test-models" / f"{source.stem}-{kind}-{seed}-{digest}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    base = gguf.GGUFReader(str(source))
    arch = str(bytes(base.fields["general.architecture"].parts[-1]), "utf-8")
    rng = numpy.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(partial), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    if invocation:
        tokens = [int(t) for t in invocation]
        writer.add_key_value(
            "adapter.alora.invocation_tokens", tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
        )
    writer.add_name(f"trioserve tiny LoRA {seed} (random weights, tests only)")
    for tensor in base.tensors:
        stem = tensor.name.removesuffix(".weight")
        if not tensor.name.endswith(".weight") or stem.rsplit(".", 1)[-1] not in _TARGETS:
            continue
        n_in, n_out = (int(d) for d in tensor.shape)  # (ggml's order: ne[0] is the input)
        n_in += wider
        a = (rng.standard_normal((rank, n_in)) * amplitude).astype(numpy.float32)
        b = (rng.standard_normal((n_out, rank)) * amplitude).astype(numpy.float32)
        writer.add_tensor(f"{tensor.name}.lora_a", a)
        writer.add_tensor(f"{tensor.name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target
