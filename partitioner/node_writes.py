"""Carry out :mod:`partitioner.node_actions` against the Kubernetes API (the writer's part).

* :class:`~partitioner.node_actions.SetNodeLabel` -- a JSON merge patch of one label of the
  Node (``None`` removes it).
* :class:`~partitioner.node_actions.RemoveNodeCondition` -- the node is read, and its status is
  merge-patched with the other conditions and the resourceVersion it was read at, so a kubelet
  update in between answers 409 and the removal is retried on a fresh read (at most
  :data:`ATTEMPTS` times).  A strategic merge patch's ``$patch: delete`` would do too, but a
  resourceVersion-guarded replacement is what every API server, fakes included, applies the
  same way.

A node that is gone (404) or a condition already absent is not an error.
"""

from __future__ import annotations

from partitioner.kubeapi import MERGE_PATCH, Conflict, KubeApi, NotFound
from partitioner.node_actions import RemoveNodeCondition, SetNodeLabel

__all__ = ["ATTEMPTS", "execute"]

ATTEMPTS = 3


def node_path(node: str) -> str:
    return f"/api/v1/nodes/{node}"


async def execute(api: KubeApi, action: SetNodeLabel | RemoveNodeCondition) -> None:
    """Carry out one action (module docstring); API errors other than 404 propagate."""
    path = node_path(action.node)
    try:
        if isinstance(action, SetNodeLabel):
            await api.patch(path, {"metadata": {"labels": {action.key: action.value}}})
            return
        for attempt in range(ATTEMPTS):
            node = await api.request("GET", path)
            conditions = (node.get("status") or {}).get("conditions") or []
            kept = [c for c in conditions if c.get("type") != action.type]
            if len(kept) == len(conditions):
                return
            version = (node.get("metadata") or {}).get("resourceVersion")
            body = {"metadata": {"resourceVersion": version}, "status": {"conditions": kept}}
            try:
                await api.patch(f"{path}/status", body, MERGE_PATCH)
                return
            except Conflict:
                if attempt == ATTEMPTS - 1:
                    raise
    except NotFound:
        return
