"""The DRA kubelet plugin: plugin registration (v1) and the DRA v1 and v1beta1 services over
unix sockets.

Model
-----
The kubelet discovers plugins by watching its ``plugins_registry`` directory
(shared/facts/dra.md section 3):

* :class:`DraKubeletPlugin` serves ``pluginregistration.Registration`` on
  ``<registry_dir>/<driver>-reg.sock``.  ``GetInfo`` answers ``PluginInfo{type: "DRAPlugin",
  name: <driver>, endpoint: <plugin_dir>/<driver>/dra.sock, supported_versions:
  ["v1.DRAPlugin", "v1beta1.DRAPlugin"]}`` (the Go helper's list: a kubelet takes the first it
  knows, so one older than 1.34 speaks v1beta1); the kubelet dials the endpoint and calls
  ``NotifyRegistrationStatus``, whose outcome is kept (:attr:`DraKubeletPlugin.registered`,
  :attr:`DraKubeletPlugin.error`, :attr:`DraKubeletPlugin.waiting_since`), a success passed to
  ``on_registered`` (the ResourceSlice publisher republishes then: a starting kubelet deletes
  its node's slices), a refusal to ``on_refused``.  The driver publishes nothing for new
  claims while the kubelet has not registered the plugin
  (:meth:`DraKubeletPlugin.registration_problem`, :mod:`node_agent.dra_driver`).
* ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` on the endpoint, and the same methods as
  ``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` (identical messages on the wire).  ``NodePrepareResources``: for
  each claim, read the ResourceClaim from the API (:class:`ClaimReader`), take this driver's
  results (:func:`node_agent.dra_claims.allocated_devices`), prepare them
  (:class:`node_agent.dra_prepare.DraPreparer`, in a worker thread: NVML blocks) and answer
  its devices with their CDI IDs, each with the requests it serves by their base names (a
  result of a ``firstAvailable`` subrequest, ``gpu/small``, answers ``gpu``: the kubelet
  matches a container's ``resources.claims[].request``, which names no subrequest, against
  them exactly, as the Go helper's ``BaseRequestRef`` strips them; a device serving several
  requests is answered once, with each name once); a claim that fails gets its ``error`` and
  the others are still answered (every claim of the request gets an entry, as the kubelet
  requires) -- a claim on a GPU NVML cannot read (``GPU_IS_LOST``) gets an error naming the
  GPU and the NVML error, and the kubelet retries it
  (:class:`~node_agent.dra_prepare.GpuUnreadable`); a new claim on a device an XID made
  unhealthy gets an error naming the GPU and the XID (:mod:`node_agent.dra_prepare`, "An
  XID").
  ``NodeUnprepareResources`` likewise, by UID (an unknown claim is success).  After either,
  ``on_claims_changed`` is called (the driver runs a publishing round, in either mode).
* Both sockets are watched (every ``poll_interval_s``): a socket file someone removed (a
  kubelet that cleans its directories, an operator) is served again on a fresh file, so the
  kubelet's directory watch registers the plugin again.  A kubelet restart needs nothing: the
  kubelet rescans the registry directory and calls ``GetInfo`` again; prepared claims are in
  the preparer's checkpoint, so a repeated prepare answers the same devices.

The gRPC bodies never raise for a claim's failure: a gRPC error would void the whole response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import grpc.aio

from node_agent.agent import now_rfc3339
from node_agent.deviceplugin import socket_identity
from node_agent.dra_checkpoint import PreparedDevice
from node_agent.dra_claims import AllocatedDevice, ClaimError, ClaimRef, allocated_devices
from node_agent.dra_failures import PrepareFailures
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_slices import DRIVER
from node_agent.proto import dra_v1_pb2 as dra
from node_agent.proto import dra_v1_pb2_grpc as dra_grpc
from node_agent.proto import pluginregistration_v1_pb2 as reg
from node_agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from node_agent.tasks import cancel

if TYPE_CHECKING:
    from contract.nodepartitioning import PrepareFailure
    from node_agent.metrics import AgentMetrics

__all__ = [
    "DRA_PLUGIN_DIR",
    "DRA_SERVICE",
    "DRA_SERVICE_V1BETA1",
    "PLUGIN_TYPE",
    "REGISTRY_DIR",
    "SUPPORTED_VERSIONS",
    "ClaimReader",
    "DraKubeletPlugin",
    "KubeClaimReader",
]

log = logging.getLogger(__name__)

REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DRA_PLUGIN_DIR = "/var/lib/kubelet/plugins"
PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICE = "v1.DRAPlugin"
"""What ``supported_versions`` lists for the v1 DRAPlugin service (kubelet ``types.go``)."""
DRA_SERVICE_V1BETA1 = "v1beta1.DRAPlugin"
"""What ``supported_versions`` lists for the v1beta1 DRAPlugin service (kubelets before 1.34
know only this one)."""
SUPPORTED_VERSIONS = (DRA_SERVICE, DRA_SERVICE_V1BETA1)
"""Listed in this order, as the Go helper does: the kubelet takes the first it knows."""
V1BETA1_SERVICE_NAME = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
"""The gRPC service of v1beta1: the same methods and messages as v1's (only the proto package
differs, which the wire format does not carry; v1's optional ``share_id`` is a field a v1beta1
kubelet skips as unknown)."""


class ClaimReader(Protocol):
    async def read(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim as a dict; ``None`` if it does not exist."""
        ...


class KubeClaimReader:
    """Reads ResourceClaims (``resource.k8s.io/v1``) through a kubernetes_asyncio
    ``CustomObjectsApi`` (which serves any group's path), each read bounded in time."""

    def __init__(self, api: Any, request_timeout_s: float = 10.0) -> None:
        self.api = api
        self.request_timeout_s = request_timeout_s

    async def read(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            obj: Mapping[str, Any] = await self.api.get_namespaced_custom_object(
                "resource.k8s.io",
                "v1",
                namespace,
                "resourceclaims",
                name,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return obj


async def _claims_own[T](what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; any error but a :class:`ClaimError` becomes one naming
    ``what``: a claim's failure, never the whole call's (shared/facts/dra.md section 3)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except ClaimError:
        raise
    except Exception as e:
        raise ClaimError(f"{what}: {type(e).__name__}: {e}") from None


class DraKubeletPlugin:
    """The registration and DRA servers of one driver on this node (module docstring)."""

    def __init__(
        self,
        preparer: DraPreparer,
        claims: ClaimReader,
        *,
        registry_dir: str = REGISTRY_DIR,
        plugin_dir: str = DRA_PLUGIN_DIR,
        driver: str = DRIVER,
        on_registered: Callable[[], None] | None = None,
        poll_interval_s: float = 1.0,
        metrics: AgentMetrics | None = None,
    ) -> None:
        """``metrics``: counts prepares and unprepares by result and the claims failing now
        (``gpuslice_agent_dra_*``)."""
        self.preparer = preparer
        self.metrics = metrics
        self.claims = claims
        self.driver = driver
        self.pool = preparer.node
        self.registration_socket = os.path.join(registry_dir, f"{driver}-reg.sock")
        self.dra_socket = os.path.join(plugin_dir, driver, "dra.sock")
        self.on_registered = on_registered
        self.on_claims_changed: Callable[[], None] | None = None
        """Called after every NodePrepareResources and NodeUnprepareResources (the driver's
        shaped publishing runs a round then)."""
        self.poll_interval_s = poll_interval_s
        self.on_refused: Callable[[], None] | None = None
        """Called when the kubelet refuses the plugin (the driver runs a round then)."""
        self.registry_dir = registry_dir
        self.registered = False
        """The kubelet has registered the plugin (and not refused it since; its registration
        socket was not served anew since)."""
        self.error = ""
        """The kubelet's last registration error (empty: none)."""
        self.waiting_since: float | None = time.monotonic()
        """When the plugin began to wait for the kubelet to register it (created, started,
        its registration socket served anew); ``None`` once registered."""
        self.prepare_calls = 0
        self.unprepare_calls = 0
        self.failures = PrepareFailures()
        """The claims whose last prepare failed (:mod:`node_agent.dra_failures`): shaped
        publishing reports them in the node's status."""
        self._servers: dict[str, grpc.aio.Server] = {}
        self._served: dict[str, tuple[int, int, int] | None] = {}
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the DRA endpoint, then the registration socket (the kubelet dials the
        endpoint as soon as it sees the registration socket), and watch both files."""
        await self._serve(self.dra_socket)
        await self._serve(self.registration_socket)
        if not self.registered:
            self.waiting_since = time.monotonic()
        self._task = asyncio.create_task(self._watch(), name="dra-plugin-sockets")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel(task)
        for path in (self.registration_socket, self.dra_socket):  # deregister first
            await self._unserve(path)
        self.registered = False

    async def _serve(self, path: str) -> None:
        await self._unserve(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = grpc.aio.server()
        if path == self.dra_socket:
            servicer = _DraServicer(self)
            dra_grpc.add_DRAPluginServicer_to_server(servicer, server)
            server.add_generic_rpc_handlers((_v1beta1_handler(servicer),))
        else:
            reg_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        self._servers[path] = server
        self._served[path] = socket_identity(path)

    async def _unserve(self, path: str) -> None:
        server = self._servers.pop(path, None)
        if server is not None:
            await server.stop(grace=0.5)
        if self._served.pop(path, None) is not None and socket_identity(path) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.check_sockets()

    async def check_sockets(self) -> list[str]:
        """Serve again any socket whose file is gone or replaced; return their paths."""
        redone = []
        for path in (self.dra_socket, self.registration_socket):
            if socket_identity(path) != self._served.get(path):
                log.warning("DRA plugin socket %s vanished; serving it again", path)
                if path == self.registration_socket:
                    self.registered = False
                    self.error = ""
                    self.waiting_since = time.monotonic()
                await self._serve(path)
                redone.append(path)
        return redone

    # -- RPC bodies --------------------------------------------------------------------

    def info(self) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=self.dra_socket,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def notified(self, status: reg.RegistrationStatus) -> None:
        self.registered = status.plugin_registered
        self.error = "" if status.plugin_registered else status.error or "no reason given"
        if status.plugin_registered:
            self.waiting_since = None
            log.info("DRA driver %s registered with the kubelet", self.driver)
            if self.on_registered is not None:
                self.on_registered()
        else:
            if self.waiting_since is None:
                self.waiting_since = time.monotonic()
            log.error("the kubelet refused DRA driver %s: %s", self.driver, self.error)
            if self.on_refused is not None:
                self.on_refused()

    def registration_problem(self, now: float, grace_s: float) -> str | None:
        """Why the kubelet will not call this driver, in words naming the sockets: it refused
        the plugin (its error), or has not registered it for over ``grace_s`` seconds (a
        registry directory the kubelet does not watch); ``None`` while registered or waiting
        less than that (:class:`~node_agent.dra_driver.DraDriver` publishes no device for new
        claims then and fails ``/readyz``, not liveness)."""
        if self.registered:
            return None
        where = (
            f"registration socket {self.registration_socket}, DRA socket {self.dra_socket}, "
            f"versions {', '.join(SUPPORTED_VERSIONS)}"
        )
        if self.error:
            return (
                f"the kubelet refused DRA driver {self.driver}: {self.error} ({where}); it "
                "calls no prepare here, so no device is published for new claims"
            )
        since = self.waiting_since
        if since is None or now - since <= grace_s:
            return None
        return (
            f"the kubelet has not registered DRA driver {self.driver} within {grace_s:.0f} s "
            f"({where}): is {self.registry_dir} the kubelet's plugins_registry directory "
            "(chart value dra.hostPaths.registryDir; <kubelet root dir>/plugins_registry)? No "
            "device is published for new claims until it registers the driver"
        )

    async def prepare(
        self, request: dra.NodePrepareResourcesRequest
    ) -> dra.NodePrepareResourcesResponse:
        self.prepare_calls += 1
        out = dra.NodePrepareResourcesResponse()
        for c in request.claims:
            ref = ClaimRef(c.namespace, c.name, c.uid)
            entry = out.claims[c.uid]
            devices: list[AllocatedDevice] = []
            try:
                try:
                    obj = await self.claims.read(c.namespace, c.name)
                except Exception as e:  # the API is down: the kubelet retries
                    raise ClaimError(f"{ref}: cannot read it from the API: {e}") from None
                devices = allocated_devices(obj, ref, self.pool, self.preparer.targets, self.driver)
                prepared = await _claims_own(str(ref), self.preparer.prepare, ref, devices)
            except ClaimError as e:
                entry.error = str(e)
                log.warning("prepare failed: %s", e)
                self.failures.failed(
                    ref,
                    (d.device for d in devices),
                    str(e),
                    now=time.monotonic(),
                    wall=now_rfc3339(),
                )
                self._count("prepares", "failed")
                continue
            self.failures.succeeded(c.uid)
            self._count("prepares", "prepared")
            for (device, cdi_id, share_id), names in _answered(prepared).items():
                dev = entry.devices.add(
                    request_names=names,
                    pool_name=self.pool,
                    device_name=device,
                    cdi_device_ids=[cdi_id],
                )
                if share_id is not None:
                    dev.share_id = share_id
            log.info("prepared %s: %s", ref, ", ".join(d.device for d in prepared) or "nothing")
        if self.on_claims_changed is not None:
            self.on_claims_changed()
        return out

    async def unprepare(
        self, request: dra.NodeUnprepareResourcesRequest
    ) -> dra.NodeUnprepareResourcesResponse:
        self.unprepare_calls += 1
        out = dra.NodeUnprepareResourcesResponse()
        for c in request.claims:
            entry = out.claims[c.uid]
            self.failures.forget(c.uid)
            try:
                await _claims_own(f"claim {c.uid}", self.preparer.unprepare, c.uid)
            except ClaimError as e:
                entry.error = str(e)
                log.warning("unprepare failed: %s", e)
                self._count("unprepares", "failed")
            else:
                self._count("unprepares", "released")
        if self.on_claims_changed is not None:
            self.on_claims_changed()
        return out

    def _count(self, what: str, result: str) -> None:
        if self.metrics is not None:
            counter = (
                self.metrics.dra_prepares if what == "prepares" else self.metrics.dra_unprepares
            )
            counter.labels(result=result).inc()
            self.metrics.dra_prepare_failures.set(len(self.failures))

    def prepare_failures(
        self, allocated: Collection[str] | None, now: float
    ) -> list[PrepareFailure]:
        """The claims whose last prepare failed (:meth:`PrepareFailures.report
        <node_agent.dra_failures.PrepareFailures.report>`), the gauge set to their count."""
        out = self.failures.report(allocated, now=now)
        if self.metrics is not None:
            self.metrics.dra_prepare_failures.set(len(out))
        return out


def base_request(name: str) -> str:
    """The request a result serves as a container names it: ``gpu`` for ``gpu`` and for a
    ``firstAvailable`` subrequest's ``gpu/small`` (the Go helper's ``BaseRequestRef``)."""
    return name.split("/", 1)[0]


def _answered(prepared: Sequence[PreparedDevice]) -> dict[tuple[str, str, str | None], list[str]]:
    """The devices to answer, ``(device, CDI id, share id)`` in the order prepared, each with
    the base names (:func:`base_request`) of the requests it serves, once each."""
    out: dict[tuple[str, str, str | None], list[str]] = {}
    for d in prepared:
        names = out.setdefault((d.device, d.cdi_id, d.share_id), [])
        if (base := base_request(d.request)) not in names:
            names.append(base)
    return out


class _RegistrationServicer(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self.plugin = plugin

    async def GetInfo(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return self.plugin.info()

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: Any
    ) -> reg.RegistrationStatusResponse:
        self.plugin.notified(request)
        return reg.RegistrationStatusResponse()


def _v1beta1_handler(servicer: _DraServicer) -> grpc.GenericRpcHandler:
    """The v1beta1 DRAPlugin service (:data:`V1BETA1_SERVICE_NAME`) on ``servicer``."""
    return grpc.method_handlers_generic_handler(
        V1BETA1_SERVICE_NAME,
        {
            "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                servicer.NodePrepareResources,
                request_deserializer=dra.NodePrepareResourcesRequest.FromString,
                response_serializer=dra.NodePrepareResourcesResponse.SerializeToString,
            ),
            "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                servicer.NodeUnprepareResources,
                request_deserializer=dra.NodeUnprepareResourcesRequest.FromString,
                response_serializer=dra.NodeUnprepareResourcesResponse.SerializeToString,
            ),
        },
    )


class _DraServicer(dra_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self.plugin = plugin

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Any
    ) -> dra.NodePrepareResourcesResponse:
        return await self.plugin.prepare(request)

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Any
    ) -> dra.NodeUnprepareResourcesResponse:
        return await self.plugin.unprepare(request)
