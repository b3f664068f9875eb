"""A fake kubelet for DRA plugins: the plugin watcher and the DRA manager's client, over real gRPC.

Model
-----
:class:`FakeDraKubelet` does what the kubelet does with DRA plugins (shared/facts/dra.md
section 3), with the stubs generated from the kubelet's own .proto files:

* :meth:`FakeDraKubelet.scan` plays the plugin watcher on the registry directory: for every
  socket not yet registered it dials it, calls ``GetInfo`` and validates the answer (type
  ``DRAPlugin``; a ``supported_versions`` entry the kubelet knows, ``v1.DRAPlugin`` or
  ``v1beta1.DRAPlugin``, the first one listed that it knows wins; an absolute endpoint), dials
  the endpoint and calls ``NotifyRegistrationStatus`` with the outcome.
* :meth:`FakeDraKubelet.prepare` / :meth:`FakeDraKubelet.unprepare` call the registered
  driver's ``NodePrepareResources`` / ``NodeUnprepareResources`` with the kubelet's 45 s
  deadline and check the kubelet's rule that every claim of the request has an entry.
* :meth:`FakeDraKubelet.restart` drops every connection and registration and scans again, as
  a restarted kubelet does (the plugin's sockets stay; the registry is rescanned).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from node_agent.proto import dra_v1_pb2 as dra
from node_agent.proto import dra_v1_pb2_grpc as dra_grpc
from node_agent.proto import pluginregistration_v1_pb2 as reg
from node_agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc

KNOWN_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CALL_DEADLINE_S = 45.0


@dataclass
class DraConnection:
    info: reg.PluginInfo
    service: str
    channel: grpc.aio.Channel
    stub: Any


@dataclass
class FakeDraKubelet:
    registry_dir: str
    plugins: dict[str, DraConnection] = field(default_factory=dict)
    """Driver name -> connection, for registered drivers."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(socket, reason) of every registration refused."""
    infos: list[reg.PluginInfo] = field(default_factory=list)
    """Every GetInfo answer received."""
    known_services: tuple[str, ...] = KNOWN_SERVICES
    """The DRA services this kubelet speaks (an older kubelet knows fewer)."""

    async def scan(self) -> None:
        seen = {c.info.name for c in self.plugins.values()}
        for name in sorted(os.listdir(self.registry_dir)):
            path = os.path.join(self.registry_dir, name)
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
            async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
                r = reg_grpc.RegistrationStub(ch)
                info = await r.GetInfo(reg.InfoRequest(), timeout=10)
                self.infos.append(info)
                if info.name in seen:
                    continue
                error = self._validate(info)
                conn = None
                if not error:
                    channel = grpc.aio.insecure_channel(f"unix:{info.endpoint}")
                    service = next(s for s in info.supported_versions if s in self.known_services)
                    conn = DraConnection(info, service, channel, dra_grpc.DRAPluginStub(channel))
                await r.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=10
                )
                if error:
                    self.refused.append((path, error))
                elif conn is not None:
                    self.plugins[info.name] = conn

    def _validate(self, info: reg.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"plugin type {info.type!r} is not DRAPlugin"
        if not any(s in self.known_services for s in info.supported_versions):
            return f"none of the supported versions {list(info.supported_versions)} is known"
        if not os.path.isabs(info.endpoint) or not os.path.exists(info.endpoint):
            return f"endpoint {info.endpoint!r} is not an existing absolute path"
        return ""

    def _conn(self, driver: str) -> DraConnection:
        conn = self.plugins.get(driver)
        if conn is None:
            raise AssertionError(f"driver {driver} is not registered")
        return conn

    async def _call(self, driver: str, method: str, request: Any, claims: Any) -> dict[str, Any]:
        """Call ``method`` with the kubelet's deadline; every claim must get an entry."""
        stub = self._conn(driver).stub
        reply = await getattr(stub, method)(request, timeout=CALL_DEADLINE_S)
        missing = {u for _, _, u in claims} - set(reply.claims)
        assert not missing, f"{method} left out claims {missing}"
        return dict(reply.claims)

    async def prepare(
        self, driver: str, *claims: tuple[str, str, str]
    ) -> dict[str, dra.NodePrepareResourceResponse]:
        """``claims`` are ``(namespace, name, uid)``; returns uid -> the driver's entry."""
        req = dra.NodePrepareResourcesRequest(
            claims=[dra.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
        )
        return await self._call(driver, "NodePrepareResources", req, claims)

    async def unprepare(
        self, driver: str, *claims: tuple[str, str, str]
    ) -> dict[str, dra.NodeUnprepareResourceResponse]:
        req = dra.NodeUnprepareResourcesRequest(
            claims=[dra.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
        )
        return await self._call(driver, "NodeUnprepareResources", req, claims)

    async def close(self) -> None:
        plugins, self.plugins = self.plugins, {}
        for conn in plugins.values():
            await conn.channel.close()

    async def restart(self) -> None:
        await self.close()
        await self.scan()
