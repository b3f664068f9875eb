"""The kubelet device plugin (API v1beta1): one gRPC server per advertised extended resource.

Model
-----
The agent hands :meth:`DevicePluginManager.set_devices` the full picture, resource name ->
:class:`~node_agent.devices.AdvertisedDevice` list, every time the actual layout changes. For each
resource the manager runs a *resource plugin*: a ``grpc.aio`` server of ``v1beta1.DevicePlugin``
on its own unix socket ``<plugin_dir>/<socket_prefix>-<resource with / -> _>.sock``, registered
with the kubelet through ``v1beta1.Registration/Register`` on ``<plugin_dir>/kubelet.sock``.

* ``ListAndWatch`` sends the full device list (``Healthy``/``Unhealthy``) at once and again after
  every change of that resource's list; the stream stays open, so a layout change reaches the
  kubelet without restarting or re-registering the plugin.
* ``Allocate`` answers each container request with the env of its devices, merged by
  :func:`node_agent.devices.container_env` (MIG: ``NVIDIA_VISIBLE_DEVICES=<MIG UUID>``; MPS: GPU
  UUID, ``CUDA_MPS_PIPE_DIRECTORY``, pinned memory limit, active thread percentage), plus the
  mounts of :func:`node_agent.devices.container_mounts` (MPS: the daemon's pipe directory at the
  same path and the daemons' shared memory at ``/dev/shm``, so clients need no ``hostIPC``).
  An id this plugin does not
  advertise fails with ``NOT_FOUND`` naming it, an unhealthy one with ``FAILED_PRECONDITION``.
  A container request of more than one MPS slice fails with ``INVALID_ARGUMENT``, as NVIDIA's
  plugin refuses more than one MPS replica per request (``failRequestsGreaterThanOne``): the
  daemon caps each of its clients at one slice (its defaults are the largest slice's), so a
  second slice would be held for nothing, and on a hybrid node two slices may belong to two
  daemons, of which a container can reach one.  The kubelet fails such a pod at admission
  (``UnexpectedAdmissionError``, phase Failed); the message names the fix, one slice of the
  total size (``nvidia.com/gpu-<N>gb``).  The partitioner refuses such pods before they get
  here (:func:`planner.demand.one_mps_slice`); this catches the ungated ones.
* ``GetPreferredAllocation`` (advertised in the options) answers with
  :func:`preferred_allocation` over the devices no foreign process uses (those only when
  nothing else is free: :attr:`~node_agent.devices.AdvertisedDevice.foreign`), grouping
  devices by their parent GPU
  (:attr:`~node_agent.devices.AdvertisedDevice.gpu`: the physical GPU of a MIG instance) or,
  for MPS slices, by their daemon (the GPU's, or on a hybrid node the MIG instance's): all
  ``must_include`` ids, then devices of the groups already chosen, then whole groups that
  fit the rest (smallest first), else largest groups first; so a container's devices span as
  few GPUs (daemons) as possible. An id the plugin does not advertise counts as a group of its
  own.
* ``PreStartContainer`` is not required (``pre_start_required=false``) and answers empty.
* Every id a successful ``Allocate`` returns is passed to ``on_allocate`` (the agent's
  :class:`~node_agent.allocations.AllocationLedger`) *before* the reply leaves: the kubelet
  records the allocation only after the reply, and until PodResources shows it the reconciler
  must still count the device as in use.

A single reconcile task (started by :meth:`DevicePluginManager.start`) converges the running
plugins to the desired resources: it starts plugins for new resources, stops those of resources
that disappeared (their socket is removed, their streams end), and registers every plugin not yet
registered with the *current* kubelet. It runs on every ``set_devices`` and at least every
``poll_interval_s`` to detect a kubelet restart, which deletes every socket in the plugin
directory and creates a new ``kubelet.sock``: a plugin whose socket vanished, or that registered
with an earlier ``kubelet.sock`` (identified by device, inode and ctime), is served on a fresh
socket and registered again. A failed or impossible registration (kubelet down, socket missing) is
retried on the next round, so the manager never needs the kubelet to be up first.

``set_devices`` is synchronous and cheap; it validates its input (resource names must have a
domain other than ``kubernetes.io``, ids must be unique and at most 63 characters, every device
must name its parent GPU) and raises
:class:`ValueError` naming the offending device before anything changes. Call it from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from node_agent.devices import (
    ENV_MPS_MEM_LIMIT,
    ENV_MPS_PIPE,
    MAX_DEVICE_ID_LEN,
    AdvertisedDevice,
    container_env,
    container_mounts,
)
from node_agent.proto import deviceplugin_v1beta1_pb2 as pb
from node_agent.proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from node_agent.tasks import cancel
from planner.snapshot import mps_gb_of

__all__ = [
    "API_VERSION",
    "DEVICE_PLUGIN_DIR",
    "HEALTHY",
    "KUBELET_SOCKET_NAME",
    "UNHEALTHY",
    "DevicePluginManager",
    "PluginStatus",
    "more_than_one_mps_slice",
    "plugin_socket_name",
    "preferred_allocation",
    "socket_identity",
]

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the terminating NUL

_OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

_FRESH_CHANNEL = [("grpc.use_local_subchannel_pool", 1)]
"""Each registration attempt dials afresh: a subchannel shared with an earlier attempt may still be
backing off from a kubelet that has since restarted."""

SocketIdentity = tuple[int, int, int]
"""(st_dev, st_ino, st_ctime_ns) of a socket file: changes when the file is recreated."""


def plugin_socket_name(resource: str, prefix: str = "gpuslice") -> str:
    """Socket file name (inside the plugin directory) of the plugin serving ``resource``."""
    return f"{prefix}-{resource.replace('/', '_')}.sock"


def preferred_allocation(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpu_of: Callable[[str], str],
    avoid: Callable[[str], bool] | None = None,
) -> list[str]:
    """Pick ``size`` ids: every ``must_include`` id, then as few GPUs as possible.

    Greedy, deterministic: repeatedly take devices (in id order) from the best GPU group, where a
    GPU to ``avoid`` (one the partitioner is draining for a waiting pod) comes after every
    other, then a GPU already holding a chosen device beats any other, then a GPU that alone
    covers what is still missing (the smallest such, to keep big free GPUs whole), then the
    largest group.  Taking largest groups first minimises the number of GPUs when nothing is
    pre-chosen. Returns fewer ids if not enough are available, and all ``must_include`` ids even
    beyond ``size``.
    """
    chosen = list(dict.fromkeys(must_include))
    need = size - len(chosen)
    if need <= 0:
        return chosen
    taken = set(chosen)
    groups: dict[str, list[str]] = {}
    for dev in sorted(dict.fromkeys(available)):
        if dev not in taken:
            groups.setdefault(gpu_of(dev), []).append(dev)
    used_gpus = {gpu_of(dev) for dev in chosen}

    def rank(gpu: str) -> tuple[bool, bool, bool, int, str]:
        n = len(groups[gpu])
        fits = n >= need
        avoided = avoid is not None and avoid(gpu)
        return (avoided, gpu not in used_gpus, not fits, n if fits else -n, gpu)

    while need > 0 and groups:
        gpu = min(groups, key=rank)
        picked = groups.pop(gpu)[:need]
        chosen.extend(picked)
        used_gpus.add(gpu)
        need -= len(picked)
    return chosen


def socket_identity(path: str) -> SocketIdentity | None:
    """(device, inode, ctime) of the socket file at ``path``; ``None`` if absent or not a
    socket (a recreated file has another identity)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _validate(
    devices: Mapping[str, Sequence[AdvertisedDevice]],
) -> dict[str, list[AdvertisedDevice]]:
    out: dict[str, list[AdvertisedDevice]] = {}
    for resource, devs in devices.items():
        domain, slash, name = resource.partition("/")
        if not slash or not domain or not name or domain == "kubernetes.io":
            raise ValueError(
                f"resource name {resource!r} must look like 'vendor.com/name' with a domain other "
                f"than kubernetes.io (the kubelet rejects it otherwise), e.g. 'nvidia.com/gpu-10gb'"
            )
        seen: set[str] = set()
        for dev in devs:
            if dev.resource != resource:
                raise ValueError(
                    f"device {dev.id!r} has resource {dev.resource!r} but was listed under "
                    f"{resource!r}: group devices by their own resource name"
                )
            if not dev.id or len(dev.id) > MAX_DEVICE_ID_LEN:
                raise ValueError(
                    f"device id {dev.id!r} of {resource!r} must have 1 to {MAX_DEVICE_ID_LEN} "
                    f"characters (kubelet limit)"
                )
            if not dev.gpu:
                raise ValueError(
                    f"device {dev.id!r} of {resource!r} names no parent GPU: set "
                    f"AdvertisedDevice.gpu to the UUID of the GPU it lives on"
                )
            if dev.id in seen:
                raise ValueError(f"device id {dev.id!r} is listed twice under {resource!r}")
            seen.add(dev.id)
        out[resource] = list(devs)
    return out


class _ResourcePlugin:
    """One resource's DevicePlugin server, its current devices and its registration state."""

    def __init__(
        self,
        resource: str,
        socket_path: str,
        on_allocate: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.on_allocate = on_allocate
        self.devices: dict[str, AdvertisedDevice] = {}
        self.avoided: frozenset[str] = frozenset()
        """GPU UUIDs whose devices GetPreferredAllocation offers last (drained GPUs)."""
        self.registered_with: SocketIdentity | None = None
        self.served_socket: SocketIdentity | None = None
        self._changed = asyncio.Event()
        self._closed = False
        self._server: grpc.aio.Server | None = None

    # -- state -------------------------------------------------------------------------------
    def update(self, devices: Iterable[AdvertisedDevice]) -> None:
        new = {d.id: d for d in devices}
        if new == self.devices:
            return
        self.devices = new
        self._notify()

    def _notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def list_response(self) -> pb.ListAndWatchResponse:
        return pb.ListAndWatchResponse(
            devices=[
                pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY)
                for d in self.devices.values()
            ]
        )

    # -- server lifecycle --------------------------------------------------------------------
    async def serve(self) -> None:
        """(Re)start the server on a fresh socket file."""
        await self._stop_server()
        self._closed = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # a stale file of any kind would fail the bind
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        await server.start()
        self._server = server
        self.served_socket = socket_identity(self.socket_path)
        self.registered_with = None

    def socket_intact(self) -> bool:
        return self.served_socket is not None and (
            socket_identity(self.socket_path) == self.served_socket
        )

    async def close(self) -> None:
        """End the streams, stop the server and remove the socket."""
        await self._stop_server()
        if self.served_socket is not None and self.socket_intact():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self.served_socket = None
        self.registered_with = None

    async def _stop_server(self) -> None:
        self._closed = True
        self._notify()
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.5)

    # -- RPC bodies --------------------------------------------------------------------------
    async def watch(self) -> AsyncIterator[pb.ListAndWatchResponse]:
        while not self._closed:
            changed = self._changed  # taken before the snapshot, so no change is missed
            yield self.list_response()
            await changed.wait()

    def allocate(self, ids: Sequence[str]) -> pb.ContainerAllocateResponse:
        devices: list[AdvertisedDevice] = []
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:  # the kubelet never asks so; the limits would add up to more than advertised
            raise _RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"device(s) {', '.join(repr(i) for i in twice)} of {self.resource} asked for "
                "more than once in one container; each device can be allocated once",
            )
        for dev_id in ids:
            dev = self.devices.get(dev_id)
            if dev is None:
                raise _RpcFailure(
                    grpc.StatusCode.NOT_FOUND,
                    f"device {dev_id!r} is not a device of {self.resource} on this node "
                    f"({len(self.devices)} advertised now); the layout changed since the "
                    f"kubelet's last ListAndWatch update: retry after the next one",
                )
            if not dev.healthy:
                raise _RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"device {dev_id!r} of {self.resource} is Unhealthy and cannot be allocated",
                )
            devices.append(dev)
        refusal = more_than_one_mps_slice(self.resource, devices)
        if refusal is not None:
            raise _RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        try:
            env = container_env(devices)
            mounts = [
                pb.Mount(
                    container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
                )
                for m in container_mounts(devices)
            ]
        except ValueError as err:
            raise _RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        return pb.ContainerAllocateResponse(envs=env, mounts=mounts)

    def prefer(self, req: pb.ContainerPreferredAllocationRequest) -> list[str]:
        parent: dict[str, str] = {}

        def gpu_of(dev_id: str) -> str:
            """The group of a device: its GPU, or an MPS slice's daemon (module docstring)."""
            dev = self.devices.get(dev_id)
            if dev is None:
                return dev_id
            pipe = dev.env.get(ENV_MPS_PIPE) if ENV_MPS_MEM_LIMIT in dev.env else None
            group = f"{dev.gpu} {pipe}" if pipe else dev.gpu
            parent[group] = dev.gpu
            return group

        avoided = self.avoided
        avoid = (lambda group: parent.get(group, group) in avoided) if avoided else None
        available = list(req.available_deviceIDs)
        clean = [d for d in available if not ((dev := self.devices.get(d)) and dev.foreign)]
        chosen = preferred_allocation(
            clean, list(req.must_include_deviceIDs), req.allocation_size, gpu_of, avoid
        )
        if len(chosen) < req.allocation_size and len(clean) < len(available):
            # devices processes of no pod use only when nothing else is free (and the
            # partitioner promises none of them: its pods never need these)
            chosen = preferred_allocation(available, chosen, req.allocation_size, gpu_of, avoid)
        return chosen


def more_than_one_mps_slice(resource: str, devices: Sequence[AdvertisedDevice]) -> str | None:
    """Why one container cannot be given ``devices`` (more than one MPS slice), or ``None``.

    The kubelet reports the refusal as the pod's admission failure
    (``UnexpectedAdmissionError``: "Allocate failed due to rpc error: code = InvalidArgument
    desc = <this>, which is unexpected"), so the text says what to change in the pod."""
    slices = [d for d in devices if ENV_MPS_MEM_LIMIT in d.env]
    n = len(slices)
    if n <= 1:
        return None
    gb = mps_gb_of(resource)
    one = f"nvidia.com/gpu-{gb * n}gb: 1" if gb else "nvidia.com/gpu-<N>gb: 1, N the total GiB"
    daemons = len({d.env.get(ENV_MPS_PIPE) for d in slices})
    split = f" (and these {n} are served by {daemons} MPS daemons)" if daemons > 1 else ""
    return (
        f"a container of this pod requests {resource}: {n}, but gpuslice gives a container "
        f"one MPS slice: a container reaches one MPS daemon, which caps each of its clients at "
        f"one slice's memory and threads, so the other slices would be held for nothing{split}. "
        f"The kubelet fails the pod at admission (UnexpectedAdmissionError, phase Failed). "
        f"Fix: request one slice of the size needed ({one} instead of {resource}: {n}), or "
        f"MIG instances (nvidia.com/mig-<profile>) to use several GPUs"
    )


class _RpcFailure(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Servicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    """``v1beta1.DevicePlugin`` over one :class:`_ResourcePlugin`."""

    def __init__(self, plugin: _ResourcePlugin) -> None:
        self._plugin = plugin

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: Any
    ) -> pb.DevicePluginOptions:
        return _OPTIONS

    async def ListAndWatch(
        self, request: pb.Empty, context: Any
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        async for reply in self._plugin.watch():
            yield reply

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(deviceIDs=self._plugin.prefer(req))
                for req in request.container_requests
            ]
        )

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        try:
            responses = [
                self._plugin.allocate(list(r.devices_ids)) for r in request.container_requests
            ]
        except _RpcFailure as err:
            log.warning("Allocate on %s failed: %s", self._plugin.resource, err.details)
            await context.abort(err.code, err.details)
            raise AssertionError("unreachable: context.abort raises") from err
        if self._plugin.on_allocate is not None:  # before the kubelet can act on the reply
            self._plugin.on_allocate([d for r in request.container_requests for d in r.devices_ids])
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


@dataclass(frozen=True, slots=True)
class PluginStatus:
    """What the manager knows about one resource plugin (for conditions, logs and tests)."""

    resource: str
    socket_path: str
    devices: int
    healthy: int
    registered: bool


class DevicePluginManager:
    """Runs one device plugin per resource and keeps them registered with the kubelet.

    Arguments: ``plugin_dir`` holds ``kubelet.sock`` and the plugin sockets; ``socket_prefix``
    starts every plugin socket name; ``poll_interval_s`` bounds how late a kubelet restart is
    noticed (and a failed registration retried); ``register_timeout_s`` limits one ``Register``
    call; ``on_allocate`` receives the ids of every successful ``Allocate`` (module docstring).
    """

    def __init__(
        self,
        plugin_dir: str = DEVICE_PLUGIN_DIR,
        *,
        socket_prefix: str = "gpuslice",
        poll_interval_s: float = 1.0,
        register_timeout_s: float = 10.0,
        on_allocate: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        if not os.path.isabs(plugin_dir):
            raise ValueError(
                f"device plugin directory {plugin_dir!r} must be absolute, e.g. {DEVICE_PLUGIN_DIR!r}"
            )
        if poll_interval_s <= 0 or register_timeout_s <= 0:
            raise ValueError(
                f"poll_interval_s ({poll_interval_s}) and register_timeout_s "
                f"({register_timeout_s}) must be > 0"
            )
        if not socket_prefix or "/" in socket_prefix:
            raise ValueError(f"socket_prefix {socket_prefix!r} must be a non-empty file name part")
        self.plugin_dir = plugin_dir
        self.kubelet_socket = os.path.join(plugin_dir, KUBELET_SOCKET_NAME)
        self.socket_prefix = socket_prefix
        self.poll_interval_s = poll_interval_s
        self.register_timeout_s = register_timeout_s
        self.on_allocate = on_allocate
        self._desired: dict[str, list[AdvertisedDevice]] = {}
        self._plugins: dict[str, _ResourcePlugin] = {}
        self._avoided: frozenset[str] = frozenset()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_error: dict[str, str] = {}

    # -- public API --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the reconcile task (plugins start on the first :meth:`set_devices`)."""
        if self._task is not None:
            raise RuntimeError("DevicePluginManager.start() called twice")
        if not os.path.isdir(self.plugin_dir):
            raise FileNotFoundError(
                f"device plugin directory {self.plugin_dir!r} does not exist: mount the kubelet's "
                f"{DEVICE_PLUGIN_DIR} into the agent (hostPath)"
            )
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="gpuslice-device-plugins")

    async def stop(self) -> None:
        """Stop every plugin server, remove their sockets, end the reconcile task."""
        task, self._task = self._task, None
        await cancel(task)
        plugins, self._plugins = self._plugins, {}
        for plugin in plugins.values():
            await plugin.close()

    def set_avoided(self, gpus: frozenset[str]) -> None:
        """GPUs (UUIDs) the partitioner drains: every plugin's preferred allocation puts their
        devices last, so the kubelet allocates them only when nothing else is free."""
        self._avoided = frozenset(gpus)
        for plugin in self._plugins.values():
            plugin.avoided = self._avoided

    def set_devices(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        """Make the advertised resources exactly ``devices`` (resource name -> devices)."""
        desired = _validate(devices)
        for resource in desired:
            self._socket_path(resource)  # raises early if the path cannot be bound
        loop = self._loop
        if loop is None or _on_loop(loop):
            self._apply(desired)
        else:
            loop.call_soon_threadsafe(self._apply, desired)

    def status(self) -> list[PluginStatus]:
        """One row per running plugin, sorted by resource."""
        return [
            PluginStatus(
                resource=p.resource,
                socket_path=p.socket_path,
                devices=len(p.devices),
                healthy=sum(d.healthy for d in p.devices.values()),
                registered=p.registered_with is not None,
            )
            for p in sorted(self._plugins.values(), key=lambda p: p.resource)
        ]

    # -- internals ---------------------------------------------------------------------------
    def _apply(self, desired: dict[str, list[AdvertisedDevice]]) -> None:
        self._desired = desired
        for resource, plugin in self._plugins.items():
            if resource in desired:
                plugin.update(desired[resource])  # streams the change right away
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._sync()
            except Exception:  # never let one bad round kill the plugins
                log.exception("device plugin reconcile round failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)

    async def _sync(self) -> None:
        for resource in [r for r in self._plugins if r not in self._desired]:
            log.info("stopping device plugin for %s (no longer advertised)", resource)
            await self._plugins.pop(resource).close()
        kubelet = socket_identity(self.kubelet_socket)
        for resource in list(self._desired):
            try:
                await self._sync_one(resource, kubelet)
            except Exception as e:  # one resource's socket must not keep the others unserved
                message = f"{type(e).__name__}: {e}"
                level = (
                    logging.DEBUG if self._last_error.get(resource) == message else logging.ERROR
                )
                log.log(
                    level,
                    "device plugin for %s cannot be served (the other resources are; will "
                    "retry): %s",
                    resource,
                    message,
                )
                self._last_error[resource] = message

    async def _sync_one(self, resource: str, kubelet: SocketIdentity | None) -> None:
        """Serve (and register) ``resource``'s plugin as :meth:`_sync` wants it."""
        # re-read after every await: set_devices may have changed or removed it meanwhile
        devices = self._desired.get(resource)
        if devices is None:
            return
        plugin = self._plugins.get(resource)
        if plugin is None:
            plugin = _ResourcePlugin(resource, self._socket_path(resource), self.on_allocate)
            plugin.avoided = self._avoided
            plugin.update(devices)
            self._plugins[resource] = plugin  # before serving: set_devices updates it
            await plugin.serve()
            log.info("serving device plugin for %s on %s", resource, plugin.socket_path)
        elif not plugin.socket_intact() or (
            plugin.registered_with is not None and plugin.registered_with != kubelet
        ):
            log.info("kubelet restarted: serving %s on a fresh socket", resource)
            await plugin.serve()
        if kubelet is not None and plugin.registered_with != kubelet:
            await self._register(plugin, kubelet)

    def _socket_path(self, resource: str) -> str:
        path = os.path.join(self.plugin_dir, plugin_socket_name(resource, self.socket_prefix))
        if len(path.encode()) > _MAX_UNIX_PATH:
            raise ValueError(
                f"socket path {path!r} for {resource!r} is longer than {_MAX_UNIX_PATH} bytes: "
                f"use a shorter plugin directory or socket_prefix"
            )
        return path

    async def _register(self, plugin: _ResourcePlugin, kubelet: SocketIdentity) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=os.path.basename(plugin.socket_path),
            resource_name=plugin.resource,
            options=_OPTIONS,
        )
        try:
            async with grpc.aio.insecure_channel(
                f"unix:{self.kubelet_socket}", options=_FRESH_CHANNEL
            ) as channel:
                await pb_grpc.RegistrationStub(channel).Register(
                    request, timeout=self.register_timeout_s
                )
        except grpc.aio.AioRpcError as err:
            message = f"{err.code().name}: {err.details()}"
            level = (
                logging.DEBUG
                if self._last_error.get(plugin.resource) == message
                else logging.WARNING
            )
            log.log(
                level,
                "registering %s with the kubelet failed (will retry): %s",
                plugin.resource,
                message,
            )
            self._last_error[plugin.resource] = message
            return
        self._last_error.pop(plugin.resource, None)
        plugin.registered_with = kubelet
        log.info("registered %s with the kubelet (endpoint %s)", plugin.resource, request.endpoint)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """True if touching the manager's state directly is safe from the calling thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop in this thread: safe only while the manager's loop is idle
        return not loop.is_running()
