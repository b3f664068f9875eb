"""Device plugin manager: layout changes that land while its reconcile task awaits.

The manager's reconcile task (``DevicePluginManager._sync``) awaits while it starts a plugin's
gRPC server (``grpc.aio`` ``server.start()`` yields to the event loop) and while it registers
with the kubelet (up to ``register_timeout_s``).  The reconciler publishes on the same loop at
any of those points.  A publish made then must not be lost, and a resource it removed must not
be started and registered with the devices it had before.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest
from fake_kubelet import FakeKubelet, eventually

from node_agent import deviceplugin
from node_agent.deviceplugin import DevicePluginManager
from node_agent.devices import AdvertisedDevice

MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"


def dev(resource: str, dev_id: str) -> AdvertisedDevice:
    return AdvertisedDevice(id=dev_id, resource=resource, gpu=GPU0, healthy=True, env={})


@pytest.fixture
def plugin_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gsdr-", dir="/tmp")  # unix socket paths: 107 bytes at most
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: str) -> AsyncIterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    await k.start()
    yield k
    await k.stop()


class HeldServe:
    """Holds the first start of ``resource``'s plugin server until :meth:`release`, the way
    ``server.start()`` suspends the reconcile task, so a test can publish meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, resource: str) -> None:
        self.entered = asyncio.Event()
        self._gate = asyncio.Event()
        real = deviceplugin._ResourcePlugin.serve
        held = self

        async def serve(plugin: deviceplugin._ResourcePlugin) -> None:
            if plugin.resource == resource and not held.entered.is_set():
                held.entered.set()
                await held._gate.wait()
            await real(plugin)

        monkeypatch.setattr(deviceplugin._ResourcePlugin, "serve", serve)

    def release(self) -> None:
        self._gate.set()


async def test_a_publish_while_a_new_plugin_starts_reaches_the_kubelet(
    kubelet: FakeKubelet, plugin_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldServe(monkeypatch, MIG_1G)
    manager = DevicePluginManager(plugin_dir, poll_interval_s=0.05, register_timeout_s=5)
    await manager.start()
    try:
        manager.set_devices({MIG_1G: [dev(MIG_1G, "MIG-old")]})
        await asyncio.wait_for(held.entered.wait(), 5)
        # the instance behind MIG-old was replaced meanwhile: the reconciler publishes
        manager.set_devices({MIG_1G: [dev(MIG_1G, "MIG-new")]})
        held.release()

        def current() -> bool:
            conn = kubelet.registered(MIG_1G)
            return conn is not None and conn.devices == {"MIG-new": "Healthy"}

        await eventually(current, what="the kubelet to see the layout published last")
    finally:
        await manager.stop()


async def test_a_resource_removed_while_another_plugin_starts_is_never_registered(
    kubelet: FakeKubelet, plugin_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldServe(monkeypatch, MIG_1G)
    manager = DevicePluginManager(plugin_dir, poll_interval_s=0.05, register_timeout_s=5)
    await manager.start()
    try:
        manager.set_devices({MIG_1G: [dev(MIG_1G, "MIG-a")], MIG_3G: [dev(MIG_3G, "MIG-b")]})
        await asyncio.wait_for(held.entered.wait(), 5)
        # MIG-b's instance was destroyed meanwhile: its resource is gone from the layout
        manager.set_devices({MIG_1G: [dev(MIG_1G, "MIG-a")]})
        held.release()
        await eventually(lambda: kubelet.registered(MIG_1G) is not None, what="1g registered")
        await asyncio.sleep(0.3)  # several reconcile rounds
        assert [r.resource_name for r in kubelet.registrations] == [MIG_1G]
        assert [s.resource for s in manager.status()] == [MIG_1G]
    finally:
        await manager.stop()
