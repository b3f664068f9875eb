"""The container image recipe (``Dockerfile``, ``.dockerignore``) stays in step with the package.

No image is built here (no container daemon in CI); instead the recipe is read as data:

* every top-level package that ``pyproject.toml`` packages is copied into the build stage and
  allowed by the ``.dockerignore`` allow-list, and every copied path exists;
* the final stage runs as a non-root user, and its entrypoint is the package's console script;
* the subcommands the Helm chart runs exist in the CLI.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from gpuslice.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def copied_sources() -> list[str]:
    return [
        src
        for word, args in instructions()
        if word == "COPY" and not args.startswith("--from")
        for src in args.split()[:-1]
    ]


def allowed_by_dockerignore() -> set[str]:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in lines, ".dockerignore should exclude everything, then allow what is copied"
    return {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}


def test_every_packaged_package_is_copied_and_allowed() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    sources = {s.rstrip("/").removeprefix("./") for s in copied_sources()}
    assert packages <= sources, f"packages not copied into the image: {packages - sources}"
    readme = pyproject["project"]["readme"]
    assert {"pyproject.toml", readme} <= sources
    allowed = allowed_by_dockerignore()
    assert sources <= allowed, f"copied but excluded from the build context: {sources - allowed}"
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"


def test_final_stage_is_non_root_with_the_console_script_entrypoint() -> None:
    stage = final_stage()
    (user,) = [args for word, args in stage if word == "USER"]
    assert user.split(":")[0] not in {"0", "root"}
    (entrypoint,) = [args for word, args in stage if word == "ENTRYPOINT"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert yaml.safe_load(entrypoint) == list(pyproject["project"]["scripts"])


def test_chart_runs_real_subcommands() -> None:
    templates = ROOT / "charts" / "gpuslice" / "templates"
    for name, sub in (
        ("partitioner-deployment.yaml", "partitioner"),
        ("agent-daemonset.yaml", "agent"),
    ):
        text = (templates / name).read_text()
        assert re.search(rf"args:\n\s+- {sub}\n", text), f"{name} does not run `gpuslice {sub}`"
        assert sub in COMMANDS
