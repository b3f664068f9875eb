"""Kubernetes ``v1`` Event objects for the partitioner's :class:`~partitioner.actions.EmitEvent`.

Events about cluster-scoped objects (Nodes, NodePartitionings) go to the ``default``
namespace, as the kubelet's and the scheduler's do.  Names are ``<object>.<random hex>``
(unique, like client-go's), so posting never collides; messages are cut to the API's 1 KiB.
"""

from __future__ import annotations

import datetime
import secrets
from typing import Any

from partitioner.actions import EmitEvent

__all__ = ["COMPONENT", "event_body", "event_namespace"]

COMPONENT = "gpuslice-partitioner"
_MAX_MESSAGE = 1024


def event_namespace(event: EmitEvent) -> str:
    return event.ref.namespace or "default"


def event_body(event: EmitEvent, now: datetime.datetime, instance: str) -> dict[str, Any]:
    ref = event.ref
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: dict[str, Any] = {"apiVersion": ref.api_version, "kind": ref.kind, "name": ref.name}
    if ref.namespace:
        involved["namespace"] = ref.namespace
    if ref.uid:
        involved["uid"] = ref.uid
    message = event.message
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{ref.name}.{secrets.token_hex(8)}",
            "namespace": event_namespace(event),
        },
        "involvedObject": involved,
        "reason": event.reason,
        "message": message,
        "type": event.type,
        "source": {"component": COMPONENT},
        "reportingComponent": f"gpuslice.io/{COMPONENT}",
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
