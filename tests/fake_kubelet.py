"""A fake kubelet for tests: the kubelet side of the device plugin and PodResources APIs, over real gRPC.

Model
-----
:class:`FakeKubelet` behaves like the kubelet's device manager, on unix sockets in a temp dir:

* it serves ``v1beta1.Registration`` on ``<plugin_dir>/kubelet.sock``; ``Register`` checks the
  version (``v1beta1``) and the resource name (``domain/name``, domain not ``kubernetes.io``),
  dials ``<plugin_dir>/<endpoint>``, calls ``GetDevicePluginOptions`` and starts consuming the
  plugin's ``ListAndWatch`` stream, all before answering, as the kubelet does; a failure becomes
  an error status. A new registration of the same resource replaces the old connection;
* every registration is recorded (:attr:`FakeKubelet.registrations`), and every ListAndWatch
  message too (:attr:`PluginConnection.updates`), so tests can assert "updated without restart";
* :meth:`PluginConnection.allocate` / :meth:`PluginConnection.preferred` call ``Allocate`` and
  ``GetPreferredAllocation`` on the plugin like the kubelet at pod admission / container creation;
* :meth:`FakeKubelet.restart` does what a restarting kubelet does: stop serving, delete every
  socket in the plugin directory, serve a fresh ``kubelet.sock`` (new inode).

:class:`FakePodResources` serves ``v1.PodResourcesLister`` (List, GetAllocatableResources, Get)
from plain mutable lists.

:func:`eventually` polls a condition with a deadline instead of sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from node_agent.proto import deviceplugin_v1beta1_pb2 as dp
from node_agent.proto import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from node_agent.proto import podresources_v1_pb2 as pr
from node_agent.proto import podresources_v1_pb2_grpc as pr_grpc

DIAL_TIMEOUT_S = 10.0  # the kubelet's timeout for dialing a plugin during Register


async def eventually(
    check: Callable[[], bool] | Callable[[], Awaitable[bool]],
    *,
    timeout: float = 5.0,
    what: str = "condition",
) -> None:
    """Poll ``check`` (sync or async) every 10 ms until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class PluginConnection:
    """The kubelet's connection to one registered plugin."""

    request: dp.RegisterRequest
    options: dp.DevicePluginOptions
    channel: grpc.aio.Channel
    stub: Any
    updates: list[dict[str, str]] = field(default_factory=list)
    """Every ListAndWatch message received, as device id -> health."""
    stream_ended: bool = False
    stream_error: str | None = None
    task: asyncio.Task[None] | None = None

    @property
    def resource(self) -> str:
        return str(self.request.resource_name)

    @property
    def devices(self) -> dict[str, str]:
        """The latest device list (id -> health); empty before the first message."""
        return self.updates[-1] if self.updates else {}

    async def watch(self) -> None:
        try:
            async for reply in self.stub.ListAndWatch(dp.Empty()):
                self.updates.append({d.ID: d.health for d in reply.devices})
        except grpc.aio.AioRpcError as err:
            self.stream_error = f"{err.code().name}: {err.details()}"
        finally:
            self.stream_ended = True

    async def allocate(self, *containers: Sequence[str]) -> dp.AllocateResponse:
        request = dp.AllocateRequest(
            container_requests=[
                dp.ContainerAllocateRequest(devices_ids=list(c)) for c in containers
            ]
        )
        reply: dp.AllocateResponse = await self.stub.Allocate(request, timeout=5)
        return reply

    async def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        request = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        reply = await self.stub.GetPreferredAllocation(request, timeout=5)
        return list(reply.container_responses[0].deviceIDs)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.channel.close()


class _UnixServer:
    """A grpc.aio server on ``socket_path`` serving this object's ``_add_to`` servicer."""

    socket_path: str
    _server: grpc.aio.Server | None

    def _add_to(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def _start_server(self) -> None:
        server = grpc.aio.server()
        self._add_to(server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        await server.start()
        self._server = server

    async def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=None)


class FakeKubelet(_UnixServer, dp_grpc.RegistrationServicer):  # type: ignore[misc]
    """Serves Registration on ``<plugin_dir>/kubelet.sock`` and talks back to plugins."""

    def __init__(self, plugin_dir: str) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, "kubelet.sock")
        self.registrations: list[dp.RegisterRequest] = []
        self.plugins: dict[str, PluginConnection] = {}
        self.reject_with: str | None = None
        """If set, Register fails with this message (after recording the request)."""
        self._server: grpc.aio.Server | None = None

    def _add_to(self, server: grpc.aio.Server) -> None:
        dp_grpc.add_RegistrationServicer_to_server(self, server)

    async def start(self) -> None:
        await self._start_server()

    async def stop(self) -> None:
        await self._stop_server()
        plugins, self.plugins = self.plugins, {}
        for conn in plugins.values():
            await conn.close()

    async def restart(self, *, wipe_plugin_sockets: bool = True) -> None:
        """Stop, delete every socket in the plugin directory, serve a new kubelet.sock.

        With ``wipe_plugin_sockets=False`` only kubelet.sock is recreated (plugins must then
        notice its new inode alone).
        """
        await self.stop()
        for name in os.listdir(self.plugin_dir):
            path = os.path.join(self.plugin_dir, name)
            if stat.S_ISSOCK(os.lstat(path).st_mode) and (
                wipe_plugin_sockets or path == self.socket_path
            ):
                os.unlink(path)
        await self.start()

    def registered(self, resource: str) -> PluginConnection | None:
        return self.plugins.get(resource)

    async def Register(self, request: dp.RegisterRequest, context: Any) -> dp.Empty:
        self.registrations.append(request)
        if self.reject_with is not None:
            await context.abort(grpc.StatusCode.UNKNOWN, self.reject_with)
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.UNKNOWN, f"Unsupported version {request.version!r}")
        domain, slash, name = request.resource_name.partition("/")
        if not slash or not name or domain in ("", "kubernetes.io"):
            await context.abort(
                grpc.StatusCode.UNKNOWN, f"invalid resource name {request.resource_name!r}"
            )
        endpoint = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpc.aio.insecure_channel(
            f"unix:{endpoint}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        stub = dp_grpc.DevicePluginStub(channel)
        try:
            options = await stub.GetDevicePluginOptions(
                dp.Empty(), timeout=DIAL_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as err:
            await channel.close()
            await context.abort(
                grpc.StatusCode.UNKNOWN, f"cannot dial plugin at {endpoint}: {err.details()}"
            )
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            await old.close()
        conn = PluginConnection(request=request, options=options, channel=channel, stub=stub)
        conn.task = asyncio.create_task(conn.watch())
        self.plugins[request.resource_name] = conn
        return dp.Empty()


class FakePodResources(_UnixServer, pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """Serves ``v1.PodResourcesLister`` from :attr:`pods` and :attr:`allocatable_devices`."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: list[pr.PodResources] = []
        self.allocatable_devices: list[pr.ContainerDevices] = []
        self.calls: list[str] = []
        self._server: grpc.aio.Server | None = None

    def add_pod(
        self, namespace: str, name: str, containers: dict[str, dict[str, Sequence[str]]]
    ) -> None:
        """Add a pod: container name -> resource name -> device ids."""
        self.pods.append(
            pr.PodResources(
                name=name,
                namespace=namespace,
                containers=[
                    pr.ContainerResources(
                        name=cname,
                        devices=[
                            pr.ContainerDevices(resource_name=res, device_ids=list(ids))
                            for res, ids in devs.items()
                        ],
                    )
                    for cname, devs in containers.items()
                ],
            )
        )

    def _add_to(self, server: grpc.aio.Server) -> None:
        pr_grpc.add_PodResourcesListerServicer_to_server(self, server)

    async def start(self) -> None:
        await self._start_server()

    async def stop(self) -> None:
        await self._stop_server()

    async def List(self, request: pr.ListPodResourcesRequest, context: Any) -> Any:
        self.calls.append("List")
        return pr.ListPodResourcesResponse(pod_resources=self.pods)

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: Any
    ) -> Any:
        self.calls.append("GetAllocatableResources")
        return pr.AllocatableResourcesResponse(devices=self.allocatable_devices)

    async def Get(self, request: pr.GetPodResourcesRequest, context: Any) -> Any:
        self.calls.append("Get")
        for pod in self.pods:
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=pod)
        await context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )
