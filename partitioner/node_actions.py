"""Two node writes of the opt-out lifecycle (:mod:`partitioner.optout`): plain action records.

* :class:`SetNodeLabel` -- set or remove one label of a Node.
* :class:`RemoveNodeCondition` -- drop one condition type from a Node's ``status.conditions``.

:mod:`partitioner.node_writes` carries them out.  This module imports nothing of the
partitioner, so :mod:`partitioner.actions` can list these records in its ``Action`` union.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RemoveNodeCondition", "SetNodeLabel"]


@dataclass(frozen=True, slots=True)
class SetNodeLabel:
    """Set (or, with ``value=None``, remove) one label of a Node."""

    node: str
    key: str
    value: str | None


@dataclass(frozen=True, slots=True)
class RemoveNodeCondition:
    """Remove the condition of ``type`` from a Node's ``status.conditions``."""

    node: str
    type: str
