"""MPS control daemons: one per GPU in MPS mode (and one per MIG instance in hybrid mode).

Model
-----
A daemon is identified by a *key* (``gpu0``, or ``gpu0-mig4`` for the MIG instance at slot 4 in
hybrid mode; the same name as its pipe directory, :func:`node_agent.devices.mps_pipe_directory`)
and described by a :class:`MpsDaemonSpec`: the device it serves (GPU or MIG UUID), its pipe and
log directories and its *daemon-side* limits.  Clients (pods) find it through
``CUDA_MPS_PIPE_DIRECTORY``; their shared memory is the host directory every daemon also uses
as ``/dev/shm`` (:func:`node_agent.devices.mps_shm_directory`), so no client needs ``hostIPC``.

Limits.  A client's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` come from ``Allocate`` as environment variables, which a
container can change.  What a client cannot change is its daemon's: the default active-thread
percentage and default pinned device-memory limit (``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit 0 <M>M``, applied to every MPS server the daemon starts
afterwards, and ``set_active_thread_percentage`` / ``set_device_pinned_mem_limit`` to the
servers already running, from ``get_server_list``).  A client's thread percentage can only be
lowered below the daemon's (facts/gpu-operator.md section 4), so the reconciler gives each
whole-GPU daemon the *largest* slice of its GPU as defaults: no client of that GPU can take more
threads or pinned memory than the largest slice, whatever it sets.  (With unequal slices on one
GPU the smaller slices' limits are the clients' own env; equal slices are enforced exactly.)
Hybrid daemons (one per MIG instance) get the same defaults from their instance's largest
slice (docs/hybrid.md, "Inside an instance: MPS limits"); the instance bounds them all.  The
daemon of an instance without slices (advertised whole) gets 100 % and the instance's memory:
a limit is only ever replaced by another one (``None`` sends nothing), so a daemon whose
instance hosted slices before would otherwise keep capping the pod at the old slice's memory.

Limits pending.  A daemon runs from its ``-d`` on, but its limits are in force only once every
limit command has succeeded.  A daemon for which one failed (at its start, or when its limits
changed) is *limits-pending* (:meth:`ProcessSupervisor.limits_pending`): the failing
``ensure`` raises :class:`MpsError`, and every later ``ensure`` sends all of its limits again
(defaults and running servers), whatever spec it is given, until one succeeds.  Meanwhile the
reconciler advertises the daemon's devices Unhealthy and reports the pass's error (not
``Applied``): a client given one would run without (or with stale) limits -- nos #38.

A :class:`ProcessSupervisor` starts, checks and stops daemons; the reconciler only says which
keys should run (:meth:`ProcessSupervisor.ensure`) and which may stop.  It never stops a daemon
whose GPU still has a slice in use: that would kill the pod's CUDA context.  A daemon that
*died* (crashed, OOM-killed) is another matter: its clients died with it, so nothing is left to
protect, and every daemon still wanted -- one whose slices pods hold above all -- is simply
started again, with its limits, by the next ``ensure``; "in use" only ever keeps a daemon
running, it never keeps a dead one down.

Deaths.  A supervisor remembers which of its daemons were *up* (started, adopted, or seen
answering since) and counts a death when one of them is found not answering -- by
:meth:`~ProcessSupervisor.check`, which the agent calls every few seconds between passes, or by
a pass's own probes (``running``, ``ensure``).  A ``stop`` (or the ``quit`` of a restart for
another device) is not a death, nor is a start that failed.  ``check`` returns the deaths seen
since its last call, each once, so the agent can log and count them (crash loops) and wake a
pass at once instead of at the next resync.  ``check`` is called off the event loop (it runs
``get_server_list`` per daemon), never while a pass runs.

* :class:`MpsControlSupervisor` runs the real ``nvidia-cuda-mps-control -d`` with
  ``CUDA_VISIBLE_DEVICES``, ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` set, then
  sends the limits; liveness is ``get_server_list`` answering; stop is ``quit``.  ``ensure``
  with changed limits re-sends them (defaults and running servers), as it does for a
  limits-pending daemon whatever the spec; with another device (a
  hybrid instance re-created at the same slot) it restarts the daemon; a daemon found running
  after an agent restart (:meth:`~ProcessSupervisor.discover` probes the candidates' pipe
  directories with ``get_server_list``) is adopted -- counted as running, so it is never
  started twice nor left unknown -- and the next ``ensure`` sends it the limits again.
  A ``quit`` that fails (``stop``, or the restart for another device) is followed by a
  ``get_server_list``.  The daemon is forgotten only on a clear "no daemon" answer: the control
  command's ``Cannot find MPS control daemon`` (:data:`NO_DAEMON`: what the binary prints when
  nothing listens on the pipe directory's control socket), to the ``quit`` or to that probe.
  Any other outcome -- the daemon still answers, or neither command is answered (a time-out, a
  hung daemon, a control pipe silent for a moment) -- keeps it tracked, with its spec, and
  raises :class:`MpsError`, so the reconciler neither destroys nor re-creates what it serves
  this pass and the next pass quits it again.  (A daemon forgotten while it runs would serve
  on untracked: a destroyed MIG device's UUID adopted as a new instance's daemon, an idle MPS
  server holding its instance for good, or a drained GPU left in ``EXCLUSIVE_PROCESS``.)
  Commands go through an injectable runner so the logic is unit-testable
  (:class:`node_agent.mps_fake.FakeMpsControl` plays the control binary on the fake GPUs).
* :class:`FakeSupervisor` keeps the set of running keys in memory, with failure knobs.  Given
  the node's :class:`~node_agent.nvml_fake.FakeNvml`, it refuses to start a whole-GPU daemon
  unless that GPU is in compute mode ``EXCLUSIVE_PROCESS``, the mode MPS is run in
  (facts/mig.md), so tests catch a reconciler that forgets to set it.  Hybrid daemons (one per
  MIG instance, ``device_uuid`` a MIG UUID) are not checked: the compute mode is a whole-GPU
  setting.  It counts starts, restarts (device changed) and limit updates (recorded with the
  spec: it is never limits-pending).  Its daemons stand
  for processes on the host: a new reconciler given the same supervisor finds them running.
  :meth:`FakeSupervisor.kill` is a daemon's death: reported by the next ``check``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
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
NO_DAEMON = "Cannot find MPS control daemon"
"""What the control command prints (exit code 1) when no daemon serves its pipe directory:
"Cannot find MPS control daemon process"."""


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
    """Daemon-side cap of every client's active-thread percentage."""
    default_pinned_mem_limit_mib: int | None = None
    """Daemon-side cap of every client's pinned device memory, MiB (``None``: none sent, so a
    running daemon keeps the limit it was given before; give the device's memory to lift it)."""

    def limit_commands(self) -> list[str]:
        """The control commands that set this daemon's default limits."""
        out = [f"set_default_active_thread_percentage {self.default_thread_percentage}"]
        if self.default_pinned_mem_limit_mib is not None:
            out.append(
                f"set_default_device_pinned_mem_limit 0 {self.default_pinned_mem_limit_mib}M"
            )
        return out

    def server_limit_commands(self, pid: int) -> list[str]:
        """The control commands that set these limits on the running server ``pid``."""
        out = [f"set_active_thread_percentage {pid} {self.default_thread_percentage}"]
        if self.default_pinned_mem_limit_mib is not None:
            out.append(f"set_device_pinned_mem_limit {pid} 0 {self.default_pinned_mem_limit_mib}M")
        return out


class ProcessSupervisor(Protocol):
    def ensure(self, spec: MpsDaemonSpec) -> None:
        """Start the daemon unless it runs already (idempotent); raise :class:`MpsError`."""
        ...

    def stop(self, key: str) -> None:
        """Stop the daemon ``key`` if it runs (idempotent).  Raise :class:`MpsError` if it still
        runs afterwards (its ``quit`` failed): it stays supervised, and a later ``stop`` tries
        again."""
        ...

    def running(self) -> set[str]:
        """Keys of the daemons that are up now."""
        ...

    def limits_pending(self) -> set[str]:
        """Keys of daemons started or given new limits of which a limit command failed: their
        limits are not (all) in force, and the next ``ensure`` sends them all again.  Their
        devices must not be advertised Healthy meanwhile (module docstring)."""
        ...

    def discover(self, candidates: Iterable[MpsDaemonSpec]) -> None:
        """Adopt the candidates whose daemon already runs (started by an earlier agent)."""
        ...

    def check(self) -> list[str]:
        """Probe the daemons that were up; return the keys of those that died since the last
        call (found by this probe or an earlier one), each death once (module docstring).

        Blocking (a control command per daemon): call it off the event loop, between passes."""
        ...


class MpsControlSupervisor:
    """Real daemons via ``nvidia-cuda-mps-control`` (see the module docstring)."""

    def __init__(self, runner: Runner = subprocess_runner) -> None:
        self._run = runner
        self._specs: dict[str, MpsDaemonSpec] = {}
        self._adopted: set[str] = set()
        """Keys taken over from an earlier agent: their limits are sent again at ``ensure``."""
        self._up: set[str] = set()
        """Keys whose daemon answered when last probed or started (a later silence: a death)."""
        self._deaths: list[str] = []
        """Deaths seen and not yet returned by :meth:`check`."""
        self._pending: set[str] = set()
        """Keys whose daemon was started or given new limits but not every limit command
        succeeded: the next ``ensure`` sends them all again, whatever its spec."""

    @staticmethod
    def _env(spec: MpsDaemonSpec) -> dict[str, str]:
        return {
            "CUDA_VISIBLE_DEVICES": spec.device_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": spec.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": spec.log_dir,
        }

    def _servers(self, spec: MpsDaemonSpec) -> list[int] | None:
        """Pids of the daemon's MPS servers (``get_server_list``); ``None``: not running."""
        rc, out = self._run([CONTROL], self._env(spec), "get_server_list\n")
        if rc != 0:
            return None
        return [int(w) for w in out.split() if w.isdigit()]

    def _alive(self, spec: MpsDaemonSpec) -> bool:
        return self._servers(spec) is not None

    def _seen(self, key: str, alive: bool) -> None:
        """Record a probe of a supervised daemon: silent after it was up is a death."""
        if alive:
            self._up.add(key)
        elif key in self._up:
            self._up.discard(key)
            self._deaths.append(key)

    def _quit(self, spec: MpsDaemonSpec) -> None:
        """Send ``quit``.  Accepted, or answered "no daemon" (:data:`NO_DAEMON`, by the quit
        or by the ``get_server_list`` after a failed one): done.  Otherwise raise
        :class:`MpsError` (the caller keeps the daemon supervised): it still answers, or
        neither command was answered -- silence is not "gone" (module docstring)."""
        env = self._env(spec)
        rc, out = self._run([CONTROL], env, "quit\n")
        if rc == 0 or NO_DAEMON in out:
            return
        probe_rc, probe = self._run([CONTROL], env, "get_server_list\n")
        if probe_rc != 0 and NO_DAEMON in probe:
            return
        state = (
            "the daemon still runs"
            if probe_rc == 0
            else f"get_server_list was not answered either ({probe_rc}: {probe.strip()})"
        )
        raise MpsError(
            f"MPS daemon {spec.key}: quit failed ({rc}): {out.strip()}; {state} (serving "
            f"{spec.device_uuid}): kept, and quit again next pass"
        )

    def _send(self, spec: MpsDaemonSpec, commands: list[str]) -> None:
        env = self._env(spec)
        for cmd in commands:
            rc, out = self._run([CONTROL], env, cmd + "\n")
            if rc != 0:
                raise MpsError(f"MPS daemon {spec.key}: {cmd} failed ({rc}): {out.strip()}")

    def ensure(self, spec: MpsDaemonSpec) -> None:
        old = self._specs.get(spec.key)
        servers = self._servers(spec)
        if old is not None:
            self._seen(spec.key, servers is not None)
        if servers is not None and old is not None and old.device_uuid != spec.device_uuid:
            self._quit(old)  # serves a device that is gone; still answering: kept, raises
            self._up.discard(spec.key)  # stopped, not dead
            servers = None
        self._specs[spec.key] = spec
        if servers is not None:
            self._up.add(spec.key)
            # new limits, adopted, or an earlier send that failed: (re)send them all
            if old != spec or spec.key in self._adopted or spec.key in self._pending:
                self._pending.add(spec.key)  # until every command below has succeeded
                self._adopted.discard(spec.key)
                self._send(spec, spec.limit_commands())
                for pid in servers:
                    self._send(spec, spec.server_limit_commands(pid))
            self._pending.discard(spec.key)
            return
        self._adopted.discard(spec.key)
        self._pending.discard(spec.key)  # not running: the start below sends every limit
        os.makedirs(spec.pipe_dir, exist_ok=True)
        os.makedirs(spec.log_dir, exist_ok=True)
        rc, out = self._run([CONTROL, "-d"], self._env(spec), None)
        if rc != 0:
            if old is not None and old.device_uuid != spec.device_uuid:
                # the old daemon may run on unanswering (hung): still tracked as serving the
                # old device, so the next ensure quits it rather than taking it for this one
                self._specs[spec.key] = old
            raise MpsError(
                f"MPS daemon {spec.key}: '{CONTROL} -d' failed ({rc}): {out.strip()}; check that "
                f"the agent runs privileged with the NVIDIA driver and {spec.pipe_dir} is writable"
            )
        self._up.add(spec.key)  # up from here: silent later is a death
        self._pending.add(spec.key)  # running, limits not yet in force
        self._send(spec, spec.limit_commands())
        self._pending.discard(spec.key)

    def stop(self, key: str) -> None:
        spec = self._specs.get(key)
        if spec is not None:
            self._quit(spec)  # still answering: raises, and the daemon stays supervised
        self._specs.pop(key, None)
        self._adopted.discard(key)
        self._pending.discard(key)
        self._up.discard(key)

    def running(self) -> set[str]:
        out: set[str] = set()
        for key, spec in list(self._specs.items()):
            alive = self._alive(spec)
            self._seen(key, alive)
            if alive:
                out.add(key)
        return out

    def limits_pending(self) -> set[str]:
        return set(self._pending)

    def check(self) -> list[str]:
        self.running()
        died, self._deaths = self._deaths, []
        return died

    def discover(self, candidates: Iterable[MpsDaemonSpec]) -> None:
        for spec in candidates:
            # a daemon creates its pipe directory: where there is none, nothing is probed
            if spec.key in self._specs or not os.path.isdir(spec.pipe_dir):
                continue
            if self._alive(spec):
                self._specs[spec.key] = spec
                self._adopted.add(spec.key)
                self._up.add(spec.key)


@dataclass
class FakeSupervisor:
    """In-memory supervisor: ``fail_next`` start attempts fail; :meth:`kill` simulates a crash
    (a death that :meth:`check` reports once).

    With ``nvml`` set, starting a daemon for a GPU of that fake whose compute mode is not
    ``EXCLUSIVE_PROCESS`` fails (see the module docstring)."""

    daemons: dict[str, MpsDaemonSpec] = field(default_factory=dict)
    fail_next: int = 0
    starts: int = 0
    restarts: int = 0
    """Starts that replaced a daemon serving another device."""
    limit_updates: int = 0
    nvml: FakeNvml | None = None
    _deaths: list[str] = field(default_factory=list)

    def ensure(self, spec: MpsDaemonSpec) -> None:
        old = self.daemons.get(spec.key)
        if old == spec:
            return
        if old is not None and old.device_uuid == spec.device_uuid:
            self.limit_updates += 1
            self.daemons[spec.key] = spec
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
        self.restarts += old is not None
        self.daemons[spec.key] = spec

    def stop(self, key: str) -> None:
        self.daemons.pop(key, None)

    def running(self) -> set[str]:
        return set(self.daemons)

    def limits_pending(self) -> set[str]:
        """Never any: a fake daemon's limits are recorded with its spec."""
        return set()

    def discover(self, candidates: Iterable[MpsDaemonSpec]) -> None:
        """Nothing to find: :attr:`daemons` is the host's state itself."""

    def check(self) -> list[str]:
        died, self._deaths = self._deaths, []
        return died

    def kill(self, key: str) -> None:
        """The daemon ``key`` dies (if it runs): gone, and a death for :meth:`check`."""
        if self.daemons.pop(key, None) is not None:
            self._deaths.append(key)
