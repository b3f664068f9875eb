"""DRA mode: placements that run processes outside any claim, and what they take from the pool.

Model
-----
A *foreign use* is a MIG instance no prepared claim owns (:mod:`node_agent.dra_prepare`,
"Ownership") on which compute processes run (NVML's list less MPS servers,
:func:`node_agent.reconciler.workload`), or a GPU in MIG mode off, not prepared whole for a
claim, on which compute processes run: a CUDA job started by hand, a container that got the
GPU outside Kubernetes, a process that outlived its pod's claim.  The agent never destroys
such an instance, and prepare refuses any claim whose placement it is in the way of (the
kubelet retries for as long as the pod exists).  If the node went on publishing those
placements and reporting them free, kube-scheduler would allocate them and the partitioner
would plan and promise them, and every such pod would wait on a prepare that cannot succeed
until the processes end: a promise that cannot arrive.

So every round of the DRA agent reads the foreign uses (:meth:`DraPreparer.foreign_use
<node_agent.dra_prepare.DraPreparer.foreign_use>`) and

* withdraws from the ResourceSlices every free device that shares a memory slot with one
  (:func:`foreign_devices`; a whole-GPU use, or an instance whose profile the catalog lacks,
  takes every device of its GPU), as it withdraws those an XID hit -- allocated devices stay
  published, so the scheduler's counters stay exact;
* under planner-shaped publishing, reports the placement in the GPU's layout as ``used``
  (:func:`~node_agent.dra_shape.shaped_status`; a whole-GPU use as the whole GPU used), so the
  partitioner neither promises it nor plans a layout over it, exactly as it treats an
  instance a claim holds;
* creates nothing planned on a GPU used whole (switching MIG mode needs the GPU idle).

A GPU whose processes cannot be read in the round (an error since the round found it
readable, or a transient one) counts as used whole for that round, with no pid: unknown is
not free.  Once the processes end the next round publishes and reports the placement as
before.  Nothing
else changes: no condition (the GPU is healthy, merely in use), a WARNING when the set of
foreign uses changes, naming the placements and pids.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from node_agent.dra_claims import DeviceTarget

__all__ = ["ForeignUse", "foreign_devices", "whole_gpus"]


@dataclass(frozen=True, slots=True)
class ForeignUse:
    """Processes outside any claim on one MIG placement, or on a whole GPU."""

    gpu: int
    device: str
    """The placement's device name; ``""``: the whole GPU (MIG mode off, or an instance of a
    profile the catalog lacks, which cannot be told apart from the rest)."""
    pids: tuple[int, ...]
    """Empty: the GPU's processes could not be read this round, so it is taken as used whole
    (its free devices withdrawn, nothing planned made on it) until a round reads it."""

    def __str__(self) -> str:
        where = self.device or f"GPU {self.gpu} (whole)"
        if not self.pids:
            return f"{where}: processes unknown (NVML could not read them this round)"
        shown = ", ".join(map(str, self.pids[:8]))
        more = f" and {len(self.pids) - 8} more" if len(self.pids) > 8 else ""
        return f"{where}: pids {shown}{more}"


def _slots(t: DeviceTarget) -> set[int] | None:
    """The memory slots of a target; ``None``: every slot of its GPU (the whole GPU)."""
    return None if t.profile is None else set(t.profile.span(t.start))


def foreign_devices(targets: Mapping[str, DeviceTarget], uses: Collection[ForeignUse]) -> set[str]:
    """Every device that shares a memory slot with a foreign use (a whole-GPU use, or the
    whole-GPU device, shares every slot of its GPU)."""
    whole = whole_gpus(targets, uses)
    taken: dict[int, set[int]] = {}
    for u in uses:
        t = targets.get(u.device)
        if t is not None and (slots := _slots(t)) is not None:
            taken.setdefault(t.gpu, set()).update(slots)
    out: set[str] = set()
    for name, t in targets.items():
        if t.gpu in whole:
            out.add(name)
        elif t.gpu in taken:
            slots = _slots(t)
            if slots is None or slots & taken[t.gpu]:
                out.add(name)
    return out


def whole_gpus(targets: Mapping[str, DeviceTarget], uses: Collection[ForeignUse]) -> set[int]:
    """The GPUs a foreign use takes whole (no placement, or one this node does not publish)."""
    return {u.gpu for u in uses if not u.device or u.device not in targets}
