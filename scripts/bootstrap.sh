#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment on Python 3.12 and install gpuslice into it.
# Python 3.12 is chosen deliberately: the machine default 3.11.7 has CPython gh-106905
# ("AST constructor recursion depth mismatch" under pytest + hypothesis).
# Usage: source-free; prints the venv's python path on the last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GPUSLICE_VENV:-$root/.venv}"
extra="${1:-}"

find_python() {
    local cand
    for cand in "${GPUSLICE_PYTHON:-}" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3.13; do
        [ -n "$cand" ] || continue
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    echo "gpuslice needs Python >= 3.12 (set GPUSLICE_PYTHON=/path/to/python3.12)" >&2
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python)"
    "$py" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
fi
stamp="$venv/.gpuslice-installed${extra:+-$extra}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    if [ -n "$extra" ]; then
        "$venv/bin/python" -m pip install -q -e "$root[$extra]" >&2
    else
        "$venv/bin/python" -m pip install -q -e "$root" >&2
    fi
    touch "$stamp"
fi
echo "$venv/bin/python"
