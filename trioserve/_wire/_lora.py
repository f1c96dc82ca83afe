"""The bodies of the run-time LoRA endpoints (docs/lora.md, "Hot load and unload"):
vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, and
llama-server's ``POST /lora-adapters``; sans-IO."""

from __future__ import annotations

import msgspec

from ._codec import decode as _decode

__all__ = [
    "LoadLoraRequest",
    "LoraScale",
    "LoraScalesSet",
    "UnloadLoraRequest",
    "decode_load_lora",
    "decode_lora_scales",
    "decode_unload_lora",
]


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``{"lora_name", "lora_path"}``; ``model``: the base (default: the default
    model); ``scale``: its scale when a request names it without one (default 1)."""

    lora_name: str | None = None
    lora_path: str | None = None
    model: str | None = None
    scale: float = 1.0


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``{"lora_name"}``; ``model``: the base (default: the default model)."""

    lora_name: str | None = None
    model: str | None = None


class LoraScale(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry of llama-server's ``POST /lora-adapters``: an adapter by id, its scale."""

    id: int
    scale: float = 0.0


class LoraScalesSet(msgspec.Struct, kw_only=True):
    """``POST /lora-adapters``' answer (llama-server's)."""

    success: bool


_load = msgspec.json.Decoder(LoadLoraRequest)
_unload = msgspec.json.Decoder(UnloadLoraRequest)
_scales = msgspec.json.Decoder(list[LoraScale])


def decode_load_lora(body: bytes) -> LoadLoraRequest:
    """Raises :class:`~trioserve._core._exceptions.InvalidRequestError` naming the field."""
    return _decode(_load, body)


def decode_unload_lora(body: bytes) -> UnloadLoraRequest:
    return _decode(_unload, body)


def decode_lora_scales(body: bytes) -> list[LoraScale]:
    return _decode(_scales, body)
