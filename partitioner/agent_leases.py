"""Which node agents have stopped renewing their heartbeat Lease.  Pure: Lease objects in.

Each gpuslice node agent renews a ``coordination.k8s.io/v1`` Lease (``gpuslice-agent-<node>``
in the release namespace, label ``app.kubernetes.io/component=agent-lease``,
``spec.holderIdentity`` = its node, ``spec.leaseDurationSeconds``, ``spec.renewTime``) every
quarter of its duration, from its event loop (:mod:`node_agent.lease`).  The operator lists those
Leases every ``lease_poll_seconds`` and hands them to :meth:`AgentLeases.observe`, which says
which nodes' agents are *silent*: their Lease's ``renewTime`` has not changed for longer than
its ``leaseDurationSeconds``.

The time is the partitioner's own clock, as the node lifecycle controller does for the kubelet's
node Leases: a Lease counts as renewed when the partitioner *sees* its ``renewTime`` change, and
silent once it has seen no change for the duration, so clock skew between the node and the
partitioner cannot make an agent look dead or alive.  A Lease seen for the first time counts as
renewed then (a restarted partitioner waits a full duration before calling any agent silent).
A node without a Lease is not silent: an agent with the Lease off (``agent.leaseSeconds: 0``),
or one that predates it, is judged by the apply deadline as before.

A silent agent applies nothing and reports nothing, whatever its node's NodePartitioning still
shows: :meth:`partitioner.decide._Step.notice_unserved` then promises nothing there and plans the
node's planned pods elsewhere, in both agent modes (the device-plugin agent's kubelet may still
list its devices; the DRA agent's ResourceSlices outlive it until the kubelet wipes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contract.agent_lease import LEASE_COMPONENT, LEASE_SELECTOR

__all__ = ["LEASE_SELECTOR", "AgentLeases"]


@dataclass(slots=True)
class _Seen:
    renew_time: str
    changed_at: float
    duration_s: float


@dataclass(slots=True)
class AgentLeases:
    """The last ``renewTime`` seen per node and when it changed (this controller's clock)."""

    seen: dict[str, _Seen] = field(default_factory=dict)

    def observe(self, leases: Iterable[Mapping[str, Any]], now: float) -> frozenset[str]:
        """Fold one listing of agent Leases in at ``now``; return the silent nodes.

        Objects that are not agent Leases (no label, no holder, no positive duration) are
        ignored; a node whose Lease is gone is forgotten (not silent)."""
        listed: dict[str, tuple[str, float]] = {}
        for lease in leases:
            meta = lease.get("metadata") or {}
            labels = meta.get("labels") or {}
            if labels.get(LEASE_COMPONENT[0]) != LEASE_COMPONENT[1]:
                continue
            spec = lease.get("spec") or {}
            node = spec.get("holderIdentity")
            duration = spec.get("leaseDurationSeconds")
            if not isinstance(node, str) or not node:
                continue
            if isinstance(duration, bool) or not isinstance(duration, int | float):
                continue
            if duration <= 0:
                continue
            listed[node] = (str(spec.get("renewTime") or ""), float(duration))
        for node in self.seen.keys() - listed.keys():
            del self.seen[node]
        for node, (renew_time, duration) in listed.items():
            was = self.seen.get(node)
            if was is None or was.renew_time != renew_time:
                self.seen[node] = _Seen(renew_time, now, duration)
            else:
                was.duration_s = duration
        return self.silent(now)

    def silent(self, now: float) -> frozenset[str]:
        """Nodes whose Lease has not changed for longer than its duration at ``now``."""
        return frozenset(node for node, s in self.seen.items() if now - s.changed_at > s.duration_s)
