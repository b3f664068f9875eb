"""Client of the kubelet PodResources API v1: which device ids the kubelet has given to pods.

Model
-----
The kubelet serves ``v1.PodResourcesLister`` on a root-owned unix socket (by default
:data:`POD_RESOURCES_SOCKET`; the agent mounts ``/var/lib/kubelet/pod-resources`` as a hostPath).
Two unary calls matter to gpuslice:

* ``List`` -> per pod, per container, a list of ``ContainerDevices`` (resource name + device ids).
  Every id in there is *in use*: the reconciler must never destroy the MIG instance or MPS slice
  behind it. :meth:`PodResourcesClient.list` flattens the answer into :class:`ContainerAllocation`
  rows; :meth:`PodResourcesClient.in_use_device_ids` is the union of their ids.
* ``GetAllocatableResources`` -> every device the kubelet considers allocatable, one
  ``ContainerDevices`` entry per device (and per NUMA node); :meth:`PodResourcesClient.allocatable`
  groups them by resource name.

A ``List`` answered while the kubelet is still loading its pods (right after a kubelet restart
its pod list fills from the API server in the background, while the device assignments are
already restored from its checkpoint) can leave out pods that hold devices.  Given the agent's
own pod (``own_pod``, from the downward API), the client treats a ``List`` that lacks it as
such an incomplete answer and raises :class:`PodResourcesError`: a DaemonSet pod on this node is
in every complete list, so its absence means "not loaded yet", never "nothing in use".

The client keeps one ``grpc.aio`` channel (opened lazily on the running event loop, and reopened
after an ``UNAVAILABLE`` answer, so a restarted kubelet is reached on the next call) and raises :class:`PodResourcesError` on any failure, so that an
in-use question is never answered with a silently empty set. Responses may exceed gRPC's default
4 MiB receive limit on busy nodes; the channel accepts 16 MiB, like Kubernetes' own clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from node_agent.proto import podresources_v1_pb2 as pb
from node_agent.proto import podresources_v1_pb2_grpc as pb_grpc

__all__ = [
    "MAX_RECEIVE_MESSAGE_BYTES",
    "POD_RESOURCES_SOCKET",
    "ContainerAllocation",
    "PodResourcesClient",
    "PodResourcesError",
]

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""Where the kubelet serves the PodResources API."""

MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
"""Receive limit for List answers (gRPC's default is 4 MiB; Kubernetes' clients use 16 MiB)."""


class PodResourcesError(RuntimeError):
    """A PodResources call failed: the answer is unknown (not empty)."""


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """Device ids of one extended resource that the kubelet assigned to one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """Async client of ``v1.PodResourcesLister`` on the unix socket ``socket_path``.

    Use it as an async context manager, or call :meth:`close` when done. The channel belongs to
    the event loop of the first call.
    """

    def __init__(
        self,
        socket_path: str = POD_RESOURCES_SOCKET,
        *,
        timeout_s: float = 10.0,
        own_pod: tuple[str, str] | None = None,
    ) -> None:
        if not socket_path.startswith("/"):
            raise ValueError(
                f"PodResources socket path {socket_path!r} must be absolute, "
                f"e.g. {POD_RESOURCES_SOCKET!r}"
            )
        if timeout_s <= 0:
            raise ValueError(f"PodResources timeout_s must be > 0, got {timeout_s}")
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.own_pod = own_pod
        """(namespace, name) of the agent's own pod; ``None``: lists are not checked."""
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def __aenter__(self) -> PodResourcesClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (a later call opens a new one)."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    def _lister(self) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix:{self.socket_path}",
                options=[
                    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
                    # own subchannels: a reopened channel dials afresh instead of inheriting a
                    # shared subchannel that is still backing off from the old kubelet
                    ("grpc.use_local_subchannel_pool", 1),
                ],
            )
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def _call(self, method: str, request: Any, reply_type: type[Any]) -> Any:
        """One unary call; every way it can fail is a :class:`PodResourcesError`.

        Besides error statuses, ``grpc.aio`` answers ``None`` when a reply does not decode as
        ``reply_type`` (a kubelet speaking another protocol on the socket, a truncated frame):
        that is a failure too, never an empty answer."""
        try:
            reply = await getattr(self._lister(), method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            hint = ""
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                # a fresh channel next time: no waiting out gRPC's reconnect backoff after a
                # kubelet restart
                await self.close()
                hint = (
                    " (is the kubelet running and its pod-resources directory mounted into the "
                    "agent, hostPath /var/lib/kubelet/pod-resources?)"
                )
            raise PodResourcesError(
                f"PodResources {method} on unix:{self.socket_path} failed: "
                f"{err.code().name}: {err.details()}{hint}"
            ) from err
        except (grpc.aio.UsageError, grpc.RpcError, OSError, RuntimeError, ValueError) as err:
            raise PodResourcesError(
                f"PodResources {method} on unix:{self.socket_path} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not isinstance(reply, reply_type):
            raise PodResourcesError(
                f"PodResources {method} on unix:{self.socket_path}: the reply is not a "
                f"{reply_type.__name__} (undecodable or empty: "
                f"{type(reply).__name__}); is a kubelet serving v1.PodResourcesLister there?"
            )
        return reply

    async def list(self) -> list[ContainerAllocation]:
        """``List``: one row per (pod, container, resource) holding at least one device.

        Raises :class:`PodResourcesError` if the call fails or the answer lacks
        :attr:`own_pod` (module docstring)."""
        reply: pb.ListPodResourcesResponse = await self._call(
            "List", pb.ListPodResourcesRequest(), pb.ListPodResourcesResponse
        )
        if self.own_pod is not None and not any(
            (pod.namespace, pod.name) == self.own_pod for pod in reply.pod_resources
        ):
            namespace, name = self.own_pod
            raise PodResourcesError(
                f"PodResources List at {self.socket_path} lacks this agent's own pod "
                f"{namespace}/{name} ({len(reply.pod_resources)} pod(s) listed): the kubelet is "
                f"still loading its pods (restarted?), so which devices are in use is unknown"
            )
        rows: list[ContainerAllocation] = []
        for pod in reply.pod_resources:
            for container in pod.containers:
                for devs in container.devices:
                    if devs.device_ids:
                        rows.append(
                            ContainerAllocation(
                                namespace=pod.namespace,
                                pod=pod.name,
                                container=container.name,
                                resource=devs.resource_name,
                                device_ids=tuple(devs.device_ids),
                            )
                        )
        return rows

    async def allocatable(self) -> dict[str, set[str]]:
        """``GetAllocatableResources``: resource name -> allocatable device ids."""
        reply: pb.AllocatableResourcesResponse = await self._call(
            "GetAllocatableResources",
            pb.AllocatableResourcesRequest(),
            pb.AllocatableResourcesResponse,
        )
        return _group(reply.devices)

    async def in_use_device_ids(self) -> set[str]:
        """Every device id assigned to a container of a pod the kubelet knows (any resource)."""
        return {d for row in await self.list() for d in row.device_ids}

    async def in_use_by_resource(self) -> dict[str, set[str]]:
        """Resource name -> device ids assigned to containers."""
        out: dict[str, set[str]] = {}
        for row in await self.list():
            out.setdefault(row.resource, set()).update(row.device_ids)
        return out


def _group(devices: Any) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for devs in devices:
        out.setdefault(devs.resource_name, set()).update(devs.device_ids)
    return out
