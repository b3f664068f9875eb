"""What the node advertises to the kubelet: one :class:`AdvertisedDevice` per MIG instance or MPS slice.

Model
-----
The agent's actual state (the ``status.gpus`` it writes, :class:`contract.nodepartitioning.ActualGpu`)
is turned, by a pure function, into advertised devices grouped by extended-resource name:

* a MIG instance of profile ``P`` -> resource ``nvidia.com/mig-P`` with ``+`` spelled ``.``
  (:func:`planner.snapshot.mig_resource`, the name the plan used); device id = the MIG device
  UUID; ``Allocate`` env ``NVIDIA_VISIBLE_DEVICES=<MIG UUID>``.
* an MPS slice of ``M`` MiB -> resource ``nvidia.com/gpu-<M // 1024>gb``; device id = the slice
  id (:func:`mps_slice_id`, self-describing so a restarted agent can rebuild in-use slices from
  the kubelet's PodResources ids alone); ``Allocate`` env ``NVIDIA_VISIBLE_DEVICES=<GPU UUID>``,
  ``CUDA_MPS_PIPE_DIRECTORY`` (the GPU's control daemon), ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=
  "0=<M>M"`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``.  The ordinal is ``0`` because the
  container sees exactly that one GPU; :func:`container_env` re-indexes when a container gets
  slices of several GPUs.

* (hybrid) an MPS slice inside a MIG instance -> resource ``nvidia.com/gpu-<M // 1024>gb``;
  device id = the slice id built on the MIG device's UUID (it names the instance); ``Allocate``
  env ``NVIDIA_VISIBLE_DEVICES=<MIG UUID>``, ``CUDA_MPS_PIPE_DIRECTORY`` (the instance's own
  daemon), the pinned memory limit and thread %.  An instance hosting slices is not advertised
  as a MIG device itself.

Every device served by an MPS daemon (MPS slices, and MIG instances of hybrid GPUs) also
carries the two host mounts an MPS client needs without ``hostIPC`` (NVIDIA's device plugin
does the same, facts/gpu-operator.md section 4): its daemon's pipe directory at the same path,
and the daemons' shared-memory directory ``<mps root>/shm`` (:func:`mps_shm_directory`) at
``/dev/shm``, where the MPS server -- which sees the same directory as its own ``/dev/shm`` --
creates the segments it shares with its clients.  :func:`container_mounts` merges them for one
container.

Every device also names its parent GPU (:attr:`AdvertisedDevice.gpu`, the physical GPU's UUID,
for MIG instances and MPS slices alike), so ``GetPreferredAllocation`` can keep a container's
devices on as few GPUs as possible without parsing device ids.

Device ids must be unique per node and at most 63 characters (kubelet limit).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Protocol

from contract.nodepartitioning import ActualGpu, ActualMpsSlice
from planner.snapshot import mig_resource, mps_resource

__all__ = [
    "ENV_MPS_MEM_LIMIT",
    "ENV_MPS_PIPE",
    "ENV_MPS_THREADS",
    "ENV_VISIBLE",
    "AdvertisedDevice",
    "HostMount",
    "InUseSource",
    "MpsSliceId",
    "advertised_devices",
    "container_env",
    "container_mounts",
    "mps_pipe_directory",
    "mps_shm_directory",
    "mps_slice_id",
    "parse_mps_slice_id",
]

ENV_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
ENV_MPS_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
ENV_MPS_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

MAX_DEVICE_ID_LEN = 63
SHM = "/dev/shm"
"""Where MPS clients (and the MPS server) see the daemons' shared-memory directory."""


@dataclass(frozen=True, slots=True)
class HostMount:
    """A host directory ``Allocate`` mounts into the container (the kubelet's ``Mount``)."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class AdvertisedDevice:
    """One device of one extended resource, as ListAndWatch reports it and Allocate serves it."""

    id: str
    """Unique device id (MIG UUID, or an MPS slice id)."""
    resource: str
    """Extended resource name, e.g. ``nvidia.com/mig-1g.10gb`` or ``nvidia.com/gpu-10gb``."""
    gpu: str
    """UUID of the physical GPU the device lives on (the parent GPU of a MIG instance)."""
    healthy: bool
    """``Healthy`` in ListAndWatch; only healthy devices are allocatable."""
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Environment variables ``Allocate`` returns for this device alone."""
    mounts: tuple[HostMount, ...] = ()
    """Host directories ``Allocate`` mounts for this device (MPS: pipe and shm)."""
    foreign: bool = False
    """Processes of no pod run on it (its MIG instance, or the hybrid instance hosting the
    slice: the status's ``foreign``).  Still advertised Healthy, as NVIDIA's plugin does, but
    the preferred allocation gives it only when nothing else is free."""


class InUseSource(Protocol):
    """Which advertised device ids are allocated to pods (kubelet PodResources ``List``).

    Implemented by ``node_agent.podresources.PodResourcesClient`` and by in-memory fakes.
    Raising means "unknown": the reconciler then destroys nothing.
    """

    async def in_use_device_ids(self) -> set[str]: ...


def mps_pipe_directory(root: str, gpu_index: int, mig_start: int | None = None) -> str:
    """The pipe directory of the MPS control daemon of a GPU, or (hybrid mode) of the MIG
    instance placed at memory slot ``mig_start`` of that GPU (placements are unique per GPU)."""
    base = root.rstrip("/")
    name = f"gpu{gpu_index}" if mig_start is None else f"gpu{gpu_index}-mig{mig_start}"
    return f"{base}/{name}"


def mps_shm_directory(root: str) -> str:
    """The host directory every MPS daemon and client sees as ``/dev/shm`` (no hostIPC)."""
    return f"{root.rstrip('/')}/shm"


@cache
def mps_mounts(root: str, pipe: str) -> tuple[HostMount, ...]:
    """The mounts of an MPS client of the daemon whose pipe directory is ``pipe``."""
    return (HostMount(pipe, pipe), HostMount(SHM, mps_shm_directory(root)))


@dataclass(frozen=True, slots=True)
class MpsSliceId:
    """The parts of an MPS slice id: ``<GPU UUID>-mps<k>-<MiB>m-<pct>p``."""

    gpu_uuid: str
    slot: int
    memory_mib: int
    thread_percentage: int


_MPS_ID = re.compile(r"^(?P<gpu>.+)-mps(?P<slot>\d+)-(?P<mem>\d+)m-(?P<pct>\d+)p$")


def mps_slice_id(gpu_uuid: str, slot: int, memory_mib: int, thread_percentage: int) -> str:
    """A self-describing, stable device id for MPS slice number ``slot`` of a GPU."""
    sid = f"{gpu_uuid}-mps{slot}-{memory_mib}m-{thread_percentage}p"
    if len(sid) > MAX_DEVICE_ID_LEN:
        raise ValueError(
            f"MPS slice id {sid!r} is longer than the kubelet's {MAX_DEVICE_ID_LEN} characters; "
            f"the GPU UUID {gpu_uuid!r} is unexpectedly long"
        )
    return sid


def parse_mps_slice_id(device_id: str) -> MpsSliceId | None:
    """Inverse of :func:`mps_slice_id`; ``None`` if ``device_id`` is not an MPS slice id."""
    m = _MPS_ID.match(device_id)
    if m is None:
        return None
    return MpsSliceId(
        m.group("gpu"), int(m.group("slot")), int(m.group("mem")), int(m.group("pct"))
    )


def advertised_devices(
    gpus: Sequence[ActualGpu],
    *,
    mps_pipe_root: str,
    unhealthy: Collection[str] = (),
    hybrid_gpus: Collection[int] = (),
) -> dict[str, list[AdvertisedDevice]]:
    """Resource name -> devices for the actual state ``gpus`` (resources and devices sorted).

    Devices whose id is in ``unhealthy`` (e.g. MPS slices of a GPU whose control daemon is
    down) are advertised with ``healthy=False`` so the kubelet stops allocating them.
    MIG instances without a device id (not yet visible as MIG devices) are not advertised.
    On GPUs in ``hybrid_gpus`` each MIG instance runs its own MPS daemon, so its devices also
    carry ``CUDA_MPS_PIPE_DIRECTORY``.
    """
    out: dict[str, list[AdvertisedDevice]] = {}
    bad = set(unhealthy)
    for gpu in sorted(gpus, key=lambda g: g.index):
        parent = gpu.uuid or f"gpu{gpu.index}"  # the UUID; the index if NVML gave none
        for inst in gpu.mig:
            if not inst.deviceId:
                continue
            if inst.mps:  # a host: its slices are the devices
                hpipe = mps_pipe_directory(mps_pipe_root, gpu.index, inst.start)
                _add_slices(
                    out, inst.mps, inst.deviceId, parent, hpipe, mps_pipe_root, bad, inst.foreign
                )
                continue
            res = mig_resource(inst.profile)
            mig_env = {ENV_VISIBLE: inst.deviceId}
            mounts: tuple[HostMount, ...] = ()
            if gpu.index in hybrid_gpus:
                hpipe = mps_pipe_directory(mps_pipe_root, gpu.index, inst.start)
                mig_env[ENV_MPS_PIPE] = hpipe
                mounts = mps_mounts(mps_pipe_root, hpipe)
            env = MappingProxyType(mig_env)
            healthy = inst.deviceId not in bad
            out.setdefault(res, []).append(
                AdvertisedDevice(inst.deviceId, res, parent, healthy, env, mounts, inst.foreign)
            )
        pipe = mps_pipe_directory(mps_pipe_root, gpu.index)
        _add_slices(out, gpu.mps, gpu.uuid, parent, pipe, mps_pipe_root, bad)
    return {r: sorted(ds, key=lambda d: d.id) for r, ds in sorted(out.items())}


def _add_slices(
    out: dict[str, list[AdvertisedDevice]],
    slices: Sequence[ActualMpsSlice],
    visible: str,
    parent: str,
    pipe: str,
    root: str,
    bad: set[str],
    foreign: bool = False,
) -> None:
    """The MPS slices served by the daemon at ``pipe`` on the device ``visible`` (a GPU, or a
    hybrid MIG instance, ``foreign`` when processes of no pod run there), each its own device
    of ``nvidia.com/gpu-<N>gb``."""
    slice_mounts = mps_mounts(root, pipe)
    for sl in slices:
        if not sl.deviceId:
            continue
        res = mps_resource(sl.memoryMiB // 1024)
        env = MappingProxyType(
            {
                ENV_VISIBLE: visible,
                ENV_MPS_PIPE: pipe,
                ENV_MPS_MEM_LIMIT: f"0={sl.memoryMiB}M",
                ENV_MPS_THREADS: str(sl.activeThreadPercentage),
            }
        )
        healthy = sl.deviceId not in bad
        out.setdefault(res, []).append(
            AdvertisedDevice(sl.deviceId, res, parent, healthy, env, slice_mounts, foreign)
        )


def container_env(devices: Sequence[AdvertisedDevice]) -> dict[str, str]:
    """The env for one container that was allocated ``devices`` (one ``Allocate`` request).

    ``NVIDIA_VISIBLE_DEVICES`` lists each distinct MIG/GPU UUID once, in order.  MPS limits are
    re-indexed by the GPU's position in that list; two slices of the same GPU add up here
    (memory, and thread percentage capped at 100), but the daemon caps each client at its
    largest slice, so the device plugin's ``Allocate`` refuses a container more than one MPS
    slice before it gets here (:mod:`node_agent.deviceplugin`).  Slices of different GPUs would
    need one MPS daemon for both, which per-GPU daemons cannot give: that raises
    :class:`ValueError`.
    """
    visible: list[str] = []
    mem: dict[str, int] = {}
    threads: dict[str, int] = {}
    pipe: str | None = None
    env_pipe_only: dict[str, str] = {}
    for d in devices:
        uuid = d.env.get(ENV_VISIBLE, "")
        if uuid and uuid not in visible:
            visible.append(uuid)
        p = d.env.get(ENV_MPS_PIPE)
        if p is None or ENV_MPS_MEM_LIMIT not in d.env:
            if p is not None:  # hybrid: a MIG device with its own MPS daemon
                env_pipe_only[uuid] = p
            continue
        if pipe is not None and p != pipe:
            raise ValueError(
                f"devices {[x.id for x in devices]} are MPS slices of different GPUs; a container "
                f"can use one MPS control daemon only: request slices that fit on one GPU"
            )
        pipe = p
        limit = d.env.get(ENV_MPS_MEM_LIMIT, "")
        mib = int(limit.split("=", 1)[1].rstrip("M")) if "=" in limit else 0
        mem[uuid] = mem.get(uuid, 0) + mib
        threads[uuid] = min(100, threads.get(uuid, 0) + int(d.env.get(ENV_MPS_THREADS, "100")))
    env: dict[str, str] = {}
    if visible:
        env[ENV_VISIBLE] = ",".join(visible)
    if pipe is not None:
        env[ENV_MPS_PIPE] = pipe
        env[ENV_MPS_MEM_LIMIT] = ",".join(f"{visible.index(u)}={m}M" for u, m in mem.items())
        env[ENV_MPS_THREADS] = str(max(threads.values()))
    elif len(env_pipe_only) == 1:
        env[ENV_MPS_PIPE] = next(iter(env_pipe_only.values()))
    return env


def container_mounts(devices: Sequence[AdvertisedDevice]) -> list[HostMount]:
    """The mounts for one container allocated ``devices``: each distinct mount once, in order.

    Two devices mounting different host directories at the same container path (the devices
    of two MPS roots) cannot share a container: that raises :class:`ValueError`."""
    out: dict[str, HostMount] = {}
    for d in devices:
        for m in d.mounts:
            seen = out.setdefault(m.container_path, m)
            if seen != m:
                raise ValueError(
                    f"devices {[x.id for x in devices]} need different host directories at "
                    f"{m.container_path} ({seen.host_path}, {m.host_path}); request them in "
                    "separate containers"
                )
    return list(out.values())
