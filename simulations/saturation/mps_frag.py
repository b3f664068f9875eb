"""FGD's fragmentation of MPS GPUs, read as GPU shares: the milli view of a partitioned state.

Model
-----
The GPU-share rules (BestFit, FGD, ``fgd-waste``) and FGD's metrics count free GPU in milli-GPU.
An MPS GPU's free capacity is memory: its usable memory (GPU memory minus the MPS server
reserve) minus the slices in use.  The *milli view* reads it as the share of a whole-GPU slice
it could still hold::

    milli(free) = min(1000, floor(free_MiB × 1000 / full_MiB))

with ``full_MiB`` the whole-GPU slice of the ``mps-memory`` mapping (usable memory rounded down
to GiB: 79 GiB on an A100-80GB, :class:`simulations.inputs.mapping.MpsByMemory`).  An empty GPU
is 1000; a GPU holding one 810-milli pod's 63 GiB slice keeps 16.5 GiB, 208 milli (a GPU
share would keep 190: the mapping rounds slices down, and the reserve is taken once).

:class:`MpsFragTracker` keeps FGD's cluster fragmentation ``Σ_n F_n`` (fgd.md §5, the target
workload of the original pods) of that view and its free milli ``Σ_g milli(free_g)``, the
fragmentation ratio's denominator, recomputing only the nodes that changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from simulations.inputs.workload import GPU_MILLI
from simulations.saturation.fragmentation import FragModel, TargetWorkload

if TYPE_CHECKING:
    from simulations.saturation.partitioned import PartitionedState, SimNode

__all__ = ["MpsFragTracker", "full_slice_mib", "milli_of"]

_MIB_PER_GIB = 1024


def full_slice_mib(usable_mib: int) -> int:
    """MiB of the whole-GPU slice: the usable memory rounded down to GiB."""
    return usable_mib // _MIB_PER_GIB * _MIB_PER_GIB


def milli_of(free_mib: int, full_mib: int) -> int:
    """The milli view of ``free_mib`` free MiB (module docstring); 0 for no full slice."""
    if full_mib <= 0 or free_mib <= 0:
        return 0
    return min(GPU_MILLI, free_mib * GPU_MILLI // full_mib)


class MpsFragTracker:
    """``Σ_n F_n`` of the milli view of ``state``'s MPS nodes, updated node by node."""

    def __init__(self, state: PartitionedState, target: TargetWorkload) -> None:
        self.model = FragModel(target)
        self.full_mib = full_slice_mib(state.usable_mib)
        self._cls: dict[str, int] = {}
        self._node: dict[str, tuple[float, int]] = {}
        self.total = 0.0
        """``Σ_n F_n``, milli-GPU."""
        self.idle = 0
        """Free milli-GPU of the view, ``Σ_g milli(free_g)`` (the ratio's denominator)."""
        self.update(state.nodes)

    def frees(self, node: SimNode) -> tuple[int, ...]:
        """The node's free milli per GPU, sorted (the measure's input)."""
        return tuple(sorted(milli_of(f, self.full_mib) for f in node.free_mib))

    def node_frag(self, node: SimNode) -> float:
        cls = self._cls.get(node.label)
        if cls is None:
            cls = self._cls[node.label] = self.model.model_class(node.label)
        return self.model.frag(cls, node.cpu_free, self.frees(node))

    def update(self, nodes: Iterable[SimNode]) -> None:
        """Recompute ``F_n`` and the free milli of ``nodes`` (after they changed), and the totals."""
        for node in nodes:
            new = (self.node_frag(node), sum(self.frees(node)))
            old = self._node.get(node.name, (0.0, 0))
            self.total += new[0] - old[0]
            self.idle += new[1] - old[1]
            self._node[node.name] = new
