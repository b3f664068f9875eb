"""PodResources v1 client over real gRPC on a unix socket, against FakePodResources (tests/fake_kubelet.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio
import pytest
from fake_kubelet import FakePodResources

from node_agent.allocations import AllocationLedger, LedgerInUse
from node_agent.podresources import (
    ContainerAllocation,
    PodResourcesClient,
    PodResourcesError,
)
from node_agent.proto import podresources_v1_pb2 as pr

MIG_1G = "nvidia.com/mig-1g.10gb"
MPS_10 = "nvidia.com/gpu-10gb"


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gspr-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(sock_dir: str) -> AsyncIterator[FakePodResources]:
    server = FakePodResources(os.path.join(sock_dir, "kubelet.sock"))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(kubelet: FakePodResources) -> AsyncIterator[PodResourcesClient]:
    async with PodResourcesClient(kubelet.socket_path, timeout_s=5) as c:
        yield c


async def test_list_flattens_pods_containers_and_resources(
    kubelet: FakePodResources, client: PodResourcesClient
) -> None:
    kubelet.add_pod(
        "team-a",
        "train-0",
        {
            "main": {MIG_1G: ["MIG-1", "MIG-2"], "example.com/nic": ["nic0"]},
            "sidecar": {},
        },
    )
    kubelet.add_pod("team-b", "infer-0", {"srv": {MPS_10: ["GPU-9-mps0-10240m-50p"]}})
    kubelet.add_pod("team-b", "cpu-only", {"app": {MIG_1G: []}})

    rows = await client.list()
    assert rows == [
        ContainerAllocation("team-a", "train-0", "main", MIG_1G, ("MIG-1", "MIG-2")),
        ContainerAllocation("team-a", "train-0", "main", "example.com/nic", ("nic0",)),
        ContainerAllocation("team-b", "infer-0", "srv", MPS_10, ("GPU-9-mps0-10240m-50p",)),
    ]
    assert await client.in_use_device_ids() == {"MIG-1", "MIG-2", "nic0", "GPU-9-mps0-10240m-50p"}
    assert await client.in_use_by_resource() == {
        MIG_1G: {"MIG-1", "MIG-2"},
        "example.com/nic": {"nic0"},
        MPS_10: {"GPU-9-mps0-10240m-50p"},
    }


async def test_in_use_follows_pods_coming_and_going(
    kubelet: FakePodResources, client: PodResourcesClient
) -> None:
    assert await client.in_use_device_ids() == set()
    kubelet.add_pod("ns", "p", {"c": {MIG_1G: ["MIG-1"]}})
    assert await client.in_use_device_ids() == {"MIG-1"}
    kubelet.pods.clear()
    assert await client.in_use_device_ids() == set()
    assert kubelet.calls == ["List", "List", "List"]  # one channel, three real calls


async def test_allocatable_groups_per_device_entries_by_resource(
    kubelet: FakePodResources, client: PodResourcesClient
) -> None:
    numa0 = pr.TopologyInfo(nodes=[pr.NUMANode(ID=0)])
    numa1 = pr.TopologyInfo(nodes=[pr.NUMANode(ID=1)])
    kubelet.allocatable_devices = [  # one entry per device and NUMA node, as the kubelet answers
        pr.ContainerDevices(resource_name=MIG_1G, device_ids=["MIG-1"], topology=numa0),
        pr.ContainerDevices(resource_name=MIG_1G, device_ids=["MIG-2"], topology=numa1),
        pr.ContainerDevices(resource_name=MPS_10, device_ids=["S-1"], topology=numa0),
    ]
    assert await client.allocatable() == {MIG_1G: {"MIG-1", "MIG-2"}, MPS_10: {"S-1"}}
    assert kubelet.calls == ["GetAllocatableResources"]


async def test_list_larger_than_grpc_default_4mib(
    kubelet: FakePodResources, client: PodResourcesClient
) -> None:
    # ~6 MiB of device ids: fails with RESOURCE_EXHAUSTED at gRPC's default receive limit
    ids = [f"MIG-{i:08d}-aaaa-bbbb-cccc-dddddddddddd-{'x' * 8}" for i in range(110_000)]
    kubelet.add_pod("ns", "big", {"c": {MIG_1G: ids}})
    assert pr.ListPodResourcesResponse(pod_resources=kubelet.pods).ByteSize() > 5 * 1024 * 1024
    assert len(await client.in_use_device_ids()) == len(ids)


async def test_unreachable_kubelet_raises_a_clear_error(sock_dir: str) -> None:
    missing = os.path.join(sock_dir, "nothing-here.sock")
    async with PodResourcesClient(missing, timeout_s=2) as c:
        with pytest.raises(PodResourcesError, match="UNAVAILABLE") as err:
            await c.in_use_device_ids()
    assert missing in str(err.value)
    assert "/var/lib/kubelet/pod-resources" in str(err.value)


async def test_kubelet_restart_is_transparent(
    kubelet: FakePodResources, client: PodResourcesClient
) -> None:
    kubelet.add_pod("ns", "p", {"c": {MIG_1G: ["MIG-1"]}})
    assert await client.in_use_device_ids() == {"MIG-1"}
    await kubelet.stop()
    with pytest.raises(PodResourcesError):
        await client.in_use_device_ids()
    await kubelet.start()
    assert await client.in_use_device_ids() == {"MIG-1"}


def test_rejects_relative_socket_path() -> None:
    with pytest.raises(ValueError, match="must be absolute"):
        PodResourcesClient("kubelet.sock")


@pytest.mark.parametrize(
    ("method", "call"),
    [("List", "in_use_device_ids"), ("GetAllocatableResources", "allocatable")],
)
async def test_undecodable_reply_is_a_podresources_error(
    sock_dir: str, method: str, call: str
) -> None:
    """A reply that does not decode (grpc.aio hands back ``None``) is a failure, not a crash."""
    socket_path = os.path.join(sock_dir, "garbage.sock")

    async def garbage(request: bytes, context: object) -> bytes:
        return b"\xff\xff\xff\xff"  # field 31, wire type 7: not a protobuf message

    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {
            method: grpc.unary_unary_rpc_method_handler(
                garbage, request_deserializer=bytes, response_serializer=bytes
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    try:
        async with PodResourcesClient(socket_path, timeout_s=3) as c:
            with pytest.raises(PodResourcesError, match=f"{method} .*not a") as err:
                await getattr(c, call)()
        assert socket_path in str(err.value)
    finally:
        await server.stop(None)


async def test_a_list_without_the_agents_own_pod_is_incomplete(kubelet: FakePodResources) -> None:
    """Right after a kubelet restart its pod list is still loading while device assignments are
    already restored: a List may leave out pods that hold devices.  The agent's own DaemonSet
    pod is in every complete List, so one without it answers nothing (in use unknown)."""
    ledger = AllocationLedger(grace_seconds=60)
    ledger.record(["MIG-1"])
    kubelet.add_pod("agents", "gpuslice-agent-x", {"agent": {}})
    kubelet.add_pod("team-a", "train-0", {"main": {MIG_1G: ["MIG-1"]}})
    async with PodResourcesClient(
        kubelet.socket_path, timeout_s=5, own_pod=("gpuslice", "gpuslice-agent-x")
    ) as wrong_namespace:
        with pytest.raises(PodResourcesError, match="gpuslice/gpuslice-agent-x"):
            await wrong_namespace.list()
    own = ("agents", "gpuslice-agent-x")
    async with PodResourcesClient(kubelet.socket_path, timeout_s=5, own_pod=own) as c:
        in_use = LedgerInUse(c, ledger)
        assert await in_use.in_use_device_ids() == {"MIG-1"}  # seen: confirmed in the ledger
        kubelet.pods.clear()  # the kubelet restarts: its pod list is empty for a while
        with pytest.raises(PodResourcesError, match="still loading"):
            await in_use.in_use_device_ids()
        kubelet.add_pod("agents", "gpuslice-agent-x", {"agent": {}})
        kubelet.add_pod("team-a", "train-0", {"main": {MIG_1G: ["MIG-1"]}})
        assert await in_use.in_use_device_ids() == {"MIG-1"}
        # without the check the empty list would have answered "nothing in use", and the
        # ledger would have forgotten the confirmed id
        kubelet.pods.clear()
        async with PodResourcesClient(kubelet.socket_path, timeout_s=5) as unchecked:
            assert await LedgerInUse(unchecked, ledger).in_use_device_ids() == set()
