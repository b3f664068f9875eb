"""Opting a node out, end to end on the fakes: the agent's drain and the partitioner's lifecycle.

* **Agent** (fake NVML, the production MPS supervisor over an emulated control binary): without
  a NodePartitioning it advertises only what pods hold, destroys nothing, keeps the MPS daemons
  pods use and stops the others, puts idle MPS GPUs back in compute mode DEFAULT, leaves MIG
  mode and MIG instances as they are, says what it waits for (log, metric), and when stopped
  mid-drain passes again until nothing is held.
* **Partitioner** (:func:`partitioner.optout.node_lifecycle`, pure): opted-in nodes get the
  ``gpuslice.io/managed`` label that keeps the agent; an opted-out node keeps it, with
  ``GpusliceReady=False/Draining`` naming the pods that still use slices, until none does; then
  condition and label go (Events ``Draining``, ``Drained``).
* **Writes** (:mod:`partitioner.node_writes` against the test API server): the label patch and
  the resourceVersion-guarded condition removal, retried after a 409.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import ApiServer, declare, stored
from prometheus_client import CollectorRegistry

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.agent import Agent, InMemorySpecSource
from node_agent.devices import AdvertisedDevice
from node_agent.metrics import AgentMetrics
from node_agent.mps import MpsControlSupervisor
from node_agent.mps_fake import FakeMpsControl
from node_agent.nvml import ComputeMode
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler, ReconcileResult
from partitioner.actions import EmitEvent, SetNodeCondition
from partitioner.index import ClusterIndex
from partitioner.kubeapi import Endpoint, KubeApi
from partitioner.node_actions import RemoveNodeCondition, SetNodeLabel
from partitioner.node_writes import execute
from partitioner.optout import DRAINING, MANAGED_LABEL, node_lifecycle
from planner.catalog import default_catalog

CAT = default_catalog()


# ------------------------------------------------------------------------ the agent's drain


class Pods:
    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.down = False

    async def in_use_device_ids(self) -> set[str]:
        if self.down:
            raise ConnectionError("kubelet socket missing")
        return set(self.ids)


class Node:
    def __init__(self, tmp: Path, *models: str, mig: bool = False) -> None:
        self.nv = FakeNvml([CAT.model(m) for m in models], mig_enabled=mig)
        self.mps = FakeMpsControl(self.nv)
        self.pods = Pods()
        self.root = str(tmp / "mps")
        self.published: list[dict[str, list[AdvertisedDevice]]] = []
        self.destroys = 0
        self.nv.hooks.append(self._count)
        self.agent = Reconciler(
            self.nv,
            self.pods,
            MpsControlSupervisor(self.mps),
            CAT,
            mps_pipe_root=self.root,
            mps_log_root=str(tmp / "log"),
            publish=self.publish,
        )

    def _count(self, op: str, args: tuple[int, ...]) -> None:
        if op.startswith("destroy_") or op == "set_mig_mode":
            self.destroys += 1

    def publish(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        self.published.append({r: list(ds) for r, ds in devices.items()})

    def run(self, spec: NodePartitioningSpec | None) -> ReconcileResult:
        return asyncio.run(self.agent.reconcile(spec, 1, now="2026-01-01T00:00:00Z"))


def spec(mode: str, gpus: list[dict[str, Any]]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate({"planId": "p1", "mode": mode, "gpus": gpus})


MPS = spec(
    "mps",
    [
        {"index": i, "mps": [{"memoryMiB": 20480, "activeThreadPercentage": 25}] * 3}
        for i in (0, 1)
    ],
)


TWO_3G = [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]


def advertised(devices: Mapping[str, Sequence[AdvertisedDevice]]) -> dict[str, list[str]]:
    return {r: sorted(d.id for d in ds) for r, ds in devices.items()}


def test_mps_drain_keeps_what_pods_hold_and_hands_the_rest_back(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", "A100-SXM4-80GB")
    res = node.run(MPS)
    gpu0 = [d for d in res.devices["nvidia.com/gpu-20gb"] if d.gpu == res.status.gpus[0].uuid]
    held = gpu0[0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env["CUDA_MPS_PIPE_DIRECTORY"])

    res = node.run(None)  # the NodePartitioning is gone: opted out
    assert res.draining and res.held == (held.id,)
    assert node.published[-1] == {"nvidia.com/gpu-20gb": [held]}  # only the held slice
    assert node.mps.served(f"{node.root}/gpu0") and not node.mps.served(f"{node.root}/gpu1")
    assert not node.mps.broken and not node.mps.quit_with_clients
    assert node.nv.compute_mode(0) == ComputeMode.EXCLUSIVE_PROCESS  # its client runs on
    assert node.nv.compute_mode(1) == ComputeMode.DEFAULT  # idle: handed back
    assert node.destroys == 0

    assert node.run(None).operations == 0  # nothing more to do while the pod runs

    node.mps.disconnect(client)
    node.pods.ids = set()
    res = node.run(None)
    assert res.draining and res.held == () and node.published[-1] == {}
    assert not node.mps.daemons
    assert [node.nv.compute_mode(g) for g in (0, 1)] == [ComputeMode.DEFAULT] * 2
    assert node.destroys == 0 and not node.nv.mig_enabled(0)


def test_mps_drain_waits_while_a_process_still_runs_on_the_gpu(tmp_path: Path) -> None:
    node = Node(tmp_path, "A30")
    one = spec("mps", [{"index": 0, "mps": [{"memoryMiB": 8192, "activeThreadPercentage": 50}]}])
    assert node.run(one).applied
    stray = node.nv.start_process(0, name="python")  # outside any pod gpuslice knows
    res = node.run(None)
    assert res.held == () and node.mps.served(f"{node.root}/gpu0")  # a process: daemon stays
    assert node.nv.compute_mode(0) == ComputeMode.EXCLUSIVE_PROCESS
    node.nv.stop_process(stray)
    node.run(None)
    assert not node.mps.daemons and node.nv.compute_mode(0) == ComputeMode.DEFAULT


def test_mig_drain_leaves_mig_mode_and_instances_as_they_are(tmp_path: Path) -> None:
    node = Node(tmp_path, "H100-80GB", mig=True)
    mig = spec(
        "mig",
        [{"index": 0, "mig": TWO_3G}],
    )
    res = node.run(mig)
    held = res.devices["nvidia.com/mig-3g.40gb"][0]
    node.pods.ids = {held.id}
    layout = node.nv.instances(0)

    res = node.run(None)
    assert advertised(res.devices) == {"nvidia.com/mig-3g.40gb": [held.id]}
    node.pods.ids = set()
    res = node.run(None)
    assert res.held == () and res.devices == {} and node.published[-1] == {}
    assert node.nv.mig_enabled(0) and node.nv.instances(0) == layout and node.destroys == 0
    assert node.mps.commands == []


def test_hybrid_drain_keeps_the_daemon_of_a_used_instance_only(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    hybrid = spec(
        "hybrid",
        [{"index": 0, "mig": TWO_3G}],
    )
    res = node.run(hybrid)
    held = res.devices["nvidia.com/mig-3g.40gb"][0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env["CUDA_MPS_PIPE_DIRECTORY"])
    res = node.run(None)
    assert list(node.mps.daemons) == [held.env["CUDA_MPS_PIPE_DIRECTORY"]]
    assert res.held == (held.id,) and not node.mps.broken
    node.mps.disconnect(client)
    node.pods.ids = set()
    node.run(None)
    assert not node.mps.daemons and not node.mps.quit_with_clients


def test_drain_with_unreadable_in_use_ids_publishes_and_stops_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", "A100-SXM4-80GB")
    node.run(MPS)
    published = len(node.published)
    node.pods.down = True
    res = node.run(None)
    assert res.draining and not res.fresh and len(node.published) == published
    assert len(node.mps.daemons) == 2  # unknown users: nobody's daemon is stopped
    assert [node.nv.compute_mode(g) for g in (0, 1)] == [ComputeMode.EXCLUSIVE_PROCESS] * 2


def test_agent_loop_says_what_the_drain_waits_for_and_finishes_it_when_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", "A100-SXM4-80GB")
    source = InMemorySpecSource("gpu-node-1", MPS)
    metrics = AgentMetrics(CollectorRegistry())
    agent = Agent(node.agent, source, metrics=metrics, resync_seconds=0.05, retry_seconds=0.05)
    res = asyncio.run(agent.run_once())
    held = res.devices["nvidia.com/gpu-20gb"][0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env["CUDA_MPS_PIPE_DIRECTORY"])
    source.obj = None  # the partitioner deleted it

    caplog.set_level(logging.INFO, logger="gpuslice.agent")
    asyncio.run(agent.run_once())
    asyncio.run(agent.run_once())  # said once, not every pass
    waits = [r.getMessage() for r in caplog.records if "draining" in r.getMessage()]
    assert len(waits) == 1 and "1 device(s) still held by pods" in waits[0] and held.id in waits[0]
    assert metrics.registry.get_sample_value("gpuslice_agent_draining") == 1.0

    # the last pod ends and the pod is deleted (SIGTERM) before the next resync
    node.mps.disconnect(client)

    async def stopped_mid_drain() -> None:
        stop = asyncio.Event()
        stop.set()
        node.pods.ids = set()
        await agent.run(stop, finish_drain_s=5.0)

    asyncio.run(stopped_mid_drain())
    assert not node.mps.daemons
    assert [node.nv.compute_mode(g) for g in (0, 1)] == [ComputeMode.DEFAULT] * 2
    assert any("drained" in r.getMessage() for r in caplog.records)

    source.set_spec(MPS)  # opted in again
    res = asyncio.run(agent.run_once())
    assert res.applied and not res.draining and len(node.mps.daemons) == 2
    assert metrics.registry.get_sample_value("gpuslice_agent_draining") == 0.0


# ------------------------------------------------------------------ the partitioner's lifecycle


def node_obj(
    name: str, labels: dict[str, str], conditions: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1", "labels": labels},
        "status": {"conditions": conditions or []},
    }


def bound(name: str, node: str, resource: str, phase: str = "Running") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"limits": {resource: "1"}}}],
        },
        "status": {"phase": phase},
    }


GPU_LABELS = {
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.memory": "81920",
    "nvidia.com/mig.strategy": "mixed",
}
OPT_IN = {"gpuslice.io/partitioning": "mps", **GPU_LABELS}


def condition(reason: str, message: str, status: str = "False") -> dict[str, str]:
    return {"type": "GpusliceReady", "status": status, "reason": reason, "message": message}


def test_opted_in_nodes_get_the_managed_label_once() -> None:
    index = ClusterIndex.from_objects(
        CAT,
        nodes=[
            node_obj("new", OPT_IN),
            node_obj("nos", {"nos.nebuly.com/gpu-partitioning": "mig", **GPU_LABELS}),
            # an opt-in label the agent's affinity does not select: not labelled, or the agent
            # would take the node's GPUs from NVIDIA's device plugin and advertise nothing
            node_obj("bad", {"gpuslice.io/partitioning": "weird"}),
            node_obj("off", {"gpuslice.io/partitioning": "off", **GPU_LABELS}),
            node_obj("done", {**OPT_IN, MANAGED_LABEL: "true"}),
            node_obj("cpu", {"kubernetes.io/os": "linux"}),
        ],
    )
    assert node_lifecycle(index) == [
        SetNodeLabel("new", MANAGED_LABEL, "true"),
        SetNodeLabel("nos", MANAGED_LABEL, "true"),
    ]


def test_a_managed_node_whose_label_turns_invalid_drains_without_touching_its_condition() -> None:
    """``gpuslice.io/partitioning=off`` on a managed node: opted out for the agent, drained as
    usual; its ``GpusliceReady`` is the label check's (``InvalidPartitioningLabel``), left alone."""
    invalid = condition("InvalidPartitioningLabel", "label gpuslice.io/partitioning='off' ...")
    labels = {"gpuslice.io/partitioning": "off", MANAGED_LABEL: "true", **GPU_LABELS}
    holder = bound("infer", "n1", "nvidia.com/gpu-20gb")
    index = ClusterIndex.from_objects(CAT, nodes=[node_obj("n1", labels, [invalid])], pods=[holder])
    assert node_lifecycle(index) == []  # the pod still uses a slice: the agent stays
    index.upsert_pod({**holder, "metadata": {**holder["metadata"], "resourceVersion": "2"},
                      "status": {"phase": "Succeeded"}})  # fmt: skip
    unlabel, done = node_lifecycle(index)
    assert unlabel == SetNodeLabel("n1", MANAGED_LABEL, None)
    assert isinstance(done, EmitEvent) and done.reason == "Drained"


def test_an_opted_out_node_drains_while_pods_use_slices_then_is_let_go() -> None:
    labels = {**GPU_LABELS, MANAGED_LABEL: "true"}  # the opt-in label was removed
    pods = [
        bound("infer", "n1", "nvidia.com/gpu-20gb"),
        bound("train", "n1", "nvidia.com/mig-1g.10gb"),
        bound("done", "n1", "nvidia.com/gpu-20gb", phase="Succeeded"),
        bound("web", "n1", "cpu"),
        bound("elsewhere", "n2", "nvidia.com/gpu-20gb"),
    ]
    index = ClusterIndex.from_objects(CAT, nodes=[node_obj("n1", labels)], pods=pods)
    actions = node_lifecycle(index)
    (cond, event) = actions
    assert isinstance(cond, SetNodeCondition) and isinstance(event, EmitEvent)
    assert (cond.node, cond.status, cond.reason) == ("n1", "False", DRAINING)
    assert "2 pod(s) still do: ml/infer, ml/train" in cond.message
    assert (event.ref.kind, event.ref.name, event.type, event.reason) == (
        "Node",
        "n1",
        "Normal",
        DRAINING,
    )

    # written: nothing more while the same pods run
    drained = node_obj("n1", labels, [condition(DRAINING, cond.message)])
    index.upsert_node({**drained, "metadata": {**drained["metadata"], "resourceVersion": "2"}})
    assert node_lifecycle(index) == []

    # one pod ends: the message follows, no second Event
    index.upsert_pod({**pods[1], "metadata": {**pods[1]["metadata"], "resourceVersion": "2"},
                      "status": {"phase": "Succeeded"}})
    (update,) = node_lifecycle(index)
    assert isinstance(update, SetNodeCondition) and "1 pod(s) still do: ml/infer." in update.message

    # the last one ends: condition and label go, with a Drained Event
    index.upsert_pod({**pods[0], "metadata": {**pods[0]["metadata"], "resourceVersion": "2"},
                      "status": {"phase": "Failed"}})
    remove, unlabel, done = node_lifecycle(index)
    assert remove == RemoveNodeCondition("n1", "GpusliceReady")
    assert unlabel == SetNodeLabel("n1", MANAGED_LABEL, None)
    assert isinstance(done, EmitEvent) and done.reason == "Drained"


def test_many_holders_are_counted_and_a_leftover_condition_is_removed() -> None:
    many = [bound(f"p{i}", "n1", "nvidia.com/gpu-10gb") for i in range(7)]
    index = ClusterIndex.from_objects(
        CAT,
        nodes=[
            node_obj("n1", {MANAGED_LABEL: "true"}),
            node_obj("old", {}, [condition("InvalidGpuLabels", "label ...")]),  # never managed
        ],
        pods=many,
    )
    cond, _event, stale = node_lifecycle(index)
    assert isinstance(cond, SetNodeCondition)
    assert "7 pod(s) still do: ml/p0, ml/p1, ml/p2, ml/p3, ml/p4 and 2 more." in cond.message
    assert stale == RemoveNodeCondition("old", "GpusliceReady")


# ---------------------------------------------------------------------- the writes


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


async def test_label_and_condition_writes_keep_everything_else(kmock: ApiServer) -> None:
    declare(kmock)
    ready = {"type": "Ready", "status": "True"}
    body = node_obj("n1", {"a": "b", MANAGED_LABEL: "true"}, [ready, condition(DRAINING, "x")])
    body["metadata"].pop("resourceVersion")
    await kmock.post("/api/v1/nodes", json=body)
    api = KubeApi(lambda: Endpoint(str(kmock.url).rstrip("/")))
    try:
        await execute(api, RemoveNodeCondition("n1", "GpusliceReady"))
        await execute(api, SetNodeLabel("n1", MANAGED_LABEL, None))
        await execute(api, RemoveNodeCondition("n1", "GpusliceReady"))  # already gone: no write
        await execute(api, SetNodeLabel("gone", MANAGED_LABEL, None))  # 404: not an error
        await execute(api, RemoveNodeCondition("gone", "GpusliceReady"))
    finally:
        await api.close()
    n1 = stored(kmock, "v1/nodes", "n1")
    assert n1 is not None
    assert n1["status"]["conditions"] == [ready]
    assert n1["metadata"]["labels"] == {"a": "b"}
    patches = [w.path for w in kmock.writes if w.method == "PATCH"]
    assert patches == ["/api/v1/nodes/n1/status", "/api/v1/nodes/n1"]


async def test_condition_removal_is_retried_after_the_kubelet_wrote(kmock: ApiServer) -> None:
    declare(kmock)
    ready = {"type": "Ready", "status": "True"}
    body = node_obj("n1", {}, [ready, condition(DRAINING, "x")])
    body["metadata"].pop("resourceVersion")
    await kmock.post("/api/v1/nodes", json=body)
    api = KubeApi(lambda: Endpoint(str(kmock.url).rstrip("/")))
    original = api.request
    raced: list[str] = []

    async def kubelet_first(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        result = await original(method, path, *args, **kwargs)
        if method == "GET" and not raced:  # the kubelet updates the node after our read
            raced.append(path)
            obj = kmock.objects[kmock.resource("v1/nodes"), None, "n1"]
            obj.patch({"metadata": {"resourceVersion": "424242"}})
        return result

    api.request = kubelet_first  # type: ignore[method-assign]
    try:
        await execute(api, RemoveNodeCondition("n1", "GpusliceReady"))
    finally:
        await api.close()
    n1 = stored(kmock, "v1/nodes", "n1")
    assert n1 is not None and n1["status"]["conditions"] == [ready] and len(raced) == 1
    gets = [r for r in list(kmock) if str(r.method).upper().endswith("GET")]
    assert len(gets) == 2  # read, 409, read again, patched


# ------------------------------------------------- the whole opt-out, through the real operator


@pytest.mark.looptime
async def test_the_operator_drains_an_opted_out_node_once_no_pod_uses_a_slice(
    kmock: ApiServer,
) -> None:
    """The controller wires the lifecycle in: label on opt-in; on opt-out the NodePartitioning
    goes at once, the label stays with ``Draining`` naming the pod until it ends, then both go."""
    from test_partitioner_operator import A100, create, events, eventually, node, operator, patch

    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mps", **A100}))
    running = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "infer", "namespace": "ml"},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu-20gb": "1"}}}],
        },
        "status": {"phase": "Running"},
    }
    await create(kmock, "/api/v1/namespaces/ml/pods", running)

    def labels() -> dict[str, str]:
        n1 = stored(kmock, "v1/nodes", "n1")
        assert n1 is not None
        found: dict[str, str] = n1["metadata"].get("labels") or {}
        return found

    def ready() -> dict[str, Any] | None:
        n1 = stored(kmock, "v1/nodes", "n1")
        assert n1 is not None
        conditions = (n1.get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "GpusliceReady"), None)

    async with operator(kmock):
        await eventually(lambda: labels().get(MANAGED_LABEL) == "true", within=10)
        assert stored(kmock, "gpuslice.io/v1alpha1/nodepartitionings", "n1") is not None

        await patch(
            kmock, "/api/v1/nodes/n1", {"metadata": {"labels": {"gpuslice.io/partitioning": None}}}
        )
        await eventually(
            lambda: stored(kmock, "gpuslice.io/v1alpha1/nodepartitionings", "n1") is None,
            within=10,
        )
        draining = await eventually(ready, within=10)
        assert (draining["status"], draining["reason"]) == ("False", DRAINING)
        assert "1 pod(s) still do: ml/infer." in draining["message"]
        assert labels().get(MANAGED_LABEL) == "true"  # the agent stays while the pod runs
        (started,) = await eventually(lambda: events(kmock, DRAINING), within=5)
        assert started["involvedObject"]["name"] == "n1"

        await asyncio.sleep(10)  # nothing changes while the pod runs
        assert labels().get(MANAGED_LABEL) == "true" and ready() == draining
        assert len(events(kmock, DRAINING)) == 1

        await patch(
            kmock, "/api/v1/namespaces/ml/pods/infer/status", {"status": {"phase": "Succeeded"}}
        )
        await eventually(lambda: MANAGED_LABEL not in labels(), within=10)
        assert ready() is None
        (drained,) = await eventually(lambda: events(kmock, "Drained"), within=5)
        assert drained["involvedObject"]["name"] == "n1"
        assert "gpuslice.io/partitioning" not in labels()


def test_a_node_moving_to_dra_mode_drains_with_its_condition_then_is_let_go() -> None:
    """``gpuslice.io/partitioning=dra`` on a managed node: the device-plugin agent stays until
    no pod uses its slices (the node is not planned meanwhile), with ``GpusliceReady=False/
    Draining``; then condition and label go and the DRA agent can start."""
    labels = {"gpuslice.io/partitioning": "dra", MANAGED_LABEL: "true", **GPU_LABELS}
    holder = bound("infer", "n1", "nvidia.com/mig-1g.10gb")
    index = ClusterIndex.from_objects(CAT, nodes=[node_obj("n1", labels)], pods=[holder])
    assert index.nodes["n1"].reading is None  # not planned while it drains
    cond, event = node_lifecycle(index)
    assert isinstance(cond, SetNodeCondition) and cond.reason == DRAINING
    assert "infer" in cond.message
    assert isinstance(event, EmitEvent) and event.reason == DRAINING
    draining = node_obj("n1", labels, [condition(DRAINING, cond.message, "False")])
    index = ClusterIndex.from_objects(CAT, nodes=[draining], pods=[
        {**holder, "metadata": {**holder["metadata"], "resourceVersion": "2"},
         "status": {"phase": "Succeeded"}}])  # fmt: skip
    remove, unlabel, done = node_lifecycle(index)
    assert remove == RemoveNodeCondition("n1", "GpusliceReady")
    assert unlabel == SetNodeLabel("n1", MANAGED_LABEL, None)
    assert isinstance(done, EmitEvent) and done.reason == "Drained"
