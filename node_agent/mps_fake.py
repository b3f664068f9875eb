"""``nvidia-cuda-mps-control`` played on a :class:`~node_agent.nvml_fake.FakeNvml`'s GPUs.

Model
-----
:class:`FakeMpsControl` is a :data:`node_agent.runner.Runner`: the real
:class:`~node_agent.mps.MpsControlSupervisor` drives it exactly as it drives the host driver's
binary, so tests exercise the production supervisor, not a stand-in.  A daemon is identified by
its pipe directory (``CUDA_MPS_PIPE_DIRECTORY``) and serves ``CUDA_VISIBLE_DEVICES`` (a GPU or a
MIG device UUID of the fake):

==========================================  ===============================================
invocation                                  effect (exit code, output)
==========================================  ===============================================
``nvidia-cuda-mps-control -d``              starts the daemon (0); 1 if one already serves
                                            that pipe directory, if the device is unknown,
                                            or if a whole GPU is not in compute mode
                                            ``EXCLUSIVE_PROCESS`` (as
                                            :class:`~node_agent.mps.FakeSupervisor`: a
                                            reconciler that forgets the mode fails tests),
                                            or while :attr:`FakeMpsControl.refuse_starts`
                                            is above 0 (each refusal counts it down)
``get_server_list``                         the MPS server's pid, if any (0); 1 ("Cannot
                                            find MPS control daemon process") without daemon
``set_default_active_thread_percentage N``  recorded as the daemon's default (0)
``set_default_device_pinned_mem_limit ...`` recorded (0)
``set_active_thread_percentage PID N``,     recorded for the running server (0)
``set_device_pinned_mem_limit PID ...``
``quit``                                    the daemon and its server end (0); quitting a
                                            daemon with clients is recorded in
                                            :attr:`FakeMpsControl.quit_with_clients` and
                                            breaks them
==========================================  ===============================================

Two failures are told apart, as on a real node:

* a daemon that is gone (never started, quit, :meth:`FakeMpsControl.kill`): every command
  sent on stdin answers 1, "Cannot find MPS control daemon process" -- what the binary prints
  when nothing listens on the pipe directory's control socket;
* a control pipe that does not answer while the daemon runs on: every command sent on stdin
  to a daemon whose pipe directory is in :attr:`FakeMpsControl.hung` (a hung daemon, until
  the test removes it), or whose first word :attr:`FakeMpsControl.failing` counts above 0
  (silent for a moment; each failure counts it down), answers as
  :func:`~node_agent.runner.subprocess_runner` does when the command hits its time limit
  (:data:`~node_agent.runner.TIMED_OUT`, "... did not finish within 60 s"; nothing
  recorded).  ``-d`` for a hung daemon's pipe directory answers "already running".

Test controls stand for the rest of the node: :meth:`FakeMpsControl.connect` is a pod's CUDA
process becoming a client (the daemon starts its MPS server on the first client; client and
server are both processes on the GPU or MIG device, named ``cuda-app`` and
``nvidia-cuda-mps-server``), :meth:`FakeMpsControl.disconnect` the client's exit (the server
stays, idle, until the daemon quits), :meth:`FakeMpsControl.kill` the death of one daemon (a
crash, an OOM kill) and :meth:`FakeMpsControl.kill_all` the death of the container the daemons
run in: the daemons and their servers are gone, and every client connected to them is
*broken* (its CUDA context lost, its process gone from the GPU), listed in
:attr:`FakeMpsControl.broken`.  What the process lists hold was read on an H100 80GB (driver
580.159.04, ``scripts/mps_smoke.py``, tests/fixtures/hardware): NVML's compute-process list
names both the clients and the server, and the server stays listed after its last client
ended, with ``get_client_list`` empty, until ``quit``.  The daemons are otherwise host
processes: they outlive any supervisor object, so a new agent finds them running.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from node_agent.nvml import ComputeMode
from node_agent.nvml_fake import FakeNvml
from node_agent.runner import TIMED_OUT

__all__ = ["FakeMpsControl"]

NOT_RUNNING = "Cannot find MPS control daemon process"


@dataclass
class _Daemon:
    device: str
    gpu: int
    gi_id: int | None
    ci_id: int | None
    defaults: dict[str, str] = field(default_factory=dict)
    server_limits: dict[str, str] = field(default_factory=dict)
    server: int | None = None
    """Pid of the MPS server (a process on the GPU or MIG device), from the first client on
    until the daemon quits."""
    clients: set[int] = field(default_factory=set)


@dataclass
class FakeMpsControl:
    """The control binary on a fake node (see the module docstring)."""

    nvml: FakeNvml
    daemons: dict[str, _Daemon] = field(default_factory=dict)
    """Pipe directory -> running daemon."""
    commands: list[str] = field(default_factory=list)
    """Every invocation, as ``-d`` or the command sent on stdin."""
    starts: int = 0
    quit_with_clients: list[str] = field(default_factory=list)
    broken: set[int] = field(default_factory=set)
    """Clients whose daemon died under them."""
    refuse_starts: int = 0
    """The next this many ``-d`` fail (a daemon that cannot come back)."""
    failing: dict[str, int] = field(default_factory=dict)
    """Command (first word) -> how many of its next invocations go unanswered (time out) while
    the daemon runs on (module docstring)."""
    hung: set[str] = field(default_factory=set)
    """Pipe directories whose daemon answers no command (each times out) while it runs."""
    _client_pipe: dict[int, str] = field(default_factory=dict)

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], stdin: str | None
    ) -> tuple[int, str]:
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "")
        if list(argv[1:]) == ["-d"]:
            self.commands.append("-d")
            return self._start(pipe, env.get("CUDA_VISIBLE_DEVICES", ""))
        words = (stdin or "").split()
        self.commands.append(" ".join(words))
        daemon = self.daemons.get(pipe)
        if daemon is None:
            return 1, NOT_RUNNING
        if pipe in self.hung or (words and self.failing.get(words[0], 0) > 0):
            if pipe not in self.hung:
                self.failing[words[0]] -= 1
            # the control pipe does not answer: the runner's time limit (injected)
            return TIMED_OUT, f"{argv[0]} did not finish within 60 s"
        if words == ["get_server_list"]:
            return 0, f"{daemon.server}\n" if daemon.server is not None else ""
        if words == ["quit"]:
            if daemon.clients:
                self.quit_with_clients.append(pipe)
            self._end(pipe)
            return 0, ""
        if words and words[0].startswith("set_default_"):
            daemon.defaults[words[0]] = " ".join(words[1:])
            return 0, ""
        per_server = ("set_active_thread_percentage", "set_device_pinned_mem_limit")
        if len(words) >= 3 and words[0] in per_server:
            if daemon.server is None or words[1] != str(daemon.server):
                return 1, f"Server {words[1]} not found"
            daemon.server_limits[words[0]] = " ".join(words[2:])
            return 0, ""
        return 1, f"Unrecognized command {' '.join(words)!r}"

    def _start(self, pipe: str, device: str) -> tuple[int, str]:
        if pipe in self.daemons:
            return 1, "An instance of this daemon is already running"
        if self.refuse_starts > 0:
            self.refuse_starts -= 1
            return 1, "Failed to start the MPS control daemon (injected)"
        where = self._locate(device)
        if where is None:
            return 1, f"CUDA_VISIBLE_DEVICES={device!r}: no such device"
        gpu, gi_id, ci_id = where
        if gi_id is None and self.nvml.compute_mode(gpu) != ComputeMode.EXCLUSIVE_PROCESS:
            return 1, f"GPU {gpu} is not in compute mode EXCLUSIVE_PROCESS"
        self.daemons[pipe] = _Daemon(device, gpu, gi_id, ci_id)
        self.starts += 1
        return 0, ""

    def _locate(self, device: str) -> tuple[int, int | None, int | None] | None:
        try:
            return self.nvml.gpu_index_of(device), None, None
        except KeyError:
            pass
        mig = self.nvml.mig_uuids().get(device)
        return (mig[0], mig[1], mig[2]) if mig is not None else None

    def _end(self, pipe: str) -> None:
        daemon = self.daemons.pop(pipe)
        if daemon.server is not None:
            self.nvml.stop_process(daemon.server)
        for client in daemon.clients:
            self.broken.add(client)
            self._client_pipe.pop(client, None)
            self.nvml.stop_process(client)

    # -- test controls: the pods and the container ------------------------------------

    def connect(self, pipe: str) -> int:
        """A pod's CUDA process becomes a client of the daemon at ``pipe``; its pid."""
        daemon = self.daemons.get(pipe)
        if daemon is None:
            raise RuntimeError(f"no MPS control daemon at {pipe}: the client's CUDA init fails")
        if daemon.server is None:
            daemon.server = self.nvml.start_process(
                daemon.gpu, daemon.gi_id, daemon.ci_id, name="nvidia-cuda-mps-server"
            )
        client = self.nvml.start_process(daemon.gpu, daemon.gi_id, daemon.ci_id)
        daemon.clients.add(client)
        self._client_pipe[client] = pipe
        return client

    def disconnect(self, client: int) -> None:
        """The client process ends; the server stays (idle) until its daemon quits."""
        pipe = self._client_pipe.pop(client, None)
        self.nvml.stop_process(client)
        daemon = self.daemons.get(pipe or "")
        if daemon is not None:
            daemon.clients.discard(client)

    def kill(self, pipe: str) -> None:
        """The daemon at ``pipe`` dies (a crash, an OOM kill): it and its server end, and its
        clients are broken; the other daemons run on."""
        if pipe not in self.daemons:
            raise RuntimeError(f"no MPS control daemon at {pipe}")
        self._end(pipe)

    def kill_all(self) -> None:
        """The container the daemons run in is gone: every daemon and server ends."""
        for pipe in list(self.daemons):
            self._end(pipe)

    def served(self, pipe: str) -> bool:
        """A daemon serves ``pipe``."""
        return pipe in self.daemons

    def defaults(self, pipe: str) -> dict[str, str]:
        return dict(self.daemons[pipe].defaults)
