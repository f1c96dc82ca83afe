# Shared by scripts/serve and scripts/test: find Python 3.13 and prepare .venv.
# Quart 0.23 / quart-trio 0.13 need Python >= 3.13.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.13 python3.14; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info >= (3, 13)' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    # pyenv installs that are not the global version
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[3-9]*/bin/python3; do
        if [ -x "$candidate" ]; then echo "$candidate"; return 0; fi
    done
    echo "error: Python >= 3.13 not found (set PYTHON=/path/to/python3.13)" >&2
    return 1
}

ensure_system_packages() {
    # $@: commands that must exist, as "command:debian-package"
    local wanted missing="" entry
    for entry in "$@"; do
        command -v "${entry%%:*}" >/dev/null 2>&1 || missing="$missing ${entry##*:}"
    done
    [ -z "$missing" ] && return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: missing system packages:$missing (no apt-get to install them)" >&2
        return 1
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing system packages:$missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq && $sudo apt-get install -y -qq $missing >/dev/null
}

ensure_venv() {
    # $1: the extras to install, e.g. "test"
    local extras="$1"
    if [ ! -x .venv/bin/python ]; then
        "$(find_python)" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    # llama-cpp-python compiles llama.cpp on first install (~4 min on 2 cores; pip caches the wheel)
    export CMAKE_ARGS="${CMAKE_ARGS:-} $(no_amx_cmake_args)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
    ensure_no_amx
}

# llama.cpp's AMX kernels crash on CPUs that have AMX (Xeon Sapphire Rapids and later,
# most current x86 cloud instances): SIGSEGV in ggml_backend_amx_mul_mat at ldtilecfg on
# the first decode (ggml-org/llama.cpp #20824, open; PR #26954). A native build compiles
# them in when the CPU reports amx_int8, so every build here turns AMX off; the repacked
# AVX2/AVX-512 kernels (REPACK = 1) are kept. docs/platforms.md has the measurements.
no_amx_cmake_args() {
    case "$(uname -m)" in
        x86_64|amd64)
            echo "-DCMAKE_C_FLAGS='-mno-amx-int8 -mno-amx-tile -mno-amx-bf16'" \
                 "-DCMAKE_CXX_FLAGS='-mno-amx-int8 -mno-amx-tile -mno-amx-bf16'" ;;
    esac
}

# pip's wheel cache keys a built wheel by the sdist, not by CMAKE_ARGS: a machine that once
# built llama-cpp-python with AMX reinstalls that wheel. Check what was installed, and
# rebuild it from source, bypassing the cache, when its llama.cpp reports AMX_INT8.
ensure_no_amx() {
    local info
    info="$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())')"
    case "$info" in
        *AMX_INT8*)
            echo "llama-cpp-python was built with AMX kernels (ggml-org/llama.cpp #20824):" \
                 "rebuilding it without AMX (about 4 min)" >&2
            local version
            version="$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
            .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir \
                --force-reinstall --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version"
            info="$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())')"
            case "$info" in
                *AMX_INT8*) echo "error: llama-cpp-python still reports AMX_INT8 after a rebuild" >&2; return 1 ;;
            esac ;;
    esac
}
