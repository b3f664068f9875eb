"""``gpuslice status``: where every pod waiting for a slice stands, and every gpuslice node.

Why: the partitioner tells a pod's story in Events, and the API server drops Events after an
hour (``--event-ttl``), while a pod can wait longer in a deep queue.  What outlives them is on
the objects: the pod's scheduling gate and reservation annotation, its NodePartitioning's spec
generation and the agent's applied status, and the node's ``GpusliceReady`` condition.  This
command reads those (read-only: nodes, pods, NodePartitionings; with a DRA node, also
ResourceClaims; with pod names, also their Events) and says, per waiting pod, what it waits for:

* ``queued``: gated, no slice reserved yet; ``ahead`` counts the waiting pods asking for the
  same slices that the partitioner serves before it (priority, then age; among the pods
  listed: with ``--namespace``, that namespace's; rejected pods not counted);
* ``rejected``: the partitioner never plans it and tells why in its ``Unplaceable`` Event: its
  request cannot be read as a slice request (``PodInfo.request_error``: not a whole count, a
  slice plus ``nvidia.com/gpu``, ...), or no eligible GPU node could ever take what it asks
  for (:func:`partitioner.rejection.reject_reason` on its eligible nodes, as the controller
  calls it: a name no node advertises, a profile its nodes' model lacks, no node of the right
  mode -- naming an opted-in node it would fit that is left out for its labels --, several MPS
  slices).  The detail is the Event's text, ``cannot place: <reason>`` with the fix;
* ``planned``: a slice is planned for it on a node, which is applying the plan (or has, and its
  kubelet does not list the slice yet), with the apply deadline;
* ``released``: its gate is gone and its affinity names the node that holds its slice; it waits
  for kube-scheduler (the bind deadline says when gpuslice checks why not);
* ``held``: gated by other controllers too (e.g. Kueue's admission gate): gpuslice plans it
  once only its own gate is left, and it counts in no ``ahead``;
* ``draining``: GPUs are being emptied for it;
* ``ungated``: it asks for a slice but carries no gpuslice gate (created while the webhook was
  down, or opted out): kube-scheduler places it, or it waits for a plan;
* ``unprepared`` (DRA mode): bound, but its node's agent reports that the prepare of one of its
  ResourceClaims fails (``status.prepareFailures``; the node's ``unprepared`` column counts
  them), so it cannot start until a retry succeeds;

plus the node's problem when its ``GpusliceReady`` condition is False (``AgentSilent``, ...).
Per node it also shows the slices its agent reports ``free`` (neither used nor unhealthy, less
those kept for released pods or promised as they exist) and,
with ``-o wide``, those ``withheld`` from every pod though no pod uses them (``unhealthy``, or
``foreign``: used by processes no pod holds them for).
Pods are listed highest priority first, then oldest, as the partitioner serves them.  With pod
names (``NAME`` in ``--namespace``, or ``NAMESPACE/NAME``) only those are shown, each with the
Events about it that the API server still holds.

Output: ``-o table`` (default: nodes, then pods), ``wide`` (more columns), ``json``, ``yaml``.
Exit codes: 0 done, 1 an API call failed (the message names the object), 2 bad input (a pod
name that is malformed or not found).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

from gpuslice.cli import BadInput
from gpuslice.options import add_catalog_argument
from gpuslice.output import Column, add_output_argument, emit, render_table

if TYPE_CHECKING:
    from contract.nodepartitioning import NodePartitioningStatus
    from partitioner.index import ClusterIndex, PodInfo
    from planner.catalog import Catalog

HELP = "where every pod waiting for a slice stands, and every gpuslice node (read-only)"
NODE_CONDITION = "GpusliceReady"
"""The partitioner's node condition (partitioner.actions.NODE_CONDITION)."""

NODE_COLUMNS = (
    Column("node", "node"),
    Column("mode", "mode"),
    Column("ready", "ready"),
    Column("reason", "reason"),
    Column("plan", "plan"),
    Column("applied", "applied"),
    Column("planned", "planned", align="right"),
    Column("released", "released", align="right"),
    Column("free", "free"),
    Column("withheld", "withheld", wide=True),
    Column("cooldown", "cooldown", wide=True),
    Column("unprepared", "unprepared", wide=True, align="right"),
    Column("message", "message", wide=True),
)
POD_COLUMNS = (
    Column("pod", "pod"),
    Column("priority", "priority", wide=True, align="right"),
    Column("waiting", lambda r: _age(r["waiting_s"]), align="right"),
    Column("request", "request"),
    Column("state", "state"),
    Column("node", "node"),
    Column("ahead", "ahead", align="right"),
    Column("detail", "detail"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pods", nargs="*", metavar="POD", help="only these pods: NAME (in --namespace) or NS/NAME"
    )
    parser.add_argument(
        "-n", "--namespace", help="only this namespace (default for NAME: 'default')"
    )
    add_output_argument(parser, what="the nodes and the waiting pods")
    add_catalog_argument(
        parser, env="the chart's catalog.files, for nodes of models the built-in catalog lacks"
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    parser.add_argument("--context", help="kubeconfig context")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def _in(seconds: float) -> str:
    """A deadline relative to now: ``in 2m`` or ``2m ago``."""
    return f"in {_age(seconds)}" if seconds >= 0 else f"{_age(-seconds)} ago"


def _units(slices: Mapping[str, int]) -> str:
    return ", ".join(
        f"{r.removeprefix('nvidia.com/')} x{k}" if k != 1 else r.removeprefix("nvidia.com/")
        for r, k in sorted(slices.items())
    )


def _slice_name(resource: str) -> str:
    """The name :func:`_slices` counts a device of ``resource`` under."""
    from planner.snapshot import mps_gb_of

    gb = mps_gb_of(resource)
    if gb is not None:
        return f"mps {gb}gb"
    return resource.removeprefix("nvidia.com/mig-")


def _slices(
    status: NodePartitioningStatus | None, reserved: Counter[str] | None = None
) -> dict[str, str]:
    """What the agent reports of a node's slices: ``free`` (neither used nor unhealthy, less
    those ``reserved`` for pods -- released, or promised a slice that exists: what a new pod
    can be promised now), ``withheld`` (not used by a pod yet kept from every pod:
    ``unhealthy`` -- an XID, a GPU NVML cannot read -- or ``foreign``, used by processes no pod
    holds it for), each as ``profile xN``; ``-`` for none."""
    free: Counter[str] = Counter()
    withheld: Counter[str] = Counter()
    for g in status.gpus if status is not None else ():
        for m in g.mig:
            if m.mps:  # a hybrid host: its slices are the devices
                rows = [(f"mps {s.memoryMiB // 1024}gb", s.used, s.unhealthy) for s in m.mps]
                sick = g.unhealthy or m.unhealthy
                for name, used, bad in rows:
                    if not used:
                        (withheld if sick or bad else free)[name] += 1
                continue
            if m.foreign:
                withheld[f"{m.profile} (foreign)"] += 1
            elif not m.used:
                if g.unhealthy or m.unhealthy:
                    withheld[f"{m.profile} (unhealthy)"] += 1
                else:
                    free[m.profile] += 1
        for sl in g.mps:
            if not sl.used:
                name = f"mps {sl.memoryMiB // 1024}gb"
                (withheld if g.unhealthy or sl.unhealthy else free)[name] += 1
    free.subtract(reserved or Counter())
    return {"free": _counts(+free), "withheld": _counts(withheld)}


def _counts(counts: Counter[str]) -> str:
    return ", ".join(f"{k} x{n}" if n != 1 else k for k, n in sorted(counts.items())) or "-"


def _dra(nodes: Iterable[Mapping[str, Any]]) -> bool:
    """Some node runs the DRA agent (``gpuslice.io/partitioning=dra``): claims are read."""
    from partitioner.snapshot import DRA_VALUE, GPUSLICE_LABEL

    return any(
        ((n.get("metadata") or {}).get("labels") or {}).get(GPUSLICE_LABEL) == DRA_VALUE
        for n in nodes
    )


def _condition(node: Mapping[str, Any]) -> Mapping[str, Any]:
    for c in (node.get("status") or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == NODE_CONDITION:
            return c
    return {}


def status_document(
    nodes: Iterable[dict[str, Any]],
    pods: Iterable[dict[str, Any]],
    partitionings: Iterable[dict[str, Any]],
    now: float,
    only: Sequence[str] = (),
    catalog: Catalog | None = None,
    claims: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The command's document from the API objects (pure: ``now`` is epoch seconds).

    ``only``: pod keys (``namespace/name``) to show; empty: every waiting slice pod.
    ``catalog``: the GPU models (default: the built-in catalog).  ``claims``: the
    ResourceClaims (DRA mode: what a claim pod asks for, and which claim a prepare failure
    is of)."""
    from partitioner.claims import failed_claims
    from partitioner.decide import is_busy, missing_claims
    from partitioner.index import ClusterIndex
    from partitioner.reservations import State
    from partitioner.snapshot import cooldown_of, pod_key
    from planner.catalog import default_catalog

    nodes, partitionings, pods = list(nodes), list(partitionings), list(pods)
    index = ClusterIndex.from_objects(
        catalog or default_catalog(), nodes, pods, partitionings, claims
    )
    raw_nodes = {str((n.get("metadata") or {}).get("name")): n for n in nodes}
    problems: dict[str, str] = {}
    node_rows = []
    holds: dict[str, dict[str, int]] = {}
    reserved: dict[str, Counter[str]] = {}
    for pod in index.pods.values():
        r = pod.reservation
        if r is not None and pod.waiting:
            count = holds.setdefault(r.node, {"planned": 0, "released": 0})
            key = "released" if r.state is State.RELEASED else "planned"
            count[key] += 1
            if r.state is State.RELEASED or (r.state is State.PLANNED and not r.plan):
                # its slice exists and is kept for it: no other pod can be promised it
                for resource, k in r.units().items():
                    reserved.setdefault(r.node, Counter())[_slice_name(resource)] += k
    for name, info in sorted(index.nodes.items()):
        if info.reading is None:  # not opted in
            continue
        cond = _condition(raw_nodes.get(name) or {})
        if cond.get("status") == "False":
            problems[name] = f"{cond.get('reason') or 'NotReady'}: {cond.get('message') or ''}"
        np_info = index.partitionings.get(name)
        np = np_info.np if np_info is not None else None
        recorded = cooldown_of(np) if np is not None else None
        cooldown = None
        if recorded is not None and recorded[0] > now:
            # the controller leaves it out of new promises until then (its Waiting Event)
            cooldown = f"{recorded[1] or 'cooling down'}, ends {_in(recorded[0] - now)}"
            problems.setdefault(name, f"cooling down after {recorded[1] or 'a broken promise'}")
        generation = np.metadata.generation if np is not None else None
        observed = np.status.observedGeneration if np is not None and np.status else None
        gpu = info.gpu
        node_rows.append(
            {
                "node": name,
                "mode": gpu.mode.value if gpu is not None else "-",
                "ready": cond.get("status"),
                "reason": cond.get("reason"),
                "message": cond.get("message"),
                "plan": (np.spec.planId or None) if np is not None else None,
                "generation": generation,
                "observed_generation": observed,
                "applied": np.applied if np is not None else False,
                **holds.get(name, {"planned": 0, "released": 0}),
                "unprepared": len(np.status.prepareFailures) if np and np.status else 0,
                "cooldown": cooldown,
                **_slices(np.status if np is not None else None, reserved.get(name)),
            }
        )
    waiting = [index.pods[k] for k in index.waiting_by_age()]
    rejection = _Rejection(index)
    seen_by_request: dict[tuple[tuple[str, int], ...], int] = {}
    pod_rows = []
    gpu_nodes = index.gpu_nodes()
    busy = {n for n, info in index.partitionings.items() if info.np is None or is_busy(info.np)}
    for pod in waiting:
        shape = tuple(sorted(pod.slices.items()))
        r = pod.reservation
        ahead = None
        rejected = rejection.reason(pod)
        held = rejected is None and r is None and pod.gated and bool(pod.other_gates)
        left_out = ""
        if rejected is None and r is None and pod.gated and not held:
            left_out = _left_out(index.eligible(pod, gpu_nodes), problems, busy)
        if rejected is None and r is None and pod.gated and not held and not left_out:
            ahead = seen_by_request.get(shape, 0)
            seen_by_request[shape] = ahead + 1
        if only and pod.key not in only:
            continue
        node, detail = (r.node if r is not None else None), ""
        if rejected is not None:
            state, node = "rejected", None
            detail = f"cannot place: {rejected}"
        elif held:
            state = "held"
            detail = (
                "waiting for other scheduling gates to be removed ("
                + ", ".join(sorted(pod.other_gates))
                + "): gpuslice plans it once only its own gate is left"
            )
        elif left_out:
            state = "waiting"
            detail = (
                f"every node it may use is left out of plans now: {left_out}; it is planned "
                f"once one of them can be"
            )
        elif r is None:
            state = "queued" if pod.gated else "ungated"
            detail = (
                "gated; no slice reserved yet: it waits for a plan or for a slice to free"
                if pod.gated
                else "no gpuslice gate (created while the webhook was down, or opted out): "
                "kube-scheduler places it"
                + (", and has found no node" if pod.unschedulable else "")
            )
        elif r.state is State.PLANNED:
            state = "planned"
            np = index.partitioning(r.node)
            applied = np is not None and np.applied
            where = "applied it; the kubelet must list the slice" if applied else "applying it"
            detail = f"plan {r.plan or '-'}: node {where} (deadline {_in(r.deadline - now)})"
        elif r.state is State.RELEASED and (
            stranded := _stranded(index, pod, r.node, r.deadline, now, gpu_nodes)
        ):
            state = "stranded"
            detail = (
                f"released to node {r.node}, but {stranded}: its node affinity is pinned there "
                f"and cannot be widened; delete the pod so its controller recreates it (gated and "
                f"planned afresh; gpuslice evicts it after recreateStrandedSeconds if a "
                f"controller owns it)"
            )
        elif r.state is State.RELEASED:
            state = "released"
            detail = f"waiting for kube-scheduler (bind deadline {_in(r.deadline - now)})"
        else:
            state = r.state.value
            detail = "GPUs are being emptied for it"
        if node is not None and node in problems:
            detail += f"; node {node} {problems[node]}"
        request = _units(pod.slices) or pod.request_error or "-"
        pod_rows.append(_pod_row(pod, state, node, detail, now, ahead=ahead, request=request))
    for key in sorted(index.unclaimed):  # gated, naming a claim gpuslice does not know
        pod = index.pods[key]
        if only and key not in only:
            continue
        detail = (
            f"cannot be planned yet: {missing_claims(pod.obj, index.claims)}; gpuslice gives it "
            f"back to kube-scheduler after a batch window"
        )
        pod_rows.append(_pod_row(pod, "waiting for claims", None, detail, now))
    for name, np_info in sorted(index.partitionings.items()):  # bound, cannot start
        failed = failed_claims(
            np_info.np.status.prepareFailures if np_info.np and np_info.np.status else (),
            index.claims,
        )
        for pod in index.bound_pods(name) if failed else ():
            hit = [failed[c] for c in pod.claims if c in failed]
            if not hit or pod.phase != "Pending" or (only and pod.key not in only):
                continue
            detail = (
                f"bound; its agent has failed to prepare ResourceClaim {hit[0].claim} since "
                f"{hit[0].since or '-'}: {hit[0].message} (the kubelet retries; gpuslice evicts "
                "it after recreateStrandedSeconds if a controller owns it)"
            )
            pod_rows.append(_pod_row(pod, "unprepared", name, detail, now))
    for key in only:  # named pods that do not wait: say what they are
        if any(row["pod"] == key for row in pod_rows):
            continue
        named = index.pods.get(key)
        if named is None:  # unbound and asking for no slice: the index keeps no such pod
            raw = next((p for p in pods if pod_key(p) == key), None)
            if raw is not None:
                pod_rows.append(
                    {"pod": key, "priority": (raw.get("spec") or {}).get("priority") or 0,
                     "waiting_s": None, "request": "-", "state": "not waiting", "node": None,
                     "ahead": None, "detail": "asks for no gpuslice slice"}
                )  # fmt: skip
            continue
        state, detail = (
            ("finished", f"phase {named.phase}")
            if named.finished
            else ("bound", "running or starting there")
            if named.node
            else ("not waiting", "asks for no gpuslice slice")
            if not named.slices
            else ("deleting", "being deleted")
        )
        pod_rows.append(_pod_row(named, state, named.node or None, detail, None))
    return {"nodes": node_rows, "pods": pod_rows}


def _stranded(
    index: Any, pod: Any, node: str, deadline: float, now: float, gpu_nodes: Mapping[str, Any]
) -> str:
    """Why a released, unbound pod cannot bind on the node it is pinned to, as the controller
    reports it ``Stranded``; ``""`` if it still may."""
    if node not in gpu_nodes:
        return f"node {node} is gone or no longer a gpuslice node"
    if node not in index.eligible(pod, gpu_nodes):
        return f"node {node} no longer accepts it (cordoned, tainted or relabelled)"
    if pod.unschedulable and now >= deadline:
        return "kube-scheduler found it unschedulable there past its bind deadline"
    return ""


def _left_out(eligible: Iterable[str], problems: Mapping[str, str], busy: Set[str]) -> str:
    """``n1 (ApplyStuck), n2 (applying a previous plan)`` when every node of ``eligible`` is
    left out of plans (a node problem, or a spec not applied yet), as the controller's
    ``Waiting`` Event says; ``""`` when one may be planned (or none is eligible)."""
    from partitioner.decide import left_out_words

    names = sorted(eligible)
    if not names or any(n not in problems and n not in busy for n in names):
        return ""
    return left_out_words(
        names,
        lambda n: problems[n].split(":", 1)[0] if n in problems else "applying a previous plan",
    )


class _Rejection:
    """Why the partitioner never plans a waiting pod, as its ``Unplaceable`` Event says, or
    ``None`` (the module docstring's ``rejected``).  The controller rejects a pod whose
    request cannot be read whatever else holds it (a DaemonSet's and a nominated pod aside:
    kube-scheduler places those), and judges the others it would plan (gated
    by gpuslice alone, with no reservation or a drain's; or ungated and unschedulable, with no
    reservation) with :func:`partitioner.rejection.reject_reason` on their eligible nodes."""

    def __init__(self, index: ClusterIndex) -> None:
        from partitioner.snapshot import NodeProblem

        self.index = index
        self.gpu_nodes = index.gpu_nodes()
        self.problems = [
            (info.obj, info.reading)
            for _, info in sorted(index.nodes.items())
            if isinstance(info.reading, NodeProblem)
        ]
        self.opted_in = [info.obj for _, info in sorted(index.nodes.items()) if info.reading]
        self.paused = [
            (n, i.obj, i.gpu.mode, i.gpu.model, i.gpu.dra)
            for n, i in self.gpu_nodes.items()
            if i.gpu is not None
        ]
        self._memo: dict[tuple[frozenset[str], tuple[tuple[str, int], ...]], str | None] = {}

    def reason(self, pod: PodInfo) -> str | None:
        from partitioner.rejection import reject_reason
        from partitioner.reservations import State
        from partitioner.snapshot import no_eligible_notes

        if pod.daemonset or pod.nominated:  # the controller leaves these to kube-scheduler
            return None
        if pod.request_error:
            return pod.request_error
        r = pod.reservation
        planned_by_gpuslice = (
            pod.gated and not pod.other_gates and (r is None or r.state is State.DRAINING)
        ) or (not pod.gated and r is None and pod.unschedulable)
        if not planned_by_gpuslice or not pod.slices:
            return None
        eligible = self.index.eligible(pod, self.gpu_nodes)
        key = (eligible, tuple(sorted(pod.slices.items())))
        if key not in self._memo:
            gpus = [
                (g.mode, g.model)
                for n in sorted(eligible)
                if (g := self.gpu_nodes[n].gpu) is not None
            ]
            self._memo[key] = reject_reason(pod.slices, gpus)
        reason = self._memo[key]
        if reason is not None and reason.startswith("no eligible node"):
            reason += no_eligible_notes(
                pod.obj, pod.slices, pod.dra, self.problems, self.opted_in, self.paused
            )
        return reason


def _pod_row(
    pod: PodInfo,
    state: str,
    node: str | None,
    detail: str,
    now: float | None,
    *,
    ahead: int | None = None,
    request: str | None = None,
) -> dict[str, Any]:
    """One row of the pod table; ``now`` ``None``: its wait is not told (a pod that does not
    wait); ``request``: default its slices (``-`` for none)."""
    waited = None if now is None or pod.created is None else round(now - pod.created, 1)
    return {
        "pod": pod.key,
        "priority": pod.priority,
        "waiting_s": waited,
        "request": request or _units(pod.slices) or "-",
        "state": state,
        "node": node,
        "ahead": ahead,
        "detail": detail,
    }


def _text(doc: Mapping[str, Any], wide: bool, width: int | None) -> str:
    parts = []
    if not doc.get("only"):
        parts.append(render_table(NODE_COLUMNS, doc["nodes"], wide=wide, width=width))
    if doc["pods"]:
        parts.append(render_table(POD_COLUMNS, doc["pods"], wide=wide, width=width))
    else:
        parts.append("no pod waits for a slice")
    for key, events in (doc.get("events") or {}).items():
        lines = [f"Events of {key} (the API server keeps them about an hour):"]
        lines += [
            f"  {e['time'] or '-'}  {e['type']}  {e['reason']}: {e['message']}" for e in events
        ] or ["  (none left)"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def run(args: argparse.Namespace) -> int:
    from gpuslice.cluster_client import ApiFailure, Cluster
    from gpuslice.commands.plan import _load_catalog
    from gpuslice.options import pod_refs

    wanted = pod_refs(args.pods, args.namespace)
    catalog = _load_catalog(args.catalog)
    cluster = Cluster(args.kubeconfig, args.context)
    try:
        nodes = cluster.nodes()
        partitionings = cluster.partitioning_objects()
        pods = list(cluster.pods(args.namespace))
        claims = cluster.claims(args.namespace) if _dra(nodes) else []
        keys = {
            f"{(p.get('metadata') or {}).get('namespace')}/{p['metadata']['name']}" for p in pods
        }
        only = [f"{ns}/{name}" for ns, name in wanted]
        missing = [k for k in only if k not in keys]
        if missing:
            raise BadInput(f"no such pod: {', '.join(missing)} (check the name and --namespace)")
        doc = status_document(nodes, pods, partitionings, time.time(), only, catalog, claims)
        if only:
            doc["only"] = only
            doc["events"] = {
                key: [
                    {
                        "time": e.get("lastTimestamp") or e.get("eventTime"),
                        "type": e.get("type"),
                        "reason": e.get("reason"),
                        "message": e.get("message"),
                    }
                    for e in cluster.events(ns, "Pod", name)
                ]
                for key, (ns, name) in zip(only, wanted, strict=True)
            }
    except ApiFailure as e:
        print(f"gpuslice status: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.close()
    emit(doc, args.output, lambda wide, width: _text(doc, wide, width))
    return 0
