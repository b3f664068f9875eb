"""The simulated cluster as Kubernetes API objects, for the partitioner's real decision step.

Model
-----
:func:`partitioner.decide.decide` reads a :class:`partitioner.snapshot.ClusterView` (plain dicts
of Nodes, Pods and NodePartitionings, as the API server would return them) and returns actions.
:class:`KubeObjects` keeps that view in step with a :class:`~simulations.fake_cluster.FakeCluster`
and carries the actions out against it:

* **Nodes** are opted in with ``gpuslice.io/partitioning=<mode>`` and carry GPU Feature
  Discovery's ``nvidia.com/gpu.product`` (the catalog model name) and ``nvidia.com/gpu.count``
  labels, and ``status.allocatable`` CPU and memory.
* **Pods** (namespace ``sim``) request their slices, CPU and memory in one container.  A
  pending pod that the simulated kube-scheduler could not bind carries
  ``PodScheduled=False/Unschedulable``; a bound pod has ``spec.nodeName`` and phase Running.
* **NodePartitionings**: one per node from the start (empty spec, generation 1).  A
  :class:`~partitioner.actions.WriteSpec` bumps ``metadata.generation`` and ``resourceVersion``,
  stores the planned pods annotation and writes the spec into the fake cluster (the agent then
  withdraws the devices it will remove).  The *status* is the fake agent's report: the GPUs'
  actual instances/slices with used/free, ``observedGeneration`` and ``Applied=True`` once the
  spec is applied (:meth:`KubeObjects.applied`).  While ``observedGeneration < generation`` the
  partitioner sees the node as busy and leaves it out of plans.

Events and node conditions are counted, not stored.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from contract.nodepartitioning import API_VERSION, KIND, NodePartitioningSpec
from partitioner.actions import (
    Action,
    CreatePartitioning,
    DeletePartitioning,
    EmitEvent,
    SetNodeCondition,
    WriteSpec,
)
from partitioner.snapshot import (
    COUNT_LABEL,
    GPUSLICE_LABEL,
    PLANNED_PODS_ANNOTATION,
    PRODUCT_LABEL,
    ClusterView,
)
from planner.snapshot import Mode, PlannedGpu, PlannedSlice
from simulations.fake_cluster import FakeCluster, FakeNode

__all__ = ["NAMESPACE", "KubeObjects", "pod_key"]

NAMESPACE = "sim"


def pod_key(name: str) -> str:
    """The partitioner's pod key (``namespace/name``) of a simulated pod."""
    return f"{NAMESPACE}/{name}"


def _requests(slices: Mapping[str, int], cpu_milli: int, memory_mib: int) -> dict[str, str]:
    out = {r: str(k) for r, k in slices.items()}
    if cpu_milli:
        out["cpu"] = f"{cpu_milli}m"
    if memory_mib:
        out["memory"] = f"{memory_mib}Mi"
    return out


class KubeObjects:
    """Nodes, Pods and NodePartitionings mirroring a :class:`FakeCluster` (module docstring)."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.partitionings: dict[str, dict[str, Any]] = {}
        self.events: Counter[str] = Counter()
        """Event reason -> count (``Planned``, ``Unplaceable`` ...)."""
        self.conflicts = 0
        """WriteSpec actions refused (resourceVersion mismatch or a spec already in flight)."""
        self.view = ClusterView(self.nodes, self.pods, self.partitionings)
        for node in cluster.nodes.values():
            self.nodes[node.name] = self._node_object(node)
            self.partitionings[node.name] = {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": {
                    "name": node.name,
                    "uid": f"np-{node.name}",
                    "resourceVersion": "1",
                    "generation": 1,
                    "annotations": {},
                },
                "spec": {"planId": "", "mode": node.mode.value, "gpus": []},
            }
            self.report_status(node.name)

    # ------------------------------------------------------------------ objects

    @staticmethod
    def _node_object(node: FakeNode) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "uid": f"node-{node.name}",
                "labels": {
                    GPUSLICE_LABEL: node.mode.value,
                    PRODUCT_LABEL: node.model.name,
                    COUNT_LABEL: str(len(node.gpus)),
                },
            },
            "status": {
                "allocatable": {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi"}
            },
        }

    def add_pending(
        self,
        name: str,
        slices: Mapping[str, int],
        cpu_milli: int = 0,
        memory_mib: int = 0,
        priority: int = 0,
    ) -> None:
        """A pod the kube-scheduler could not bind: Pending, PodScheduled=False/Unschedulable."""
        requests = _requests(slices, cpu_milli, memory_mib)
        self.pods[pod_key(name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"pod-{name}"},
            "spec": {
                "priority": priority,
                "containers": [
                    {
                        "name": "main",
                        "resources": {
                            "requests": requests,
                            "limits": {r: str(k) for r, k in slices.items()},
                        },
                    }
                ],
            },
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                ],
            },
        }

    def bound(self, name: str, node: str) -> None:
        """The pod was bound to ``node`` and runs."""
        pod = self.pods[pod_key(name)]
        pod["spec"]["nodeName"] = node
        pod["status"] = {
            "phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
        }
        self.report_status(node)

    def gone(self, name: str, node: str | None) -> None:
        """The pod finished, was abandoned or evicted: its object is deleted."""
        self.pods.pop(pod_key(name), None)
        if node is not None:
            self.report_status(node)

    def report_status(self, node: str) -> None:
        """The fake agent reports the node's actual GPUs (used/free) in the status."""
        n = self.cluster.nodes[node]
        np = self.partitionings[node]
        generation = int(np["metadata"]["generation"])
        status = np.get("status") or {}
        observed = int(status.get("observedGeneration", 0))
        if n.spec is None:
            observed = generation
        gpus = []
        for g in n.gpus:
            if n.mode is Mode.MPS:
                gpus.append(
                    {
                        "index": g.index,
                        "mps": [
                            {
                                "memoryMiB": d.memory_mib,
                                "activeThreadPercentage": d.thread_percentage,
                                "used": d.pod is not None,
                            }
                            for d in g.devices
                        ],
                    }
                )
            else:
                gpus.append(
                    {
                        "index": g.index,
                        "migEnabled": True,
                        "mig": [
                            {"profile": d.profile, "start": d.slot, "used": d.pod is not None}
                            for d in g.devices
                        ],
                    }
                )
        np["status"] = {
            "observedGeneration": observed,
            "planId": np["spec"].get("planId", "") if observed == generation else "",
            "gpus": gpus,
            "conditions": [
                {
                    "type": "Applied",
                    "status": "True" if observed == generation else "False",
                    "observedGeneration": observed,
                }
            ],
        }

    # ------------------------------------------------------------------ actions

    def carry_out(self, actions: Iterable[Action], apply_at: float) -> list[WriteSpec]:
        """Carry the decision's actions out; return the specs written (to apply at ``apply_at``)."""
        written: list[WriteSpec] = []
        for action in actions:
            if isinstance(action, WriteSpec):
                if self._write(action, apply_at):
                    written.append(action)
                    for ev in action.on_success:
                        self.events[ev.reason] += 1
            elif isinstance(action, EmitEvent):
                self.events[action.reason] += 1
            elif isinstance(action, SetNodeCondition):
                self.events[f"NodeCondition/{action.reason}"] += 1
            elif isinstance(action, CreatePartitioning | DeletePartitioning):
                # every simulated node has its NodePartitioning from the start and never opts out
                self.events[type(action).__name__] += 1
        return written

    def _write(self, action: WriteSpec, apply_at: float) -> bool:
        np = self.partitionings.get(action.node)
        node = self.cluster.nodes.get(action.node)
        if np is None or node is None:
            self.conflicts += 1
            return False
        meta = np["metadata"]
        if (
            action.resource_version is not None
            and action.resource_version != meta["resourceVersion"]
        ):
            self.conflicts += 1
            return False
        if node.spec is not None:
            self.conflicts += 1
            return False
        self.cluster.write_spec(action.node, _planned(action.node, action.spec, node), apply_at)
        meta["generation"] = int(meta["generation"]) + 1
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        meta["annotations"] = {PLANNED_PODS_ANNOTATION: json.dumps(list(action.planned_pods))}
        np["spec"] = action.spec.model_dump(mode="json")
        self.report_status(action.node)
        return True

    def applied(self, node: str) -> None:
        """The agent applied the spec: ``observedGeneration`` catches up, ``Applied=True``."""
        self.report_status(node)
        rv = int(self.partitionings[node]["metadata"]["resourceVersion"])
        self.partitionings[node]["metadata"]["resourceVersion"] = str(rv + 1)


def _planned(node: str, spec: NodePartitioningSpec, fake: FakeNode) -> list[PlannedGpu]:
    out: list[PlannedGpu] = []
    for g in spec.gpus:
        if fake.mode is Mode.MPS:
            out.append(
                PlannedGpu(
                    node,
                    g.index,
                    mps=tuple(PlannedSlice(s.memoryMiB, s.activeThreadPercentage) for s in g.mps),
                )
            )
        else:
            out.append(PlannedGpu(node, g.index, mig=tuple((m.profile, m.start) for m in g.mig)))
    listed = {g.index for g in spec.gpus}
    # a GPU the spec omits is desired empty
    out.extend(PlannedGpu(node, g.index) for g in fake.gpus if g.index not in listed)
    return out
