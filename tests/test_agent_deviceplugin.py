"""Device plugin v1beta1 over real gRPC on unix sockets, against the fake kubelet (tests/fake_kubelet.py).

Devices come from the node agent's own pure builder (``node_agent.devices.advertised_devices``)
applied to an actual layout, so the envs checked here are the ones the agent would serve.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc
import grpc.aio
import pytest
from fake_kubelet import FakeKubelet, eventually
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.nodepartitioning import (
    ActualGpu,
    ActualMigInstance,
    ActualMpsSlice,
    NodePartitioningSpec,
)
from node_agent.allocations import AllocationLedger, LedgerInUse
from node_agent.deviceplugin import (
    DevicePluginManager,
    _ResourcePlugin,
    plugin_socket_name,
    preferred_allocation,
)
from node_agent.devices import AdvertisedDevice, InUseSource, advertised_devices, mps_slice_id
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
MPS_10 = "nvidia.com/gpu-10gb"
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
PIPE_ROOT = "/run/gpuslice/mps"
CAT = default_catalog()


def mig_uuid(n: int) -> str:
    return f"MIG-{n:08d}-aaaa-bbbb-cccc-000000000000"


def mig_gpu(*instances: tuple[str, int, int], index: int = 0, uuid: str = GPU0) -> ActualGpu:
    """A MIG GPU (default: GPU 0) with (profile, start, uuid number) instances."""
    return ActualGpu(
        index=index,
        uuid=uuid,
        model="H100-80GB",
        migEnabled=True,
        mig=[ActualMigInstance(profile=p, start=s, deviceId=mig_uuid(n)) for p, s, n in instances],
    )


def mps_gpu(index: int, uuid: str, slices: list[tuple[int, int]]) -> ActualGpu:
    """An MPS GPU with (memory MiB, thread %) slices."""
    return ActualGpu(
        index=index,
        uuid=uuid,
        model="A100-80GB",
        mps=[
            ActualMpsSlice(
                memoryMiB=m, activeThreadPercentage=p, deviceId=mps_slice_id(uuid, k, m, p)
            )
            for k, (m, p) in enumerate(slices)
        ],
    )


@pytest.fixture
def plugin_dir() -> Iterator[str]:
    # short path: unix socket paths are limited to 107 bytes
    path = tempfile.mkdtemp(prefix="gsdp-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: str) -> AsyncIterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    await k.start()
    yield k
    await k.stop()


@pytest.fixture
async def manager(plugin_dir: str) -> AsyncIterator[DevicePluginManager]:
    m = DevicePluginManager(plugin_dir, poll_interval_s=0.05, register_timeout_s=5)
    await m.start()
    yield m
    await m.stop()


async def registered(kubelet: FakeKubelet, resource: str, devices: dict[str, str]) -> None:
    """Wait until ``resource`` is registered and its latest ListAndWatch list is ``devices``."""

    def ok() -> bool:
        conn = kubelet.registered(resource)
        return conn is not None and conn.devices == devices

    await eventually(ok, what=f"{resource} registered with devices {devices}")


async def test_registration_request_and_first_list(
    kubelet: FakeKubelet, manager: DevicePluginManager, plugin_dir: str
) -> None:
    devices = advertised_devices(
        [mig_gpu(("1g.10gb", 0, 1), ("1g.10gb", 1, 2), ("3g.40gb", 4, 3))], mps_pipe_root=PIPE_ROOT
    )
    manager.set_devices(devices)
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy", mig_uuid(2): "Healthy"})
    await registered(kubelet, MIG_3G, {mig_uuid(3): "Healthy"})

    by_resource = {r.resource_name: r for r in kubelet.registrations}
    assert sorted(by_resource) == [MIG_1G, MIG_3G]
    req = by_resource[MIG_1G]
    assert req.version == "v1beta1"
    assert req.endpoint == plugin_socket_name(MIG_1G) == "gpuslice-nvidia.com_mig-1g.10gb.sock"
    assert os.path.exists(os.path.join(plugin_dir, req.endpoint))  # a file name, inside the dir
    assert req.options.get_preferred_allocation_available is True
    assert req.options.pre_start_required is False
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    assert conn.options == req.options  # the options the kubelet will use match the request
    assert [s.registered for s in manager.status()] == [True, True]


async def test_listandwatch_update_after_layout_change_without_restart(
    kubelet: FakeKubelet, manager: DevicePluginManager, plugin_dir: str
) -> None:
    manager.set_devices(advertised_devices([mig_gpu(("1g.10gb", 0, 1))], mps_pipe_root=PIPE_ROOT))
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    conn = kubelet.registered(MIG_1G)
    socket_inode = os.stat(os.path.join(plugin_dir, plugin_socket_name(MIG_1G))).st_ino

    # the layout changes: instance 1 goes, 2 and 3 come, 3 is unhealthy
    layout = mig_gpu(("1g.10gb", 1, 2), ("1g.10gb", 2, 3))
    manager.set_devices(
        advertised_devices([layout], mps_pipe_root=PIPE_ROOT, unhealthy={mig_uuid(3)})
    )
    await registered(kubelet, MIG_1G, {mig_uuid(2): "Healthy", mig_uuid(3): "Unhealthy"})

    assert kubelet.registered(MIG_1G) is conn  # same connection, same stream
    assert conn is not None and not conn.stream_ended
    assert conn.updates[0] == {mig_uuid(1): "Healthy"}  # the full list first, then the full list
    assert len(kubelet.registrations) == 1  # not re-registered
    assert os.stat(os.path.join(plugin_dir, plugin_socket_name(MIG_1G))).st_ino == socket_inode


async def test_resource_that_disappears_is_stopped_and_new_one_registered(
    kubelet: FakeKubelet, manager: DevicePluginManager, plugin_dir: str
) -> None:
    manager.set_devices(advertised_devices([mig_gpu(("1g.10gb", 0, 1))], mps_pipe_root=PIPE_ROOT))
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    old = kubelet.registered(MIG_1G)
    manager.set_devices(advertised_devices([mig_gpu(("3g.40gb", 0, 7))], mps_pipe_root=PIPE_ROOT))
    await registered(kubelet, MIG_3G, {mig_uuid(7): "Healthy"})
    assert old is not None
    await eventually(lambda: old.stream_ended, what="the removed plugin's stream to end")
    assert not os.path.exists(os.path.join(plugin_dir, plugin_socket_name(MIG_1G)))
    assert [s.resource for s in manager.status()] == [MIG_3G]


async def test_allocate_mig_env(kubelet: FakeKubelet, manager: DevicePluginManager) -> None:
    manager.set_devices(
        advertised_devices([mig_gpu(("1g.10gb", 0, 1), ("1g.10gb", 1, 2))], mps_pipe_root=PIPE_ROOT)
    )
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy", mig_uuid(2): "Healthy"})
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    reply = await conn.allocate([mig_uuid(2)], [mig_uuid(1)])  # two containers, answered in order
    assert [dict(r.envs) for r in reply.container_responses] == [
        {"NVIDIA_VISIBLE_DEVICES": mig_uuid(2)},
        {"NVIDIA_VISIBLE_DEVICES": mig_uuid(1)},
    ]
    assert all(len(r.mounts) == 0 for r in reply.container_responses)


async def test_allocate_mps_env_pipe_and_shm_mounts_need_no_host_ipc(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    """MPS clients get the daemon's pipe directory and its shared memory at /dev/shm (as
    NVIDIA's plugin does), so they run without hostIPC."""
    gpu = mps_gpu(3, GPU0, [(10240, 25), (10240, 50)])
    manager.set_devices(advertised_devices([gpu], mps_pipe_root=PIPE_ROOT))
    ids = [s.deviceId for s in gpu.mps]
    await registered(kubelet, MPS_10, {i: "Healthy" for i in ids})
    conn = kubelet.registered(MPS_10)
    assert conn is not None
    reply = await conn.allocate([ids[1]])
    (resp,) = reply.container_responses
    assert dict(resp.envs) == {
        "NVIDIA_VISIBLE_DEVICES": GPU0,
        "CUDA_MPS_PIPE_DIRECTORY": "/run/gpuslice/mps/gpu3",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    }
    assert [(m.container_path, m.host_path, m.read_only) for m in resp.mounts] == [
        ("/run/gpuslice/mps/gpu3", "/run/gpuslice/mps/gpu3", False),
        ("/dev/shm", "/run/gpuslice/mps/shm", False),
    ]


async def test_allocate_hybrid_mig_devices_mount_their_own_daemon_pipes_and_the_shm(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    gpu = mig_gpu(("1g.10gb", 0, 1), ("1g.10gb", 1, 2))
    manager.set_devices(advertised_devices([gpu], mps_pipe_root=PIPE_ROOT, hybrid_gpus={0}))
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy", mig_uuid(2): "Healthy"})
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    one, both = (await conn.allocate([mig_uuid(2)], [mig_uuid(1), mig_uuid(2)])).container_responses
    assert dict(one.envs)["CUDA_MPS_PIPE_DIRECTORY"] == f"{PIPE_ROOT}/gpu0-mig1"
    assert [(m.container_path, m.host_path) for m in one.mounts] == [
        (f"{PIPE_ROOT}/gpu0-mig1", f"{PIPE_ROOT}/gpu0-mig1"),
        ("/dev/shm", f"{PIPE_ROOT}/shm"),
    ]
    assert [m.container_path for m in both.mounts] == [
        f"{PIPE_ROOT}/gpu0-mig0",
        "/dev/shm",  # once
        f"{PIPE_ROOT}/gpu0-mig1",
    ]


async def test_allocate_errors_name_the_device(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    gpus = [mps_gpu(0, GPU0, [(10240, 50)]), mps_gpu(1, GPU1, [(10240, 50), (10240, 50)])]
    ids = [s.deviceId for g in gpus for s in g.mps]
    manager.set_devices(advertised_devices(gpus, mps_pipe_root=PIPE_ROOT, unhealthy={ids[2]}))
    await registered(kubelet, MPS_10, {ids[0]: "Healthy", ids[1]: "Healthy", ids[2]: "Unhealthy"})
    conn = kubelet.registered(MPS_10)
    assert conn is not None

    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await conn.allocate([ids[0], "GPU-nope-mps9-10240m-50p"])
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'GPU-nope-mps9-10240m-50p'" in str(unknown.value.details())
    assert MPS_10 in str(unknown.value.details())

    with pytest.raises(grpc.aio.AioRpcError) as sick:
        await conn.allocate([ids[2]])
    assert sick.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ids[2] in str(sick.value.details())

    with pytest.raises(grpc.aio.AioRpcError) as split:  # one container, slices of two GPUs
        await conn.allocate([ids[0], ids[1]])
    assert split.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # refused as more than one MPS slice per container, before container_env's "different GPUs"
    assert "served by 2 MPS daemons" in str(split.value.details())

    # one slice twice: its limits would add up to twice what it advertises
    with pytest.raises(grpc.aio.AioRpcError) as twice:
        await conn.allocate([ids[1], ids[1]])
    assert twice.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ids[1] in str(twice.value.details()) and "more than once" in str(twice.value.details())


async def test_a_resource_whose_socket_cannot_be_served_leaves_the_others_served(
    kubelet: FakeKubelet, manager: DevicePluginManager, plugin_dir: str
) -> None:
    """A leftover directory where one resource's socket goes (a mistaken hostPath) fails
    that resource's serving every round; the other resources are served and registered (it
    failed the whole round before, so none was)."""
    os.mkdir(os.path.join(plugin_dir, plugin_socket_name(MIG_1G)))
    devices = advertised_devices(
        [mig_gpu(("1g.10gb", 0, 1), ("3g.40gb", 4, 3))], mps_pipe_root=PIPE_ROOT
    )
    manager.set_devices(devices)
    await registered(kubelet, MIG_3G, {mig_uuid(3): "Healthy"})
    await asyncio.sleep(0.3)  # a few more rounds
    assert kubelet.registered(MIG_1G) is None


async def test_get_preferred_allocation_same_gpu_and_must_include(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    gpus = [
        mps_gpu(0, GPU0, [(10240, 25)] * 2),  # 2 slices
        mps_gpu(1, GPU1, [(10240, 25)] * 3),  # 3 slices
    ]
    manager.set_devices(advertised_devices(gpus, mps_pipe_root=PIPE_ROOT))
    g0 = [s.deviceId for s in gpus[0].mps]
    g1 = [s.deviceId for s in gpus[1].mps]
    await registered(kubelet, MPS_10, dict.fromkeys(g0 + g1, "Healthy"))
    conn = kubelet.registered(MPS_10)
    assert conn is not None
    everything = sorted(g0 + g1)

    # 2 fit on either GPU: the smallest GPU that fits (GPU0), keeping GPU1's 3 together
    assert sorted(await conn.preferred(everything, [], 2)) == sorted(g0)
    # 3 fit only on GPU1
    assert sorted(await conn.preferred(everything, [], 3)) == sorted(g1)
    # must_include a GPU1 slice: the rest comes from GPU1 too
    picked = await conn.preferred(everything, [g1[2]], 2)
    assert picked[0] == g1[2] and set(picked) <= set(g1) and len(picked) == 2
    # must_include on GPU0, size 3: GPU0's other slice first, then the fewest more GPUs
    picked = await conn.preferred(everything, [g0[0]], 3)
    assert picked[:2] == [g0[0], g0[1]] and picked[2] in g1


async def test_preferred_allocation_puts_the_gpus_the_partitioner_drains_last(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    gpus = [
        mig_gpu(("1g.10gb", 0, 1)),
        mig_gpu(("1g.10gb", 0, 2), ("1g.10gb", 1, 4), index=1, uuid=GPU1),
    ]
    manager.set_devices(advertised_devices(gpus, mps_pipe_root=PIPE_ROOT))
    await registered(
        kubelet, MIG_1G, dict.fromkeys([mig_uuid(1), mig_uuid(2), mig_uuid(4)], "Healthy")
    )
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    everything = sorted([mig_uuid(1), mig_uuid(2), mig_uuid(4)])
    assert await conn.preferred(everything, [], 1) == [mig_uuid(1)]  # the smallest group
    manager.set_avoided(frozenset({GPU0}))  # GPU0 is being drained for a waiting pod
    assert (await conn.preferred(everything, [], 1))[0] in (mig_uuid(2), mig_uuid(4))
    picked = await conn.preferred(everything, [], 3)  # nothing else left: it is used last
    assert picked[-1] == mig_uuid(1)
    manager.set_avoided(frozenset())
    assert await conn.preferred(everything, [], 1) == [mig_uuid(1)]


async def test_preferred_allocation_gives_an_instance_foreign_processes_use_only_when_needed(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    """GPU 0's lone 1g (the smallest group, preferred before) runs processes of no pod: the
    agent still advertises it Healthy, as NVIDIA's plugin does, so a pod gpuslice did not gate
    may be allocated a 1g while the partitioner promises it to nobody; the preferred
    allocation gives it only once nothing else is free."""
    plain = mig_gpu(("1g.10gb", 0, 1))
    foreign = plain.model_copy(update={"mig": [plain.mig[0].model_copy(update={"foreign": True})]})
    gpus = [foreign, mig_gpu(("1g.10gb", 0, 2), ("1g.10gb", 1, 4), index=1, uuid=GPU1)]
    devices = advertised_devices(gpus, mps_pipe_root=PIPE_ROOT)
    assert [d.foreign for d in devices[MIG_1G]] == [True, False, False]
    manager.set_devices(devices)
    everything = sorted([mig_uuid(1), mig_uuid(2), mig_uuid(4)])
    await registered(kubelet, MIG_1G, dict.fromkeys(everything, "Healthy"))
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    assert (await conn.preferred(everything, [], 1))[0] in (mig_uuid(2), mig_uuid(4))
    assert sorted(await conn.preferred(everything, [], 2)) == [mig_uuid(2), mig_uuid(4)]
    assert (await conn.preferred(everything, [], 3))[-1] == mig_uuid(1)
    assert await conn.preferred([mig_uuid(1)], [], 1) == [mig_uuid(1)]


async def test_get_preferred_allocation_groups_mig_devices_by_parent_gpu(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    # MIG UUIDs say nothing about their GPU, and their order interleaves the two GPUs
    gpus = [
        mig_gpu(("1g.10gb", 0, 1), ("1g.10gb", 1, 3)),
        mig_gpu(("1g.10gb", 0, 2), ("1g.10gb", 1, 4), ("1g.10gb", 2, 6), index=1, uuid=GPU1),
    ]
    devices = advertised_devices(gpus, mps_pipe_root=PIPE_ROOT)
    assert {d.id: d.gpu for d in devices[MIG_1G]} == {
        mig_uuid(1): GPU0,
        mig_uuid(3): GPU0,
        mig_uuid(2): GPU1,
        mig_uuid(4): GPU1,
        mig_uuid(6): GPU1,
    }
    manager.set_devices(devices)
    gpu0, gpu1 = [mig_uuid(1), mig_uuid(3)], [mig_uuid(2), mig_uuid(4), mig_uuid(6)]
    await registered(kubelet, MIG_1G, dict.fromkeys(gpu0 + gpu1, "Healthy"))
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    everything = sorted(gpu0 + gpu1)

    # 2 fit on either GPU: the smaller one (GPU0), not the first two ids (which span both)
    assert sorted(await conn.preferred(everything, [], 2)) == gpu0
    # 3 fit only on GPU1
    assert sorted(await conn.preferred(everything, [], 3)) == gpu1
    # a GPU1 device must be included: the second one comes from GPU1 as well
    picked = await conn.preferred(everything, [mig_uuid(4)], 2)
    assert picked[0] == mig_uuid(4) and picked[1] in gpu1
    # 4 devices: all of GPU1 first (largest group), then one of GPU0
    picked = await conn.preferred(everything, [], 4)
    assert sorted(picked[:3]) == gpu1 and picked[3] in gpu0
    # an id the plugin does not advertise is a GPU of its own: the rest is a best fit
    assert await conn.preferred([*everything, "MIG-unknown"], ["MIG-unknown"], 2) == [
        "MIG-unknown",
        mig_uuid(1),
    ]


async def test_reregisters_after_kubelet_restart(
    kubelet: FakeKubelet, manager: DevicePluginManager, plugin_dir: str
) -> None:
    manager.set_devices(
        advertised_devices([mig_gpu(("1g.10gb", 0, 1), ("3g.40gb", 4, 2))], mps_pipe_root=PIPE_ROOT)
    )
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    await registered(kubelet, MIG_3G, {mig_uuid(2): "Healthy"})
    assert len(kubelet.registrations) == 2

    await kubelet.restart()  # every socket deleted, a new kubelet.sock
    assert not os.path.exists(os.path.join(plugin_dir, plugin_socket_name(MIG_1G)))
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    await registered(kubelet, MIG_3G, {mig_uuid(2): "Healthy"})
    assert len(kubelet.registrations) == 4
    assert os.path.exists(os.path.join(plugin_dir, plugin_socket_name(MIG_1G)))
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    reply = await conn.allocate([mig_uuid(1)])  # the new kubelet can use the fresh socket
    assert dict(reply.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": mig_uuid(1)}


async def test_reregisters_when_only_kubelet_sock_is_recreated(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    manager.set_devices(advertised_devices([mig_gpu(("1g.10gb", 0, 1))], mps_pipe_root=PIPE_ROOT))
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    await kubelet.restart(wipe_plugin_sockets=False)  # new kubelet.sock inode, plugin socket kept
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    assert [r.resource_name for r in kubelet.registrations] == [MIG_1G, MIG_1G]


async def test_registers_once_the_kubelet_appears_and_retries_rejections(plugin_dir: str) -> None:
    manager = DevicePluginManager(plugin_dir, poll_interval_s=0.05)
    await manager.start()
    kubelet = FakeKubelet(plugin_dir)
    try:
        manager.set_devices(
            advertised_devices([mig_gpu(("1g.10gb", 0, 1))], mps_pipe_root=PIPE_ROOT)
        )
        await eventually(
            lambda: os.path.exists(os.path.join(plugin_dir, plugin_socket_name(MIG_1G))),
            what="the plugin to serve before any kubelet exists",
        )
        assert [s.registered for s in manager.status()] == [False]
        kubelet.reject_with = "not now"
        await kubelet.start()
        await eventually(lambda: len(kubelet.registrations) >= 2, what="registration retries")
        assert kubelet.registered(MIG_1G) is None
        kubelet.reject_with = None
        await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
        await eventually(
            lambda: [s.registered for s in manager.status()] == [True], what="status registered"
        )
    finally:
        await manager.stop()
        await kubelet.stop()


async def test_set_devices_from_another_thread(
    kubelet: FakeKubelet, manager: DevicePluginManager
) -> None:
    devices = advertised_devices([mig_gpu(("1g.10gb", 0, 1))], mps_pipe_root=PIPE_ROOT)
    await asyncio.to_thread(manager.set_devices, devices)
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    devices = advertised_devices(
        [mig_gpu(("1g.10gb", 0, 1), ("1g.10gb", 1, 2))], mps_pipe_root=PIPE_ROOT
    )
    await asyncio.to_thread(manager.set_devices, devices)
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy", mig_uuid(2): "Healthy"})


async def test_stop_ends_streams_and_removes_sockets(kubelet: FakeKubelet, plugin_dir: str) -> None:
    manager = DevicePluginManager(plugin_dir, poll_interval_s=0.05)
    await manager.start()
    manager.set_devices(advertised_devices([mig_gpu(("1g.10gb", 0, 1))], mps_pipe_root=PIPE_ROOT))
    await registered(kubelet, MIG_1G, {mig_uuid(1): "Healthy"})
    await manager.stop()
    conn = kubelet.registered(MIG_1G)
    assert conn is not None
    await eventually(lambda: conn.stream_ended, what="stream end after stop")
    assert os.listdir(plugin_dir) == ["kubelet.sock"]


def dev(resource: str, dev_id: str, gpu: str = GPU0) -> AdvertisedDevice:
    return AdvertisedDevice(id=dev_id, resource=resource, gpu=gpu, healthy=True, env={})


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ({"gpu-10gb": [dev("gpu-10gb", "a")]}, "'vendor.com/name'"),
        ({"kubernetes.io/gpu": [dev("kubernetes.io/gpu", "a")]}, "other than kubernetes.io"),
        ({MIG_1G: [dev(MIG_3G, "a")]}, "has resource 'nvidia.com/mig-3g.40gb'"),
        ({MIG_1G: [dev(MIG_1G, "x" * 64)]}, "1 to 63 characters"),
        ({MIG_1G: [dev(MIG_1G, "a"), dev(MIG_1G, "a")]}, "listed twice"),
        ({MIG_1G: [dev(MIG_1G, "a", gpu="")]}, "names no parent GPU"),
    ],
)
def test_set_devices_rejects_bad_input(
    devices: dict[str, list[AdvertisedDevice]], message: str
) -> None:
    manager = DevicePluginManager("/var/lib/kubelet/device-plugins")
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        manager.set_devices(devices)


def test_socket_path_too_long_is_rejected_early() -> None:
    manager = DevicePluginManager("/" + "d" * 80)
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        manager.set_devices({MIG_1G: [dev(MIG_1G, "a")]})


def test_start_needs_the_plugin_directory(plugin_dir: str) -> None:
    manager = DevicePluginManager(os.path.join(plugin_dir, "missing"))
    with pytest.raises(FileNotFoundError, match="mount the kubelet"):
        asyncio.run(manager.start())


# -- preferred_allocation, the pure part ------------------------------------------------------

groups_st = st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(groups=groups_st, data=st.data())
def test_preferred_allocation_properties(groups: list[int], data: st.DataObject) -> None:
    ids = [f"g{g}-d{k}" for g, n in enumerate(groups) for k in range(n)]

    def gpu_of(dev_id: str) -> str:
        return dev_id.split("-")[0]

    size = data.draw(st.integers(min_value=1, max_value=len(ids)))
    must = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=size))
    picked = preferred_allocation(ids, must, size, gpu_of)

    assert len(picked) == len(set(picked)) == size
    assert picked[: len(must)] == must
    assert set(picked) <= set(ids)
    if not must:  # as few GPUs as possible: the k largest groups are the best cover
        cover, total = 0, 0
        for n in sorted(groups, reverse=True):
            cover, total = cover + 1, total + n
            if total >= size:
                break
        assert len({gpu_of(p) for p in picked}) == cover
    else:  # the GPUs of must_include are filled before any other GPU is touched
        must_gpus = {gpu_of(m) for m in must}
        extra = [p for p in picked[len(must) :]]
        room = sum(n for g, n in enumerate(groups) if f"g{g}" in must_gpus) - len(must)
        assert sum(gpu_of(p) in must_gpus for p in extra) == min(room, len(extra))


def test_preferred_allocation_short_supply_and_oversized_must_include() -> None:
    assert preferred_allocation(["a", "b"], [], 3, lambda d: d) == ["a", "b"]
    assert preferred_allocation(["a", "b"], ["b", "a"], 1, lambda d: d) == ["b", "a"]


# -- Allocate feeds the allocation ledger; the reconciler keeps what it holds ------------------


class KubeletRecord:
    """PodResources as the kubelet answers it: only what it has recorded so far."""

    def __init__(self) -> None:
        self.recorded: set[str] = set()

    async def in_use_device_ids(self) -> set[str]:
        return set(self.recorded)


def spec(*instances: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p",
            "mode": "mig",
            "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in instances]}],
        }
    )


async def allocate_then_repartition(
    kubelet: FakeKubelet, plugin_dir: str, in_use: InUseSource, ledger: AllocationLedger
) -> tuple[FakeNvml, str, set[str]]:
    """Create 1g@0 + 1g@1, let the kubelet allocate 1g@0 over gRPC (not yet recorded in
    PodResources), then ask for a layout without it; return the hardware, the allocated UUID
    and the MIG UUIDs left."""
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    manager = DevicePluginManager(
        plugin_dir, poll_interval_s=0.05, register_timeout_s=5, on_allocate=ledger.record
    )
    await manager.start()
    try:

        def publish(devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
            manager.set_devices(devices)

        agent = Reconciler(nv, in_use, FakeSupervisor(nvml=nv), CAT, publish=publish)
        first = await agent.reconcile(spec(("1g.10gb", 0), ("1g.10gb", 1)), 1, now="t")
        assert first.applied
        uuid = nv.uuid_of(0, next(gi for gi, _, start, _ in nv.instances(0) if start == 0))
        await eventually(lambda: kubelet.registered(MIG_1G) is not None, what="registration")
        conn = kubelet.registered(MIG_1G)
        assert conn is not None
        await eventually(lambda: uuid in conn.devices, what="device advertised")
        await conn.allocate([uuid])  # the kubelet records it only after this returns
        await agent.reconcile(spec(("7g.80gb", 0)), 2, now="t")
    finally:
        await manager.stop()
    return nv, uuid, set(nv.mig_uuids())


async def test_a_device_allocated_before_podresources_shows_it_is_not_destroyed(
    kubelet: FakeKubelet, plugin_dir: str
) -> None:
    ledger = AllocationLedger(60)
    record = KubeletRecord()
    nv, uuid, left = await allocate_then_repartition(
        kubelet, plugin_dir, LedgerInUse(record, ledger), ledger
    )
    assert uuid in ledger  # recorded by the gRPC Allocate
    assert uuid in left  # kept: the 7g spec is not applied over it (Degraded, InstanceInUse)
    assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("1g.10gb", 0), ("1g.10gb", 1)]


async def test_without_the_ledger_the_same_race_destroys_the_device(
    kubelet: FakeKubelet, plugin_dir: str
) -> None:
    """The finding itself: PodResources alone does not protect a fresh allocation."""
    ledger = AllocationLedger(60)
    nv, uuid, left = await allocate_then_repartition(kubelet, plugin_dir, KubeletRecord(), ledger)
    assert uuid in ledger  # the plugin did hand it out ...
    assert uuid not in left  # ... and the agent destroyed it: the 7g instance replaced it
    assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("7g.80gb", 0)]


async def test_failed_allocate_records_nothing(kubelet: FakeKubelet, plugin_dir: str) -> None:
    recorded: list[list[str]] = []
    manager = DevicePluginManager(
        plugin_dir, poll_interval_s=0.05, register_timeout_s=5, on_allocate=recorded.append
    )
    await manager.start()
    try:
        dev = AdvertisedDevice("MIG-x", MIG_1G, "GPU-0", True)
        manager.set_devices({MIG_1G: [dev]})
        await eventually(lambda: kubelet.registered(MIG_1G) is not None, what="registration")
        conn = kubelet.registered(MIG_1G)
        assert conn is not None
        await eventually(lambda: "MIG-x" in conn.devices, what="device advertised")
        with pytest.raises(Exception, match="MIG-nope"):
            await conn.allocate(["MIG-nope"])
        assert recorded == []
        await conn.allocate(["MIG-x"], ["MIG-x"])
        assert recorded == [["MIG-x", "MIG-x"]]
    finally:
        await manager.stop()
    assert not os.listdir(plugin_dir) or os.listdir(plugin_dir) == ["kubelet.sock"]


# ------------------------------------------------------------------ layout changes mid-round
# Device plugin manager: layout changes that land while its reconcile task awaits.
#
# The manager's reconcile task (``DevicePluginManager._sync``) awaits while it starts a plugin's
# gRPC server (``grpc.aio`` ``server.start()`` yields to the event loop) and while it registers
# with the kubelet (up to ``register_timeout_s``).  The reconciler publishes on the same loop at
# any of those points.  A publish made then must not be lost, and a resource it removed must not
# be started and registered with the devices it had before.


class HeldServe:
    """Holds the first start of ``resource``'s plugin server until :meth:`release`, the way
    ``server.start()`` suspends the reconcile task, so a test can publish meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, resource: str) -> None:
        self.entered = asyncio.Event()
        self._gate = asyncio.Event()
        real = _ResourcePlugin.serve
        held = self

        async def serve(plugin: _ResourcePlugin) -> None:
            if plugin.resource == resource and not held.entered.is_set():
                held.entered.set()
                await held._gate.wait()
            await real(plugin)

        monkeypatch.setattr(_ResourcePlugin, "serve", serve)

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
