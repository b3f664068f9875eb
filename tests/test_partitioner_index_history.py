"""The index depends on the cluster's objects, not on the order its events arrived in.

:class:`partitioner.index.ClusterIndex` is maintained incrementally (usage per node, the
waiting queue in age order, claim links, eligibility and ledger caches), and the controller
loses watch events (a restarted watch, a relist after a 410).  Whatever sequence of events and
relists brought it to a set of objects, it must read that set exactly as an index built fresh
from the same objects does, and :func:`partitioner.decide.decide` must decide the same.

The oracle is :meth:`ClusterIndex.from_objects` on the objects the API server holds at the
end.  Histories are drawn by hypothesis: objects of every kind the index reads (Nodes, Pods,
NodePartitionings, ResourceClaims) are created, changed along realistic lifecycles (a pod is
gated, ungated, bound, finished or deleted; nodes are relabelled, tainted, cordoned; the agent
rewrites its status; claims are allocated), deleted and re-created with a new uid; each event
is delivered or lost, and any kind may be relisted at any time.  At the end every kind that
lost an event since its last relist is relisted, as the controller does after a watch error.

One thing may legitimately differ: whether the agent's report is newer than the last change
to a node's pods (``NpInfo.pods_seen``) depends on their order, and the decision step treats a
report older than the pods as possibly stale (:func:`partitioner.ledger.build_ledgers`).  The
comparison of decisions reads both indexes as if each agent had reported after the last pod
change; everything else is compared as it is.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_partitioner_dra import claim, mig_request
from test_partitioner_promises import CONFIG, T0, applied_np, status_gpu, with_alloc
from test_partitioner_snapshot import A100, node, np

from partitioner.claims import MIG_CLASS
from partitioner.decide import ControllerState, decide
from partitioner.gating import GATE
from partitioner.index import KINDS, ClusterIndex
from planner.catalog import default_catalog

CAT = default_catalog()
MIG = {"gpuslice.io/partitioning": "mig", **A100}
DRA = {"gpuslice.io/partitioning": "dra", **A100}
NODES = ("n1", "n2")
PODS = ("p1", "p2", "p3")
CLAIMS = ("c1", "c2")
WARM = dataclasses.replace(CONFIG, warm_share=0.05)


def _node(name: str, variant: int) -> dict[str, Any]:
    if variant == 0:
        return with_alloc(node(name, MIG), **{"1g_10gb": 2})
    if variant == 1:  # tainted
        return with_alloc(
            node(name, MIG, taints=[{"key": "gpu", "effect": "NoSchedule"}]), **{"7g_80gb": 1}
        )
    if variant == 2:  # a team's node, cordoned
        return node(name, {**MIG, "team": "a"}, unschedulable=True)
    if variant == 3:  # a team's node
        return with_alloc(node(name, {**MIG, "team": "a"}), **{"1g_10gb": 1})
    if variant == 4:  # not opted in
        return node(name, dict(A100))
    return node(name, DRA)  # a DRA node


def _np(name: str, variant: int) -> dict[str, Any]:
    if variant == 0:
        return applied_np(name, status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1))
    if variant == 1:
        return applied_np(name, status_gpu(0), status_gpu(1))
    if variant == 2:
        return applied_np(
            name, status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("1g.10gb", 0, False))
        )
    busy = np(  # a spec the agent has not applied yet
        name,
        plan="5",
        generation=3,
        observed=2,
        applied=True,
        gpus=[status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1)],
    )
    busy["spec"]["gpus"] = [{"index": 1, "mig": [{"profile": "7g.80gb", "start": 0}]}]
    busy["metadata"]["annotations"]["gpuslice.io/planned-at"] = str(T0 - 30)
    return busy


def _claim(name: str, variant: int) -> dict[str, Any]:
    if variant == 0:
        return claim(name, mig_request())
    if variant == 1:
        return claim(name, mig_request(count=2))
    if variant == 2:
        return claim(name, mig_request(), allocated=True)
    other = mig_request()  # another driver's class: gpuslice serves nothing
    other["exactly"]["deviceClassName"] = "gpu.example.com"
    assert other["exactly"]["deviceClassName"] != MIG_CLASS
    return claim(name, other)


@dataclasses.dataclass(frozen=True)
class PodTemplate:
    """What a pod asks for; fixed for one incarnation (one uid), as Kubernetes fixes it."""

    request: str
    units: int
    claim: str
    team: bool
    tolerates: bool
    priority: int
    age: float
    pinned: str = ""
    """Node affinity narrowed to this node (allowed while the pod is gated: gpuslice does it
    at release)."""


POD_TEMPLATES = st.builds(
    PodTemplate,
    request=st.sampled_from(
        ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-7g.80gb", "nvidia.com/mig-4g.40gb"]
    ),
    units=st.sampled_from([1, 2]),
    claim=st.sampled_from(["", "", "c1", "c2"]),
    team=st.booleans(),
    tolerates=st.booleans(),
    priority=st.sampled_from([0, 10]),
    age=st.sampled_from([0.0, 20.0, 1000.0]),
)
POD_STATES = ("gated", "unschedulable", "bound", "succeeded", "deleting")


def _pod(name: str, uid: str, t: PodTemplate, state: str, node_name: str) -> dict[str, Any]:
    created = T0 - t.age
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": {}}}]}
    if t.claim:
        spec["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
        spec["resourceClaims"] = [{"name": "g", "resourceClaimName": t.claim}]
    else:
        spec["containers"][0]["resources"]["limits"] = {t.request: str(t.units), "cpu": "1"}
    if t.team:
        spec["nodeSelector"] = {"team": "a"}
    if t.pinned:
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [t.pinned]}]}
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    if t.tolerates:
        spec["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    if t.priority:
        spec["priority"] = t.priority
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": uid,
        "creationTimestamp": stamp,
    }
    status: dict[str, Any] = {"phase": "Pending"}
    if state == "gated":
        spec["schedulingGates"] = [{"name": GATE}]
    elif state == "unschedulable":
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
    else:
        spec["nodeName"] = node_name
        status["phase"] = "Succeeded" if state == "succeeded" else "Running"
        if state == "deleting":
            meta["deletionTimestamp"] = "2027-01-15T08:00:00Z"
    return {"kind": "Pod", "metadata": meta, "spec": spec, "status": status}


# One step of a history: (what, which object, variant or template, delivered?)
DELIVERED = st.integers(0, 7).map(lambda i: i < 7)
"""Most events arrive; one in eight is lost (then the index differs until that kind is relisted)."""
STEPS = st.one_of(
    st.tuples(st.just("node"), st.sampled_from(NODES), st.integers(0, 5), DELIVERED),
    st.tuples(st.just("np"), st.sampled_from(NODES), st.integers(0, 3), DELIVERED),
    st.tuples(st.just("claim"), st.sampled_from(CLAIMS), st.integers(0, 3), DELIVERED),
    st.tuples(st.just("pod"), st.sampled_from(PODS), POD_TEMPLATES, DELIVERED),
    st.tuples(st.just("advance"), st.sampled_from(PODS), st.sampled_from(NODES), DELIVERED),
    st.tuples(
        st.just("narrow"), st.sampled_from(PODS), st.sampled_from(("team", *NODES)), DELIVERED
    ),
    st.tuples(
        st.just("delete"),
        st.sampled_from(("nodes", "pods", "partitionings", "claims")),
        st.integers(0, 4),
        DELIVERED,
    ),
    st.tuples(st.just("relist"), st.sampled_from(KINDS), st.none(), st.just(True)),
    st.tuples(st.just("cycle"), st.none(), st.sampled_from((0.0, 61.0)), st.just(True)),
)


class ApiServer:
    """The objects as the API server holds them, with resourceVersions, and what the
    controller's index was told of them (events delivered or lost, relists)."""

    def __init__(self) -> None:
        self.objs: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in KINDS}
        self.rv = 0
        self.index = ClusterIndex(CAT)
        self.missed: set[str] = set()
        self.pods: dict[str, tuple[PodTemplate, str, int, str]] = {}
        """Pod -> (template, uid, lifecycle position, node) of its current incarnation."""
        self.uids = 0

    def write(self, kind: str, key: str, obj: dict[str, Any], delivered: bool) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objs[kind][key] = obj
        if delivered:
            self.index.apply(kind, "MODIFIED", copy.deepcopy(obj))
        else:
            self.missed.add(kind)

    def delete(self, kind: str, key: str, delivered: bool) -> None:
        obj = self.objs[kind].pop(key)
        if kind == "pods":
            del self.pods[key.split("/", 1)[1]]
        if delivered:
            self.index.apply(kind, "DELETED", copy.deepcopy(obj))
        else:
            self.missed.add(kind)

    def relist(self, kind: str) -> None:
        self.index.relist(kind, [copy.deepcopy(o) for o in self.objs[kind].values()])
        self.missed.discard(kind)

    def step(self, what: str, name: Any, arg: Any, delivered: bool) -> None:
        if what == "node":
            self.write("nodes", name, _node(name, arg), delivered)
        elif what == "np":
            self.write("partitionings", name, _np(name, arg), delivered)
        elif what == "claim":
            self.write("claims", f"ns/{name}", _claim(name, arg), delivered)
        elif what == "pod":
            if name in self.pods:  # a new incarnation: the old pod is deleted first
                self.delete("pods", f"ns/{name}", delivered)
            self.uids += 1
            self.pods[name] = (arg, f"uid-{name}-{self.uids}", 0, "")
            self.write(
                "pods",
                f"ns/{name}",
                _pod(name, f"uid-{name}-{self.uids}", arg, "gated", ""),
                delivered,
            )
        elif what == "advance":  # the next lifecycle state (bound to ``arg`` when it binds)
            if name not in self.pods:
                return
            template, uid, at, bound = self.pods[name]
            if at + 1 >= len(POD_STATES):
                return
            at += 1
            bound = bound or (arg if POD_STATES[at] in ("bound", "succeeded", "deleting") else "")
            self.pods[name] = (template, uid, at, bound)
            self.write(
                "pods", f"ns/{name}", _pod(name, uid, template, POD_STATES[at], bound), delivered
            )
        elif what == "narrow":  # a gated pod's scheduling directives narrowed
            if name not in self.pods or self.pods[name][2] != 0:
                return
            template, uid, at, bound = self.pods[name]
            if arg == "team":
                template = dataclasses.replace(template, team=True)
            else:
                template = dataclasses.replace(template, pinned=arg)
            self.pods[name] = (template, uid, at, bound)
            self.write("pods", f"ns/{name}", _pod(name, uid, template, "gated", ""), delivered)
        elif what == "delete":
            keys = sorted(self.objs[name])
            if keys:
                self.delete(name, keys[arg % len(keys)], delivered)
        elif what == "cycle":  # the controller steps on the index as it is (fills its caches)
            decide(ControllerState(), self.index, T0 + arg, WARM)
        else:
            self.relist(name)

    def fresh(self) -> ClusterIndex:
        return ClusterIndex.from_objects(
            CAT,
            [copy.deepcopy(o) for o in self.objs["nodes"].values()],
            [copy.deepcopy(o) for o in self.objs["pods"].values()],
            [copy.deepcopy(o) for o in self.objs["partitionings"].values()],
            [copy.deepcopy(o) for o in self.objs["claims"].values()],
        )


def _pod_view(index: ClusterIndex) -> dict[str, tuple[object, ...]]:
    """What the controller reads of each pod that matters to it (bound, waiting or stray)."""
    return {
        key: (
            p.uid,
            p.node,
            p.finished,
            p.deleting,
            p.waiting,
            p.stray,
            p.gated,
            p.unschedulable,
            dict(p.slices),
            p.dra,
            p.claims,
            p.claims_pending,
            p.priority,
            p.created,
            p.request_error,
            p.cpu_milli,
        )
        for key, p in index.pods.items()
        if p.node or p.waiting or p.stray
    }


def _decisions(index: ClusterIndex) -> list[tuple[object, ...]]:
    """Two steps per configuration: the first opens the batch window, the second (past its
    timeout) plans the batch."""
    for name, info in index.partitionings.items():  # every agent reported after the pods
        info.pods_seen = index.node_pods.get(name, 0)
    out: list[tuple[object, ...]] = []
    for config in (CONFIG, WARM):
        state = ControllerState()
        for now in (T0, T0 + 61):
            d = decide(state, index, now, config)
            state = d.state
            out.append((d.actions, d.batch, d.error, d.warm_error, dict(d.problems)))
    return out


def _assert_same_reading(inc: ClusterIndex, fresh: ClusterIndex) -> None:
    assert _pod_view(inc) == _pod_view(fresh)
    assert inc.waiting_by_age() == fresh.waiting_by_age()
    assert [p.key for p in inc.waiting()] == [p.key for p in fresh.waiting()]
    assert inc.strays == fresh.strays
    assert inc.claims == fresh.claims
    for name in NODES:
        assert inc.usage(name) == fresh.usage(name), name
        scan = [p for k, p in sorted(inc.pods.items()) if p.node == name and not p.finished]
        assert inc.bound_pods(name) == scan, name
        assert [p.key for p in fresh.bound_pods(name)] == [p.key for p in scan], name
    # per-node entries exist only while a pod is bound there (nodes come and go by name)
    bound_to = {p.node for p in inc.pods.values() if p.node}
    assert set(inc.node_pods) == bound_to
    assert set(inc._usage) <= {p.node for p in inc.pods.values() if p.node and not p.finished}
    inc_nodes, fresh_nodes = inc.gpu_nodes(), fresh.gpu_nodes()
    assert {n: i.reading for n, i in inc_nodes.items()} == {
        n: i.reading for n, i in fresh_nodes.items()
    }
    assert {n: dict(i.allocatable) for n, i in inc.nodes.items()} == {
        n: dict(i.allocatable) for n, i in fresh.nodes.items()
    }
    for p in inc.waiting():
        assert inc.eligible(p, inc_nodes) == fresh.eligible(fresh.pods[p.key], fresh_nodes), p.key
    assert {n: (i.rv, i.error, i.raw) for n, i in inc.partitionings.items()} == {
        n: (i.rv, i.error, i.raw) for n, i in fresh.partitionings.items()
    }


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(STEPS, min_size=15, max_size=60))
def test_any_history_of_events_and_relists_reads_as_the_objects_it_ends_with(
    history: list[tuple[str, Any, Any, bool]],
) -> None:
    api = ApiServer()
    for step in history:
        api.step(*step)
        if not api.missed:  # every event so far delivered: the index is the objects now
            _assert_same_reading(api.index, api.fresh())
    for kind in sorted(api.missed):
        api.relist(kind)
    _assert_same_reading(api.index, api.fresh())
    assert _decisions(api.index) == _decisions(api.fresh())


def test_the_history_oracle_sees_a_lost_event_until_the_relist() -> None:
    """The comparison above can fail: a lost deletion leaves the pod in the index (it still
    holds its node's slice) until the pods are relisted."""
    api = ApiServer()
    api.step("node", "n1", 0, True)
    template = PodTemplate("nvidia.com/mig-1g.10gb", 1, "", False, False, 0, 0.0)
    api.step("pod", "p1", template, True)
    api.step("advance", "p1", "n1", True)
    api.step("advance", "p1", "n1", True)  # bound to n1
    api.step("delete", "pods", 0, False)  # the deletion is lost
    assert api.index.usage("n1") != api.fresh().usage("n1")
    assert _pod_view(api.index) != _pod_view(api.fresh())
    api.relist("pods")
    assert api.index.usage("n1") == api.fresh().usage("n1")
    assert _pod_view(api.index) == _pod_view(api.fresh())


@pytest.mark.parametrize("narrowed_to", ["team", "n2"])
def test_narrowing_a_gated_pod_changes_its_eligible_nodes_at_once(narrowed_to: str) -> None:
    """The index keeps a pod's eligible nodes across updates that leave its node constraints
    alone; a narrowed nodeSelector or node affinity (allowed while gated) is not such an
    update, even though the node topology did not change."""
    api = ApiServer()
    api.step("node", "n1", 0, True)
    api.step("node", "n2", 3, True)  # the team's node
    api.step("pod", "p1", PodTemplate("nvidia.com/mig-1g.10gb", 1, "", False, False, 0, 0.0), True)
    (pod,) = api.index.waiting()
    assert api.index.eligible(pod, api.index.gpu_nodes()) == {"n1", "n2"}
    api.step("narrow", "p1", narrowed_to, True)
    (pod,) = api.index.waiting()
    assert api.index.eligible(pod, api.index.gpu_nodes()) == {"n2"}
    _assert_same_reading(api.index, api.fresh())
