#!/usr/bin/env bash
# Regenerate requirements/image.lock: every package the container image installs -- the
# runtime dependencies of pyproject.toml ([project] dependencies, no extras) and its build
# backend (image-build.in) -- pinned to one version each with the sha256 hash of every file
# PyPI has for that version, resolved for CPython 3.12 on Linux x86_64 and aarch64 with
# wheels only (manylinux_2_28: the base image is Debian bookworm, glibc 2.36, and has no
# compiler).  Both architectures must resolve to the same pins; the script fails if not.
#
#   bash requirements/lock.sh                          # keep the current pins where possible
#   bash requirements/lock.sh --upgrade                # newest versions pyproject.toml allows
#   bash requirements/lock.sh --upgrade-package ortools
#
# uv runs from a throwaway virtual environment (pinned below); nothing is installed into the
# project's.  Needs network access to PyPI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv_version="0.13.9"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "uv==$uv_version"
for arch in x86_64 aarch64; do
    # start from the current lock, so that pins are kept unless asked to upgrade
    if [ -f "$root/requirements/image.lock" ]; then
        cp "$root/requirements/image.lock" "$tmp/$arch.lock"
    fi
    (cd "$root" && "$tmp/venv/bin/uv" pip compile -q \
        pyproject.toml requirements/image-build.in \
        --python-version 3.12 --python-platform "$arch-manylinux_2_28" --only-binary :all: \
        --generate-hashes --custom-compile-command "bash requirements/lock.sh" \
        --output-file "$tmp/$arch.lock" "$@")
done
if ! cmp -s "$tmp/x86_64.lock" "$tmp/aarch64.lock"; then
    diff "$tmp/x86_64.lock" "$tmp/aarch64.lock" >&2 || true
    echo "x86_64 and aarch64 resolve differently; the image needs one lock for both" >&2
    exit 1
fi
cp "$tmp/x86_64.lock" "$root/requirements/image.lock"
echo "wrote requirements/image.lock ($(grep -c '^[a-z]' "$root/requirements/image.lock") packages)"
