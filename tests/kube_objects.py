"""Minimal Kubernetes objects for the reading/adoption tests, as ``kubectl get -o json`` has them."""

from __future__ import annotations

from typing import Any

__all__ = ["pod_object"]


def pod_object(
    name: str, requests: dict[str, int], node: str = "", phase: str = "Running"
) -> dict[str, Any]:
    """A pod asking for ``requests`` (as limits and requests): bound to ``node`` in ``phase``,
    or, without a node, Pending and unschedulable (what the partitioner batches)."""
    limits = {r: str(n) for r, n in requests.items()}
    status: dict[str, Any] = {"phase": phase if node else "Pending"}
    if not node:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "nodeName": node or None,
            "containers": [{"name": "c", "resources": {"limits": limits, "requests": limits}}],
        },
        "status": status,
    }
