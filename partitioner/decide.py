"""THE decision step: ``decide(state, cluster, now, config) -> Decision``. Pure and synchronous.

The kopf operator calls it every cycle with the objects it watches; the simulator calls it with
its in-memory cluster.  It reads nothing else and changes nothing: every effect is an
:mod:`action <partitioner.actions>` in the returned :class:`Decision`, with the next
:class:`ControllerState`.

One step
--------
1. **Read** the cluster (:func:`partitioner.snapshot.read_cluster`).
2. **Housekeeping.** Create a NodePartitioning for every valid opted-in node without one
   (owned by the node, empty spec); delete those whose node is gone or no longer opted in
   (a node whose labels are merely broken keeps its object); when a node's mode changed,
   write an empty spec of the new mode under a fresh plan id (so the node stays out of
   planning until the agent has switched).
3. **Node conditions.** An opted-in node that cannot be planned gets the node condition
   ``GpusliceReady=False`` with the problem's reason and a Warning Event, once per change; a
   node whose problem is gone gets ``GpusliceReady=True``.
4. **Batch window.** Rejected pods (unknown resources, no eligible node) get a Warning Event
   ``cannot place: <reason>`` once per distinct reason; candidates feed the window
   (:mod:`partitioner.batching`).
5. **Plan** when the window is due: the planner gets every candidate and the nodes that are not
   busy.  For each node with a changed GPU, the full spec (changed GPUs from the plan, the
   others as they are now) is written only if it differs from the current spec, guarded by the
   object's ``resourceVersion``; the pods' "planned" Events are emitted once the write
   succeeds.  Unplaced pods get ``cannot place: <reason>``.

Plan ids are consecutive integers, continuing after the largest ``spec.planId`` in the cluster,
so a restarted controller never reuses one.  A planner exception is reported in
``Decision.error`` and closes the window (its pods are retried after ``retry`` seconds), so a
bad input cannot make the controller spin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contract.nodepartitioning import (
    DesiredGpu,
    DesiredMigInstance,
    DesiredMpsSlice,
    NodePartitioning,
    NodePartitioningSpec,
)
from partitioner.actions import (
    NODE_CONDITION,
    Action,
    CreatePartitioning,
    DeletePartitioning,
    EmitEvent,
    ObjectRef,
    SetNodeCondition,
    WriteSpec,
)
from partitioner.adoption import agent_reported, desired_without_status
from partitioner.batching import BatchPolicy, BatchWindow, due, observe, planned
from partitioner.snapshot import ClusterReading, ClusterView, opted_in, read_cluster
from planner.catalog import Catalog
from planner.settings import PlannerSettings
from planner.snapshot import Assignment, Plan, PlannedGpu

__all__ = ["ControllerState", "DecideConfig", "Decision", "PlanFn", "decide", "default_planner"]

PlanFn = Callable[[Any, PlannerSettings, Catalog], Plan]
"""``plan(snapshot, settings, catalog) -> Plan``."""


def default_planner() -> PlanFn:
    """``planner.api.plan``: CP-SAT within the time limit, greedy as the fallback."""
    from planner.api import plan

    return plan


@dataclass(frozen=True, slots=True)
class DecideConfig:
    catalog: Catalog
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    planner_settings: PlannerSettings = field(default_factory=PlannerSettings)
    planner: PlanFn = field(default_factory=default_planner)


@dataclass(frozen=True, slots=True)
class ControllerState:
    window: BatchWindow = field(default_factory=BatchWindow)
    reported: Mapping[str, str] = field(default_factory=dict)
    """Pod key -> the last "cannot place" message emitted for it (emit once per reason)."""
    last_plan_id: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    state: ControllerState
    actions: tuple[Action, ...]
    reading: ClusterReading
    plan: Plan | None = None
    plan_id: str = ""
    batch: tuple[str, ...] = ()
    gpus_reconfigured: int = 0
    error: str = ""


def _plan_id_floor(reading: ClusterReading, cluster: ClusterView) -> int:
    ids = [0]
    for raw in cluster.partitionings.values():
        pid = str(((raw.get("spec") or {}).get("planId")) or "")
        if pid.isdigit():
            ids.append(int(pid))
    return max(ids)


def _pod_ref(pod: Mapping[str, Any]) -> ObjectRef:
    meta = pod.get("metadata") or {}
    return ObjectRef("Pod", meta.get("name", ""), meta.get("namespace", ""), meta.get("uid", ""))


def _node_ref(node: Mapping[str, Any]) -> ObjectRef:
    meta = node.get("metadata") or {}
    return ObjectRef("Node", meta.get("name", ""), "", meta.get("uid", ""))


def _node_condition(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    conditions = (node.get("status") or {}).get("conditions") or ()
    return next((c for c in conditions if c.get("type") == NODE_CONDITION), None)


def _housekeeping(
    cluster: ClusterView, reading: ClusterReading, next_id: Callable[[], str]
) -> tuple[list[Action], set[str]]:
    actions: list[Action] = []
    switching: set[str] = set()
    for name, node in reading.gpu_nodes.items():
        if name not in cluster.partitionings:
            uid = str((cluster.nodes[name].get("metadata") or {}).get("uid", ""))
            spec = NodePartitioningSpec(mode=node.mode.value)
            actions.append(CreatePartitioning(name, uid, spec))
            continue
        np = reading.partitionings.get(name)
        if np is not None and np.spec.mode != node.mode.value:
            spec = NodePartitioningSpec(planId=next_id(), mode=node.mode.value)
            actions.append(WriteSpec(name, spec, np.metadata.resourceVersion))
            switching.add(name)
    for name in sorted(cluster.partitionings):
        node_obj = cluster.nodes.get(name)
        if node_obj is None or not opted_in(node_obj):
            actions.append(DeletePartitioning(name))
    return actions, switching


def _conditions(cluster: ClusterView, reading: ClusterReading) -> list[Action]:
    actions: list[Action] = []
    for name, problem in reading.problems.items():
        node = cluster.nodes[name]
        have = _node_condition(node) or {}
        if (have.get("status"), have.get("reason"), have.get("message")) == (
            "False",
            problem.reason,
            problem.message,
        ):
            continue
        actions.append(SetNodeCondition(name, "False", problem.reason, problem.message))
        actions.append(EmitEvent(_node_ref(node), "Warning", problem.reason, problem.message))
    for name in reading.gpu_nodes:
        if name in reading.problems:  # GPUs not readable yet (partitioner.adoption)
            continue
        have = _node_condition(cluster.nodes[name]) or {}
        if have.get("status") == "False":
            actions.append(SetNodeCondition(name, "True", "Configured", "GPU labels are valid"))
    return actions


def _desired_now(np: NodePartitioning | None, index: int) -> DesiredGpu:
    """The layout a GPU the plan does not change keeps: what the agent reports, else the spec."""
    if np is not None and np.status is not None:
        for g in np.status.gpus:
            if g.index == index:
                return DesiredGpu(
                    index=index,
                    mig=[DesiredMigInstance(profile=m.profile, start=m.start) for m in g.mig],
                    mps=[
                        DesiredMpsSlice(
                            memoryMiB=s.memoryMiB, activeThreadPercentage=s.activeThreadPercentage
                        )
                        for s in g.mps
                    ],
                )
    if np is not None:
        for d in np.spec.gpus:
            if d.index == index:
                return d
    return DesiredGpu(index=index)


def _desired_planned(planned_gpu: PlannedGpu) -> DesiredGpu:
    return DesiredGpu(
        index=planned_gpu.index,
        mig=[
            DesiredMigInstance(profile=p, start=s)
            for p, s in sorted(planned_gpu.mig, key=lambda x: x[1])
        ],
        mps=[
            DesiredMpsSlice(memoryMiB=s.memory_mib, activeThreadPercentage=s.thread_percentage)
            for s in planned_gpu.mps
        ],
    )


def _layout_key(gpus: list[DesiredGpu]) -> dict[int, tuple[Any, ...]]:
    out: dict[int, tuple[Any, ...]] = {}
    for g in gpus:
        mig = tuple(sorted((m.start, m.profile) for m in g.mig))
        mps = tuple(sorted((s.memoryMiB, s.activeThreadPercentage) for s in g.mps))
        if mig or mps:
            out[g.index] = (mig, mps)
    return out


def _describe(assignment: Assignment, plan_id: str) -> str:
    parts = []
    for resource in sorted(assignment.gpus):
        indices = sorted(set(assignment.gpus[resource]))
        gpus = "GPU " + ", ".join(str(i) for i in indices)
        parts.append(f"{resource} on node {assignment.node} {gpus}")
    return f"planned {'; '.join(parts)}, plan {plan_id}"


def _plan_actions(
    plan: Plan, plan_id: str, cluster: ClusterView, reading: ClusterReading
) -> tuple[list[Action], int]:
    actions: list[Action] = []
    reconfigured = 0
    by_node: dict[str, list[str]] = {}
    for pod, a in sorted(plan.assignments.items()):
        by_node.setdefault(a.node, []).append(pod)
    written: set[str] = set()
    for node in sorted({n for n, _ in plan.layouts}):
        np = reading.partitionings.get(node)
        gpu_node = reading.gpu_nodes.get(node)
        if np is None or gpu_node is None:
            continue
        state = next((n for n in reading.nodes if n.name == node), None)
        maybe = [
            _desired_planned(plan.layouts[(node, i)])
            if (node, i) in plan.layouts
            else _desired_now(np, i)
            if agent_reported(np) or state is None
            else desired_without_status(state, i)  # adopted; None = locked, left out
            for i in range(gpu_node.gpu_count)
        ]
        gpus = [g for g in maybe if g is not None]
        old, new = _layout_key(list(np.spec.gpus)), _layout_key(gpus)
        if old == new:
            continue
        reconfigured += sum(1 for i in set(old) | set(new) if old.get(i) != new.get(i))
        pods = tuple(by_node.get(node, ()))
        events = tuple(
            EmitEvent(
                _pod_ref(cluster.pods[p]),
                "Normal",
                "Planned",
                _describe(plan.assignments[p], plan_id),
            )
            for p in pods
            if p in cluster.pods
        )
        spec = NodePartitioningSpec(planId=plan_id, mode=gpu_node.mode.value, gpus=gpus)
        actions.append(WriteSpec(node, spec, np.metadata.resourceVersion, pods, events))
        written.add(node)
    for pod, a in sorted(plan.assignments.items()):
        if a.node not in written and pod in cluster.pods:
            message = _describe(a, plan_id) + " (no repartitioning needed)"
            actions.append(EmitEvent(_pod_ref(cluster.pods[pod]), "Normal", "Planned", message))
    return actions, reconfigured


def _cannot_place(
    cluster: ClusterView, reasons: Mapping[str, str], reported: dict[str, str]
) -> list[Action]:
    actions: list[Action] = []
    for pod, reason in sorted(reasons.items()):
        message = f"cannot place: {reason}"
        if reported.get(pod) == message or pod not in cluster.pods:
            continue
        reported[pod] = message
        actions.append(EmitEvent(_pod_ref(cluster.pods[pod]), "Warning", "Unplaceable", message))
    return actions


def decide(
    state: ControllerState, cluster: ClusterView, now: float, config: DecideConfig
) -> Decision:
    """One controller step at time ``now`` (seconds, any monotonic origin)."""
    reading = read_cluster(cluster, config.catalog)
    last_id = max(state.last_plan_id, _plan_id_floor(reading, cluster))

    def next_id() -> str:
        nonlocal last_id
        last_id += 1
        return str(last_id)

    actions, switching = _housekeeping(cluster, reading, next_id)
    actions += _conditions(cluster, reading)
    reported = {p: m for p, m in state.reported.items() if p in reading.batchable}
    actions += _cannot_place(cluster, reading.rejected, reported)

    candidates = [
        p for p, pod in reading.candidates.items() if not (pod.eligible_nodes or set()) <= switching
    ]
    window = observe(state.window, candidates, now, config.policy)
    if not due(window, now, config.policy):
        new_state = ControllerState(window, reported, last_id)
        return Decision(new_state, tuple(actions), reading)

    batch = tuple(sorted(candidates))
    snapshot = reading.snapshot(batch)
    if switching:
        snapshot = type(snapshot)(
            nodes=tuple(n for n in snapshot.nodes if n.name not in switching), pods=snapshot.pods
        )
    plan_id = next_id()
    window = planned(window, batch, now)
    try:
        plan = config.planner(snapshot, config.planner_settings, config.catalog)
    except Exception as e:  # a planner bug must not stop the controller
        new_state = ControllerState(window, reported, last_id)
        error = f"planner failed on a batch of {len(batch)} pod(s): {type(e).__name__}: {e}"
        return Decision(new_state, tuple(actions), reading, None, plan_id, batch, 0, error)
    plan_actions, reconfigured = _plan_actions(plan, plan_id, cluster, reading)
    actions += plan_actions
    actions += _cannot_place(cluster, plan.unplaced, reported)
    for pod in plan.assignments:
        reported.pop(pod, None)
    new_state = ControllerState(window, reported, last_id)
    return Decision(new_state, tuple(actions), reading, plan, plan_id, batch, reconfigured)
