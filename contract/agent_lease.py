"""The node agent's heartbeat Lease, as both sides read it: the agent writes it
(:mod:`node_agent.lease`, where the whole contract is written down), the partitioner lists it
(:mod:`partitioner.agent_leases`)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LEASE_COMPONENT", "LEASE_LABELS", "LEASE_PREFIX", "LEASE_SELECTOR"]

LEASE_PREFIX = "gpuslice-agent-"
"""``gpuslice-agent-<node>``: the Lease's name (the holder identity, not the name, says whose)."""
LEASE_COMPONENT = ("app.kubernetes.io/component", "agent-lease")
"""The label that marks an agent Lease (and nothing else)."""
LEASE_LABELS: Mapping[str, str] = {
    "app.kubernetes.io/name": "gpuslice",
    LEASE_COMPONENT[0]: LEASE_COMPONENT[1],
}
LEASE_SELECTOR = f"{LEASE_COMPONENT[0]}={LEASE_COMPONENT[1]}"
"""The label selector the partitioner lists the agents' Leases with."""
