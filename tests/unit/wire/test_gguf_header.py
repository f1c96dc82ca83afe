"""A GGUF header read without its weights (``trioserve/_wire/_gguf.py``): the default
model's facts as Ollama reports them, and files that are not GGUF models refused with
the reason, never a crash or an unbounded read."""

from __future__ import annotations

import io
import struct

import pytest

from trioserve._wire._gguf import GGUFError, format_parameters, quantization_name, read_header


def test_the_default_models_header_says_what_ollama_says(model_path: str) -> None:
    with open(model_path, "rb") as file:
        size = file.seek(0, io.SEEK_END)
        file.seek(0)
        header = read_header(file, size)
    assert header.architecture == "gemma3"
    assert header.parameters == 268098176
    assert format_parameters(header.parameters) == "268.10M"  # (Ollama's gemma3:270m)
    assert quantization_name(header.get_int("general.file_type")) == "Q4_K_M"
    assert header.metadata["gemma3.attention.layer_norm_rms_epsilon"] == 1e-06  # (float32, shortest)
    assert header.metadata["tokenizer.ggml.tokens"] is None
    assert header.array_lengths["tokenizer.ggml.tokens"] == 262144
    assert header.metadata["general.tags"] == ["gemma3", "gemma", "google", "text-generation"]


def _gguf(*parts: bytes) -> io.BytesIO:
    return io.BytesIO(b"".join(parts))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"PK\x03\x04zipfile", "magic"),
        (b"GGUF" + struct.pack("<I", 1), "version 1"),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 99),
            "type 99",
        ),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40), "a string of"),
        (b"GGUF" + struct.pack("<IQQ", 3, 1, 0), "ends inside"),
    ],
)
def test_a_file_that_is_no_gguf_model_is_refused_with_why(data: bytes, reason: str) -> None:
    with pytest.raises(GGUFError, match=reason):
        read_header(_gguf(data), len(data))


def test_parameter_sizes_are_written_as_ollama_writes_them() -> None:
    assert format_parameters(8_030_261_248) == "8.0B"
    assert format_parameters(7_000_000_000) == "7B"
    assert format_parameters(999) == "999"
