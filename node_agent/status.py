"""Building the NodePartitioning status from what the agent observed and decided. Pure.

Model
-----
* ``status.gpus`` is the *observed* state after the pass: per GPU its UUID, catalog model, MIG
  mode, MIG instances (profile, start, MIG UUID, used, and on hybrid GPUs the MPS slices the
  instance hosts) and MPS slices (memory, thread %, slice id, used).  A GPU, instance or slice
  the agent advertises Unhealthy for good (a GPU NVML cannot read, an XID critical error:
  :func:`flag_unhealthy`) is reported ``unhealthy``, so the partitioner neither offers nor
  repartitions it (the MPS devices of a daemon being restarted are not: that is seconds).
* ``Applied`` is ``True`` iff every GPU the spec lists matches it exactly (:func:`gpu_matches`;
  never while a MIG-mode change is still pending, waiting for a GPU reset), nothing is blocked and the pass had no error; otherwise ``False`` with reason ``Degraded``,
  ``Waiting`` (a transient block, e.g. in-use ids unreadable) or ``InProgress``.
* ``Degraded`` is ``True`` iff some GPU's spec cannot be applied (a non-transient
  :class:`node_agent.gpu_plan.Block`); its reason is the first block's reason and its message
  lists them all.
* ``lastTransitionTime`` is kept from the previous status while a condition's status and reason
  stay the same.  ``lastError`` is this pass's errors, or ``""``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from contract.nodepartitioning import (
    ActualGpu,
    ActualMigInstance,
    ActualMpsSlice,
    Condition,
    DesiredGpu,
    NodePartitioningSpec,
    NodePartitioningStatus,
)
from node_agent.gpu_plan import Block, MpsSlot, ObservedGpu

__all__ = [
    "actual_gpus",
    "build_status",
    "condition",
    "flag_unhealthy",
    "gpu_matches",
    "spec_applied",
]


def actual_gpus(observed: Sequence[ObservedGpu]) -> list[ActualGpu]:
    """The ``status.gpus`` list for the observed GPUs (validation skipped: trusted data)."""
    out: list[ActualGpu] = []
    for g in observed:
        mig = [
            ActualMigInstance.model_construct(
                profile=i.name,
                start=i.start,
                deviceId=i.uuid,
                used=i.used,
                foreign=i.busy and not i.in_use and not i.used_slices,
                mps=_actual_slices(i.slices, i.used_slices),
            )
            for i in sorted(g.instances, key=lambda x: x.start)
        ]
        mps = _actual_slices(g.slices, g.used_slices)
        out.append(
            ActualGpu.model_construct(
                index=g.info.index,
                uuid=g.info.uuid,
                model=g.model.name if g.model else g.info.name,
                migEnabled=g.info.mig_enabled,
                mig=mig,
                mps=mps,
            )
        )
    return out


def flag_unhealthy(
    actual: Sequence[ActualGpu], gpus: Collection[int], devices: Collection[str]
) -> list[ActualGpu]:
    """``actual`` with the GPUs whose index is in ``gpus`` reported ``unhealthy`` as a whole and
    the instances and MPS slices whose device id is in ``devices`` one by one."""
    if not gpus and not devices:
        return list(actual)
    out: list[ActualGpu] = []
    for g in actual:
        if g.index in gpus:
            out.append(g.model_copy(update={"unhealthy": True}))
            continue
        mig = [
            i.model_copy(
                update={
                    "unhealthy": i.unhealthy or i.deviceId in devices,
                    "mps": _flag_slices(i.mps, devices),
                }
            )
            for i in g.mig
        ]
        out.append(g.model_copy(update={"mig": mig, "mps": _flag_slices(g.mps, devices)}))
    return out


def _flag_slices(
    slices: Sequence[ActualMpsSlice], devices: Collection[str]
) -> list[ActualMpsSlice]:
    return [
        s.model_copy(update={"unhealthy": True}) if s.deviceId and s.deviceId in devices else s
        for s in slices
    ]


def _actual_slices(
    slices: tuple[MpsSlot, ...] | None, used: frozenset[str]
) -> list[ActualMpsSlice]:
    return [
        ActualMpsSlice.model_construct(
            memoryMiB=s.memory_mib,
            activeThreadPercentage=s.thread_percentage,
            deviceId=s.device_id,
            used=s.device_id in used,
        )
        for s in (slices or ())
    ]


def gpu_matches(obs: ObservedGpu, desired: DesiredGpu, mode: str) -> bool:
    """True iff GPU ``obs`` is exactly in the desired state (mode, instances with one CI each,
    slices).

    A MIG-mode change still pending (Ampere, until a GPU reset) is never a match."""
    if obs.info.mig_pending:
        return False
    if mode == "mps":
        if obs.info.mig_enabled or obs.slices is None:
            return False
        have = Counter((s.memory_mib, s.thread_percentage) for s in obs.slices)
        return have == Counter((s.memoryMiB, s.activeThreadPercentage) for s in desired.mps)
    if not obs.info.mig_enabled or obs.model is None:
        return False
    if any(not i.uuid or i.profile is None or i.split for i in obs.instances):
        return False
    if any(i.slices is None for i in obs.instances):
        return False
    have_mig = Counter(
        (i.profile.profile_id, i.start, _slice_key(i.slices)) for i in obs.instances if i.profile
    )
    try:
        want = Counter(
            (
                obs.model.profile(d.profile).profile_id,
                d.start,
                tuple(sorted((s.memoryMiB, s.activeThreadPercentage) for s in d.mps)),
            )
            for d in desired.mig
        )
    except ValueError:
        return False
    return have_mig == want


def _slice_key(slices: tuple[MpsSlot, ...] | None) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((s.memory_mib, s.thread_percentage) for s in slices or ()))


def spec_applied(spec: NodePartitioningSpec, observed: Sequence[ObservedGpu]) -> bool:
    by_index = {g.info.index: g for g in observed}
    for d in spec.gpus:
        g = by_index.get(d.index)
        if g is None or not gpu_matches(g, d, spec.mode):
            return False
    return True


def condition(
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    previous: Sequence[Condition],
    now: str,
) -> Condition:
    """A status condition; its ``lastTransitionTime`` is kept from ``previous`` while the
    condition's status and reason hold."""
    prev = next((c for c in previous if c.type == type_), None)
    since = (
        prev.lastTransitionTime
        if prev is not None and prev.status == status and prev.reason == reason
        else now
    )
    return Condition.model_construct(  # trusted values: validation skipped, as for gpus
        type=type_,
        status=status,
        reason=reason,
        message=message,
        lastTransitionTime=since,
        observedGeneration=generation,
    )


def build_status(
    *,
    spec: NodePartitioningSpec | None,
    generation: int,
    observed: Sequence[ObservedGpu],
    blocks: Mapping[int, Block],
    errors: Sequence[str],
    previous: NodePartitioningStatus | None,
    now: str,
    actual: list[ActualGpu] | None = None,
) -> NodePartitioningStatus:
    """The status to write after one reconcile pass (see the module docstring).

    ``actual`` is ``actual_gpus(observed)`` when the caller has it already."""
    hard = [b for _, b in sorted(blocks.items()) if not b.transient]
    soft = [b for _, b in sorted(blocks.items()) if b.transient]
    matched = spec is not None and spec_applied(spec, observed)
    applied = spec is not None and matched and not hard and not soft and not errors
    if applied:
        a_reason, a_msg = "Applied", f"spec generation {generation} applied"
    elif hard:
        a_reason, a_msg = "Degraded", "; ".join(b.message for b in hard)
    elif soft:
        a_reason, a_msg = "Waiting", "; ".join(b.message for b in soft)
    elif spec is None:
        a_reason, a_msg = "NoSpec", "no NodePartitioning spec for this node"
    else:
        a_reason, a_msg = "InProgress", "; ".join(errors) or "applying the spec"
    prev_conds = previous.conditions if previous is not None else []
    conditions = [
        condition(
            "Applied", "True" if applied else "False", a_reason, a_msg, generation, prev_conds, now
        ),
        condition(
            "Degraded",
            "True" if hard else "False",
            hard[0].reason if hard else "AsExpected",
            "; ".join(b.message for b in hard),
            generation,
            prev_conds,
            now,
        ),
    ]
    return NodePartitioningStatus.model_construct(
        observedGeneration=generation,
        planId=spec.planId if spec is not None else "",
        gpus=actual if actual is not None else actual_gpus(observed),
        conditions=conditions,
        lastError="; ".join(errors),
    )
