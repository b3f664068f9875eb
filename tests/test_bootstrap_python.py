"""scripts/bootstrap.sh and ``GPUSLICE_PYTHON`` (README, first paragraph).

A ``GPUSLICE_PYTHON`` that is missing or older than 3.12 stops the setup with exit code 2 and a
message naming the variable, instead of another Python being used without a word; an existing
venv built with another interpreter than the variable names is neither reused nor deleted (exit
2, naming both and the ways out); one built with it is reused.  No venv is created here: every
case stops before ``python -m venv`` or finds the venv already installed (its stamp file).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP = ROOT / "scripts" / "bootstrap.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GPUSLICE_PYTHON", "GPUSLICE_VENV")}
    base.setdefault("GPUSLICE_VENV", str(tmp_path / "venv"))
    return subprocess.run(
        ["bash", str(BOOTSTRAP)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _installed_venv(tmp_path: Path, python: str) -> Path:
    """A venv directory whose ``bin/python`` runs ``python`` and whose install stamp is fresh."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    wrapper.chmod(0o755)
    stamp = venv / ".gpuslice-installed"
    stamp.touch()
    t = (ROOT / "pyproject.toml").stat().st_mtime + 10
    os.utime(stamp, (t, t))
    return venv


def test_missing_gpuslice_python_stops_with_exit_2(tmp_path: Path) -> None:
    r = _run(tmp_path, GPUSLICE_PYTHON=str(tmp_path / "no" / "python3.12"))
    assert r.returncode == 2, r.stderr
    assert "GPUSLICE_PYTHON=" in r.stderr and "unset it" in r.stderr
    assert not (tmp_path / "venv").exists()


def test_gpuslice_python_that_is_not_python_3_12_stops_with_exit_2(tmp_path: Path) -> None:
    fake = tmp_path / "python3.11"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.11.7"\nexit 1\n')
    fake.chmod(0o755)
    r = _run(tmp_path, GPUSLICE_PYTHON=str(fake))
    assert r.returncode == 2, r.stderr
    assert f"GPUSLICE_PYTHON={fake} is not Python >= 3.12" in r.stderr
    assert "Python 3.11.7" in r.stderr
    assert not (tmp_path / "venv").exists()


def test_venv_of_another_interpreter_is_named_not_reused(tmp_path: Path) -> None:
    other = shutil.which("python3.11") or shutil.which("python3.13")
    if other is None or subprocess.run([other, "-c", ""], check=False).returncode != 0:
        pytest.skip("no second runnable Python here")
    venv = _installed_venv(tmp_path, other)
    r = _run(tmp_path, GPUSLICE_PYTHON=sys.executable)
    assert r.returncode == 2, r.stderr
    assert f"{venv} was built with" in r.stderr
    assert "rm -rf" in r.stderr and "unset GPUSLICE_PYTHON" in r.stderr
    assert (venv / "bin" / "python").exists()  # never deleted


def test_venv_of_the_named_interpreter_is_reused(tmp_path: Path) -> None:
    venv = _installed_venv(tmp_path, sys.executable)
    r = _run(tmp_path, GPUSLICE_PYTHON=sys.executable)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"{venv}/bin/python"


def test_existing_venv_is_reused_without_gpuslice_python(tmp_path: Path) -> None:
    other = shutil.which("python3.11") or sys.executable
    venv = _installed_venv(tmp_path, other)
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"{venv}/bin/python"
