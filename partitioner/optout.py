"""Opting a node in and out: the node label that keeps the agent on a node until it is drained,
and the node condition that says what a drain waits for.  Pure.

Model
-----
The partitioner labels every opted-in node ``gpuslice.io/managed=true`` (:data:`MANAGED_LABEL`).
The agent DaemonSet's node affinity selects the opt-in labels OR this one, so removing the
opt-in label does not take the agent away at once -- only the partitioner removes this label,
once the node is drained.  Each decision step, for each node (:func:`node_lifecycle`):

* **opted in** (``gpuslice.io/partitioning`` in ``mig|mps|hybrid`` or
  ``nos.nebuly.com/gpu-partitioning`` in ``mig|mps``: the values the agent DaemonSet's affinity
  selects, :func:`agent_selected`): the label is set if missing.  A node whose opt-in label has
  another value (``off``, a typo) is *not* labelled: the agent must not take such a node's GPUs
  from NVIDIA's device plugin (whose affinity is the complement of the agent's).
* **opted out, still labelled**: the node is *draining*.  Its NodePartitioning is deleted as
  before (housekeeping), and the agent, finding none, advertises only the devices pods hold,
  destroys nothing and stops idle MPS daemons (:mod:`node_agent.reconciler`, "Drain").  While a
  pod bound to the node and not finished holds a gpuslice resource (``nvidia.com/mig-*``,
  ``nvidia.com/gpu-<N>gb``), the node's ``GpusliceReady`` condition is ``False`` with reason
  ``Draining`` and a message naming those pods (rewritten when the set changes), with a Normal
  Event ``Draining`` when the drain starts.  Once none does, the condition is removed, then the
  label, with a Normal Event ``Drained``: the DaemonSet deletes the agent pod, whose last pass
  stops the last idle daemon and puts its GPU back in compute mode ``DEFAULT``.
* **opted out, not labelled** (never managed, or already drained) with a leftover
  ``GpusliceReady`` condition: the condition is removed.

A node whose opt-in label has an invalid value is opted out here (drained like the others if it
was managed), but its ``GpusliceReady`` condition belongs to the decision step's label check
(``InvalidPartitioningLabel``, which names the fix): this module neither sets nor removes it
there, so the two never overwrite each other.

What stays on a drained node: its MIG mode and MIG instances, as they were (documented in
docs/operations.md, "Opt a node out").  Actions are only emitted when the node differs from
what they would make it, so a quiet cluster costs nothing.  Cost: O(nodes) per step plus, for a
draining node with pods, O(pods) to name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partitioner.actions import NODE_CONDITION, EmitEvent, ObjectRef, SetNodeCondition
from partitioner.index import ClusterIndex, NodeInfo
from partitioner.node_actions import RemoveNodeCondition, SetNodeLabel
from partitioner.snapshot import DRA_VALUE, GPUSLICE_LABEL, MANAGED_LABEL, NOS_LABEL, opted_in

__all__ = ["DRAINING", "MANAGED_LABEL", "agent_selected", "node_lifecycle", "slice_holders"]

DRAINING = "Draining"
"""Reason of the ``GpusliceReady=False`` condition of a node being drained."""
_SHOWN = 5

LifecycleAction = SetNodeLabel | RemoveNodeCondition | SetNodeCondition | EmitEvent


AGENT_VALUES = {GPUSLICE_LABEL: ("mig", "mps", "hybrid"), NOS_LABEL: ("mig", "mps")}
"""Opt-in label -> the values the agent DaemonSet's node affinity selects (the chart's
agent-daemonset.yaml; tests/test_chart.py keeps the two equal)."""


def agent_selected(labels: Mapping[str, str]) -> bool:
    """An opt-in label with a value the agent DaemonSet selects (its terms are ORed; the nos
    term excludes ``gpuslice.io/partitioning=dra``, a DRA node)."""
    if labels.get(GPUSLICE_LABEL) == DRA_VALUE:
        return False
    return any(labels.get(key) in values for key, values in AGENT_VALUES.items())


def _labels(info: NodeInfo) -> Mapping[str, str]:
    labels: Mapping[str, str] = (info.obj.get("metadata") or {}).get("labels") or {}
    return labels


def _condition(info: NodeInfo) -> Mapping[str, Any] | None:
    conditions = (info.obj.get("status") or {}).get("conditions") or ()
    return next((c for c in conditions if c.get("type") == NODE_CONDITION), None)


def slice_holders(index: ClusterIndex, node: str) -> list[str]:
    """``namespace/name`` of the pods bound to ``node``, not finished, holding a slice."""
    if not index.usage(node).slices:  # kept incrementally: no pod scan on a free node
        return []
    return [p.key for p in index.bound_pods(node) if p.slices]


def _draining_message(holders: list[str]) -> str:
    shown = ", ".join(holders[:_SHOWN])
    more = f" and {len(holders) - _SHOWN} more" if len(holders) > _SHOWN else ""
    return (
        f"opted out: gpuslice leaves this node once no pod uses its slices; {len(holders)} "
        f"pod(s) still do: {shown}{more}. Nothing is destroyed meanwhile and free slices are "
        f"no longer advertised"
    )


def node_lifecycle(index: ClusterIndex) -> list[LifecycleAction]:
    """The label, condition and Event writes of the opt-in/opt-out lifecycle (module docstring)."""
    out: list[LifecycleAction] = []
    for name, info in sorted(index.nodes.items()):
        labels = _labels(info)
        managed = labels.get(MANAGED_LABEL) is not None
        if agent_selected(labels):
            if labels.get(MANAGED_LABEL) != "true":
                out.append(SetNodeLabel(name, MANAGED_LABEL, "true"))
            continue
        # an invalid opt-in value: the label check owns the condition (module docstring); a
        # node moving to DRA mode is not read (planned) while labelled, so its drain owns it
        moving_to_dra = managed and labels.get(GPUSLICE_LABEL) == DRA_VALUE
        owns_condition = not opted_in(info.obj) or moving_to_dra
        have = _condition(info) if owns_condition else None
        ref = ObjectRef("Node", name, uid=info.uid)
        if not managed:
            if have is not None:
                out.append(RemoveNodeCondition(name, NODE_CONDITION))
            continue
        holders = slice_holders(index, name)
        if holders:
            message = _draining_message(holders)
            if owns_condition:
                current = (have or {}).get("reason"), (have or {}).get("message")
                if current != (DRAINING, message):
                    out.append(SetNodeCondition(name, "False", DRAINING, message))
                if current[0] != DRAINING:
                    out.append(EmitEvent(ref, "Normal", DRAINING, message))
            continue
        if have is not None:
            out.append(RemoveNodeCondition(name, NODE_CONDITION))
        out.append(SetNodeLabel(name, MANAGED_LABEL, None))
        out.append(
            EmitEvent(
                ref,
                "Normal",
                "Drained",
                "opted out and no pod uses a gpuslice slice any more: the gpuslice agent leaves "
                "the node; MIG mode and MIG instances are left as they are",
            )
        )
    return out
