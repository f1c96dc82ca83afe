"""The AMX guard (docs/platforms.md): llama.cpp's AMX kernels crash on AMX CPUs
(ggml-org/llama.cpp #20824), so a llama.cpp that reports ``AMX_INT8 = 1`` is loaded
without extra buffer types unless the user asks; and the venv the scripts build has no
AMX kernels at all."""

from __future__ import annotations

import llama_cpp
import pytest

from trioserve._backends._platform import decide_repack, system_features

#: llama_print_system_info() of llama-cpp-python built natively on a Sapphire Rapids Xeon
AMX_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 "
    "| REPACK = 1 | "
)
#: the same machine, built by scripts/_env.sh (-mno-amx-int8 -mno-amx-tile -mno-amx-bf16)
NO_AMX_INFO = AMX_INFO.replace("AMX_INT8 = 1 | ", "")


def test_system_info_is_read_as_features() -> None:
    features = system_features(AMX_INFO)
    assert features["AMX_INT8"] == 1
    assert features["REPACK"] == 1
    assert "AMX_INT8" not in system_features(NO_AMX_INFO)
    assert system_features("CPU : AVX2 = 0 | Metal : AVX2 = 1 |")["AVX2"] == 1  # the largest


def test_a_llama_cpp_with_amx_is_loaded_without_extra_buffers() -> None:
    decision = decide_repack(AMX_INFO, None)
    assert decision.extra_buffers is False
    assert decision.amx is True
    assert "#20824" in decision.reason
    assert "--repack on" in decision.reason  # says how to override


def test_without_amx_weights_are_repacked() -> None:
    decision = decide_repack(NO_AMX_INFO, None)
    assert decision.extra_buffers is True
    assert decision.amx is False


@pytest.mark.parametrize(
    ("info", "requested", "invariant", "extra"),
    [
        (AMX_INFO, True, False, True),  # --repack on: the user's build may have the fix
        (AMX_INFO, False, False, False),
        (NO_AMX_INFO, False, False, False),  # --repack off
        (NO_AMX_INFO, None, True, False),  # batch-invariant mode never repacks
        (NO_AMX_INFO, True, True, False),
    ],
)
def test_the_user_decides_where_asked(
    info: str, requested: bool | None, invariant: bool, extra: bool
) -> None:
    assert decide_repack(info, requested, batch_invariant=invariant).extra_buffers is extra


def test_the_installed_llama_cpp_has_no_amx_kernels() -> None:
    """The venv scripts/test builds: on any machine, no AMX_INT8 (a native build on an
    AMX CPU would have it, and crash on the first decode)."""
    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX_INT8" not in system_features(info), info
