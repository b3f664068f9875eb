"""What a pod asks for, as kube-scheduler counts it, decides what gpuslice promises and releases.

A pod is only released to a node where kube-scheduler can bind it: a promise smaller than the
pod's real request, or a release of a pod that asks for something gpuslice nodes never
advertise, pins the pod to a node it can never be bound to (the gate cannot be re-added and
the affinity cannot be widened) while its slice stays held.
"""

from __future__ import annotations

from typing import Any

from test_partitioner_promises import (
    MIG,
    ONE_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from partitioner.gating import GATE
from partitioner.index import ClusterIndex
from partitioner.quantities import pod_requests
from planner.catalog import default_catalog

CAT = default_catalog()


def _free_one_g(*pods: dict[str, Any], free: int = 1) -> Cluster:
    instances = [("1g.10gb", s, False) for s in range(free)]
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": free}),
        applied_np("n1", status_gpu(0, *instances), status_gpu(1)),
        *pods,
    )


def test_a_pod_asking_for_a_slice_and_a_whole_gpu_is_not_released() -> None:
    """gpuslice nodes advertise no ``nvidia.com/gpu`` (NVIDIA's device plugin is off there):
    released, the pod would wait forever pinned to its node, holding the slice.  gpuslice
    gives it back to kube-scheduler instead (a node that is not opted in may offer both; see
    tests/test_partitioner_give_back.py): no reservation, no narrowed affinity."""
    p = gated("p", ONE_G)
    p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    c = _free_one_g(p)
    d = c.step(T0 + 5)
    assert events(d, "Released") == [] and reservation(c, "p") is None
    d = c.step(T0 + 60)  # given back once it has existed for a batch window
    assert "schedulingGates" not in c.pod("p")["spec"]
    assert "affinity" not in c.pod("p")["spec"]
    assert reservation(c, "p") is None
    assert events(d, "Released") == []
    (why,) = events(d, "Ungated")
    assert "nvidia.com/gpu" in why


def test_a_slice_and_a_whole_gpu_pod_leaves_the_free_slice_to_the_next_pod() -> None:
    p = gated("p", ONE_G, created=T0)
    p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    c = _free_one_g(p, gated("q", ONE_G, created=T0 + 1))
    c.step(T0 + 5)
    assert reservation(c, "q") is not None and "schedulingGates" not in c.pod("q")["spec"]


def _sidecar_pod() -> dict[str, Any]:
    """An app container and a sidecar (restartable init container) each with a 1g slice."""
    p = gated("p", ONE_G)
    p["spec"]["initContainers"] = [
        {
            "name": "sidecar",
            "restartPolicy": "Always",
            "resources": {"limits": {ONE_G: "1"}},
        }
    ]
    return p


def test_a_sidecar_slice_adds_to_the_app_containers_slices() -> None:
    """A sidecar runs beside the app containers: kube-scheduler adds its requests to theirs
    (KEP-753), and the kubelet keeps its devices for it."""
    assert pod_requests(_sidecar_pod())[ONE_G] == 2
    plain_init = gated("q", ONE_G)
    plain_init["spec"]["initContainers"] = [{"name": "init", "resources": {"limits": {ONE_G: "1"}}}]
    assert pod_requests(plain_init)[ONE_G] == 1  # a one-off init container's devices are reused


def test_kube_schedulers_rule_for_init_containers_after_sidecars() -> None:
    """An init container after a sidecar runs beside it: max(app + sidecars, init + the
    sidecars started before it)."""
    p = gated("p", ONE_G)
    p["spec"]["initContainers"] = [
        {"name": "side", "restartPolicy": "Always", "resources": {"limits": {ONE_G: "1"}}},
        {"name": "init", "resources": {"limits": {ONE_G: "3"}}},
    ]
    assert pod_requests(p)[ONE_G] == 4  # max(1 + 1, 3 + 1)
    p["spec"]["initContainers"].reverse()  # the init container now runs before the sidecar
    assert pod_requests(p)[ONE_G] == 3  # max(1 + 1, 3)


def test_a_pod_with_a_sidecar_slice_is_promised_both_slices() -> None:
    c = _free_one_g(_sidecar_pod(), free=1)
    d = c.step(T0 + 5)
    assert events(d, "Released") == []  # one free slice: kube-scheduler needs two
    assert c.pod("p")["spec"]["schedulingGates"] == [{"name": GATE}]
    c = _free_one_g(_sidecar_pod(), free=2)
    c.step(T0 + 5)
    r = reservation(c, "p")
    assert r is not None and r.units() == {ONE_G: 2}


def test_the_index_counts_a_bound_sidecar_pods_slices() -> None:
    p = _sidecar_pod()
    p["spec"].pop("schedulingGates")
    p["spec"]["nodeName"] = "n1"
    p["status"]["phase"] = "Running"
    index = ClusterIndex.from_objects(CAT, [node("n1", MIG)], [p])
    assert index.usage("n1").slices == {ONE_G: 2}


def test_pod_level_cpu_and_memory_replace_the_containers_sum() -> None:
    """Pod-level resources (``spec.resources``, on by default since Kubernetes 1.34):
    kube-scheduler counts them instead of the containers' sum; read as 0 CPU, a pod asking
    12 CPUs for itself was released to a node with 4 free (a review's c2)."""
    p = gated("p", ONE_G)
    p["spec"]["resources"] = {"requests": {"cpu": "12", "memory": "8Gi"}}
    p["spec"]["overhead"] = {"cpu": "250m"}
    got = pod_requests(p)
    assert got["cpu"] == 12 + 0.25 and got["memory"] == 8 * 2**30 and got[ONE_G] == 1
    only_limits = gated("q", ONE_G)
    only_limits["spec"]["resources"] = {"limits": {"cpu": "3"}}
    assert pod_requests(only_limits)["cpu"] == 3  # the API server defaults requests to limits
    index = ClusterIndex.from_objects(CAT, [node("n1", MIG)], [p])
    assert index.pods["ns/p"].cpu_milli == 12_250


def test_a_container_asking_for_two_slice_resources_is_refused_with_the_fix() -> None:
    """The kubelet merges the environments of one container's device plugin answers, first
    one wins: a container asking for a 1g and a 2g would see one of them and hold the other
    idle (a review's r1).  Several units of one resource, or one per container, are fine."""
    two = "nvidia.com/mig-2g.20gb"
    bad = gated("bad", ONE_G)
    bad["spec"]["containers"][0]["resources"]["limits"][two] = "1"
    c = _free_one_g(bad, free=2)
    d = c.step(T0 + 5)
    assert events(d, "Released") == [] and reservation(c, "bad") is None
    (why,) = events(d, "Unplaceable")
    assert f"asks for {ONE_G} and {two}" in why and "one slice resource per container" in why
    c.step(T0 + 60)  # given back to kube-scheduler after a batch window, never held
    assert "schedulingGates" not in c.pod("bad")["spec"] and reservation(c, "bad") is None
    ok = gated("ok", ONE_G)
    ok["spec"]["containers"].append({"name": "second", "resources": {"limits": {ONE_G: "1"}}})
    c = _free_one_g(ok, free=2)
    c.step(T0 + 5)
    r = reservation(c, "ok")
    assert r is not None and r.units() == {ONE_G: 2}


def test_a_bound_pod_is_never_refused_its_devices_count_as_used() -> None:
    """The refusals of what a pod asks for (two MIG resources in one container, MIG and MPS
    at once) apply before binding only: a bound pod holds its devices whatever it asked, and
    a plan that took them for free would destroy them under it."""
    two = "nvidia.com/mig-2g.20gb"
    p = gated("p", ONE_G)
    p["spec"]["containers"][0]["resources"]["limits"][two] = "1"
    p["spec"].pop("schedulingGates")
    p["spec"]["nodeName"] = "n1"
    p["status"]["phase"] = "Running"
    index = ClusterIndex.from_objects(CAT, [node("n1", MIG)], [p])
    assert index.usage("n1").slices == {ONE_G: 1, two: 1}
