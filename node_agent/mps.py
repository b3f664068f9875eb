"""MPS control daemons: one per GPU in MPS mode (and one per MIG instance in hybrid mode).

Model
-----
A daemon is identified by a *key* (``gpu0``, or ``gpu0-mig4`` for the MIG instance at slot 4 in
hybrid mode; the same name as its pipe directory, :func:`node_agent.devices.mps_pipe_directory`)
and described by a :class:`MpsDaemonSpec`: the device it serves (GPU or MIG UUID), its pipe and
log directories and the default active-thread percentage.  Clients (pods) find it through
``CUDA_MPS_PIPE_DIRECTORY`` and may only *lower* their share with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.

A :class:`ProcessSupervisor` starts, checks and stops daemons; the reconciler only says which
keys should run (:meth:`ProcessSupervisor.ensure`) and which may stop.  It never stops a daemon
whose GPU still has a slice in use: that would kill the pod's CUDA context.

* :class:`MpsControlSupervisor` runs the real ``nvidia-cuda-mps-control -d`` with
  ``CUDA_VISIBLE_DEVICES``, ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` set, then
  ``set_default_active_thread_percentage``; liveness is ``get_server_list`` answering; stop is
  ``quit``.  Commands go through an injectable runner so the logic is unit-testable.
* :class:`FakeSupervisor` keeps the set of running keys in memory, with failure knobs.  Given
  the node's :class:`~node_agent.nvml_fake.FakeNvml`, it refuses to start a whole-GPU daemon
  unless that GPU is in compute mode ``EXCLUSIVE_PROCESS``, the mode MPS is run in
  (facts/mig.md), so tests catch a reconciler that forgets to set it.  Hybrid daemons (one per
  MIG instance, ``device_uuid`` a MIG UUID) are not checked: the compute mode is a whole-GPU
  setting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

from node_agent.nvml import ComputeMode
from node_agent.nvml_fake import FakeNvml
from node_agent.runner import Runner, subprocess_runner

__all__ = [
    "FakeSupervisor",
    "MpsControlSupervisor",
    "MpsDaemonSpec",
    "MpsError",
    "ProcessSupervisor",
    "Runner",
]

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """An MPS control daemon could not be started or stopped."""


@dataclass(frozen=True, slots=True)
class MpsDaemonSpec:
    key: str
    device_uuid: str
    """``CUDA_VISIBLE_DEVICES`` of the daemon: a GPU UUID, or a MIG UUID (hybrid)."""
    pipe_dir: str
    log_dir: str
    default_thread_percentage: int = 100


class ProcessSupervisor(Protocol):
    def ensure(self, spec: MpsDaemonSpec) -> None:
        """Start the daemon unless it runs already (idempotent); raise :class:`MpsError`."""
        ...

    def stop(self, key: str) -> None:
        """Stop the daemon ``key`` if it runs (idempotent)."""
        ...

    def running(self) -> set[str]:
        """Keys of the daemons that are up now."""
        ...


class MpsControlSupervisor:
    """Real daemons via ``nvidia-cuda-mps-control`` (see the module docstring)."""

    def __init__(self, runner: Runner = subprocess_runner) -> None:
        self._run = runner
        self._specs: dict[str, MpsDaemonSpec] = {}

    @staticmethod
    def _env(spec: MpsDaemonSpec) -> dict[str, str]:
        return {
            "CUDA_VISIBLE_DEVICES": spec.device_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": spec.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": spec.log_dir,
        }

    def _alive(self, spec: MpsDaemonSpec) -> bool:
        rc, _ = self._run([CONTROL], self._env(spec), "get_server_list\n")
        return rc == 0

    def ensure(self, spec: MpsDaemonSpec) -> None:
        self._specs[spec.key] = spec
        if self._alive(spec):
            return
        os.makedirs(spec.pipe_dir, exist_ok=True)
        os.makedirs(spec.log_dir, exist_ok=True)
        env = self._env(spec)
        rc, out = self._run([CONTROL, "-d"], env, None)
        if rc != 0:
            raise MpsError(
                f"MPS daemon {spec.key}: '{CONTROL} -d' failed ({rc}): {out.strip()}; check that "
                f"the agent runs privileged with the NVIDIA driver and {spec.pipe_dir} is writable"
            )
        cmd = f"set_default_active_thread_percentage {spec.default_thread_percentage}\n"
        rc, out = self._run([CONTROL], env, cmd)
        if rc != 0:
            raise MpsError(f"MPS daemon {spec.key}: {cmd.strip()} failed ({rc}): {out.strip()}")

    def stop(self, key: str) -> None:
        spec = self._specs.pop(key, None)
        if spec is not None:
            self._run([CONTROL], self._env(spec), "quit\n")

    def running(self) -> set[str]:
        return {k for k, s in self._specs.items() if self._alive(s)}


@dataclass
class FakeSupervisor:
    """In-memory supervisor: ``fail_next`` start attempts fail; :meth:`kill` simulates a crash.

    With ``nvml`` set, starting a daemon for a GPU of that fake whose compute mode is not
    ``EXCLUSIVE_PROCESS`` fails (see the module docstring)."""

    daemons: dict[str, MpsDaemonSpec] = field(default_factory=dict)
    fail_next: int = 0
    starts: int = 0
    nvml: FakeNvml | None = None

    def ensure(self, spec: MpsDaemonSpec) -> None:
        if spec.key in self.daemons:
            return
        if self.fail_next > 0:
            self.fail_next -= 1
            raise MpsError(f"MPS daemon {spec.key}: injected start failure")
        if self.nvml is not None:
            try:
                gpu = self.nvml.gpu_index_of(spec.device_uuid)
            except KeyError:
                gpu = None  # a MIG device (hybrid mode): no compute mode of its own
            if gpu is not None:
                mode = self.nvml.compute_mode(gpu)
                if mode != ComputeMode.EXCLUSIVE_PROCESS:
                    raise MpsError(
                        f"MPS daemon {spec.key}: GPU {gpu} is in compute mode {mode.name}; "
                        f"set it to EXCLUSIVE_PROCESS before starting MPS"
                    )
        self.starts += 1
        self.daemons[spec.key] = spec

    def stop(self, key: str) -> None:
        self.daemons.pop(key, None)

    def running(self) -> set[str]:
        return set(self.daemons)

    def kill(self, key: str) -> None:
        self.daemons.pop(key, None)
