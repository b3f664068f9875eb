"""The container image recipe (``Dockerfile``, ``.dockerignore``, ``requirements/image.lock``)
stays in step with the package.

No image is built here (no container daemon in CI); instead the recipe is read as data:

* every top-level package that ``pyproject.toml`` packages is copied into the build stage and
  allowed by the ``.dockerignore`` allow-list, and every copied path exists;
* the final stage runs as a non-root user, and its entrypoint is the package's console script;
* the subcommands the Helm chart runs exist in the CLI;
* reproducible: every stage starts from the one base image, pinned by digest; Python packages
  come only from the hashed lock (``--require-hashes``, wheels only) and the package itself is
  installed with ``--no-deps --no-build-isolation``, then ``pip check``;
* the lock pins every runtime dependency of ``pyproject.toml`` within its version range, with
  hashes, and no package of the ``sim`` extra that nothing else needs (matplotlib);
* the image carries what its code imports: every third-party module imported by the
  partitioner, the agent and the CLI is in the lock (``sim`` modules only in the what-if code),
  and with matplotlib absent the components import and ``gpuslice simulate`` exits 2 naming
  ``pip install 'gpuslice[sim]'``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from gpuslice.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = ROOT / "requirements" / "image.lock"
DIGEST = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")
SIM_FILES = {"gpuslice/commands/simulate.py", "gpuslice/commands/sweep.py"}
"""Files outside simulations/ that may import the sim extra's modules."""


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


def pip_commands() -> list[str]:
    """Every ``pip install`` of the recipe, one string each (``&&`` chains split)."""
    out = []
    for word, args in instructions():
        if word == "RUN":
            out += [c.strip() for c in args.split("&&") if re.search(r"\bpip install\b", c)]
    return out


def locked() -> dict[str, tuple[Version, int]]:
    """Package (canonical name) -> (pinned version, number of sha256 hashes) from the lock."""
    out: dict[str, tuple[Version, int]] = {}
    current = ""
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", line)
        if m:
            current = canonicalize_name(m.group(1))
            assert current not in out, f"{current} pinned twice in {LOCK.name}"
            out[current] = (Version(m.group(2)), 0)
        elif current and re.match(r"^\s+--hash=sha256:[0-9a-f]{64}", line):
            version, hashes = out[current]
            out[current] = (version, hashes + 1)
        elif line.strip() and not line.lstrip().startswith("#"):
            raise AssertionError(f"{LOCK.name}: unexpected line {line!r}")
    return out


def test_every_packaged_package_is_copied_and_allowed() -> None:
    packages = {
        p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    sources = {s.rstrip("/").removeprefix("./") for s in copied_sources()}
    assert packages <= sources, f"packages not copied into the image: {packages - sources}"
    readme = PYPROJECT["project"]["readme"]
    assert {"pyproject.toml", readme, "requirements/image.lock"} <= sources
    allowed = allowed_by_dockerignore()
    assert sources <= allowed, f"copied but excluded from the build context: {sources - allowed}"
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"


def test_final_stage_is_non_root_with_the_console_script_entrypoint() -> None:
    stage = final_stage()
    (user,) = [args for word, args in stage if word == "USER"]
    assert user.split(":")[0] not in {"0", "root"}
    (entrypoint,) = [args for word, args in stage if word == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == list(PYPROJECT["project"]["scripts"])


def test_chart_runs_real_subcommands() -> None:
    templates = ROOT / "charts" / "gpuslice" / "templates"
    for name, sub in (
        ("partitioner-deployment.yaml", "partitioner"),
        ("agent-daemonset.yaml", "agent"),
    ):
        text = (templates / name).read_text()
        assert re.search(rf"args:\n\s+- {sub}\n", text), f"{name} does not run `gpuslice {sub}`"
        assert sub in COMMANDS


def test_every_stage_starts_from_the_base_image_pinned_by_digest() -> None:
    args = [a for w, a in instructions() if w == "ARG" and a.startswith("PYTHON_IMAGE=")]
    assert len(args) == 1, "one overridable ARG PYTHON_IMAGE names the base image"
    base = args[0].split("=", 1)[1]
    assert DIGEST.match(base), f"base image {base!r} is not pinned by digest (image:tag@sha256:...)"
    assert re.match(r"^python:3\.12[\d.]*-slim-bookworm@", base), base
    froms = [a.split()[0] for w, a in instructions() if w == "FROM"]
    assert len(froms) >= 2 and set(froms) == {"${PYTHON_IMAGE}"}, froms


def test_python_packages_come_only_from_the_hashed_lock() -> None:
    pips = pip_commands()
    assert len(pips) == 2, pips
    lock_install, package_install = pips
    flags = ("--require-hashes", "--only-binary=:all:", "--no-deps", "-r requirements/image.lock")
    for flag in flags:
        assert flag in lock_install, f"the lock install lacks {flag}: {lock_install}"
    assert re.search(r"--no-deps --no-build-isolation \.$", package_install), package_install
    runs = " && ".join(a for w, a in instructions() if w == "RUN")
    assert runs.index("requirements/image.lock") < runs.index("--no-build-isolation")
    assert "pip check" in runs.split("--no-build-isolation", 1)[1]
    assert "MPLCONFIGDIR" not in DOCKERFILE, "matplotlib is not in the image any more"


def test_lock_pins_every_runtime_dependency_with_hashes_and_leaves_sim_out() -> None:
    pins = locked()
    assert len(pins) >= 20
    for name, (_version, hashes) in pins.items():
        assert hashes >= 1, f"{name} has no --hash in {LOCK.name}"
    build = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in [Requirement(r) for r in PYPROJECT["project"]["dependencies"]] + build:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} (pyproject.toml) is not in {LOCK.name}: run lock.sh"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{LOCK.name} pins {name}=={version}, outside pyproject.toml's {req}: run "
            "bash requirements/lock.sh"
        )
    assert "matplotlib" not in pins
    assert "bash requirements/lock.sh" in LOCK.read_text().split("\n", 3)[1]


def test_sim_extra_holds_the_what_if_modules_and_test_pulls_it_in() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    sim = {canonicalize_name(Requirement(r).name) for r in extras["sim"]}
    assert sim == {"numpy", "matplotlib"}
    runtime = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    assert not sim & runtime, "sim packages are runtime dependencies again"
    assert "gpuslice[sim]" in extras["test"], "'.[test]' (scripts/test.sh) must install sim"
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert re.search(r"bootstrap\.sh\"? sim\b", demo), "demo.sh runs simulate: install sim"


def _imports(path: Path) -> set[str]:
    """Top-level modules ``path`` imports: import statements (also inside functions) and
    ``importlib.import_module("...")`` calls with a literal name."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value.split(".")[0])
    return out


def test_the_image_has_every_module_its_code_imports() -> None:
    own = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    pins = locked()
    dists = importlib.metadata.packages_distributions()
    sim_modules = {"numpy", "matplotlib"}
    checked = 0
    for package in sorted(own):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            what_if = package == "simulations" or rel in SIM_FILES
            for module in sorted(_imports(path)):
                if module in own or module in sys.stdlib_module_names or module == "__future__":
                    continue
                checked += 1
                if module in sim_modules and what_if:
                    continue
                assert module not in sim_modules - {"numpy"}, (
                    f"{rel} imports {module} (the sim extra), which the image leaves out"
                )
                names = {canonicalize_name(d) for d in dists.get(module, ())}
                assert names, f"{rel} imports {module}, which no installed distribution provides"
                assert names & set(pins), f"{rel} imports {module} ({names}), not in {LOCK.name}"
    assert checked > 30


def test_components_import_and_simulate_refuses_without_matplotlib() -> None:
    """The image's situation: matplotlib absent (numpy present: ortools needs it)."""
    script = textwrap.dedent(
        """
        import importlib, sys
        sys.modules["matplotlib"] = None  # not installed: import fails, find_spec says None
        for m in ("partitioner.operator", "node_agent.agent", "gpuslice.commands.agent",
                  "gpuslice.commands.partitioner", "gpuslice.commands.ungate",
                  "gpuslice.commands.plan", "gpuslice.commands.nos_check",
                  "gpuslice.commands.bench"):
            importlib.import_module(m)
        from gpuslice.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "simulate"], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 2, run.stderr
    assert "pip install 'gpuslice[sim]'" in run.stderr and "matplotlib" in run.stderr
    assert "Traceback" not in run.stderr
    helped = subprocess.run(
        [sys.executable, "-c", script, "sweep", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert helped.returncode == 0 and "usage: gpuslice sweep" in helped.stdout, helped.stderr
