"""Drain reservations: which GPUs to empty for a pod that has waited too long. Pure.

Model
-----
A pod that has waited ``drain_after`` seconds and that the last plan could not place for lack
of capacity gets a *drain*: the GPUs closest to free on one of its eligible nodes are frozen
for it.  A frozen GPU takes no new pod (no reservation is made on its free devices, the planner
does not see it, the node agent's preferred allocation avoids it), so it empties as its pods
finish; then the waiting pod is planned onto it.  The pod stays a candidate meanwhile: a plan
or a free slice elsewhere that fits it cancels the drain.

Choice (:func:`choose_drain`): the pod needs one GPU per requested unit (``units`` GPUs); on
every eligible node with that many GPUs that are not frozen, whose CPU and memory hold the pod
and whose model offers the pod's resources, take the ``units`` GPUs that best fit: first those
whose layout already has a device of a requested resource (a used ``4g`` instance for a ``4g``
pod: once drained, it serves the pod as it is), then the least loaded (load: compute slices of
instances in use or held on MIG GPUs, MiB of slices in use or held on MPS GPUs; then devices in
use; then index); the node whose chosen GPUs need the fewest new layouts wins, then the least
load (then the fewest devices in use, then the name).  Why layouts first: a drain onto a GPU
whose layout lacks the pod's instance repartitions it for the pod and again for the next pod
after it; in the 4-node openb replays (deep overload) that made drains most of all
reconfigurations (default: 272-340 GPUs reconfigured against nos's 96; gpushare40: 554 against
172), and preferring the GPU that already has the instance brought them to 92 and 155 with the
same waiting times as no drains at all (README, replay notes).

At most ``budget`` GPUs may be frozen in the cluster at once (:func:`drain_budget`); drains
start in age order, and a pod whose drain would exceed what is left waits for a later cycle, as
do all younger ones (none overtakes it). A pod that needs more GPUs than the whole budget (a
whole-node pod on a small cluster) is never drained and holds no one back: freezing a whole
node until its longest pod ends costs the other pods more than it saves (measured: with such
drains, the openb gpushare40 replay on 8 nodes waited p99 15,279 s instead of 24 s). Raise
``drain_fraction`` to let such pods drain.

Starvation bound: a pod that no plan can place is frozen a GPU set at most one batch window
after it has waited ``drain_after`` (if the budget has room); the set empties once the pods on
it end, i.e. within the longest remaining runtime ``R`` of those pods; it is then planned at
the next cycle and released once the node has applied (``apply_deadline`` at most).  So its
wait is at most ``drain_after + window + R + apply_deadline + bind``, and, with ``B`` GPUs of
budget and ``q`` older drains ahead of it, ``(q // B + 1)`` such rounds.  The bound holds
while the queue is shallow: no drain starts while more slice units wait than
``drain_queue_limit`` per GPU of the cluster and they would fill more GPUs than that too
(overload; :meth:`partitioner.decide._Step.deep_queue`, step 8),
and a queue that turns deep ends the drains in progress (their frozen GPUs would idle while
the queue's pods could run there); such a pod is drained again, from the start, once the
queue is short.
Then free slices go to the smallest pods first (throughput), except that pods past ``aged_after``
(8 h) go first, oldest first, and a one-GPU one keeps free slices for the next plan:
such a pod waits at most ``aged_after`` plus the time the older ones past it take to be
served, as capacity frees.  A pod that needs several GPUs on one node is served only when
that many are free at once (no drain runs in a deep queue), so its wait is bounded only once
the queue is back below the limit, plus the bound above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from partitioner.ledger import GpuSlots, NodeLedger
from planner.snapshot import Mode, mig_profile_of, mps_gb_of

__all__ = ["DrainChoice", "choose_drain", "drain_budget", "gpu_load", "serves"]


@dataclass(frozen=True, slots=True)
class DrainChoice:
    node: str
    gpus: tuple[int, ...]


def drain_budget(ledgers: Iterable[NodeLedger], fraction: float) -> int:
    """GPUs that may be frozen at once: ``fraction`` of all GPU nodes' GPUs, at least 1."""
    total = sum(len(ledger.gpus) for ledger in ledgers)
    return max(1, math.floor(total * fraction)) if total else 0


def gpu_load(gpu: GpuSlots, mode: Mode) -> tuple[int, int, int]:
    busy = [d for d in gpu.devices if d.used or d.pinned]
    load = sum(d.memory_mib for d in busy) if mode is Mode.MPS else sum(d.compute for d in busy)
    return (load, len(busy), gpu.index)


def serves(ledger: NodeLedger, units: Mapping[str, int]) -> bool:
    """The node's model and mode can offer every requested resource."""
    for resource in units:
        profile = mig_profile_of(resource)
        if profile is not None:
            if ledger.gpu.mode is Mode.MPS:
                return False
            if resource not in {p.resource for p in ledger.gpu.model.profiles}:
                return False
        elif mps_gb_of(resource) is None or ledger.gpu.mode is Mode.MIG:
            return False
    return True


def _misfit(gpu: GpuSlots, units: Mapping[str, int]) -> int:
    """0 if the GPU already has a device of a requested resource (once drained, the pod takes
    it without a new layout), else 1 (its layout must change for the pod, and later again)."""
    return 0 if any(d.resource in units for d in gpu.devices) else 1


def choose_drain(
    units: Mapping[str, int],
    cpu_milli: int,
    memory_mib: int,
    candidates: Iterable[NodeLedger],
) -> DrainChoice | None:
    """The node and GPUs to freeze for a pod (module docstring), or ``None``."""
    need = sum(units.values())
    if need <= 0:
        return None
    best: tuple[tuple[int, int, int, str], DrainChoice] | None = None
    for ledger in candidates:
        if not serves(ledger, units):
            continue
        if cpu_milli > ledger.cpu_free or memory_mib > ledger.memory_free:
            continue
        open_gpus = sorted(
            (_misfit(g, units), gpu_load(g, ledger.gpu.mode), g.index)
            for g in ledger.gpus
            if not g.frozen
        )
        if len(open_gpus) < need:
            continue
        chosen = open_gpus[:need]
        key = (
            sum(c[0] for c in chosen),
            sum(c[1][0] for c in chosen),
            sum(c[1][1] for c in chosen),
            ledger.name,
        )
        choice = DrainChoice(ledger.name, tuple(sorted(c[2] for c in chosen)))
        if best is None or key < best[0]:
            best = (key, choice)
    return best[1] if best is not None else None
