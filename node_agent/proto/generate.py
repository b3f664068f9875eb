"""Regenerate the committed gRPC/protobuf code of :mod:`node_agent.proto` with grpcio-tools.

Model: the sources of truth are the ``.proto`` files in this folder. They are compiled with the
repository root as the include path, so each file is known to protobuf as
``node_agent/proto/<name>.proto`` and the generated ``*_pb2_grpc.py`` imports its messages as
``from node_agent.proto import <name>_pb2`` (no ``sys.path`` tricks). Each run writes, per proto,
``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` next to it.

Usage::

    python -m node_agent.proto.generate          # rewrite the generated files in place
    python -m node_agent.proto.generate --check  # exit 1 if they differ from a fresh generation

grpcio-tools is a build/test dependency only; the agent needs grpcio and protobuf at run time.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent
PROTO_FILES = (
    "deviceplugin_v1beta1.proto",
    "podresources_v1.proto",
    "pluginregistration_v1.proto",
    "dra_v1.proto",
)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

__all__ = ["PROTO_FILES", "compile_descriptor_set", "generate", "generated_files", "main"]


def _rel_protos() -> list[str]:
    return [str((PROTO_DIR / name).relative_to(REPO_ROOT)) for name in PROTO_FILES]


def _protoc(args: Sequence[str]) -> None:
    """Run grpcio-tools' protoc in a child process.

    Not in-process: grpcio-tools embeds its own gRPC core and protobuf runtime, and loading it
    into a process that already ran grpcio of another version can abort the interpreter.
    """
    if importlib.util.find_spec("grpc_tools") is None:
        raise SystemExit(
            "grpcio-tools is not installed: install the test extra (pip install -e '.[test]')"
        )
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO_ROOT}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"protoc failed with exit code {done.returncode} on {', '.join(_rel_protos())}:\n"
            f"{done.stderr.strip()}"
        )


def generated_files(root: Path = REPO_ROOT) -> list[Path]:
    """The generated files, under ``root`` (the repository root or a scratch output root)."""
    rel = PROTO_DIR.relative_to(REPO_ROOT)
    return [
        root / rel / (Path(name).stem + suffix)
        for name in PROTO_FILES
        for suffix in GENERATED_SUFFIXES
    ]


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Compile the protos into ``out_root`` (which mirrors the repository layout)."""
    out = str(out_root)
    _protoc([f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *_rel_protos()])
    return generated_files(out_root)


def compile_descriptor_set(path: Path) -> Path:
    """Write a serialized ``FileDescriptorSet`` of the protos to ``path`` (for comparisons)."""
    _protoc([f"--descriptor_set_out={path}", *_rel_protos()])
    return path


def _check() -> int:
    with tempfile.TemporaryDirectory(prefix="gpuslice-proto-") as tmp:
        fresh = generate(Path(tmp))
        stale = [
            str(committed.relative_to(REPO_ROOT))
            for new, committed in zip(fresh, generated_files(), strict=True)
            if not committed.exists() or not filecmp.cmp(new, committed, shallow=False)
        ]
    if stale:
        print(
            "generated code is stale: "
            + ", ".join(stale)
            + "; run python -m node_agent.proto.generate",
            file=sys.stderr,
        )
        return 1
    print("generated code is up to date")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m node_agent.proto.generate", description=__doc__
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        return _check()
    with tempfile.TemporaryDirectory(prefix="gpuslice-proto-") as tmp:
        for new, committed in zip(generate(Path(tmp)), generated_files(), strict=True):
            shutil.copyfile(new, committed)
            print(f"wrote {committed.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
