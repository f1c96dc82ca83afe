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
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
}
