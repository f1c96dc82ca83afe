"""What the loaded llama.cpp can run on this CPU, and the choices made from it.

llama.cpp's AMX kernels crash on CPUs that have AMX (Xeon Sapphire Rapids and later,
most current x86 cloud instances): ``ggml_backend_amx_mul_mat`` faults at ``ldtilecfg``
on the first decode (ggml-org/llama.cpp #20824, open; PR #26954). A native build of
llama-cpp-python compiles them in when the CPU reports ``amx_int8``, and repacked weights
then go to the AMX buffer type. trioserve's own scripts build llama.cpp without AMX
(``scripts/_env.sh``); for a llama-cpp-python brought by the user, :func:`decide_repack`
loads the model without extra buffer types (no AMX, no repacking) when the library
reports ``AMX_INT8 = 1``, unless the user asks for them (``--repack on``). Measurements:
``docs/platforms.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["RepackDecision", "decide_repack", "system_features"]

_FEATURE = re.compile(r"([A-Z0-9_]+)\s*=\s*(\d+)")


def system_features(system_info: str) -> dict[str, int]:
    """``llama_print_system_info()``'s ``NAME = value`` pairs (``AVX2 = 1``, ``REPACK =
    1``, ``AMX_INT8 = 1``…); a name listed twice (one per backend) keeps its largest value."""
    features: dict[str, int] = {}
    for name, value in _FEATURE.findall(system_info):
        features[name] = max(features.get(name, 0), int(value))
    return features


@dataclass(frozen=True, slots=True)
class RepackDecision:
    """Whether the model is loaded with llama.cpp's extra buffer types
    (``use_extra_bufts``: repacked weights, and AMX where it was built in), and why."""

    extra_buffers: bool
    reason: str
    #: the loaded llama.cpp has AMX kernels (``AMX_INT8 = 1``)
    amx: bool

    def to_dict(self) -> dict[str, object]:
        return {"extra_buffers": self.extra_buffers, "amx": self.amx, "reason": self.reason}


def decide_repack(
    system_info: str, requested: bool | None, *, batch_invariant: bool = False
) -> RepackDecision:
    """Decide ``use_extra_bufts``. ``requested``: ``True`` (``--repack on``), ``False``
    (``off``), ``None`` (``auto``: on unless the library has AMX kernels)."""
    amx = system_features(system_info).get("AMX_INT8", 0) > 0
    if batch_invariant:
        return RepackDecision(
            False, "batch-invariant mode: repacked weights have GEMM kernels of their own", amx
        )
    if requested is False:
        return RepackDecision(False, "--repack off", amx)
    if requested is True:
        if amx:
            return RepackDecision(
                True, "--repack on, with AMX kernels: they crash on AMX CPUs (ggml-org/llama.cpp #20824)", amx
            )
        return RepackDecision(True, "--repack on", amx)
    if amx:
        return RepackDecision(
            False,
            "this llama.cpp was built with AMX kernels (AMX_INT8 = 1), which crash on the first decode "
            "(ggml-org/llama.cpp #20824): loaded without extra buffer types (no repacking); rebuild "
            "llama-cpp-python without AMX (scripts/_env.sh) to get repacking back, or pass --repack on",
            amx,
        )
    return RepackDecision(True, "auto: repacked weights for this CPU's kernels", amx)
