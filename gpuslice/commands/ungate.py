"""``gpuslice ungate``: release pods from gpuslice's scheduling gate, to the ordinary path.

A pod gated by gpuslice (``gpuslice.io/slice``) waits until the partitioner releases it.  When
the partitioner is down for good, or gpuslice is uninstalled (the chart's pre-delete hook runs
``gpuslice ungate --all --remove-webhook <configuration>``), nothing else would: this command
removes the gate from every gated pod (``--all``, cluster-wide or in ``--namespace``) or from
the named ones, and clears the reservation annotation in the same JSON merge patch.  Other
controllers' gates stay.  kube-scheduler then places the pods like any other (onto any free
matching slice).

Each patch carries the resourceVersion the pod was read at; a 409 (the pod changed, e.g. the
partitioner released it meanwhile) re-reads the pod and tries again while it is still gated.
A 404 on the patch or the re-read (the pod was deleted since it was listed or read) means
nothing of it is left gated: it is reported as gone and is no failure (a named pod missing
from the start is one: the name may be wrong).
``--remove-webhook NAME`` first deletes that MutatingWebhookConfiguration, so no pod created
after the command started is gated (used on uninstall, before the partitioner is gone).

``--all --cleanup`` (uninstall) also looks at the pods gpuslice already *released* that are
not bound yet (no ``spec.nodeName``, not being deleted, the reservation annotation still on
them): their required
node affinity was narrowed to the node their slice waited on (``state: released``), and
Kubernetes lets a pod's affinity change only while it is gated, so it can never widen again.
Once gpuslice is gone nothing offers that slice any more (``--cleanup`` deletes the node's
NodePartitioning; no partitioner evicts a stranded pod), so such a pod would stay Pending for
good.  One a controller owns (an ownerReference with ``controller: true``) is evicted
(``policy/v1`` Eviction, preconditions uid and resourceVersion; the API server evicts a Pending
pod without consulting its PodDisruptionBudget) so that its controller creates it again: on
uninstall the webhook is deleted and the partitioner stopped before, so the new pod is not gated
and takes the ordinary path.  A pod nothing owns cannot be created again by anyone but its
author: its reservation annotation is cleared and a warning names it and says what to do
(delete it and create it again).  Any other such pod (annotation left by an earlier state,
affinity not narrowed) only gets its annotation cleared.

Uninstall (the chart's pre-delete hook) also passes:

* ``--stop-partitioner NAMESPACE/DEPLOYMENT``: scale the partitioner to 0 replicas and wait (at
  most ``--wait-seconds``) until its pods have ended, before anything else is removed -- a
  running partitioner would gate, label and re-create what this command takes away;
  ``--delete-lease NAMESPACE/NAME`` then deletes its leader-election Lease (it would outlive
  the release: the partitioner creates it at run time), and ``--delete-secret NAMESPACE/NAME``
  the webhook's self-managed certificate Secret (owned by the webhook configuration, so the
  garbage collector deletes it too, but a replica that starts while the configuration is gone
  creates one without an owner);
* ``--cleanup``: after releasing the pods, delete every NodePartitioning (each agent, finding
  none, drains its node: it advertises only what pods hold, stops idle MPS daemons and puts
  their GPUs back in compute mode DEFAULT), then remove the ``GpusliceReady`` condition and the
  ``gpuslice.io/managed`` label from every node that has them.  Pods that still use MPS slices
  are listed with a warning: their daemons run in the agent pods, which Helm deletes next.

Order: webhook, partitioner, Lease, Secret, pods (gated ones, then released ones not bound),
NodePartitionings, nodes.  Every step runs even if an earlier one failed (each failure is
printed and makes the exit code 1).

Connection: ``--kubeconfig``/``--context`` (or ``$KUBECONFIG``), else the in-cluster service
account.  Exit codes: 0 done (or nothing to do), 1 an API call failed (each failure names the
object), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from gpuslice.cli import BadInput
from gpuslice.cluster_client import ApiFailure, Cluster
from gpuslice.options import pod_refs

HELP = "release pods from gpuslice's scheduling gate (uninstall, partitioner down for good)"
_ATTEMPTS = 5
NODE_CONDITION = "GpusliceReady"
"""The partitioner's node condition (partitioner.actions.NODE_CONDITION)."""
MANAGED_LABEL = "gpuslice.io/managed"
"""The partitioner's node label (partitioner.optout.MANAGED_LABEL)."""
_sleep: Callable[[float], None] = time.sleep
_clock: Callable[[], float] = time.monotonic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pods",
        nargs="*",
        metavar="POD",
        help="pods to release: NAME (in --namespace) or NAMESPACE/NAME",
    )
    parser.add_argument("--all", action="store_true", help="every gated pod")
    parser.add_argument(
        "-n", "--namespace", help="only this namespace (default for NAME: 'default')"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be released, change nothing"
    )
    parser.add_argument(
        "--remove-webhook",
        metavar="CONFIGURATION",
        help="first delete this MutatingWebhookConfiguration (uninstall)",
    )
    parser.add_argument(
        "--stop-partitioner",
        metavar="NAMESPACE/DEPLOYMENT",
        help="first scale the partitioner Deployment to 0 and wait for its pods to end (uninstall)",
    )
    parser.add_argument(
        "--delete-lease",
        metavar="NAMESPACE/NAME",
        help="after the partitioner stopped, delete its leader-election Lease (uninstall)",
    )
    parser.add_argument(
        "--delete-secret",
        metavar="NAMESPACE/NAME",
        help="after the partitioner stopped, delete the webhook's certificate Secret (uninstall)",
    )
    parser.add_argument(
        "--wait-seconds",
        type=float,
        default=120.0,
        help="longest wait for the partitioner's pods to end (default %(default)s)",
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help=f"also delete every NodePartitioning and remove the {NODE_CONDITION} condition "
        f"and the {MANAGED_LABEL} label from every node (uninstall; with --all)",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    parser.add_argument("--context", help="kubeconfig context")


def _namespaced(flag: str, ref: str | None, what: str) -> tuple[str, str] | None:
    if ref is None:
        return None
    ns, sep, name = ref.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise BadInput(f"{flag} {ref!r}: expected NAMESPACE/{what}")
    return ns, name


def _deployment(args: argparse.Namespace) -> tuple[str, str] | None:
    if not 0 < args.wait_seconds <= 3600:
        raise BadInput(f"--wait-seconds {args.wait_seconds:g}: expected 0 < seconds <= 3600")
    return _namespaced("--stop-partitioner", args.stop_partitioner, "DEPLOYMENT")


def _targets(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.cleanup and not args.all:
        raise BadInput("--cleanup removes gpuslice from the whole cluster: give it with --all")
    if args.all and args.pods:
        raise BadInput("give either --all or pod names, not both")
    if not args.all and not args.pods:
        raise BadInput("name the pods to release, or give --all (every gated pod)")
    return pod_refs(args.pods, args.namespace)


def release_body(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that removes gpuslice's gate and its reservation annotation, or
    ``None`` when the pod is not gated by gpuslice."""
    from partitioner.gating import ungate_patch
    from partitioner.reservations import RESERVATION_ANNOTATION

    body = ungate_patch(pod)
    if body is None:
        return None
    body["metadata"]["annotations"] = {RESERVATION_ANNOTATION: None}
    return body


Outcome = Literal["released", "not gated", "gone"]


def _release(pods: Cluster, pod: dict[str, Any], dry_run: bool) -> Outcome:
    """Release one pod: ``released`` (or would be), ``not gated`` when it turned out not to be
    gated (any more), ``gone`` when it was deleted meanwhile (404 on the patch or on the re-read
    after a 409: nothing of it is left gated)."""
    meta = pod.get("metadata") or {}
    ns, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    for _ in range(_ATTEMPTS):
        body = release_body(pod)
        if body is None:
            return "not gated"
        if dry_run:
            return "released"
        try:
            pods.patch(ns, name, body)
            return "released"
        except ApiFailure as e:
            if e.status == 404:
                return "gone"
            if e.status != 409:
                raise
        try:
            pod = pods.get(ns, name)
        except ApiFailure as e:
            if e.status == 404:
                return "gone"
            raise
    raise ApiFailure(f"pod {ns}/{name}", 409, f"kept changing ({_ATTEMPTS} tries)")


def _print_error(e: ApiFailure | str) -> None:
    print(f"gpuslice ungate: error: {e}", file=sys.stderr)


def _remove_webhook(cluster: Cluster, name: str, dry_run: bool) -> int:
    """Delete the webhook configuration; the number of failures."""
    if dry_run:
        print(f"would delete MutatingWebhookConfiguration {name}")
        return 0
    try:
        gone = cluster.delete_webhook(name)
    except ApiFailure as e:  # still release what is gated: exit 1 at the end
        _print_error(e)
        return 1
    print(f"MutatingWebhookConfiguration {name} {'deleted' if gone else 'already absent'}")
    return 0


def _matches(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    have = (pod.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _stop_partitioner(
    cluster: Cluster, where: tuple[str, str], wait_s: float, dry_run: bool
) -> int:
    """Scale the partitioner to 0 and wait until its pods have ended; the number of failures."""
    ns, name = where
    if dry_run:
        print(f"would scale Deployment {ns}/{name} to 0 replicas")
        return 0
    try:
        deployment = cluster.deployment(ns, name)
    except ApiFailure as e:
        if e.status == 404:
            print(f"Deployment {ns}/{name} already absent")
            return 0
        _print_error(e)
        return 1
    labels = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    try:
        cluster.scale_to_zero(ns, name)
        deadline = _clock() + wait_s
        while selector:
            left = [
                p["metadata"]["name"] for p in cluster.pods(ns, selector) if _matches(p, labels)
            ]
            if not left:
                break
            if _clock() >= deadline:
                _print_error(
                    f"Deployment {ns}/{name}: pod(s) {', '.join(sorted(left))} still running "
                    f"after {wait_s:g} s; what follows may be undone by them"
                )
                return 1
            _sleep(1.0)
    except ApiFailure as e:
        _print_error(e)
        return 1
    print(f"Deployment {ns}/{name} scaled to 0: no partitioner pod runs")
    return 0


def _delete_lease(cluster: Cluster, where: tuple[str, str], dry_run: bool) -> int:
    ns, name = where
    if dry_run:
        print(f"would delete Lease {ns}/{name}")
        return 0
    try:
        gone = cluster.delete_lease(ns, name)
    except ApiFailure as e:
        _print_error(e)
        return 1
    print(f"Lease {ns}/{name} {'deleted' if gone else 'already absent'}")
    return 0


def _delete_secret(cluster: Cluster, where: tuple[str, str], dry_run: bool) -> int:
    ns, name = where
    if dry_run:
        print(f"would delete Secret {ns}/{name}")
        return 0
    try:
        # Cluster has no call of its own for this: its generic delete (404 -> False).
        gone = cluster._delete(
            f"Secret {ns}/{name}", cluster.core.delete_namespaced_secret, name, ns
        )
    except ApiFailure as e:
        _print_error(e)
        return 1
    print(f"Secret {ns}/{name} {'deleted' if gone else 'already absent'}")
    return 0


def reserved_unbound(pod: Mapping[str, Any]) -> bool:
    """``pod`` carries gpuslice's reservation annotation but not its gate, is not bound, not
    being deleted and has not ended: released by gpuslice (or reserved, then ungated by someone
    else) and still waiting for kube-scheduler."""
    from partitioner.gating import has_gate
    from partitioner.reservations import RESERVATION_ANNOTATION

    meta = pod.get("metadata") or {}
    if has_gate(pod) or (pod.get("spec") or {}).get("nodeName") or meta.get("deletionTimestamp"):
        return False
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    return RESERVATION_ANNOTATION in (meta.get("annotations") or {})


def pinned_node(pod: Mapping[str, Any]) -> str | None:
    """The node gpuslice narrowed ``pod``'s required node affinity to when it released it (the
    reservation says ``state: released`` and the affinity holds ``metadata.name In [node]``);
    ``None`` for any other pod (a malformed annotation included)."""
    from partitioner.reservations import (
        RESERVATION_ANNOTATION,
        ReservationError,
        State,
        parse_reservation,
    )

    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(RESERVATION_ANNOTATION)
    if not isinstance(text, str):
        return None
    try:
        reservation = parse_reservation(text)
    except ReservationError:
        return None
    if reservation.state is not State.RELEASED:
        return None
    pin = {"key": "metadata.name", "operator": "In", "values": [reservation.node]}
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms") or ():
        if isinstance(term, Mapping) and pin in (term.get("matchFields") or ()):
            return reservation.node
    return None


def controller_of(pod: Mapping[str, Any]) -> str | None:
    """``"<kind> <name>"`` of the controller that owns ``pod`` (the ownerReference with
    ``controller: true``: it creates the pod again once it is deleted); ``None`` if none."""
    for o in (pod.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(o, Mapping) and o.get("controller") is True:
            return f"{o.get('kind') or ''} {o.get('name') or ''}".strip()
    return None


def _evict(cluster: Cluster, pod: Mapping[str, Any]) -> None:
    """POST the pod's ``policy/v1`` Eviction, preconditions uid and resourceVersion as read."""
    meta = pod.get("metadata") or {}
    ns, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    preconditions = {k: meta[k] for k in ("uid", "resourceVersion") if meta.get(k)}
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": ns},
        "deleteOptions": {"preconditions": preconditions},
    }
    # Cluster has no call of its own for this: its generic call (errors as ApiFailure).
    cluster._call(f"pod {ns}/{name}", cluster.core.create_namespaced_pod_eviction, name, ns, body)


def _settle(cluster: Cluster, pod: dict[str, Any], dry_run: bool) -> None:
    """One released pod not bound yet (module docstring): evicted when gpuslice pinned it and a
    controller owns it, else its reservation annotation cleared, with a warning when it is
    pinned.  Prints what was (or would be) done; :class:`ApiFailure` when a call failed.  A 409
    re-reads the pod (one bound or changed meanwhile is left alone); a 404 means it is gone."""
    from partitioner.reservations import RESERVATION_ANNOTATION

    meta = pod.get("metadata") or {}
    ns, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    for _ in range(_ATTEMPTS):
        if not reserved_unbound(pod):
            print(f"{ns}/{name} was bound or changed meanwhile: nothing to do")
            return
        node = pinned_node(pod)
        owner = controller_of(pod) if node else None
        try:
            if node and owner:
                if not dry_run:
                    _evict(cluster, pod)
                print(
                    f"{'would evict' if dry_run else 'evicted'} {ns}/{name}: released to node "
                    f"{node} but not bound, its node affinity pinned there for good; its "
                    f"controller ({owner}) creates it again, ungated"
                )
                return
            if not dry_run:
                version = (pod.get("metadata") or {}).get("resourceVersion")
                cluster.patch(
                    ns,
                    name,
                    {
                        "metadata": {
                            "resourceVersion": version,
                            "annotations": {RESERVATION_ANNOTATION: None},
                        }
                    },
                )
            print(
                f"{'would clear' if dry_run else 'cleared'} the reservation of {ns}/{name} "
                "(not bound)"
            )
            if node:
                print(
                    f"warning: pod {ns}/{name} was released to node {node} but is not bound: "
                    f"its node affinity is pinned to {node} for good (Kubernetes changes it "
                    "only while a pod is gated) and nothing owns it to create it again; without "
                    f"gpuslice {node} may never offer its slice again, so it can stay Pending: "
                    f"delete it and create it again (kubectl delete pod -n {ns} {name})",
                    file=sys.stderr,
                )
            return
        except ApiFailure as e:
            if e.status == 404:
                print(f"{ns}/{name} is gone (deleted meanwhile): nothing to do")
                return
            if e.status != 409:
                raise
        try:
            pod = cluster.get(ns, name)
        except ApiFailure as e:
            if e.status == 404:
                print(f"{ns}/{name} is gone (deleted meanwhile): nothing to do")
                return
            raise
    raise ApiFailure(f"pod {ns}/{name}", 409, f"kept changing ({_ATTEMPTS} tries)")


def _settle_all(cluster: Cluster, pods: list[dict[str, Any]], dry_run: bool) -> int:
    """:func:`_settle` each released pod not bound yet; the number of failures."""
    failed = 0
    for pod in pods:
        try:
            _settle(cluster, pod, dry_run)
        except ApiFailure as e:
            _print_error(e)
            failed += 1
    return failed


def _release_pods(
    cluster: Cluster, args: argparse.Namespace, targets: list[tuple[str, str]]
) -> tuple[int, int, list[dict[str, Any]]] | None:
    """Release the gated (or named) pods: ``(released, failed, waiting)``, ``waiting`` being
    (with ``--all``) the released pods not bound yet (:func:`reserved_unbound`), listed in the
    same pass; or ``None`` if the pods could not be listed."""
    from partitioner.gating import has_gate

    verb = "would release" if args.dry_run else "released"
    found: list[dict[str, Any]] | None = None
    waiting: list[dict[str, Any]] = []
    if args.all:
        found = []
        try:
            for p in cluster.pods(args.namespace):
                if has_gate(p):
                    found.append(p)
                elif reserved_unbound(p):
                    waiting.append(p)
        except ApiFailure as e:
            _print_error(e)
            return None
    candidates: list[tuple[str, str, dict[str, Any] | None]] = (
        [(p["metadata"].get("namespace", ""), p["metadata"]["name"], p) for p in found]
        if found is not None
        else [(ns, name, None) for ns, name in targets]
    )
    released = failed = 0
    for ns, name, pod in candidates:
        try:
            outcome = _release(
                cluster, pod if pod is not None else cluster.get(ns, name), args.dry_run
            )
            if outcome == "released":
                print(f"{verb} {ns}/{name}")
                released += 1
            elif outcome == "gone":
                print(f"{ns}/{name} is gone (deleted meanwhile): nothing to do")
            else:
                print(f"{ns}/{name} is not gated by gpuslice: nothing to do")
        except ApiFailure as e:
            _print_error(e)
            failed += 1
    return released, failed, waiting


def mps_clients(pods: Iterator[dict[str, Any]]) -> list[str]:
    """``namespace/name`` of the running pods that hold an MPS slice (``nvidia.com/gpu-<N>gb``),
    in an app container or a sidecar (an init container with ``restartPolicy: Always``)."""
    from planner.snapshot import mps_gb_of

    out = []
    for pod in pods:
        spec = pod.get("spec") or {}
        if not spec.get("nodeName"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        sidecars = [
            c for c in spec.get("initContainers") or () if c.get("restartPolicy") == "Always"
        ]
        for c in [*(spec.get("containers") or ()), *sidecars]:
            res = c.get("resources") or {}
            names = {*(res.get("limits") or {}), *(res.get("requests") or {})}
            if any(mps_gb_of(str(r)) is not None for r in names):
                meta = pod.get("metadata") or {}
                out.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
                break
    return sorted(out)


def _without_condition(node: dict[str, Any]) -> dict[str, Any] | None:
    """The status merge patch that drops gpuslice's condition, guarded by the node's
    resourceVersion (the kubelet's conditions are kept as read); ``None`` if it has none."""
    conditions = (node.get("status") or {}).get("conditions") or []
    kept = [c for c in conditions if c.get("type") != NODE_CONDITION]
    if len(kept) == len(conditions):
        return None
    version = (node.get("metadata") or {}).get("resourceVersion")
    return {"metadata": {"resourceVersion": version}, "status": {"conditions": kept}}


def _clean_node(cluster: Cluster, node: dict[str, Any], dry_run: bool) -> list[str]:
    """Remove gpuslice's condition and label from one node; what was (or would be) done."""
    name = str((node.get("metadata") or {}).get("name", ""))
    done = []
    for _ in range(_ATTEMPTS):
        body = _without_condition(node)
        if body is None:
            break
        if dry_run:
            done.append(f"would remove condition {NODE_CONDITION} from node {name}")
            break
        try:
            cluster.patch_node(name, body, status=True)
            done.append(f"removed condition {NODE_CONDITION} from node {name}")
            break
        except ApiFailure as e:
            if e.status != 409:  # the kubelet updated the node meanwhile: read it again
                raise
        node = cluster.read_node(name)
    else:
        raise ApiFailure(f"node {name}", 409, f"kept changing ({_ATTEMPTS} tries)")
    labels = (node.get("metadata") or {}).get("labels") or {}
    if MANAGED_LABEL in labels:
        if dry_run:
            done.append(f"would remove label {MANAGED_LABEL} from node {name}")
        else:
            cluster.patch_node(name, {"metadata": {"labels": {MANAGED_LABEL: None}}})
            done.append(f"removed label {MANAGED_LABEL} from node {name}")
    return done


def _cleanup(cluster: Cluster, dry_run: bool) -> int:
    """Delete every NodePartitioning, then clean every node; the number of failures."""
    failed = 0
    try:
        users = mps_clients(cluster.pods(None))
    except ApiFailure as e:
        _print_error(e)
        users, failed = [], 1
    if users:
        print(
            f"warning: {len(users)} running pod(s) use MPS slices: {', '.join(users)}; their "
            "MPS daemons run in the gpuslice agent pods, which are deleted next, so their CUDA "
            "processes lose the MPS server (drain them first to avoid that)",
            file=sys.stderr,
        )
    try:
        names = cluster.partitionings()
    except ApiFailure as e:
        _print_error(e)
        names, failed = [], failed + 1
    for name in names:
        if dry_run:
            print(f"would delete NodePartitioning {name}")
            continue
        try:
            gone = cluster.delete_partitioning(name)
            print(f"NodePartitioning {name} {'deleted' if gone else 'already absent'}")
        except ApiFailure as e:
            _print_error(e)
            failed += 1
    try:
        nodes = cluster.nodes()
    except ApiFailure as e:
        _print_error(e)
        return failed + 1
    for node in nodes:
        try:
            for line in _clean_node(cluster, node, dry_run):
                print(line)
        except ApiFailure as e:
            _print_error(e)
            failed += 1
    return failed


def run(args: argparse.Namespace) -> int:
    targets = _targets(args)
    partitioner = _deployment(args)
    lease = _namespaced("--delete-lease", args.delete_lease, "NAME")
    secret = _namespaced("--delete-secret", args.delete_secret, "NAME")
    cluster = Cluster(args.kubeconfig, args.context)
    try:
        return _run(cluster, args, targets, partitioner, lease, secret)
    finally:
        cluster.close()


def _run(
    cluster: Cluster,
    args: argparse.Namespace,
    targets: list[tuple[str, str]],
    partitioner: tuple[str, str] | None,
    lease: tuple[str, str] | None,
    secret: tuple[str, str] | None = None,
) -> int:
    """Every step, in order (module docstring); the exit code."""
    verb = "would release" if args.dry_run else "released"
    failed = 0
    if args.remove_webhook:
        failed += _remove_webhook(cluster, args.remove_webhook, args.dry_run)
    if partitioner is not None:
        failed += _stop_partitioner(cluster, partitioner, args.wait_seconds, args.dry_run)
    if lease is not None:
        failed += _delete_lease(cluster, lease, args.dry_run)
    if secret is not None:
        failed += _delete_secret(cluster, secret, args.dry_run)
    outcome = _release_pods(cluster, args, targets)
    if outcome is None:
        failed += 1
        released = 0
    else:
        released, not_released, waiting = outcome
        failed += not_released
        print(f"{released} pod(s) {verb}" + (f", {not_released} failed" if not_released else ""))
        if args.cleanup:
            failed += _settle_all(cluster, waiting, args.dry_run)
        elif waiting:
            # gpuslice stays: their slices are still offered, and the partitioner strands
            # (and after recreateStrandedSeconds evicts) one that cannot bind
            names = ", ".join(
                f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in waiting
            )
            print(
                f"{len(waiting)} pod(s) released by gpuslice, not bound yet, left as they are "
                f"(their node still offers their slice; --cleanup evicts or clears them on "
                f"uninstall): {names}"
            )
    if args.cleanup:
        failed += _cleanup(cluster, args.dry_run)
    return 1 if failed else 0
