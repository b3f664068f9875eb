"""Running the host driver's command-line tools (``nvidia-cuda-mps-control``, ``nvidia-smi``).

A :data:`Runner` is ``(argv, extra env, stdin) -> (exit code, combined output)``; the agent's
code takes one as an argument so that its logic is tested with scripted or emulated tools
(:meth:`node_agent.nvml_fake.FakeNvml.nvidia_smi` plays ``nvidia-smi`` on the fake GPUs).
:func:`subprocess_runner` runs the real program with a time limit; a program that cannot be
started answers :data:`NOT_RUN` (the shell's "command not found") and one that runs past the
limit :data:`TIMED_OUT` (``timeout(1)``'s code), each with the reason as output.  Output is
decoded leniently (invalid bytes replaced), so a tool's output never raises.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence

__all__ = ["NOT_RUN", "TIMED_OUT", "Runner", "subprocess_runner"]

Runner = Callable[[Sequence[str], Mapping[str, str], str | None], tuple[int, str]]
"""``(argv, extra env, stdin) -> (exit code, combined output)``."""

NOT_RUN = 127
"""Exit code of a program that could not be started (not found, not executable)."""
TIMED_OUT = 124
"""Exit code of a program stopped at the time limit."""


def subprocess_runner(
    argv: Sequence[str], env: Mapping[str, str], stdin: str | None, timeout_s: float = 60.0
) -> tuple[int, str]:
    """Run ``argv`` with ``env`` added to the agent's environment (see the module docstring)."""
    try:
        p = subprocess.run(
            list(argv),
            input=stdin,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except OSError as e:
        return NOT_RUN, f"cannot run {argv[0]}: {e}"
    except subprocess.TimeoutExpired:
        return TIMED_OUT, f"{argv[0]} did not finish within {timeout_s:g} s"
    return p.returncode, (p.stdout or "") + (p.stderr or "")
