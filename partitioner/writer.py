"""Carry out the decision step's actions against the Kubernetes API.

* Spec writes are JSON merge patches carrying the ``metadata.resourceVersion`` the decision
  was made from: the API server refuses them with 409 if anyone changed the object since
  (optimistic concurrency).  A refused write is reported (Warning Event on the
  NodePartitioning, ``conflicts`` in the :class:`Outcome`) and not retried here: the pods are
  still pending and the next cycle plans them again from fresh state.
* Creating a NodePartitioning that already exists (409) is not an error; deleting one that is
  gone (404) neither.
* Node conditions are strategic-merge patches of ``status.conditions`` (merged by ``type``, so
  the kubelet's conditions stay).
* Pod patches (reserve, release, drop a reservation, ungate) are JSON merge patches; those that
  depend on what was read carry the pod's resourceVersion, so a pod changed meanwhile answers
  409 and the next cycle decides again.  A refused patch (409 conflict, 422 invalid, 404 gone)
  is logged; its Events are not emitted; a pod that answered 404 is listed in
  ``Outcome.gone_pods`` (the controller drops it from its index).  A refusal that a retry gets
  again (400, 403, 422: a validating webhook or policy that forbids changing a gated pod) is
  also told in a Warning Event ``PatchRefused`` on the pod, once per pod and answer, naming
  the answer and the fix: the pod is never left gated with a log line only.  ``after_spec`` patches run
  only if that node's spec write in the same batch succeeded.
* A stranded pod is evicted (``POST pods/<name>/eviction``, ``policy/v1``) with the
  preconditions ``uid`` and ``resourceVersion`` it was read with: one that changed since (it
  bound after all) or was replaced by a pod of the same name answers 409 and stays.  An
  evicted pod is listed in ``Outcome.evicted`` and ``Outcome.gone_pods``; one that is gone
  already (404) in ``gone_pods`` alone.
* ``status.reservations`` of a NodePartitioning is a merge patch of the status subresource
  with that field alone, so the node agent's status fields stay.
* Every action is independent: one failure is logged and the others still run.  Every failed
  write is listed in ``Outcome.write_failures`` as (action, answer): the status code, or
  ``unreachable`` / ``timeout`` when none came (``gpuslice_write_failures_total``).
* A write to a node or its NodePartitioning (create, delete, spec, ``status.reservations``,
  node condition or label) refused in a way a retry gets again (:data:`REFUSALS`: an admission
  policy, RBAC, a rule of the API server) is told once per object and answer: one WARNING and a
  Warning Event ``WriteRefused`` on the Node (a create) or the NodePartitioning, naming the
  answer.  Then :class:`WriteBackoff` holds that object's same write back, for ``base_s``
  doubling up to ``cap_s`` (the decision step decides it again every cycle: a refused create
  of every opted-in node was re-sent each second, forever); a write that changed (another
  spec, condition, resourceVersion) goes at once, and a success forgets the refusal.

The objects the API returns are handed back (``Outcome.objects``) so the controller's cache
sees its own writes before the watch does.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from contract.nodepartitioning import API_VERSION, GROUP, KIND, PLURAL, VERSION
from partitioner.actions import (
    NODE_CONDITION,
    Action,
    CreatePartitioning,
    DeletePartitioning,
    EmitEvent,
    EvictPod,
    MarkCooldown,
    ObjectRef,
    PatchPod,
    SetNodeCondition,
    WriteReservations,
    WriteSpec,
)
from partitioner.events import event_body, event_namespace
from partitioner.kubeapi import (
    STRATEGIC_MERGE_PATCH,
    ApiError,
    Conflict,
    KubeApi,
    NotFound,
    Unreachable,
)
from partitioner.node_actions import RemoveNodeCondition, SetNodeLabel
from partitioner.node_writes import execute as execute_node_write
from partitioner.snapshot import (
    COOLDOWN_ANNOTATION,
    PLANNED_AT_ANNOTATION,
    PLANNED_PODS_ANNOTATION,
    cooldown_annotation,
)

__all__ = ["NP_PATH", "Outcome", "WriteBackoff", "execute"]

NP_PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
log = logging.getLogger("gpuslice.partitioner.writer")


@dataclass
class Outcome:
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    """NodePartitioning name -> its latest state (returned by a create or a write, or re-read
    after a conflict), for the controller's cache."""
    deleted: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    """Nodes whose spec was written."""
    conflicts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Node whose spec write was refused with 409 -> the pods that plan was for."""
    failures: list[str] = field(default_factory=list)
    events: int = 0
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Pod key -> its state after a successful patch, for the controller's index."""
    pod_refusals: dict[str, str] = field(default_factory=dict)
    """Pod key -> why a patch was refused."""
    gone_pods: list[tuple[str, str]] = field(default_factory=list)
    """(key, uid) of the pods whose patch answered 404: no pod of that name exists (the index
    drops them unless it holds another pod of that name by then)."""
    evicted: list[str] = field(default_factory=list)
    """Pods evicted (:class:`~partitioner.actions.EvictPod`), by key."""
    write_failures: list[tuple[str, str]] = field(default_factory=list)
    """(action, answer) of every failed write: :func:`action_label`, and the status code or
    ``unreachable`` / ``timeout`` (:func:`answer_label`)."""
    held_back: list[str] = field(default_factory=list)
    """Writes not sent: their object's refusal is backed off (:class:`WriteBackoff`)."""
    refused_specs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Node whose spec write was refused for good (:data:`REFUSALS`) or held back for such a
    refusal -> the pods that plan was for: the controller leaves the node out of plans for a
    cool-down, so they are planned elsewhere (before, the same node was planned every batch
    and its pods waited for good)."""


def _np_ref(name: str) -> ObjectRef:
    return ObjectRef(KIND, name, api_version=API_VERSION)


REFUSALS = frozenset({400, 403, 422})
"""Answers to a pod patch that its retry would get again (a 404 is a gone pod, a 409 a newer
pod the next cycle reads, a 429 or 5xx passes)."""

MAX_TOLD = 10_000
"""Pods whose refused patch was told at most (:meth:`_Writer._tell_refusal`; then forgotten)."""

BackedOff = (
    CreatePartitioning
    | DeletePartitioning
    | WriteSpec
    | WriteReservations
    | MarkCooldown
    | SetNodeCondition
    | SetNodeLabel
    | RemoveNodeCondition
)
_BACKED_OFF = (
    CreatePartitioning,
    DeletePartitioning,
    WriteSpec,
    WriteReservations,
    MarkCooldown,
    SetNodeCondition,
    SetNodeLabel,
    RemoveNodeCondition,
)


def action_label(action: object) -> str:
    """``action`` label of ``gpuslice_write_failures_total``: the action's type in snake case
    (``create_partitioning``, ``write_spec``, ``patch_pod`` ...)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(action).__name__).lower()


def answer_label(e: BaseException) -> str:
    """``code`` label of ``gpuslice_write_failures_total``: the API's status code, else
    ``unreachable`` (no answer: refused, reset, TLS) or ``timeout``."""
    if isinstance(e, ApiError) and not isinstance(e, Unreachable) and e.status:
        return str(e.status)
    return "timeout" if isinstance(e, TimeoutError) else "unreachable"


def _written(a: BackedOff) -> object:
    """What the write would write: a refused write is held back only while this stays the same
    (a spec's plan id and time aside, which every new plan changes)."""
    if isinstance(a, WriteSpec):
        return (a.resource_version, a.spec.mode, a.spec.model_dump(mode="json")["gpus"])
    return a


@dataclass(slots=True)
class _Refusal:
    code: int
    written: object
    failures: int
    until: float


class WriteBackoff:
    """Writes to nodes and NodePartitionings refused with :data:`REFUSALS`, per object
    (kept by the caller across cycles; module docstring).

    ``base_s``: the first wait after a refusal, doubled after each refusal of the same write up
    to ``cap_s``; ``clock``: monotonic seconds.
    """

    def __init__(
        self,
        base_s: float = 1.0,
        cap_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_s, self.cap_s, self.clock = base_s, cap_s, clock
        self.refusals: dict[tuple[str, str], _Refusal] = {}
        """(action, node) -> its last refusal."""
        self.told: dict[tuple[str, str], set[int]] = {}
        """(action, node) -> the answers told already (until a write of it succeeds)."""

    @staticmethod
    def _key(a: BackedOff) -> tuple[str, str]:
        return (action_label(a), a.node)

    def holds(self, a: BackedOff) -> float:
        """Seconds ``a`` is still held back (0: send it)."""
        refusal = self.refusals.get(self._key(a))
        if refusal is None or refusal.written != _written(a):
            return 0.0
        return max(0.0, refusal.until - self.clock())

    def refused(self, a: BackedOff, code: int) -> tuple[bool, float]:
        """Record a refusal: (whether to tell it, the wait before ``a`` is sent again)."""
        key, written = self._key(a), _written(a)
        last = self.refusals.get(key)
        failures = last.failures + 1 if last is not None and last.written == written else 1
        wait = min(self.cap_s, self.base_s * 2 ** min(failures - 1, 30))
        if key not in self.refusals and len(self.refusals) >= MAX_TOLD:
            self.refusals.clear()
            self.told.clear()
        self.refusals[key] = _Refusal(code, written, failures, self.clock() + wait)
        codes = self.told.setdefault(key, set())
        first = code not in codes
        codes.add(code)
        return first, wait

    def succeeded(self, a: BackedOff) -> None:
        key = self._key(a)
        self.refusals.pop(key, None)
        self.told.pop(key, None)


def _refused_ref(a: BackedOff) -> ObjectRef:
    if isinstance(a, CreatePartitioning):
        return ObjectRef("Node", a.node, uid=a.node_uid)
    if isinstance(a, SetNodeCondition | SetNodeLabel | RemoveNodeCondition):
        return ObjectRef("Node", a.node)
    return _np_ref(a.node)


_REFUSED_WHAT = {
    "create_partitioning": f"creating {KIND} {{node}}",
    "delete_partitioning": f"deleting {KIND} {{node}}",
    "write_spec": f"writing the spec of {KIND} {{node}}",
    "write_reservations": f"writing status.reservations of {KIND} {{node}}",
    "mark_cooldown": f"writing the cool-down annotation of {KIND} {{node}}",
    "set_node_condition": "setting the GpusliceReady condition of node {node}",
    "set_node_label": "setting a label of node {node}",
    "remove_node_condition": "removing a condition of node {node}",
}


class _Writer:
    def __init__(
        self,
        api: KubeApi,
        instance: str,
        wall: Callable[[], datetime.datetime],
        told: dict[str, str] | None = None,
    ) -> None:
        self.api, self.instance, self.wall = api, instance, wall
        self.out = Outcome()
        self.told: dict[str, str] = told if told is not None else {}
        """Pod uid -> the refusal last told in an Event (kept by the caller across cycles)."""

    async def event(self, ev: EmitEvent) -> None:
        path = f"/api/v1/namespaces/{event_namespace(ev)}/events"
        try:
            await self.api.create(path, event_body(ev, self.wall(), self.instance))
            self.out.events += 1
        except ApiError as e:
            self.out.write_failures.append((action_label(ev), answer_label(e)))
            log.warning(
                "could not post event %s on %s %s: %s", ev.reason, ev.ref.kind, ev.ref.name, e
            )

    async def create(self, a: CreatePartitioning) -> None:
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {
                "name": a.node,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": a.node, "uid": a.node_uid}
                ]
                if a.node_uid
                else [],
            },
            "spec": a.spec.model_dump(mode="json"),
        }
        try:
            self.out.objects[a.node] = await self.api.create(NP_PATH, body)
            log.info("created %s %s (mode %s)", KIND, a.node, a.spec.mode)
        except Conflict:
            log.debug("%s %s already exists", KIND, a.node)

    async def delete(self, a: DeletePartitioning) -> None:
        try:
            await self.api.delete(f"{NP_PATH}/{a.node}")
            log.info("deleted %s %s: node opted out or is gone", KIND, a.node)
        except NotFound:
            pass
        self.out.deleted.append(a.node)

    async def write(self, a: WriteSpec) -> None:
        annotations = {PLANNED_PODS_ANNOTATION: json.dumps(list(a.planned_pods))}
        if a.planned_at is not None:
            annotations[PLANNED_AT_ANNOTATION] = f"{a.planned_at:.3f}"
        meta: dict[str, Any] = {"annotations": annotations}
        if a.resource_version is not None:
            meta["resourceVersion"] = a.resource_version
        patch = {"metadata": meta, "spec": a.spec.model_dump(mode="json")}
        try:
            self.out.objects[a.node] = await self.api.patch(f"{NP_PATH}/{a.node}", patch)
        except Conflict as e:
            self.out.write_failures.append((action_label(a), answer_label(e)))
            self.out.conflicts[a.node] = a.planned_pods
            with contextlib.suppress(ApiError):  # else the watch brings it
                self.out.objects[a.node] = await self.api.request("GET", f"{NP_PATH}/{a.node}")
            message = (
                f"plan {a.spec.planId} not written: the object changed since it was read "
                f"({e.status} {e.reason}); its pods are planned again next cycle"
            )
            log.warning("%s %s: %s", KIND, a.node, message)
            await self.event(EmitEvent(_np_ref(a.node), "Warning", "SpecConflict", message))
            return
        self.out.written.append(a.node)
        log.info(
            "wrote %s %s plan %s for %d pod(s)", KIND, a.node, a.spec.planId, len(a.planned_pods)
        )
        for ev in a.on_success:
            await self.event(ev)

    async def patch_pod(self, a: PatchPod) -> None:
        if a.after_spec is not None and a.after_spec not in self.out.written:
            return  # the plan it belongs to was not written
        namespace, _, name = a.pod.partition("/")
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        try:
            self.out.pods[a.pod] = await self.api.patch(path, a.patch)
        except ApiError as e:
            self.out.write_failures.append((action_label(a), answer_label(e)))
            self._refused(a.pod, a.ref.uid, f"{a.purpose} patch", e)
            if e.status in REFUSALS:
                await self._tell_refusal(a, e)
            return
        for ev in a.on_success:
            await self.event(ev)

    async def _tell_refusal(self, a: PatchPod, e: ApiError) -> None:
        """A pod patch refused in a way a retry does not fix (:data:`REFUSALS`: a validating
        webhook or policy, a rule of the API server): a Warning Event on the pod, once per pod
        uid and answer (:attr:`told`), so the pod is not left gated with a log line only."""
        told = f"{a.purpose}: {e.status} {e.reason}: {e.message}"
        key = a.ref.uid or a.pod
        if self.told.get(key) == told:
            return
        if len(self.told) >= MAX_TOLD:
            self.told.clear()
        self.told[key] = told
        stays = (
            "stays gated, its slice kept for it"
            if a.purpose in ("release", "ungate")
            else "keeps what it has"
        )
        await self.event(
            EmitEvent(
                a.ref,
                "Warning",
                "PatchRefused",
                f"gpuslice's {a.purpose} patch of this pod was refused ({e.status} {e.reason}: "
                f"{e.message}); the pod {stays} and the patch is retried every cycle: allow "
                "gpuslice's ServiceAccount to change scheduling gates, node affinity and "
                "gpuslice.io annotations of gated pods (validating webhooks, admission "
                "policies), or delete the pod (its controller recreates it)",
            )
        )

    def _refused(self, pod: str, uid: str, what: str, e: ApiError) -> None:
        """A pod write was refused: recorded, and a pod that is gone (404) listed as gone."""
        self.out.pod_refusals[pod] = f"{e.status} {e.reason}: {e.message}"
        if isinstance(e, NotFound):
            self.out.gone_pods.append((pod, uid))
        level = logging.INFO if e.status in (404, 409) else logging.WARNING
        log.log(level, "pod %s: %s refused: %s", pod, what, e)

    async def evict(self, a: EvictPod) -> None:
        namespace, _, name = a.pod.partition("/")
        preconditions: dict[str, str] = {}
        if a.ref.uid:
            preconditions["uid"] = a.ref.uid
        if a.resource_version is not None:
            preconditions["resourceVersion"] = a.resource_version
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": preconditions},
        }
        try:
            await self.api.create(f"/api/v1/namespaces/{namespace}/pods/{name}/eviction", body)
        except ApiError as e:
            self.out.write_failures.append((action_label(a), answer_label(e)))
            self._refused(a.pod, a.ref.uid, "eviction", e)
            return
        log.info("evicted stranded pod %s", a.pod)
        self.out.evicted.append(a.pod)
        self.out.gone_pods.append((a.pod, a.ref.uid))
        for ev in a.on_success:
            await self.event(ev)

    async def reservations(self, a: WriteReservations) -> None:
        body = {"status": {"reservations": [r.model_dump(mode="json") for r in a.reservations]}}
        obj = await self.api.patch(f"{NP_PATH}/{a.node}/status", body)
        self.out.objects[a.node] = obj

    async def cooldown(self, a: MarkCooldown) -> None:
        value = None if a.until is None else cooldown_annotation(a.until, a.reason)
        patch = {"metadata": {"annotations": {COOLDOWN_ANNOTATION: value}}}
        with contextlib.suppress(NotFound):  # deleted since it was read: nothing to keep it on
            self.out.objects[a.node] = await self.api.patch(f"{NP_PATH}/{a.node}", patch)

    async def condition(self, a: SetNodeCondition) -> None:
        stamp = self.wall().astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {
            "type": NODE_CONDITION,
            "status": a.status,
            "reason": a.reason,
            "message": a.message,
            "lastTransitionTime": stamp,
            "lastHeartbeatTime": stamp,
        }
        patch = {"status": {"conditions": [cond]}}
        await self.api.patch(f"/api/v1/nodes/{a.node}/status", patch, STRATEGIC_MERGE_PATCH)

    async def run(self, a: Action) -> None:
        match a:
            case EmitEvent():
                await self.event(a)
            case CreatePartitioning():
                await self.create(a)
            case DeletePartitioning():
                await self.delete(a)
            case WriteSpec():
                await self.write(a)
            case SetNodeCondition():
                await self.condition(a)
            case SetNodeLabel() | RemoveNodeCondition():
                await execute_node_write(self.api, a)
            case PatchPod():
                await self.patch_pod(a)
            case EvictPod():
                await self.evict(a)
            case WriteReservations():
                await self.reservations(a)
            case MarkCooldown():
                await self.cooldown(a)


async def execute(
    api: KubeApi,
    actions: Iterable[Action],
    *,
    instance: str = "",
    wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    told: dict[str, str] | None = None,
    backoff: WriteBackoff | None = None,
) -> Outcome:
    """Run every action in order; failures are logged and collected, never raised.  ``told``:
    the pod patch refusals already told in Events, ``backoff``: the refused writes to nodes and
    NodePartitionings held back (both kept across cycles by the caller; module docstring)."""
    writer = _Writer(api, instance, wall, told)
    out = writer.out
    for action in actions:
        backed = action if isinstance(action, _BACKED_OFF) else None
        if backed is not None and backoff is not None:
            wait = backoff.holds(backed)
            if wait > 0:
                log.debug("%s on %s held back %.0f s more", action_label(action), backed.node, wait)
                out.held_back.append(f"{action_label(action)} {backed.node}")
                if isinstance(action, WriteSpec):
                    out.refused_specs[action.node] = action.planned_pods
                continue
        try:
            await writer.run(action)
        except (ApiError, TimeoutError) as e:  # refused, or unreachable (Unreachable)
            out.write_failures.append((action_label(action), answer_label(e)))
            out.failures.append(f"{type(action).__name__}: {e}")
            if (
                backed is not None
                and backoff is not None
                and isinstance(e, ApiError)
                and e.status in REFUSALS
            ):
                if isinstance(action, WriteSpec):
                    out.refused_specs[action.node] = action.planned_pods
                await _tell_write_refusal(writer, backoff, backed, e)
            else:
                log.warning("%s failed: %s", type(action).__name__, e)
        else:
            if backed is not None and backoff is not None:
                backoff.succeeded(backed)
    return out


async def _tell_write_refusal(
    writer: _Writer, backoff: WriteBackoff, a: BackedOff, e: ApiError
) -> None:
    """A node's or NodePartitioning's write refused with :data:`REFUSALS`: backed off, and
    told once per object and answer (module docstring)."""
    first, wait = backoff.refused(a, e.status)
    what = _REFUSED_WHAT[action_label(a)].format(node=a.node)
    if not first:
        log.debug("%s refused again (%s); next try in %.0f s", what, e, wait)
        return
    if isinstance(a, WriteSpec):  # operator.cool_refused_specs
        again = (
            "its pods are planned on other nodes and the node is left out of plans for "
            "cooldownSeconds, then planned again"
        )
    else:
        again = (
            f"gpuslice tries it again less and less often (next in {wait:.0f} s, then up to "
            f"every {backoff.cap_s:.0f} s), and at once when it changes"
        )
    message = (
        f"{what[0].upper()}{what[1:]} was refused ({e.status} {e.reason}: {e.message}); "
        f"{again}: allow gpuslice's ServiceAccount this write (RBAC, validating webhooks, "
        "admission policies)"
    )
    log.warning("%s", message, extra={"node": a.node})
    await writer.event(EmitEvent(_refused_ref(a), "Warning", "WriteRefused", message))
