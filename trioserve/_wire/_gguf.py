"""A GGUF file's header — its metadata and its tensors' shapes — read without the
weights (Ollama's ``/api/show``, ``/api/tags``: docs/models.md, "Ollama's model routes").

Blocking (a worker thread's): the header of a model with a large vocabulary holds
megabytes of token strings, walked here (their lengths read, their text skipped), which
takes a fraction of a second where ``gguf.GGUFReader`` (which maps every element) took
14 s on the default model. Arrays longer than :data:`ARRAY_KEEP` elements are kept as
their length only (Ollama's ``/api/show`` sends them as ``null`` unless ``verbose``).

The file is read from its start in :data:`CHUNK` pieces; :attr:`GGUFHeader.identity`
is the SHA-256 of those pieces (the whole header and the start of the weights) and the
file's size: a model's identity that costs no pass over its gigabytes (docs/models.md,
"Ollama's model routes")."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

__all__ = ["ARRAY_KEEP", "GGUFError", "GGUFHeader", "format_parameters", "quantization_name", "read_header"]

CHUNK = 1 << 20
#: arrays of more elements are kept as their length only
ARRAY_KEEP = 64
#: what a header may hold before it is refused as no model's (corrupt or hostile files)
MAX_HEADER_BYTES = 512 << 20
_MAX_STRING = 64 << 20
_MAX_TENSORS = 1 << 20
_MAX_ITEMS = 1 << 32

#: llama.cpp's ``llama_ftype`` values (``general.file_type``), as Ollama names them
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}  # fmt: skip

#: GGUF value types: (struct format, size) of the scalars; 8 = string, 9 = array
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_STRING, _ARRAY, _F32 = 8, 9, 6

type Value = int | float | bool | str | list[Value] | None


class GGUFError(ValueError):
    """The file is not a GGUF this reader can read (the message says why)."""


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    #: every key's value; an array over :data:`ARRAY_KEEP` elements is ``None`` (its
    #: length is in :attr:`array_lengths`)
    metadata: dict[str, Value]
    tensor_count: int
    #: the weights' elements, every tensor's together (``general.parameter_count``)
    parameters: int
    #: the SHA-256 of the file's first pieces (the header) and its size, in hex
    identity: str
    array_lengths: dict[str, int] = field(default_factory=dict[str, int])

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def get_int(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def get_str(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None


class _Reader:
    """The file from its start, in :data:`CHUNK` pieces, each hashed as it is read."""

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file = file
        self._buffer = bytearray()
        self._at = 0  # the position in the buffer
        self._offset = 0  # the buffer's first byte in the file
        self.hasher = hashlib.sha256()
        self.hasher.update(struct.pack("<Q", size))

    @property
    def position(self) -> int:
        return self._offset + self._at

    def _need(self, n: int) -> None:
        while len(self._buffer) - self._at < n:
            if self.position + n > MAX_HEADER_BYTES:
                raise GGUFError(f"its header is larger than {MAX_HEADER_BYTES >> 20} MiB")
            chunk = self._file.read(CHUNK)
            if not chunk:
                raise GGUFError("the file ends inside its header (truncated?)")
            self.hasher.update(chunk)
            if self._at > CHUNK:  # (what was read is not needed again)
                del self._buffer[: self._at]
                self._offset += self._at
                self._at = 0
            self._buffer += chunk

    def take(self, n: int) -> bytes:
        self._need(n)
        data = bytes(self._buffer[self._at : self._at + n])
        self._at += n
        return data

    def unpack(self, fmt: str, size: int) -> int | float | bool:
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._buffer, self._at)
        self._at += size
        return value  # type: ignore[no-any-return]

    def u32(self) -> int:
        return int(self.unpack("<I", 4))

    def u64(self) -> int:
        return int(self.unpack("<Q", 8))

    def skip(self, n: int) -> None:
        while n > 0:
            self._need(1)
            step = min(n, len(self._buffer) - self._at)
            self._at += step
            n -= step

    def string(self, limit: int = _MAX_STRING) -> str:
        length = self.u64()
        if length > limit:
            raise GGUFError(f"a string of {length} bytes at offset {self.position}")
        return self.take(length).decode("utf-8", errors="replace")


def _f32(value: float) -> float:
    """A float32 as its shortest decimal (Go's JSON writes ``1e-06``, not the
    float64 widening ``9.999999974752427e-07``)."""
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == packed:
            return short
    return value


def _value(reader: _Reader, kind: int) -> Value:
    if kind == _STRING:
        return reader.string()
    scalar = _SCALARS.get(kind)
    if scalar is None:
        raise GGUFError(f"an unknown value type {kind} at offset {reader.position}")
    value = reader.unpack(*scalar)
    return _f32(float(value)) if kind == _F32 else value


def _array(reader: _Reader, key: str, lengths: dict[str, int]) -> Value:
    kind = reader.u32()
    count = reader.u64()
    if count > _MAX_ITEMS:
        raise GGUFError(f"{key}: an array of {count} elements")
    keep = count <= ARRAY_KEEP
    if not keep:
        lengths[key] = count
    if kind == _ARRAY:
        items = [_array(reader, key, {}) for _ in range(count)]
        return items if keep else None
    if keep:
        return [_value(reader, kind) for _ in range(count)]
    if kind == _STRING:
        for _ in range(count):  # (each string's length, its text skipped)
            length = reader.u64()
            if length > _MAX_STRING:
                raise GGUFError(f"{key}: a string of {length} bytes")
            reader.skip(length)
    else:
        scalar = _SCALARS.get(kind)
        if scalar is None:
            raise GGUFError(f"{key}: an unknown element type {kind}")
        reader.skip(scalar[1] * count)
    return None


def read_header(file: BinaryIO, size: int) -> GGUFHeader:
    """The header of the GGUF ``file`` (``size``: its size in bytes). Raises
    :class:`GGUFError` for a file that is not a GGUF (version 2 or 3) or is cut short.
    Blocking."""
    reader = _Reader(file, size)
    try:
        magic = reader.take(4)
    except GGUFError:
        raise GGUFError("the file is empty or shorter than a GGUF header") from None
    if magic != b"GGUF":
        raise GGUFError(f"it does not start with GGUF's magic bytes (it starts with {magic!r})")
    version = reader.u32()
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} (versions 2 and 3 are read)")
    tensors, keys = reader.u64(), reader.u64()
    if tensors > _MAX_TENSORS or keys > _MAX_TENSORS:
        raise GGUFError(f"{tensors} tensors and {keys} keys: not a model's header")
    metadata: dict[str, Value] = {}
    lengths: dict[str, int] = {}
    for _ in range(keys):
        key = reader.string(limit=1 << 16)
        kind = reader.u32()
        metadata[key] = _array(reader, key, lengths) if kind == _ARRAY else _value(reader, kind)
    parameters = 0
    for _ in range(tensors):
        reader.string(limit=1 << 16)
        dims = reader.u32()
        if dims > 8:
            raise GGUFError(f"a tensor of {dims} dimensions")
        elements = 1
        for _ in range(dims):
            elements *= reader.u64()
        reader.skip(4 + 8)  # its type and offset
        parameters += elements
    return GGUFHeader(
        version=version,
        metadata=metadata,
        tensor_count=tensors,
        parameters=parameters,
        identity=reader.hasher.hexdigest(),
        array_lengths=lengths,
    )


def quantization_name(file_type: int | None) -> str | None:
    """``general.file_type`` as Ollama's ``quantization_level`` (``Q4_K_M``)."""
    if file_type is None:
        return None
    return _FILE_TYPES.get(file_type, f"unknown ({file_type})")


def format_parameters(count: int) -> str:
    """A parameter count as Ollama's ``parameter_size``: ``268.10M``, ``8.0B``."""
    for scale, suffix, digits in ((1e12, "T", 1), (1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 2)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.{digits}f}{suffix}"
    return str(count)
