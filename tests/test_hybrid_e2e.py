"""End to end on a hybrid node: two pending pods -> one plan -> the agent -> the kubelet's devices.

A pending ``nvidia.com/gpu-10gb`` pod and a pending ``nvidia.com/mig-3g.40gb`` pod, one hybrid
A100-SXM4-80GB node with MIG mode off.  The snapshot is built the way the partitioner builds it
(the NodePartitioning status through :func:`partitioner.adoption.gpus_from_status`), the plan is
one :func:`planner.plan` call, and its layouts become the NodePartitioning spec through the
partitioner's own conversion (``partitioner.decide._desired_planned``).  The node agent's
reconciler applies the spec on the fake NVML (MIG mode on, the instances at their planned
starts, an MPS daemon for the instance that hosts the slice) and publishes the devices through
its device plugins, which register over gRPC on unix sockets with the fake kubelet
(tests/fake_kubelet.py); in-use devices come from the fake PodResources server over gRPC.

Checked: both resources are advertised; ``Allocate`` of the MIG device answers with its UUID,
``Allocate`` of the MPS slice with the hosting instance's UUID, its daemon's pipe directory, the
slice's pinned-memory and thread limits and the pipe and shm mounts; the status lists the slice
inside its instance; and once a pod holds the slice, a spec that drops it is refused for that
GPU (its instance and daemon stay) while the next plan, made from that status, keeps both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from fake_kubelet import FakeKubelet, FakePodResources, eventually

from contract.nodepartitioning import (
    NodePartitioning,
    NodePartitioningSpec,
    NodePartitioningStatus,
    ObjectMeta,
)
from node_agent.deviceplugin import DevicePluginManager
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.podresources import PodResourcesClient
from node_agent.reconciler import Reconciler
from partitioner.adoption import gpus_from_status
from partitioner.decide import _desired_planned
from planner import Mode, NodeState, PendingPod, Plan, PlannerSettings, Snapshot, plan
from planner.catalog import default_catalog

CAT = default_catalog()
MODEL = "A100-SXM4-80GB"
MPS_10 = "nvidia.com/gpu-10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
PIPE_ROOT = "/run/gpuslice/mps"
SETTINGS = PlannerSettings(time_limit_s=5.0)


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gshyb-", dir="/tmp")  # unix socket paths: <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Node:
    nv: FakeNvml
    sup: FakeSupervisor
    agent: Reconciler
    kubelet: FakeKubelet
    pod_resources: FakePodResources


@asynccontextmanager
async def hybrid_node(socket_dir: str) -> AsyncIterator[Node]:
    plugin_dir = os.path.join(socket_dir, "dp")
    os.mkdir(plugin_dir)
    kubelet = FakeKubelet(plugin_dir)
    pod_resources = FakePodResources(os.path.join(socket_dir, "podres.sock"))
    await kubelet.start()
    await pod_resources.start()
    plugins = DevicePluginManager(plugin_dir, poll_interval_s=0.1, register_timeout_s=5)
    await plugins.start()
    in_use = PodResourcesClient(pod_resources.socket_path, timeout_s=5)
    nv = FakeNvml([CAT.model(MODEL)], mig_enabled=False)
    sup = FakeSupervisor(nvml=nv)
    agent = Reconciler(nv, in_use, sup, CAT, mps_pipe_root=PIPE_ROOT, publish=plugins.set_devices)
    try:
        yield Node(nv, sup, agent, kubelet, pod_resources)
    finally:
        await plugins.stop()
        await in_use.close()
        await pod_resources.stop()
        await kubelet.stop()


def snapshot(status: NodePartitioningStatus | None, pods: tuple[PendingPod, ...]) -> Snapshot:
    """The planner's input as the partitioner builds it from the node's NodePartitioning."""
    np = NodePartitioning(
        metadata=ObjectMeta(name="n1"),
        spec=NodePartitioningSpec(mode="hybrid"),
        status=status,
    )
    node = NodeState("n1", Mode.HYBRID, MODEL, gpus_from_status(np, 1))
    return Snapshot((node,), pods)


def spec_of(result: Plan, plan_id: str) -> NodePartitioningSpec:
    """The spec the partitioner writes for the plan's changed GPUs."""
    gpus = [_desired_planned(planned) for planned in result.layouts.values()]
    return NodePartitioningSpec(planId=plan_id, mode="hybrid", gpus=gpus)


async def test_a_mps_pod_and_a_mig_pod_on_one_hybrid_a100(socket_dir: str) -> None:
    pods = (
        PendingPod("default/mps", {MPS_10: 1}, cpu_milli=1000),
        PendingPod("default/mig", {MIG_3G: 1}, cpu_milli=1000),
    )
    result = plan(snapshot(None, pods), SETTINGS)
    assert result.status == "OPTIMAL" and not result.unplaced
    (planned,) = result.layouts.values()
    (host_start,) = result.assignments["default/mps"].hosts[MPS_10]
    hosted = dict(planned.mig_mps)
    assert [s.memory_mib for s in hosted[host_start]] == [10 * 1024]
    assert ("3g.40gb", host_start) not in planned.mig  # the MIG pod's instance hosts nothing
    spec = spec_of(result, "1")
    (gpu_spec,) = spec.gpus
    host_spec = next(m for m in gpu_spec.mig if m.start == host_start)
    (slice_spec,) = host_spec.mps
    assert slice_spec.memoryMiB == 10240 and 1 <= slice_spec.activeThreadPercentage <= 100

    async with hybrid_node(socket_dir) as node:
        res = await node.agent.reconcile(spec, 1)
        assert res.applied, res.status.conditions

        # the fake NVML holds exactly the planned instances, and the host's daemon runs
        assert node.nv.mig_enabled(0)
        layout = sorted((p.name, start) for p, start, _ in node.nv.layout(0))
        assert layout == sorted(planned.mig)
        (actual,) = res.status.gpus
        by_start = {m.start: m for m in actual.mig}
        host = by_start[host_start]
        (actual_slice,) = host.mps
        assert actual_slice.memoryMiB == 10240 and not actual_slice.used
        assert actual_slice.deviceId.startswith(host.deviceId)  # the id names the instance
        daemon = node.sup.daemons[f"gpu0-mig{host_start}"]
        assert daemon.device_uuid == host.deviceId
        assert daemon.default_pinned_mem_limit_mib == 10240
        assert daemon.default_thread_percentage == actual_slice.activeThreadPercentage

        # both devices reach the kubelet through ListAndWatch
        def advertised(resource: str) -> dict[str, str]:
            conn = node.kubelet.registered(resource)
            return conn.devices if conn is not None else {}

        await eventually(lambda: bool(advertised(MPS_10)), timeout=10, what=f"{MPS_10}")
        await eventually(lambda: bool(advertised(MIG_3G)), timeout=10, what=f"{MIG_3G}")
        assert advertised(MPS_10) == {actual_slice.deviceId: "Healthy"}
        mig_ids = {m.deviceId for m in actual.mig if m.profile == "3g.40gb" and not m.mps}
        assert set(advertised(MIG_3G)) == mig_ids and len(mig_ids) == 1
        for prof in CAT.model(MODEL).profiles:  # a host is no MIG device of its own
            assert host.deviceId not in advertised(prof.resource)

        # Allocate: the MIG pod gets its instance; the MPS pod its slice inside the host
        mig_conn = node.kubelet.registered(MIG_3G)
        mps_conn = node.kubelet.registered(MPS_10)
        assert mig_conn is not None and mps_conn is not None
        (mig_id,) = mig_ids
        mig_reply = (await mig_conn.allocate([mig_id])).container_responses[0]
        assert dict(mig_reply.envs)["NVIDIA_VISIBLE_DEVICES"] == mig_id
        mps_reply = (await mps_conn.allocate([actual_slice.deviceId])).container_responses[0]
        pipe = f"{PIPE_ROOT}/gpu0-mig{host_start}"
        assert dict(mps_reply.envs) == {
            "NVIDIA_VISIBLE_DEVICES": host.deviceId,
            "CUDA_MPS_PIPE_DIRECTORY": pipe,
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(actual_slice.activeThreadPercentage),
        }
        assert [(m.container_path, m.host_path) for m in mps_reply.mounts] == [
            (pipe, pipe),
            ("/dev/shm", f"{PIPE_ROOT}/shm"),
        ]

        # the pods run: PodResources shows both devices held
        node.pod_resources.add_pod("default", "mps", {"c": {MPS_10: [actual_slice.deviceId]}})
        node.pod_resources.add_pod("default", "mig", {"c": {MIG_3G: [mig_id]}})
        res = await node.agent.reconcile(spec, 1)
        assert res.applied
        host = next(m for m in res.status.gpus[0].mig if m.start == host_start)
        assert host.used and [s.used for s in host.mps] == [True]

        # a spec that drops the held slice is refused for that GPU: nothing destroyed
        bare = spec.model_copy(
            update={
                "planId": "2",
                "gpus": [
                    g.model_copy(update={"mig": [m.model_copy(update={"mps": []}) for m in g.mig]})
                    for g in spec.gpus
                ],
            }
        )
        res = await node.agent.reconcile(bare, 2)
        assert not res.applied and res.blocks[0].reason == "SliceInUse"
        assert sorted((p.name, start) for p, start, _ in node.nv.layout(0)) == layout
        assert f"gpu0-mig{host_start}" in node.sup.running()
        assert actual_slice.deviceId in {d.id for d in res.devices.get(MPS_10, [])}

        # the next plan, made from that status, keeps the held slice and its instance
        more = (PendingPod("default/more", {MPS_10: 1}),)
        again = plan(snapshot(res.status, more), SETTINGS)
        assert "default/more" in again.assignments
        kept = again.layouts.get(("n1", 0))
        if kept is not None:
            assert (host.profile, host_start) in kept.mig
            assert any(s.used and s.memory_mib == 10240 for s in dict(kept.mig_mps)[host_start])
