"""Resetting a GPU as NVIDIA's tooling does: ``nvidia-smi -r -i <PCI bus id>`` of the host driver.

Model
-----
A MIG-mode change on Ampere (A100, A30) stays *pending* until the GPU is reset (facts/mig.md).
NVML's public API has no reset call; NVIDIA's mig-parted resets with ``nvidia-smi -r -i <bus
id>`` (facts/gpu-operator.md section 6), and so does the agent, through :class:`NvidiaSmi`.
The program belongs to the host driver: the NVIDIA container runtime puts it into the agent's
container when ``NVIDIA_DRIVER_CAPABILITIES`` includes ``utility`` (the chart sets it); another
path can be given with ``GPUSLICE_NVIDIA_SMI``.

:func:`reset_gpu` is the procedure both NVML adapters run -- the real one through
:func:`node_agent.runner.subprocess_runner`, the fake one through its emulation of the tool
(:meth:`node_agent.nvml_fake.FakeNvml.nvidia_smi`), so tests exercise this very code:

1. the caller has checked that no compute process runs on the GPU (the reconciler names the
   processes that block a reset instead of trying);
2. if persistence mode is on, ``nvidia-smi -pm 0 -i BUS`` first: a GPU held in persistence mode
   refuses the reset as "In use by another client" (NVIDIA gpu-operator issue 118);
3. ``nvidia-smi -r -i BUS``;
4. persistence mode is turned back on if it was on, whether the reset worked or not.

nvidia-smi's exit code and output become an :class:`~node_agent.nvml.NvmlError` like an NVML
call's: the program cannot be run -> ``NOT_SUPPORTED``; "in use" (exit 255 with "In use by
another client" or "currently ... used by ... processes") -> ``IN_USE``; the exit codes of
nvidia-smi(1) (RETURN VALUE) 3 / 4 / 6 / 9 / 12 / 15 -> ``NOT_SUPPORTED`` / ``NO_PERMISSION`` /
``NOT_FOUND`` / ``DRIVER_NOT_LOADED`` / ``LIBRARY_NOT_FOUND`` / ``GPU_IS_LOST``; the time limit
-> ``TIMEOUT``; anything else ``UNKNOWN``; the tool's output is always in the detail.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

from node_agent.nvml import NvmlError, NvmlErrorCode
from node_agent.runner import NOT_RUN, TIMED_OUT, Runner, subprocess_runner

__all__ = ["DEFAULT_NVIDIA_SMI", "NvidiaSmi", "reset_gpu"]

DEFAULT_NVIDIA_SMI = "nvidia-smi"

_EXIT_CODES = {
    3: NvmlErrorCode.NOT_SUPPORTED,
    4: NvmlErrorCode.NO_PERMISSION,
    6: NvmlErrorCode.NOT_FOUND,
    9: NvmlErrorCode.DRIVER_NOT_LOADED,
    12: NvmlErrorCode.LIBRARY_NOT_FOUND,
    15: NvmlErrorCode.GPU_IS_LOST,
    TIMED_OUT: NvmlErrorCode.TIMEOUT,
}
_IN_USE = re.compile(r"in use by another client|currently (being )?used by|currently in use", re.I)
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")


class NvidiaSmi:
    """The host driver's ``nvidia-smi``, run through a :data:`~node_agent.runner.Runner`."""

    def __init__(self, runner: Runner = subprocess_runner, binary: str = DEFAULT_NVIDIA_SMI):
        self._run = runner
        self.binary = binary

    def _call(self, op: str, args: Sequence[str], bus_id: str) -> None:
        if not _BUS_ID.match(bus_id):
            raise NvmlError(NvmlErrorCode.INVALID_ARGUMENT, op, f"{bus_id!r} is not a PCI bus id")
        rc, out = self._run([self.binary, *args, "-i", bus_id], {}, None)
        if rc == 0:
            return
        text = " ".join(out.split())[:500]  # one line, bounded
        if rc == NOT_RUN:
            raise NvmlError(
                NvmlErrorCode.NOT_SUPPORTED,
                op,
                f"{text}; the agent needs the host driver's nvidia-smi (NVIDIA container "
                "runtime with NVIDIA_DRIVER_CAPABILITIES=utility, or GPUSLICE_NVIDIA_SMI)",
            )
        code = NvmlErrorCode.IN_USE if _IN_USE.search(out) else _EXIT_CODES.get(rc)
        raise NvmlError(code or NvmlErrorCode.UNKNOWN, op, f"{self.binary} exit {rc}: {text}")

    def reset(self, bus_id: str) -> None:
        """``nvidia-smi -r -i BUS``: reset one idle GPU."""
        self._call("reset_gpu", ["-r"], bus_id)

    def set_persistence(self, bus_id: str, enabled: bool) -> None:
        """``nvidia-smi -pm 1|0 -i BUS``."""
        self._call("reset_gpu", ["-pm", "1" if enabled else "0"], bus_id)


def reset_gpu(smi: NvidiaSmi, bus_id: str, persistence_mode: bool) -> None:
    """Reset the idle GPU at ``bus_id`` (the procedure of the module docstring)."""
    if persistence_mode:
        smi.set_persistence(bus_id, False)
    try:
        smi.reset(bus_id)
    except NvmlError:
        if persistence_mode:  # restore it, but report why the reset failed
            with contextlib.suppress(NvmlError):
                smi.set_persistence(bus_id, True)
        raise
    if persistence_mode:
        smi.set_persistence(bus_id, True)
