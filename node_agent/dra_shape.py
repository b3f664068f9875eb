"""Planner-shaped publishing in DRA mode: which devices the node publishes, the status it
reports, which idle MIG instances it keeps.

Model
-----
The partitioner plans a ``gpuslice.io/partitioning=dra`` node like a MIG node: it writes the
``spec`` of the node's NodePartitioning (named after the node), per GPU the MIG layout it
wants, a list of ``(profile, start)``.  With ``dra_publish=shaped`` (the default) every round
of the DRA agent (:class:`~node_agent.dra_driver.DraDriver`) reads that object and computes:

* the *planned* devices of GPU ``i``: the spec's placements of ``i`` as device names
  (:func:`~node_agent.dra_slices.device_name`); a placement the GPU's model does not have (an
  unknown profile, a start the profile does not allow) is skipped and reported
  (:func:`planned_devices`);
* the *allocated* devices: every result of this driver in this node's pool in the
  ``status.allocation`` of any ResourceClaim (all namespaces, :meth:`ShapeApi.allocated`), plus
  the devices of the claims the preparer has prepared (its checkpoint);
* the *published* devices (:func:`publish_set`): per GPU its planned devices, or the whole GPU
  ``gpu<i>`` when the spec lists no MIG instance for it (or there is no NodePartitioning, or no
  spec): the most useful free capacity, and a MIG claim that finds no published placement makes
  the partitioner plan a layout for it; less the free devices an XID hit or processes outside
  any claim use (:mod:`node_agent.dra_foreign`); always united with the allocated devices.  An
  allocated device never leaves the slices, even when the new spec overlaps it: the scheduler
  counts counters only for published devices, and the counters keep the overlapping planned
  device from being allocated beside it;
* the *status* (:func:`shaped_status`), written after a successful publish as a merge patch of
  the status subresource: ``observedGeneration`` (the generation read), ``planId``, condition
  ``Applied`` ``True`` (``False``/``Degraded`` with ``Degraded`` ``True``, reason
  ``InvalidPlacement``, when some placement was skipped) and per MIG-capable GPU ``{index, uuid,
  model, migEnabled (as NVML reads it), mig: [{profile, start, used}]}``: the allocated placements (``used``;
  so are those that run processes outside any claim, :mod:`node_agent.dra_foreign`) and then the planned placements the GPU's counters allow beside them (free), so the report is
  always a valid layout (a spec planned before an allocation was seen may overlap it; that
  placement is not free until the claim goes).  A GPU a claim holds whole (device
  ``gpu<i>`` allocated) is reported as one instance of the model's profile covering every
  memory slot (e.g. ``7g.80gb``) at start 0, used: planners then take the GPU as fully used
  (:func:`~node_agent.dra_slices.reported_layout`, which the time replay's fake agent
  reports too).  Without a NodePartitioning no status is written.
* the *kept* placements, for the preparer (:class:`~node_agent.dra_prepare.DraPreparer`):
  the planned devices.  Each round first destroys the idle instances no claim owns whose
  placement is neither planned nor allocated, then creates the planned placements that have no
  instance yet (where nothing allocated or in use overlaps them), then publishes: as the
  device-plugin agent applies a spec before its devices are advertised, so a claim's prepare
  adopts the instance and a pod never holds its placement while the instance is made.
  Unprepare keeps a claim's idle instance when its placement is planned (the next claim
  allocated that placement adopts it).

**A planned placement the round could not make** (:attr:`PlannedOutcome.unmade
<node_agent.dra_prepare.PlannedOutcome.unmade>`) is not free: prepare there would fail as the
round did.  A GPU whose MIG mode could not be switched on is reported ``Degraded`` with reason
``MIGModePending`` (the device-plugin agent's reason), the message naming the GPU, the error
and the remedy, and the GPU ``unhealthy`` (the partitioner locks it: nothing on it is promised
and no plan changes it); a placement whose instance could not be created, ``Degraded``
``InstanceNotCreated`` and the placement ``unhealthy``.  Their free devices are withdrawn.
While the kubelet will not call the driver (:mod:`node_agent.dra_driver`, "The kubelet's
registration") the status says ``Degraded``/``DriverNotRegistered`` first and every GPU
``unhealthy``.

**An unreadable GPU** (NVML cannot read that GPU alone, ``GPU_IS_LOST`` typically:
:meth:`DraPreparer.unreadable <node_agent.dra_prepare.DraPreparer.unreadable>`, read at the start
of every round) is isolated for the round, as the device-plugin agent isolates it
(:mod:`node_agent.reconciler`): its free devices are withdrawn -- :func:`publish_set` treats it
like a drained GPU, so kube-scheduler allocates nothing new there -- while its *allocated*
devices stay published; nothing on it is destroyed or created (the idle clean-up and
:meth:`~node_agent.dra_prepare.DraPreparer.create_planned` skip it); the status keeps its
reported layout (allocated and planned placements, as above: the partitioner does not see it
empty and re-plan it) and says ``Degraded`` with reason ``GpuUnreadable``, the message naming
the GPU and the NVML error (:func:`node_agent.reconciler.unreadable_block`, the device-plugin
agent's block), ``Applied`` ``False``/``Degraded``.  The other GPUs are shaped as usual.  Once
it reads again, the next round publishes and shapes it like the others.

Why allocated devices stay published: kube-scheduler computes the counters an allocated device
consumes from the published slices, and an allocated device that leaves them stops counting
(the rule above), so the pool the scheduler sees would no longer be the one the claims hold;
keeping them published keeps the scheduler's view of what is taken exact, the same for every
GPU, and the claims' devices come back with no transition when the GPU recovers.  It allows
nothing new: no free device of that GPU is published, so nothing can be allocated beside them.
(A claim's prepare there fails meanwhile with an error naming the GPU; the kubelet retries.)

A GPU unreadable since the agent started (no model known yet) is reported the same way, as
the object's status last listed it, else by its index alone, ``unhealthy`` (the partitioner
locks it); the spec's placements on it are not reported invalid.  Once it reads it joins the
published GPUs (:meth:`DraPreparer.read_pending
<node_agent.dra_prepare.DraPreparer.read_pending>`).

**An XID critical error** (:mod:`node_agent.xid`; what it marks:
:mod:`node_agent.dra_prepare`, "An XID") is handled on the same path: the unhealthy devices
(those sharing a memory slot with the placement hit, every device of a GPU hit as a whole) are
left out of the published set unless allocated (:func:`publish_set`'s ``unhealthy``; the
allocated ones are published tainted ``NoSchedule``, :func:`unusable_taints`, as are those
processes outside any claim use and those of an unreadable GPU), nothing
is created or destroyed over them, and the status says ``Degraded`` with reason ``GpuXid``
naming the GPU, the instance and the XID (added to the message of a ``GpuUnreadable`` block of
the same GPU), reports the placement hit in the GPU's layout, ``unhealthy`` (kept in the layout
whether a claim holds it or not: its instance stays), or the GPU ``unhealthy`` as a whole.
The partitioner then promises none of it and plans no change over it.  An unreadable GPU is
reported ``unhealthy`` as a whole too.

With ``dra_publish=all`` none of this runs: every placement is published, as before -- except
that an unreadable GPU's devices, and the unhealthy ones, are withdrawn but those prepared on
this node (the preparer's checkpoint: that mode lists no claims), see
:class:`~node_agent.dra_driver.DraDriver`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contract.nodepartitioning import (
    ActualGpu,
    ActualMigInstance,
    NodePartitioning,
    NodePartitioningSpec,
    NodePartitioningStatus,
    PrepareFailure,
)
from node_agent.dra_claims import DeviceTarget
from node_agent.dra_foreign import ForeignUse
from node_agent.dra_slices import (
    DRIVER,
    TAINT_REASONS,
    DraGpu,
    device_name,
    reported_layout,
    whole_gpu_profile,
)
from node_agent.gpu_plan import Block
from node_agent.nvml import NvmlError
from node_agent.reconciler import unreadable_block
from node_agent.status import condition
from node_agent.xid import XidMark, add_xid_blocks
from planner.catalog import GpuModel, MigProfile

__all__ = [
    "PUBLISH_MODES",
    "ShapeApi",
    "claim_devices",
    "planned_devices",
    "publish_set",
    "shaped_status",
    "unusable_taints",
]

log = logging.getLogger(__name__)

UNREADABLE_DEVICES = "its free devices are withdrawn from the ResourceSlices"
"""What the ``GpuUnreadable`` block says became of an unreadable GPU's devices in DRA mode."""
XID_DEVICES = (
    "the free devices sharing a memory slot with what it hit are withdrawn from the "
    "ResourceSlices (allocated ones stay published, tainted NoSchedule where the API server "
    "keeps device taints) and nothing there is created or destroyed"
)
"""What the ``GpuXid`` block says became of the devices an XID hit in DRA mode."""
MODE_DEVICES = (
    "its planned placements are not made: their free devices are withdrawn from the "
    "ResourceSlices and the GPU is reported unhealthy until its MIG mode switches (tried again "
    "every round)"
)
"""What the ``MIGModePending`` block says became of a GPU whose MIG mode could not be switched
on in DRA mode."""
CREATE_DEVICES = (
    "it is withdrawn from the ResourceSlices while free and reported unhealthy until it is "
    "made (tried again every round)"
)
"""What the ``InstanceNotCreated`` block says became of a planned placement not made."""

PUBLISH_MODES = ("shaped", "all")
"""``dra_publish``: planner-shaped (this module) or every placement."""

CLAIM_GROUP, CLAIM_VERSION, CLAIM_PLURAL = "resource.k8s.io", "v1", "resourceclaims"
CLAIM_PAGE = 500


def planned_devices(
    gpus: Sequence[DraGpu], spec: NodePartitioningSpec | None, waiting: Collection[int] = ()
) -> tuple[dict[int, list[str]], list[str]]:
    """Per GPU index, the device names of the spec's MIG placements (a GPU the spec does not
    list: ``[]``); and one line per placement skipped (not a placement of the GPU's model).
    The placements of the ``waiting`` GPUs (unreadable since the agent started, so not in
    ``gpus`` yet: reported ``GpuUnreadable`` instead) are neither."""
    by_index = {g.index: g for g in gpus}
    out: dict[int, list[str]] = {g.index: [] for g in gpus}
    skipped: list[str] = []
    for d in spec.gpus if spec is not None else ():
        g = by_index.get(d.index)
        if g is None and d.index in waiting:
            continue
        for inst in d.mig:
            where = f"GPU {d.index} instance {inst.profile}@{inst.start}"
            if g is None:
                skipped.append(f"{where}: the node has no such GPU in the catalog")
                continue
            try:
                p = g.model.profile(inst.profile)
            except ValueError as e:
                skipped.append(f"{where}: {e}")
                continue
            if inst.start not in p.starts:
                skipped.append(
                    f"{where}: {p.name} cannot start at {inst.start} on {g.model.name} "
                    f"(starts {', '.join(map(str, p.starts))})"
                )
                continue
            name = device_name(g.index, p, inst.start)
            if name not in out[g.index]:
                out[g.index].append(name)
    return out, skipped


def publish_set(
    planned: Mapping[int, Sequence[str]],
    allocated: Collection[str],
    withheld: Collection[int] = (),
    unhealthy: Collection[str] = (),
) -> set[str]:
    """The devices to publish: per GPU its planned devices, else the whole GPU; nothing free on
    the ``withheld`` GPUs (the ones the partitioner drains, the unreadable ones) and no free
    ``unhealthy`` device (an XID hit it); plus every allocated device."""
    out: set[str] = set()
    for i, names in planned.items():
        if i not in withheld:
            out.update(names if names else [device_name(i)])
    return (out - set(unhealthy)) | set(allocated)


def unusable_taints(
    published: Collection[str],
    *,
    unreadable: Collection[str] = (),
    xid: Collection[str] = (),
    foreign: Collection[str] = (),
) -> dict[str, str]:
    """The published devices no new claim can use, each with why (the value of the
    :data:`~node_agent.dra_slices.UNUSABLE_TAINT_KEY` taint, the most serious reason first):
    on an ``unreadable`` GPU, hit by an ``xid``, used by ``foreign`` processes.  Only allocated
    ones are published (:func:`publish_set`); tainted, they stay unallocatable after their
    claim is deallocated, until the agent's next round withdraws them."""
    out: dict[str, str] = {}
    for why, names in zip(TAINT_REASONS, (unreadable, xid, foreign), strict=True):
        for name in names:
            if name in published:
                out.setdefault(name, why)
    return out


def claim_devices(claims: Iterable[Mapping[str, Any]], pool: str, driver: str = DRIVER) -> set[str]:
    """The devices of ``driver`` in ``pool`` the claims' ``status.allocation`` names.  A result
    with ``adminAccess`` is not an allocation (kube-scheduler does not count it as one:
    :mod:`node_agent.dra_prepare`, "adminAccess") and holds nothing here: counted, it kept a
    placement the plan dropped published and its device reported used."""
    out: set[str] = set()
    for c in claims:
        allocation = (c.get("status") or {}).get("allocation") if isinstance(c, Mapping) else None
        if not isinstance(allocation, Mapping):
            continue
        results = (allocation.get("devices") or {}).get("results") or ()
        for r in results if isinstance(results, list) else ():
            if (
                isinstance(r, Mapping)
                and r.get("driver") == driver
                and r.get("pool") == pool
                and isinstance(r.get("device"), str)
                and r.get("adminAccess") is not True
            ):
                out.add(r["device"])
    return out


def _mig_enabled(g: DraGpu, read: Mapping[int, bool] | None, last: ActualGpu | None) -> bool:
    """GPU ``g``'s ``migEnabled``: as NVML ``read`` it, else as the status last said, else as
    its model allows."""
    if read is not None and g.index in read:
        return read[g.index]
    return last.migEnabled if last is not None else g.model.mig_capable


def _add_block(blocks: dict[int, Block], gpu: int, block: Block) -> None:
    """Add ``block`` to GPU ``gpu``'s (the reason of the first one stays)."""
    had = blocks.get(gpu)
    blocks[gpu] = block if had is None else Block(had.reason, f"{had.message}; {block.message}")


def _keys(model: GpuModel, rows: Iterable[tuple[MigProfile | None, int]]) -> set[tuple[str, int]]:
    """``(profile, start)`` of placements as :func:`reported_layout` reports them (the whole GPU,
    ``None``, as the model's whole-GPU profile at 0)."""
    whole = whole_gpu_profile(model)
    out: set[tuple[str, int]] = set()
    for p, s in rows:
        if p is not None:
            out.add((p.name, s))
        elif whole is not None:
            out.add((whole.name, 0))
    return out


def shaped_status(
    gpus: Sequence[DraGpu],
    targets: Mapping[str, DeviceTarget],
    obj: NodePartitioning,
    planned: Mapping[int, Sequence[str]],
    allocated: Collection[str],
    skipped: Sequence[str],
    now: str,
    unreadable: Mapping[int, NvmlError] | None = None,
    xid_marks: Sequence[XidMark] = (),
    prepare_failures: Sequence[PrepareFailure] = (),
    foreign: Sequence[ForeignUse] = (),
    *,
    mig_enabled: Mapping[int, bool] | None = None,
    mode_failed: Mapping[int, str] | None = None,
    not_created: Mapping[str, str] | None = None,
    kubelet: Block | None = None,
) -> NodePartitioningStatus:
    """The status after publishing ``planned`` and ``allocated`` for ``obj`` (module
    docstring); ``lastTransitionTime`` is kept from ``obj.status`` while a condition holds.
    ``unreadable``: the GPUs NVML could not read this round, with the error (``Degraded``,
    ``GpuUnreadable``, before any ``InvalidPlacement``; the GPU ``unhealthy``; one not in
    ``gpus`` -- unreadable since the agent started -- is listed as ``obj``'s status last
    reported it, else bare).  ``xid_marks``: the critical XIDs seen (``Degraded``, ``GpuXid``,
    added to a ``GpuUnreadable`` block of the same GPU; the GPU, or the placement hit, reported
    ``unhealthy``, the placement kept in the layout whether a claim holds it or not).
    ``prepare_failures``: the claims whose last prepare failed
    (:meth:`node_agent.dra_failures.PrepareFailures.report`), listed as they are; they change
    no condition (the GPUs' own problems do).  ``foreign``: the placements (or whole GPUs)
    running processes outside any claim (:mod:`node_agent.dra_foreign`), reported ``used``
    like an allocated one.

    ``mig_enabled``: the MIG mode NVML reads per GPU (``migEnabled``; a GPU missing there is
    reported as the object's status last listed it, else as its model allows).
    ``mode_failed``: the GPUs whose MIG mode could not be switched on this round, with the
    error (:attr:`~node_agent.dra_prepare.PlannedOutcome.mode_failed`): ``Degraded``
    ``MIGModePending`` naming the GPU and the remedy, the GPU ``unhealthy`` as a whole (none of
    its planned placements can be made, so none is free: the partitioner promises nothing
    there and plans no change over it until the mode switches).  ``not_created``: planned
    placements whose instance could not be created, with the error (``Degraded``
    ``InstanceNotCreated``; the placement reported ``unhealthy``).  ``kubelet``: the kubelet
    has not registered the plugin (:class:`~node_agent.dra_driver.DraDriver`): that block
    first, every GPU ``unhealthy`` (their free devices are withdrawn)."""
    generation = obj.metadata.generation or 0
    unreadable = unreadable or {}
    mode_failed = mode_failed or {}
    not_created = not_created or {}
    unmade: dict[int, set[tuple[str, int]]] = {}
    for name in not_created:
        if (t := targets.get(name)) is not None and t.profile is not None:
            unmade.setdefault(t.gpu, set()).add((t.profile.name, t.start))
    held: dict[int, list[tuple[MigProfile | None, int]]] = {}
    for name in sorted(allocated):
        if (t := targets.get(name)) is not None:
            held.setdefault(t.gpu, []).append((t.profile, t.start))
    claimed = {g: list(rows) for g, rows in held.items()}
    theirs: dict[int, list[tuple[MigProfile | None, int]]] = {}
    for f in foreign:
        t = targets.get(f.device) if f.device else None
        theirs.setdefault(f.gpu, []).append((t.profile, t.start) if t is not None else (None, 0))
        held.setdefault(f.gpu, []).append(theirs[f.gpu][-1])
    hit: dict[int, list[tuple[MigProfile, int]]] = {}
    for m in xid_marks:
        t = targets.get(m.device) if m.device else None
        if t is not None and t.profile is not None:
            hit.setdefault(t.gpu, []).append((t.profile, t.start))
    sick = {m.gpu for m in xid_marks if not m.device} | set(unreadable) | set(mode_failed)
    if kubelet is not None:
        sick |= {g.index for g in gpus}
    before = {g.index: g for g in obj.status.gpus} if obj.status is not None else {}
    out: list[ActualGpu] = []
    for g in sorted(gpus, key=lambda x: x.index):
        mig: list[ActualMigInstance] = []
        if g.model.mig_capable:
            wanted = [targets[n] for n in planned.get(g.index, ()) if n in targets]
            used = {(p.name, s) for p, s in held.get(g.index, []) if p is not None}
            only_theirs = _keys(g.model, theirs.get(g.index, ())) - _keys(
                g.model, claimed.get(g.index, ())
            )
            bad = {(p.name, s) for p, s in hit.get(g.index, [])}
            broken = unmade.get(g.index, set())
            layout = reported_layout(
                g.model,
                [*held.get(g.index, []), *hit.get(g.index, [])],
                [
                    (t.profile, t.start)
                    for t in wanted
                    if t.gpu == g.index and t.profile is not None
                ],
            )
            mig = [
                ActualMigInstance(
                    profile=p,
                    start=s,
                    used=u and ((p, s) in used or (p, s) not in bad),
                    unhealthy=(p, s) in bad or (p, s) in broken,
                    foreign=u and (p, s) in only_theirs,
                )
                for p, s, u in layout
            ]
        out.append(
            ActualGpu(
                index=g.index,
                uuid=g.uuid,
                model=g.model.name,
                migEnabled=_mig_enabled(g, mig_enabled, before.get(g.index)),
                mig=mig,
                unhealthy=g.index in sick,
            )
        )
    listed = {g.index for g in gpus}
    for i in sorted(unreadable.keys() - listed):
        last = before.get(i)
        out.append(
            last.model_copy(update={"unhealthy": True})
            if last is not None
            else ActualGpu(index=i, unhealthy=True)
        )
    out.sort(key=lambda x: x.index)
    previous = obj.status.conditions if obj.status is not None else []
    blocks: dict[int, Block] = {
        i: unreadable_block(i, e, UNREADABLE_DEVICES) for i, e in unreadable.items()
    }
    add_xid_blocks(blocks, xid_marks, XID_DEVICES)
    for i, error in mode_failed.items():
        _add_block(blocks, i, Block("MIGModePending", f"{error}; {MODE_DEVICES}"))
    for name, error in sorted(not_created.items()):
        if (t := targets.get(name)) is not None and t.profile is not None:
            _add_block(
                blocks,
                t.gpu,
                Block(
                    "InstanceNotCreated",
                    f"GPU {t.gpu}: the planned instance {t.profile.name} at {t.start} could "
                    f"not be created ({error}); {CREATE_DEVICES}",
                ),
            )
    lost = [b for _, b in sorted(blocks.items())]
    if kubelet is not None:
        lost.insert(0, kubelet)
    if lost or skipped:
        message = "; ".join([b.message for b in lost] + list(skipped))
        reason = lost[0].reason if lost else "InvalidPlacement"
        applied = condition("Applied", "False", "Degraded", message, generation, previous, now)
        degraded = condition("Degraded", "True", reason, message, generation, previous, now)
    else:
        applied = condition(
            "Applied",
            "True",
            "Applied",
            f"spec generation {generation} published",
            generation,
            previous,
            now,
        )
        degraded = condition("Degraded", "False", "AsExpected", "", generation, previous, now)
    return NodePartitioningStatus(
        observedGeneration=generation,
        planId=obj.spec.planId,
        gpus=out,
        conditions=[applied, degraded],
        lastError="",
        prepareFailures=list(prepare_failures),
    )


@dataclass(slots=True)
class ShapeApi:
    """The API calls of shaped publishing (kubernetes_asyncio ``CustomObjectsApi``):
    ResourceClaims of all namespaces, listed in pages of :data:`CLAIM_PAGE`."""

    api: Any
    node: str
    driver: str = DRIVER
    request_timeout_s: float = 10.0

    async def allocated(self) -> set[str]:
        """This pool's allocated devices, from every ResourceClaim's allocation."""
        out: set[str] = set()
        token = ""
        while True:
            kwargs: dict[str, Any] = {"limit": CLAIM_PAGE}
            if token:
                kwargs["_continue"] = token
            page = await self.api.list_cluster_custom_object(
                CLAIM_GROUP,
                CLAIM_VERSION,
                CLAIM_PLURAL,
                _request_timeout=self.request_timeout_s,
                **kwargs,
            )
            out |= claim_devices(page.get("items") or (), self.node, self.driver)
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return out
