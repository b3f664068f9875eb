#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment on Python 3.12 and install gpuslice into it.
# Python 3.12 is chosen deliberately: the machine default 3.11.7 has CPython gh-106905
# ("AST constructor recursion depth mismatch" under pytest + hypothesis).
# Usage: source-free; prints the venv's python path on the last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GPUSLICE_VENV:-$root/.venv}"
extra="${1:-}"

die() { echo "scripts/bootstrap.sh: $*" >&2; exit 2; }

# "<real path of the base interpreter> (Python <version>)" of a Python; a venv's python names
# the interpreter it was built with.
ident() {
    "$1" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "(Python %s)" % sys.version.split()[0])' 2>/dev/null
}

# GPUSLICE_PYTHON, when set, is the interpreter: one that is missing or too old stops here
# (exit 2) rather than being replaced by another Python without a word.
find_python() {
    local cand
    if [ -n "${GPUSLICE_PYTHON:-}" ]; then
        command -v "$GPUSLICE_PYTHON" >/dev/null 2>&1 \
            || die "GPUSLICE_PYTHON=$GPUSLICE_PYTHON is not a command here: set it to a Python >= 3.12 (e.g. GPUSLICE_PYTHON=/usr/bin/python3.12), or unset it to let bootstrap find one"
        "$GPUSLICE_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null \
            || die "GPUSLICE_PYTHON=$GPUSLICE_PYTHON is not Python >= 3.12 (it says: $("$GPUSLICE_PYTHON" --version 2>&1 | head -n 1 || true)): point it at a Python 3.12 or later, or unset it to let bootstrap find one"
        command -v "$GPUSLICE_PYTHON"; return 0
    fi
    for cand in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3.13; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    die "gpuslice needs Python >= 3.12 and found none (python3.12, python3.13): install one, or set GPUSLICE_PYTHON=/path/to/python3.12"
}

if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python)"
    "$py" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
elif [ -n "${GPUSLICE_PYTHON:-}" ]; then
    # An existing venv is kept as it is; one built by another interpreter than GPUSLICE_PYTHON
    # names is neither reused against the variable's word nor deleted: say how to choose.
    py="$(find_python)"
    have="$(ident "$venv/bin/python" || true)"
    want="$(ident "$py" || true)"
    if [ "$have" != "$want" ]; then
        die "$venv was built with ${have:-a Python that no longer runs}, not with GPUSLICE_PYTHON=$GPUSLICE_PYTHON: ${want:-?}. To rebuild it with GPUSLICE_PYTHON: rm -rf '$venv' and run this again; to keep it: unset GPUSLICE_PYTHON; or set GPUSLICE_VENV to another directory"
    fi
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
