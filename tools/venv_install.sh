#!/usr/bin/env bash
# Install packages into the virtual environment of PYTHON: with uv when the venv has it, else with pip.
#
#     tools/venv_install.sh PYTHON PIP_INSTALL_ARGS...      (e.g. .venv/bin/python -e ".[dev]")
#
# uv installs the same wheels as pip in about half the time (a fresh `.venv` with torch, the package and its dev
# extra: ~42 s against ~79 s on 2 cores; README "Set-up time"): it unpacks and compiles in parallel. The bytecode
# is compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine), a module never
# compiled would be compiled again by every process that imports it (transformers' Qwen3 import: 13.6 s instead
# of 5.1). uv reads no pip configuration, so the settings pip's configuration holds on this machine (the local
# wheel directory, extra indexes, the constraint file) are handed to it; a directory or file that does not exist
# is left out, as pip warns and skips it. When uv is missing or fails, pip does the install: the same packages.
set -euo pipefail
py=$1
shift
uv="$(dirname "$py")/uv"

pip_setting() { # the value of one pip setting (environment first, then pip's configuration files), or nothing
    local env_name=$1 key=$2
    if [[ -n ${!env_name:-} ]]; then
        printf '%s\n' "${!env_name}"
    else
        "$py" -m pip config get "global.$key" 2>/dev/null || true
    fi
}

if [[ -x $uv ]]; then
    args=()
    for dir in $(pip_setting PIP_FIND_LINKS find-links); do
        [[ -e ${dir#file://} ]] && args+=(--find-links "$dir")
    done
    index=$(pip_setting PIP_INDEX_URL index-url)
    [[ -n $index ]] && args+=(--index-url "$index")
    for url in $(pip_setting PIP_EXTRA_INDEX_URL extra-index-url); do
        [[ $url == file://* && ! -e ${url#file://} ]] && continue
        args+=(--extra-index-url "$url")
    done
    for file in $(pip_setting PIP_CONSTRAINT constraint); do
        [[ -f $file ]] && args+=(--constraint "$file")
    done
    # pip takes the best version over every index; uv, by default, only the first index that has the package.
    if "$uv" pip install --quiet --compile-bytecode --python "$py" --index-strategy unsafe-best-match "${args[@]}" "$@"; then
        exit 0
    fi
    echo "venv_install: uv failed; installing with pip" >&2
fi
exec "$py" -m pip install --quiet "$@"
