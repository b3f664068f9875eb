"""A Kubernetes API server for tests: kmock's emulator plus the bookkeeping and rules clients rely on.

Model
-----
kmock (by kopf's author) stores objects and serves get/list/watch/create/patch/delete over real
HTTP, but assigns neither ``uid`` nor ``resourceVersion`` nor ``generation``, checks no
preconditions, knows no status subresource and accepts any pod change.  :class:`ApiServer` adds
what the API server does for those, so the node agent's and the partitioner's clients see
realistic objects and are refused what a real cluster refuses:

* create: ``uid``, ``generation: 1`` (unless given) and a fresh ``resourceVersion``;
* every update (JSON merge patch or JSON patch): a fresh ``resourceVersion``; a
  ``metadata.resourceVersion`` in a merge patch that is not the current one -> ``409
  Conflict``; a JSON patch whose ``test`` fails -> ``422 Invalid``;
* resources declared with the ``status`` subresource (:func:`declare`): a write to the object
  drops ``status`` from the body and bumps ``generation`` when ``spec`` changes; a write to
  ``<object>/status`` keeps only ``status`` (and the precondition) and never bumps it;
* pods (:mod:`simulations.replay.kube_rules`): a create with duplicate gates or with ``nodeName`` and gates, and any
  update Kubernetes forbids (gates added, node affinity widened or changed after the last gate
  is gone, resources changed, ...) -> ``422 Invalid`` naming the field; a gated pod is created
  with the condition ``PodScheduled=False, reason SchedulingGated`` (unless it brings a
  PodScheduled condition: the fake keeps a client's status, unlike the real server); a
  strategic merge patch of a pod's spec -> ``415`` (not emulated: it merges ``schedulingGates``
  by name, so a client sending one would behave differently in a cluster);
* ``POST pods/<name>/eviction`` (``policy/v1`` Eviction) deletes the pod like the API server
  does for one that is not running (no PodDisruptionBudget is consulted: none is emulated):
  ``404`` if it is gone, ``409`` if ``deleteOptions.preconditions`` name another ``uid`` or
  ``resourceVersion``; else it gains the condition ``DisruptionTarget`` (reason
  ``EvictionByEvictionAPI``) and is deleted (marked deleting if it has finalizers); a running
  pod -> ``429`` (tests evict only pods that have not started);
* ``POST pods/<name>/binding`` binds like the API server does for kube-scheduler: sets
  ``spec.nodeName`` and ``PodScheduled=True``; ``409`` if the pod is gated, already bound or
  being deleted (:func:`bind_like_scheduler` first checks, like kube-scheduler's filter, that
  the pod may go to that node);
* an optional mutating admission webhook (:meth:`ApiServer.configure_admission`): a pod
  CREATE is sent to it as an ``AdmissionReview`` (v1) before validation; its JSONPatch is
  applied; ``allowed: false`` rejects the pod; a call that fails (connection, TLS, timeout, HTTP
  error, unreadable answer) creates the pod unpatched under ``failurePolicy: Ignore`` and is
  rejected under ``Fail``.

* Leases (``coordination.k8s.io/v1``, :func:`declare_leases`): ``PUT`` replaces a Lease
  atomically, ``409 Conflict`` unless its ``metadata.resourceVersion`` is the current one (kmock
  knows no PUT); :attr:`ApiServer.lease_outage` names authors whose Lease requests hang (a
  leader cut off from its Lease alone);
* every successful write (any method but GET) is recorded in :attr:`ApiServer.writes` with its
  author (the bearer token: give each client its own) and the loop time it was answered.
* lists (not watches) are paginated like the API server's: ``limit`` caps a page, and a page
  that stops early carries ``metadata.continue``, an opaque token for the rest (objects in
  (namespace, name) order; every page of one list reports the first page's resourceVersion,
  but reads the objects as they are then: no snapshot).
  Faults on demand: :attr:`ApiServer.expire_continues` makes that many requests with a continue
  token answer ``410 Expired`` (as after the server compacted the list's version);
  :attr:`ApiServer.fail_lists` makes that many list requests answer ``503``.  Every list
  request is recorded in :attr:`ApiServer.lists`.

kmock ignores field and label selectors and ``timeoutSeconds`` on watches: a client must filter
the events it gets and end its watch itself.

:func:`declare` registers the resources gpuslice uses (namespaces, nodes, pods, events, secrets,
MutatingWebhookConfigurations, NodePartitionings) and the ``default`` namespace.  Use it with the
``kmock`` pytest fixture by overriding ``kmock_options`` to ``{"cls": ApiServer}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import datetime
import itertools
import json
import ssl
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import kmock

from partitioner.eligibility import pod_fits_node
from simulations.replay.kube_rules import create_errors, invalid_message, update_errors

NP_RESOURCE = "gpuslice.io/v1alpha1/nodepartitionings"
NP_PATH = "/apis/gpuslice.io/v1alpha1/nodepartitionings"
MWC_RESOURCE = "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
_VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
_PODS = kmock.resource("v1/pods")
LEASE_RESOURCE = "coordination.k8s.io/v1/leases"
_LEASES = kmock.resource(LEASE_RESOURCE)
_SLICES = kmock.resource("resource.k8s.io/v1/resourceslices")
_SMP = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Admission:
    """Where and how the fake API server calls a mutating webhook for pod CREATEs."""

    url: str
    cafile: Path | None = None
    server_hostname: str | None = None
    """TLS server name to check (the Service's DNS name the API server would use)."""
    insecure: bool = False
    """Do not verify the webhook's certificate (an ``http://`` URL needs no TLS at all)."""
    failure_policy: Literal["Ignore", "Fail"] = "Ignore"
    timeout_s: float = 5.0


@dataclass(frozen=True)
class Write:
    """One write the fake API server accepted (status < 400)."""

    author: str
    """The client's bearer token ("" when it sent none)."""
    method: str
    path: str
    at: float
    """Loop time when it was answered (after it took effect)."""


@dataclass(frozen=True)
class ListCall:
    """One list request the fake API server received (answered or refused)."""

    path: str
    limit: int | None
    continued: bool
    """It carried a continue token."""
    status: int
    """200, or the status of the refusal (410 expired token, 503 injected outage)."""
    items: int
    at: float
    """Loop time when it was received."""


def _now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _author(request: kmock.Request) -> str:
    auth = str(request.headers.get("Authorization", ""))
    return auth.removeprefix("Bearer ").strip()


def _invalid(pod: Mapping[str, Any], errors: list[str]) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", message=invalid_message(pod, errors))


def _merge_patch(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what kmock applies to a dict body)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(base) if isinstance(base, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def admission_review(pod: Mapping[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    """The ``AdmissionReview`` (v1) the API server sends a webhook for a pod ``operation``."""
    meta = pod.get("metadata") or {}
    gvk = {"group": "", "version": "v1", "kind": "Pod"}
    gvr = {"group": "", "version": "v1", "resource": "pods"}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": meta.get("name", ""),
            "namespace": meta.get("namespace", ""),
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:test:creator"},
            "object": copy.deepcopy(dict(pod)),
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock plus uid, resourceVersion, generation, 409, the status subresource, the pod rules,
    pod binding and a mutating admission webhook (see the module docstring)."""

    _versions: Iterator[int] = attrs.field(factory=lambda: itertools.count(1000), init=False)
    admission: Admission | None = attrs.field(default=None, init=False)
    admission_failures: list[str] = attrs.field(factory=list, init=False)
    """Why each webhook call failed (Ignore let those pods in unpatched)."""
    writes: list[Write] = attrs.field(factory=list, init=False)
    """Every accepted write, in order (module docstring)."""
    lease_outage: set[str] = attrs.field(factory=set, init=False)
    """Authors whose Lease requests hang while they are in this set (then answer 503)."""
    lists: list[ListCall] = attrs.field(factory=list, init=False)
    """Every list request (not watches), in order."""
    fail_lists: int = attrs.field(default=0, init=False)
    """The next this many list requests answer ``503 ServiceUnavailable`` (an outage)."""
    expire_continues: int = attrs.field(default=0, init=False)
    """The next this many list requests with a continue token answer ``410 Expired``."""
    drop_partitionable: bool = attrs.field(default=False, init=False)
    """Drop ``sharedCounters`` and ``consumesCounters`` from ResourceSlice writes, as an API
    server with the DRAPartitionableDevices gate off does (silently)."""
    drop_taints: bool = attrs.field(default=False, init=False)
    """Drop devices' ``taints`` from ResourceSlice writes, as an API server with the
    DRADeviceTaints gate off does (silently).  Otherwise a taint written without
    ``timeAdded`` gets the time of the write, as the API server stamps it."""

    def configure_admission(self, admission: Admission | None) -> None:
        self.admission = admission

    def _has_status_subresource(self, resource: kmock.resource) -> bool:
        try:
            info = self.resources[resource]
        except KeyError:
            return False
        return "status" in set(info.subresources)

    async def _handle(self, request: kmock.Request) -> Any:
        """Serve ``request`` (:meth:`_serve`), recording it in :attr:`writes` if accepted."""
        method = str(request.method).upper().rsplit(".", 1)[-1]
        if request.resource == _LEASES:
            await self._lease_outage(request)
        if request.resource == _LEASES and method == "PUT" and request.name is not None:
            response = await self._put_lease(request)
        else:
            response = await self._serve(request)
        status = getattr(response, "status", 200)
        if method != "GET" and isinstance(status, int) and status < 400:
            loop_time = asyncio.get_running_loop().time()
            self.writes.append(Write(_author(request), method, request.url.path, loop_time))
        return response

    async def _serve(self, request: kmock.Request) -> Any:
        data = request.data
        binding = request.resource == _PODS and request.subresource == "binding"
        if binding and str(request.method).upper().endswith("POST") and request.name is not None:
            return await self._bind(request)
        eviction = request.resource == _PODS and request.subresource == "eviction"
        if eviction and str(request.method).upper().endswith("POST") and request.name is not None:
            return await self._evict(request)
        if request.resource == _SLICES and self.drop_partitionable and isinstance(data, dict):
            spec = data.get("spec") or {}
            spec.pop("sharedCounters", None)
            for device in spec.get("devices") or ():
                device.pop("consumesCounters", None)
        if request.resource == _SLICES and isinstance(data, dict):
            for device in (data.get("spec") or {}).get("devices") or ():
                if self.drop_taints:
                    device.pop("taints", None)
                for taint in device.get("taints") or ():
                    taint.setdefault("timeAdded", _now_rfc3339())
        if request.resource is not None and isinstance(data, (dict, list)):
            if request.action == kmock.action.CREATE and isinstance(data, dict):
                if request.resource == _PODS:
                    await self._admit_pod(request, data)
                meta = data.setdefault("metadata", {})  # admission may have replaced it
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == kmock.action.UPDATE and request.name is not None:
                self._update(request, request.resource, request.name, data)
        return await super()._handle(request)

    # -- create ------------------------------------------------------------------------------
    async def _admit_pod(self, request: kmock.Request, pod: dict[str, Any]) -> None:
        """Mutating admission, then validation, then the SchedulingGated condition."""
        if request.namespace:
            pod["metadata"].setdefault("namespace", request.namespace)
        if self.admission is not None:
            await self._call_webhook(self.admission, pod)
        errors = create_errors(pod)
        if errors:
            raise _invalid(pod, errors)
        if (pod.get("spec") or {}).get("schedulingGates"):
            status = pod.setdefault("status", {})
            conditions = status.setdefault("conditions", [])
            if not any(c.get("type") == "PodScheduled" for c in conditions):
                conditions.append(
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "SchedulingGated",
                        "message": "Scheduling is blocked due to non-empty scheduling gates",
                    }
                )

    async def _call_webhook(self, admission: Admission, pod: dict[str, Any]) -> None:
        review = admission_review(pod)
        review_uid = review["request"]["uid"]
        try:
            response = await self._post_review(admission, review)
            if response.get("uid") != review_uid:
                raise ValueError(f"answer for uid {response.get('uid')!r}, not {review_uid!r}")
            if not response.get("allowed"):
                status = response.get("status") or {}
                raise kmock.KubernetesError(
                    status=int(status.get("code") or 403),
                    reason="Forbidden",
                    message=f"admission webhook denied the request: {status.get('message', '')}",
                )
            if response.get("patch"):
                if response.get("patchType") != "JSONPatch":
                    raise ValueError(f"patchType {response.get('patchType')!r}")
                ops = json.loads(base64.b64decode(response["patch"], validate=True))
                patched = jsonpatch.apply_patch(pod, ops)
                pod.clear()
                pod.update(patched)
        except kmock.KubernetesError:
            raise
        except (
            aiohttp.ClientError,
            TimeoutError,
            OSError,
            ValueError,
            binascii.Error,
            jsonpatch.JsonPatchException,
            jsonpatch.JsonPointerException,
        ) as e:
            why = f"failed calling webhook {admission.url}: {type(e).__name__}: {e}"
            self.admission_failures.append(why)
            if admission.failure_policy == "Fail":
                raise kmock.KubernetesError(status=500, reason="InternalError", message=why) from e

    @staticmethod
    async def _post_review(admission: Admission, review: dict[str, Any]) -> dict[str, Any]:
        ssl_ctx: ssl.SSLContext | bool = not admission.insecure
        if admission.url.startswith("https://") and not admission.insecure:
            ssl_ctx = ssl.create_default_context(
                cafile=str(admission.cafile) if admission.cafile else None
            )
        timeout = aiohttp.ClientTimeout(total=admission.timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(
                admission.url,
                json=review,
                ssl=ssl_ctx,
                server_hostname=admission.server_hostname,
            ) as resp,
        ):
            resp.raise_for_status()
            answer = await resp.json()
        response = answer.get("response") if isinstance(answer, dict) else None
        if not isinstance(response, dict):
            raise ValueError("the answer has no response")
        return response

    # -- update ------------------------------------------------------------------------------
    def _update(
        self,
        request: kmock.Request,
        resource: kmock.resource,
        name: str,
        data: dict[str, Any] | list[Any],
    ) -> None:
        _check_patch_type(request, resource, data)
        key = (resource, request.namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        current = self.objects[key]
        cur_meta = current.get("metadata") or {}
        if isinstance(data, list):
            try:
                new = jsonpatch.apply_patch(current.raw, data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
            self._check_pod_update(request, resource, current.raw, new)
            # kmock applies the client's ops; these bump the bookkeeping after them.
            data.append(
                {
                    "op": "add",
                    "path": "/metadata/resourceVersion",
                    "value": str(next(self._versions)),
                }
            )
            if request.subresource is None and new.get("spec") != current.get("spec"):
                generation = int(cur_meta.get("generation") or 1) + 1
                data.append({"op": "add", "path": "/metadata/generation", "value": generation})
            return
        meta = data.setdefault("metadata", {})
        wanted = meta.get("resourceVersion")
        if wanted is not None and wanted != cur_meta.get("resourceVersion"):
            raise kmock.KubernetesError(
                status=409,
                reason="Conflict",
                message=(
                    f"the object has been modified (resourceVersion is "
                    f"{cur_meta.get('resourceVersion')}, the update named {wanted})"
                ),
            )
        if self._has_status_subresource(resource):
            if request.subresource == "status":
                for field in [k for k in data if k not in ("status", "metadata")]:
                    del data[field]
                for field in [k for k in meta if k != "resourceVersion"]:
                    del meta[field]
            else:
                data.pop("status", None)
        if resource == _PODS and request.subresource is None and "spec" in data:
            if _SMP in str(request.headers.get("Content-Type", "")):
                raise kmock.KubernetesError(
                    status=415,
                    reason="UnsupportedMediaType",
                    message="the fake API server does not emulate strategic merge patches of a "
                    "pod's spec (they merge schedulingGates by name); send a JSON merge patch",
                )
            self._check_pod_update(request, resource, current.raw, _merge_patch(current.raw, data))
        if request.subresource is None and "spec" in data and data["spec"] != current.get("spec"):
            meta["generation"] = int(cur_meta.get("generation") or 1) + 1
        meta["resourceVersion"] = str(next(self._versions))

    @staticmethod
    def _check_pod_update(
        request: kmock.Request,
        resource: kmock.resource,
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> None:
        if resource != _PODS or request.subresource is not None:
            return
        errors = update_errors(old, new)
        if errors:
            raise _invalid(old, errors)

    # -- binding -----------------------------------------------------------------------------
    async def _bind(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (_PODS, request.namespace, str(request.name))
        body = request.data if isinstance(request.data, dict) else {}
        target = str((body.get("target") or {}).get("name") or "")
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            pod = self.objects[key].raw
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            why = (
                f"pod {request.name} is being deleted, cannot be assigned to a host"
                if meta.get("deletionTimestamp")
                else f"pod {request.name} is already assigned to node {spec['nodeName']!r}"
                if spec.get("nodeName")
                else f"pod {request.name} has non-empty .spec.schedulingGates"
                if spec.get("schedulingGates")
                else "a Binding needs target.name"
                if not target
                else ""
            )
            if why:
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message=f'Operation cannot be fulfilled on pods/binding "{request.name}": {why}',
                )
            conditions = [
                c
                for c in (pod.get("status") or {}).get("conditions") or ()
                if c.get("type") != "PodScheduled"
            ]
            conditions.append({"type": "PodScheduled", "status": "True"})
            self.objects[key].patch(
                {
                    "metadata": {"resourceVersion": str(next(self._versions))},
                    "spec": {"nodeName": target},
                    "status": {"conditions": conditions, "nominatedNodeName": None},
                }
            )
            raw = self.objects[key].raw
            await self._buses[_PODS].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(
            {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}, status=201
        )

    async def _evict(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (_PODS, request.namespace, str(request.name))
        body = request.data if isinstance(request.data, dict) else {}
        wanted = (body.get("deleteOptions") or {}).get("preconditions") or {}
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            pod = self.objects[key].raw
            meta = pod.get("metadata") or {}
            for field in ("uid", "resourceVersion"):
                if wanted.get(field) and wanted[field] != meta.get(field):
                    raise kmock.KubernetesError(
                        status=409,
                        reason="Conflict",
                        message=f"Operation cannot be fulfilled on Pod {request.name!r}: the "
                        f"{field} in the precondition ({wanted[field]}) does not match the "
                        f"{field} in record ({meta.get(field)})",
                    )
            if (pod.get("status") or {}).get("phase") not in ("Pending", None):
                raise kmock.KubernetesError(
                    status=429,
                    reason="TooManyRequests",
                    message="the fake API server evicts only pods that have not started",
                )
            conditions = [
                c
                for c in (pod.get("status") or {}).get("conditions") or ()
                if c.get("type") != "DisruptionTarget"
            ]
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                }
            )
            patch: dict[str, Any] = {
                "metadata": {"resourceVersion": str(next(self._versions))},
                "status": {"conditions": conditions},
            }
            if meta.get("finalizers"):
                stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                patch["metadata"]["deletionTimestamp"] = stamp
                self.objects[key].patch(patch)
                event = {"type": "MODIFIED", "object": self.objects[key].raw}
            else:
                self.objects[key].patch(patch)
                raw = self.objects[key].raw
                self.objects[key].delete()
                event = {"type": "DELETED", "object": raw}
            await self._buses[_PODS].put(event)
        return aiohttp.web.json_response(
            {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}, status=201
        )

    # -- lists -------------------------------------------------------------------------------
    async def _serve_list(self, request: kmock.Request) -> Any:
        """kmock's list, in (namespace, name) order, cut into pages (module docstring)."""
        params = request.params or {}
        limit = _positive_int(params.get("limit"))
        token = str(params.get("continue") or "")
        at = asyncio.get_running_loop().time()

        def refuse(status: int, reason: str, message: str) -> kmock.KubernetesError:
            self.lists.append(ListCall(request.url.path, limit, bool(token), status, 0, at))
            return kmock.KubernetesError(status=status, reason=reason, message=message)

        if self.fail_lists > 0:
            self.fail_lists -= 1
            raise refuse(503, "ServiceUnavailable", "the API server is unavailable (injected)")
        after: tuple[str, str] | None = None
        version = ""
        if token:
            if self.expire_continues > 0:
                self.expire_continues -= 1
                raise refuse(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.",
                )
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
                after, version = (str(state["ns"]), str(state["name"])), str(state["rv"])
            except (ValueError, KeyError, TypeError) as e:
                raise refuse(400, "BadRequest", f"invalid continue token: {e}") from e
        doc = await super()._serve_list(request)
        assert isinstance(doc, dict), f"kmock listed {type(doc).__name__}, not a dict"
        items = sorted(doc.get("items") or (), key=_list_key)
        if not version:
            version = str(max((_version(i) for i in items), default=0))
        if after is not None:
            items = [i for i in items if _list_key(i) > after]
        meta: dict[str, Any] = {"resourceVersion": version}
        if limit is not None and len(items) > limit:
            items = items[:limit]
            ns, name = _list_key(items[-1])
            state = {"ns": ns, "name": name, "rv": version}
            raw = json.dumps(state).encode()
            meta["continue"] = base64.urlsafe_b64encode(raw).decode("ascii")
            meta["remainingItemCount"] = len(doc.get("items") or ()) - len(items)
        self.lists.append(ListCall(request.url.path, limit, bool(token), 200, len(items), at))
        return {**doc, "metadata": meta, "items": items}

    # -- leases ------------------------------------------------------------------------------
    async def _lease_outage(self, request: kmock.Request) -> None:
        author = _author(request)
        if author not in self.lease_outage:
            return
        while author in self.lease_outage:
            await asyncio.sleep(0.25)
        raise kmock.KubernetesError(
            status=503, reason="ServiceUnavailable", message="the Lease was unreachable"
        )

    async def _put_lease(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Replace a Lease if the body names its current resourceVersion (else 409)."""
        key = (_LEASES, request.namespace, str(request.name))
        body = request.data if isinstance(request.data, dict) else {}
        meta = body.setdefault("metadata", {})
        async with self._lock:  # the check and the replacement are one step
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            current = self.objects[key].raw
            cur_meta = current.get("metadata") or {}
            if meta.get("resourceVersion") != cur_meta.get("resourceVersion"):
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message=(
                        f'Operation cannot be fulfilled on leases.coordination.k8s.io '
                        f'"{request.name}": the object has been modified; please apply your '
                        f"changes to the latest version and try again"
                    ),
                )
            new = {
                **body,
                "metadata": {
                    **cur_meta,
                    "resourceVersion": str(next(self._versions)),
                },
            }
            self.objects[key].create(new)  # a new version of the object, replacing the last
            raw = self.objects[key].raw
            await self._buses[_LEASES].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)


def _positive_int(value: Any) -> int | None:
    """A ``limit`` parameter: a positive integer, or ``None`` (absent, 0: no limit)."""
    if value in (None, ""):
        return None
    try:
        number = int(value)
    except ValueError as e:
        raise kmock.KubernetesError(
            status=400, reason="BadRequest", message=f"limit {value!r} is not an integer"
        ) from e
    return number if number > 0 else None


def _list_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _version(obj: Mapping[str, Any]) -> int:
    raw = (obj.get("metadata") or {}).get("resourceVersion")
    return int(raw) if isinstance(raw, str) and raw.isdigit() else 0


class Unschedulable(AssertionError):
    """kube-scheduler would not bind the pod to that node."""


async def bind_like_scheduler(
    api: kmock.KubernetesEmulator, namespace: str, name: str, node: str
) -> dict[str, Any]:
    """Bind a pod to ``node`` as kube-scheduler would: only an ungated pod, only to a node its
    nodeSelector and required node affinity admit (:class:`Unschedulable` otherwise), through
    the ``pods/binding`` subresource.  Returns the bound pod."""
    pod = stored(api, "v1/pods", name, namespace)
    node_obj = stored(api, "v1/nodes", node)
    if pod is None or node_obj is None:
        raise Unschedulable(f"no pod {namespace}/{name} or no node {node}")
    why = unschedulable_reason(pod, node_obj)
    if why:
        raise Unschedulable(f"{namespace}/{name} on {node}: {why}")
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    resp = await api.post(f"/api/v1/namespaces/{namespace}/pods/{name}/binding", json=binding)
    if resp.status != 201:
        raise Unschedulable(await resp.text())
    bound = stored(api, "v1/pods", name, namespace)
    assert bound is not None
    return bound


def declare(api: kmock.KubernetesEmulator) -> None:
    """Declare the resources gpuslice uses and the ``default`` namespace."""
    api.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs=_VERBS
    )
    api.resources["v1/nodes"] = kmock.ResourceInfo(
        kind="Node", singular="node", namespaced=False, verbs=_VERBS, subresources={"status"}
    )
    api.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod",
        singular="pod",
        namespaced=True,
        verbs=_VERBS,
        subresources={"status", "binding", "eviction"},
    )
    api.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs=_VERBS
    )
    api.resources["v1/secrets"] = kmock.ResourceInfo(
        kind="Secret", singular="secret", namespaced=True, verbs=_VERBS
    )
    api.resources[MWC_RESOURCE] = kmock.ResourceInfo(
        kind="MutatingWebhookConfiguration",
        singular="mutatingwebhookconfiguration",
        namespaced=False,
        verbs=_VERBS,
    )
    api.resources[NP_RESOURCE] = kmock.ResourceInfo(
        kind="NodePartitioning",
        singular="nodepartitioning",
        namespaced=False,
        verbs=_VERBS,
        subresources={"status"},
    )
    api.objects["v1/namespaces", None, "default"] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "default", "uid": "ns-default", "resourceVersion": "1"},
    }


_JSON_PATCH = "application/json-patch+json"


def _check_patch_type(
    request: kmock.Request, resource: kmock.resource, data: dict[str, Any] | list[Any]
) -> None:
    """Refuse a PATCH whose body its Content-Type cannot carry, as the API server does: a JSON
    Patch is a list of operations (kubernetes_asyncio picks that type for a dict body sent to
    a custom object's patch unless ``_content_type`` says otherwise), and a strategic merge
    patch exists for built-in kinds only.  Any other type (the tests' own raw requests) is read
    as a merge patch."""
    if not str(request.method).upper().endswith("PATCH"):
        return
    content_type = str(request.headers.get("Content-Type", "")).split(";")[0].strip().lower()
    if content_type == _JSON_PATCH and not isinstance(data, list):
        raise kmock.KubernetesError(
            status=400,
            reason="BadRequest",
            message="json: cannot unmarshal object into Go value of type []handlers.jsonPatchOp",
        )
    if content_type != _JSON_PATCH and isinstance(data, list):
        raise kmock.KubernetesError(
            status=400,
            reason="BadRequest",
            message="json: cannot unmarshal array into Go value of type map[string]interface {}",
        )
    if content_type == _SMP and resource.group not in ("", "apps", "batch", "coordination.k8s.io"):
        raise kmock.KubernetesError(
            status=415,
            reason="UnsupportedMediaType",
            message="strategic merge patch is not supported for custom resources "
            f"({resource.group}): use application/merge-patch+json",
        )


def declare_leases(api: kmock.KubernetesEmulator) -> None:
    """Declare ``coordination.k8s.io/v1`` Leases (namespaced; PUT is served by :class:`ApiServer`)."""
    api.resources[LEASE_RESOURCE] = kmock.ResourceInfo(
        kind="Lease", singular="lease", namespaced=True, verbs=_VERBS
    )


SLICE_RESOURCE = "resource.k8s.io/v1/resourceslices"
CLAIM_RESOURCE = "resource.k8s.io/v1/resourceclaims"


def declare_dra(api: kmock.KubernetesEmulator) -> None:
    """Declare ``resource.k8s.io/v1`` ResourceSlices (cluster-scoped) and ResourceClaims."""
    api.resources[SLICE_RESOURCE] = kmock.ResourceInfo(
        kind="ResourceSlice", singular="resourceslice", namespaced=False, verbs=_VERBS
    )
    api.resources[CLAIM_RESOURCE] = kmock.ResourceInfo(
        kind="ResourceClaim",
        singular="resourceclaim",
        namespaced=True,
        verbs=_VERBS,
        subresources={"status"},
    )


def stored(
    api: kmock.KubernetesEmulator, resource: str, name: str, namespace: str | None = None
) -> dict[str, Any] | None:
    """The stored object, or ``None`` if absent or deleted."""
    key = (kmock.resource(resource), namespace, name)
    if key not in api.objects or api.objects[key].deleted:
        return None
    return dict(api.objects[key])


def unschedulable_reason(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str:
    """Why kube-scheduler would not put ``pod`` on ``node`` (gates, binding, its node filters:
    nodeSelector, required node affinity, taints), or ``""``."""
    spec = pod.get("spec") or {}
    name = str((node.get("metadata") or {}).get("name", ""))
    gates = [str(g.get("name", "")) for g in spec.get("schedulingGates") or ()]
    if gates:
        return f"pod is gated by {', '.join(gates)}"
    if spec.get("nodeName"):
        return f"pod is already bound to {spec['nodeName']}"
    if not pod_fits_node(pod, node):
        return f"node {name} does not match the pod's nodeSelector, node affinity or taints"
    return ""


def write_kubeconfig(api: kmock.KubernetesEmulator, path: Path) -> Path:
    """A kubeconfig at ``path`` whose current context is ``api`` (token ``t``), for commands
    that connect the way a user does (``--kubeconfig``)."""
    import yaml

    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "k", "cluster": {"server": str(api.url).rstrip("/")}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
                "current-context": "k",
            }
        )
    )
    return path
