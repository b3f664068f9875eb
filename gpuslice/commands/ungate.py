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
``--remove-webhook NAME`` first deletes that MutatingWebhookConfiguration, so no pod created
after the command started is gated (used on uninstall, before the partitioner is gone).

Connection: ``--kubeconfig``/``--context`` (or ``$KUBECONFIG``), else the in-cluster service
account.  Exit codes: 0 done (or nothing to do), 1 an API call failed (each failure names the
object), 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpuslice.cli import BadInput

HELP = "release pods from gpuslice's scheduling gate (uninstall, partitioner down for good)"
MERGE_PATCH = "application/merge-patch+json"
_ATTEMPTS = 5
_PAGE = 500


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
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    parser.add_argument("--context", help="kubeconfig context")


@dataclass(frozen=True)
class ApiFailure(Exception):
    """An API call failed; ``what`` names the object."""

    what: str
    status: int
    detail: str

    def __str__(self) -> str:
        return (
            f"{self.what}: {self.status} {self.detail}"
            if self.status
            else f"{self.what}: {self.detail}"
        )


def _targets(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.all and args.pods:
        raise BadInput("give either --all or pod names, not both")
    if not args.all and not args.pods:
        raise BadInput("name the pods to release, or give --all (every gated pod)")
    out = []
    for ref in args.pods:
        ns, sep, name = ref.rpartition("/")
        if (sep and not ns) or not name or "/" in ns:
            raise BadInput(f"pod {ref!r}: expected NAME or NAMESPACE/NAME")
        if sep and args.namespace and ns != args.namespace:
            raise BadInput(f"pod {ref!r} is not in --namespace {args.namespace}")
        out.append((ns or args.namespace or "default", name))
    return out


class Cluster:
    """The few calls this command makes, as raw JSON (kubernetes client, no model objects)."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        from kubernetes import client, config

        try:
            if kubeconfig is None and context is None and "KUBERNETES_SERVICE_HOST" in os.environ:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                api_client = client.ApiClient(configuration)
            else:
                api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
        except (config.ConfigException, OSError, ValueError, TypeError) as e:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise BadInput(f"cannot connect: kubeconfig {where}: {e}") from None
        self.core = client.CoreV1Api(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)

    @staticmethod
    def _call(what: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            resp = fn(*args, _preload_content=False, **kwargs)
        except ApiException as e:
            detail = e.reason or ""
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(e.body or "{}").get("message") or detail
            raise ApiFailure(what, int(e.status or 0), str(detail)) from None
        except HTTPError as e:
            raise ApiFailure(what, 0, f"cannot reach the API server: {e}") from None
        result: dict[str, Any] = json.loads(resp.data or b"{}")
        return result

    def gated(self, namespace: str | None) -> Iterator[dict[str, Any]]:
        from partitioner.gating import has_gate

        token: str | None = None
        while True:
            page: dict[str, Any] = {"limit": _PAGE}
            if token:
                page["_continue"] = token
            if namespace:
                doc = self._call(
                    f"pods in {namespace}", self.core.list_namespaced_pod, namespace, **page
                )
            else:
                doc = self._call("pods", self.core.list_pod_for_all_namespaces, **page)
            yield from (p for p in doc.get("items") or () if has_gate(p))
            token = (doc.get("metadata") or {}).get("continue")
            if not token:
                return

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call(f"pod {namespace}/{name}", self.core.read_namespaced_pod, name, namespace)

    def patch(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self._call(
            f"pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            body,
            _content_type=MERGE_PATCH,
        )

    def delete_webhook(self, name: str) -> bool:
        """Delete the MutatingWebhookConfiguration; ``False`` if it was already gone."""
        try:
            self._call(
                f"MutatingWebhookConfiguration {name}",
                self.admission.delete_mutating_webhook_configuration,
                name,
            )
        except ApiFailure as e:
            if e.status == 404:
                return False
            raise
        return True


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


def _release(pods: Cluster, pod: dict[str, Any], dry_run: bool) -> bool:
    """Release one pod; ``False`` when it turned out not to be gated (any more)."""
    meta = pod.get("metadata") or {}
    ns, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    for _ in range(_ATTEMPTS):
        body = release_body(pod)
        if body is None:
            return False
        if dry_run:
            return True
        try:
            pods.patch(ns, name, body)
            return True
        except ApiFailure as e:
            if e.status != 409:
                raise
        pod = pods.get(ns, name)
    raise ApiFailure(f"pod {ns}/{name}", 409, f"kept changing ({_ATTEMPTS} tries)")


def run(args: argparse.Namespace) -> int:
    targets = _targets(args)
    pods = Cluster(args.kubeconfig, args.context)
    verb = "would release" if args.dry_run else "released"
    failed = released = 0
    if args.remove_webhook:
        if args.dry_run:
            print(f"would delete MutatingWebhookConfiguration {args.remove_webhook}")
        else:
            try:
                gone = pods.delete_webhook(args.remove_webhook)
                state = "deleted" if gone else "already absent"
                print(f"MutatingWebhookConfiguration {args.remove_webhook} {state}")
            except ApiFailure as e:  # still release what is gated: exit 1 at the end
                print(f"gpuslice ungate: error: {e}", file=sys.stderr)
                failed += 1
    try:
        found = list(pods.gated(args.namespace)) if args.all else None
    except ApiFailure as e:
        print(f"gpuslice ungate: error: {e}", file=sys.stderr)
        return 1
    candidates: list[tuple[str, str, dict[str, Any] | None]] = (
        [(p["metadata"].get("namespace", ""), p["metadata"]["name"], p) for p in found]
        if found is not None
        else [(ns, name, None) for ns, name in targets]
    )
    for ns, name, pod in candidates:
        try:
            if _release(pods, pod if pod is not None else pods.get(ns, name), args.dry_run):
                print(f"{verb} {ns}/{name}")
                released += 1
            else:
                print(f"{ns}/{name} is not gated by gpuslice: nothing to do")
        except ApiFailure as e:
            print(f"gpuslice ungate: error: {e}", file=sys.stderr)
            failed += 1
    print(f"{released} pod(s) {verb}" + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0
