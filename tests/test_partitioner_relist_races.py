"""The operator's initial listing runs while kopf's watches already deliver events.

kopf starts watching as soon as the startup handler returns, and the controller's own listing
(:meth:`partitioner.operator.Controller.sync`, paginated: seconds on a large cluster) runs at
the same time.  A watch event that arrives while the listing is being read describes the
cluster *after* the listing's snapshot; reconciling the index with the listing must not undo
it: a pod created after the snapshot must not be dropped (nothing re-announces a gated pod, so
it would wait gated until the next restart), and a pod deleted after the snapshot must not come
back (a ghost that holds its slice, or is planned every step ahead of real pods).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from fake_apiserver import _merge_patch
from test_partitioner_dra import claim, mig_request
from test_partitioner_promises import MIG, T0, applied_np, status_gpu, with_alloc
from test_partitioner_snapshot import node

from partitioner.gating import GATE
from partitioner.index import ClusterIndex
from partitioner.kubeapi import NotFound
from partitioner.operator import Controller
from partitioner.settings import PartitionerSettings

ONE_G = "nvidia.com/mig-1g.10gb"


def _pod(name: str, rv: str, **spec: Any) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": rv},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {ONE_G: "1"}}}],
            "schedulingGates": [{"name": GATE}],
            **spec,
        },
        "status": {"phase": "Pending"},
    }


def _controller(
    listings: Mapping[str, tuple[str, list[dict[str, Any]]]],
    during: Callable[[Controller], None],
) -> Controller:
    """A controller whose listing of pods (snapshot ``version``, ``items``) lets ``during``
    fold watch events in while it is read; other kinds list empty."""
    controller = Controller(
        PartitionerSettings(metrics_port=0, health_port=0),
        connection=kopf.ConnectionInfo(server="https://example.invalid"),
    )

    async def list_all(path: str, page_size: int = 500, restarts: int = 3) -> dict[str, Any]:
        kind = path.rsplit("/", 1)[-1]
        version, items = listings.get(kind, ("100", []))
        if kind == "pods":
            during(controller)  # kopf's watch delivers events while the pages are read
        return {"metadata": {"resourceVersion": version}, "items": items}

    controller.api.list_all = list_all  # type: ignore[method-assign]
    return controller


def test_a_pod_created_after_the_listings_snapshot_stays() -> None:
    def during(c: Controller) -> None:
        c.observe("pods", {"type": "ADDED", "object": _pod("new", "120")})

    controller = _controller({"pods": ("100", [_pod("old", "90")])}, during)
    asyncio.run(controller.sync())
    assert sorted(controller.index.pods) == ["ns/new", "ns/old"]
    assert [p.key for p in controller.index.waiting()] == ["ns/new", "ns/old"]


def test_a_pod_deleted_after_the_listings_snapshot_does_not_come_back() -> None:
    def during(c: Controller) -> None:
        c.observe("pods", {"type": None, "object": _pod("gone", "90")})  # kopf's own listing
        c.observe("pods", {"type": "DELETED", "object": _pod("gone", "105")})

    controller = _controller({"pods": ("100", [_pod("gone", "90"), _pod("old", "80")])}, during)
    asyncio.run(controller.sync())
    assert sorted(controller.index.pods) == ["ns/old"]


def test_a_bound_pod_deleted_after_the_snapshot_frees_its_slice() -> None:
    bound = _pod("done", "90", nodeName="n1")
    del bound["spec"]["schedulingGates"]
    bound["status"]["phase"] = "Running"
    gone = {**bound, "metadata": {**bound["metadata"], "resourceVersion": "105"}}

    def during(c: Controller) -> None:
        c.observe("pods", {"type": "DELETED", "object": gone})

    controller = _controller({"pods": ("100", [bound])}, during)
    asyncio.run(controller.sync())
    assert controller.index.usage("n1").slices == {}


def test_a_pod_deleted_before_the_snapshot_is_dropped_and_a_recreated_one_kept() -> None:
    """What the listing is for: a pod deleted while nobody watched goes; a pod deleted and
    created again under the same name after the deletion event is the new pod."""

    def during(c: Controller) -> None:
        c.observe("pods", {"type": None, "object": _pod("stale", "50")})
        c.observe("pods", {"type": None, "object": _pod("again", "40")})
        c.observe("pods", {"type": "DELETED", "object": _pod("again", "60")})

    again = _pod("again", "70")
    again["metadata"]["uid"] = "uid-again-2"
    controller = _controller({"pods": ("100", [again])}, during)
    asyncio.run(controller.sync())
    assert sorted(controller.index.pods) == ["ns/again"]
    assert controller.index.pods["ns/again"].uid == "uid-again-2"


def test_a_pod_the_api_server_no_longer_has_leaves_the_index_on_its_404() -> None:
    """A pod deleted between the controller's snapshot and kopf's own listing gets no DELETED
    event: the listing brings it in and nothing removes it.  Gated, it takes a free slice
    every step ahead of younger pods; the 404 its patch gets is the proof that it is gone."""
    ghost = _pod("ghost", "90")
    ghost["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    listings = {
        "nodes": ("100", [with_alloc(node("n1", MIG), **{"1g_10gb": 1})]),
        "nodepartitionings": ("100", [applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)))]),
        "pods": ("100", [ghost]),
    }
    controller = _controller(listings, lambda c: None)
    controller.offload = False
    patched: list[str] = []

    class Api:
        async def patch(self, path: str, body: Any, content_type: str = "") -> dict[str, Any]:
            patched.append(path)
            if path.endswith("/ghost"):
                raise NotFound(404, "NotFound", 'pods "ghost" not found', path)
            return {}

        async def create(self, path: str, body: Any) -> dict[str, Any]:
            return {}

        async def request(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {}

    controller.writer_api = Api()  # type: ignore[assignment]
    asyncio.run(controller.sync())
    asyncio.run(controller.step(T0))
    assert "/api/v1/namespaces/ns/pods/ghost" in patched
    assert "ns/ghost" not in controller.index.pods


def _release_then_delete(deleted_rv: str | None) -> Controller:
    """A step releases pod p (its PATCH answers at resourceVersion 101); while the step still
    writes its Events, kopf's watch delivers p's DELETED (at ``deleted_rv``)."""
    pod = _pod("p", "90")
    pod["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    listings = {
        "nodes": ("100", [with_alloc(node("n1", MIG), **{"1g_10gb": 1})]),
        "nodepartitionings": ("100", [applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)))]),
        "pods": ("100", [pod]),
    }
    controller = _controller(listings, lambda c: None)
    controller.offload = False
    server: dict[str, Any] = {"p": pod}

    class Api:
        async def patch(self, path: str, body: Any, content_type: str = "") -> dict[str, Any]:
            if not path.endswith("/pods/p"):
                return {}  # the node's condition
            new = _merge_patch(server["p"], body)
            new["metadata"]["resourceVersion"] = "101"
            server["p"] = new
            return dict(new)

        async def create(self, path: str, body: Any) -> dict[str, Any]:
            if "p" in server and server["p"]["metadata"]["resourceVersion"] == "101":
                gone = dict(server.pop("p"))
                gone["metadata"] = {**gone["metadata"], "resourceVersion": deleted_rv}
                controller.observe("pods", {"type": "DELETED", "object": gone})
            return {}

        async def request(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {}

    controller.writer_api = Api()  # type: ignore[assignment]
    asyncio.run(controller.sync())
    asyncio.run(controller.step(T0))
    assert "p" not in server  # the pod was released, then deleted during the step's writes
    return controller


def test_a_pod_deleted_while_the_step_writes_does_not_come_back_with_the_patchs_answer() -> None:
    """The step folds its writes' answers in after they are all done; kopf's handlers fold the
    watch's events in as they come.  A DELETED that came in between is newer than the patch's
    answer: folded in, the answer made a ghost pod that held its released slice for good (no
    DELETED comes again, and no patch is sent it to get a 404)."""
    controller = _release_then_delete("102")
    assert "ns/p" not in controller.index.pods
    assert controller.index.write_deletions is None  # recorded only while writes are in flight


def test_a_deletion_without_a_comparable_version_wins_over_the_answer() -> None:
    controller = _release_then_delete(None)
    assert "ns/p" not in controller.index.pods


def test_an_answer_newer_than_a_deletion_is_folded_in() -> None:
    """The object was deleted and created again under its name before the answer: kept."""
    answer = _pod("p", "120")
    assert not ClusterIndex.stale_response("pods", answer, {("pods", "ns/p"): "110"})
    assert ClusterIndex.stale_response("pods", answer, {("pods", "ns/p"): "120"})
    assert not ClusterIndex.stale_response("pods", answer, {("pods", "ns/q"): "130"})


# -- kopf lists again after a gap in its watch ---------------------------------------------------


class _Gap:
    """A controller whose API lists ``items`` (a dict kind -> pods, mutable), a fake monotonic
    clock, and a step that only counts (the cycle's relisting is what is tested)."""

    def __init__(self, pods: list[dict[str, Any]], **settings: Any) -> None:
        self.now = 0.0
        self.items: dict[str, list[dict[str, Any]]] = {"pods": pods}
        self.listed: list[str] = []
        self.fail = False
        self.steps = 0
        self.controller = Controller(
            PartitionerSettings(metrics_port=0, health_port=0, **settings),
            connection=kopf.ConnectionInfo(server="https://example.invalid"),
            monotonic=lambda: self.now,
        )

        async def list_all(path: str, page_size: int = 500, restarts: int = 3) -> dict[str, Any]:
            kind = path.rsplit("/", 1)[-1]
            self.listed.append(kind)
            if self.fail:
                raise ConnectionError("apiserver unreachable")
            return {"metadata": {"resourceVersion": "500"}, "items": self.items.get(kind, [])}

        async def step(now: float | None = None) -> Any:
            self.steps += 1

        self.controller.api.list_all = list_all  # type: ignore[method-assign]
        self.controller.step = step  # type: ignore[method-assign]

    def kopf_lists(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            self.controller.observe("pods", {"type": None, "object": pod})
            self.now += 0.01


def _bound(name: str, rv: str) -> dict[str, Any]:
    pod = _pod(name, rv, nodeName="n1")
    del pod["spec"]["schedulingGates"]
    pod["status"]["phase"] = "Running"
    return pod


def test_a_bound_pod_deleted_in_a_watch_gap_frees_its_slice_at_kopfs_next_listing() -> None:
    """kopf's watch fails (410 Gone); a bound pod is deleted before kopf lists again, so no
    DELETED event ever comes: without a listing of its own the partitioner counts the pod's
    slice as used until it restarts."""
    done, waiting = _bound("done", "90"), _pod("waiting", "91")
    gap = _Gap([done, waiting])
    c = gap.controller
    asyncio.run(c.sync())
    gap.kopf_lists([done, waiting])  # kopf's first listing, beside the controller's own
    c.observe("pods", {"type": "MODIFIED", "object": _pod("waiting", "95")})  # its watch
    assert c.relist_due == set()
    assert c.index.usage("n1").slices == {ONE_G: 1}

    gap.items["pods"] = [_pod("waiting", "95")]  # "done" deleted while nobody watched
    gap.now += 300
    gap.kopf_lists([_pod("waiting", "95")])
    assert c.relist_due == {"pods"}
    assert c.changed.is_set()  # the next cycle starts at once
    listed = len(gap.listed)
    asyncio.run(c._cycle())
    assert gap.listed[listed:] == ["pods"]  # that kind only
    assert c.relist_due == set()
    assert c.index.usage("n1").slices == {}
    assert sorted(c.index.pods) == ["ns/waiting"]
    assert gap.steps == 1


def test_kopfs_first_listing_after_the_controllers_own_lists_nothing_again() -> None:
    pods = [_pod(f"p{i}", str(10 + i)) for i in range(5)]
    gap = _Gap(pods)
    c = gap.controller
    asyncio.run(c.sync())
    gap.kopf_lists(pods)
    assert c.relist_due == set()
    listed = len(gap.listed)
    asyncio.run(c._cycle())
    assert gap.listed[listed:] == []
    assert gap.steps == 1


def test_a_quiet_kind_listed_again_is_listed_by_the_controller_too() -> None:
    """No watch event between kopf's two listings (nothing changed for minutes, then the
    watch's resourceVersion expired): the second listing is told apart by its time."""
    pods = [_pod("a", "10"), _pod("b", "11")]
    gap = _Gap(pods)
    c = gap.controller
    asyncio.run(c.sync())
    gap.kopf_lists(pods)
    gap.now += 10  # still kopf's first listing, one slow page later
    gap.kopf_lists([_pod("c", "12")])
    assert c.relist_due == set()
    gap.now += 600
    gap.items["pods"] = [_pod("a", "10")]
    gap.kopf_lists([_pod("a", "10")])
    assert c.relist_due == {"pods"}
    asyncio.run(c._cycle())
    assert sorted(c.index.pods) == ["ns/a"]


def test_a_failed_relisting_is_tried_again_and_the_step_still_runs() -> None:
    pods = [_pod("a", "10")]
    gap = _Gap(pods)
    c = gap.controller
    asyncio.run(c.sync())
    gap.kopf_lists(pods)
    c.observe("pods", {"type": "MODIFIED", "object": _pod("a", "20")})
    gap.kopf_lists([_pod("a", "20")])
    gap.fail = True
    asyncio.run(c._cycle())
    assert c.relist_due == {"pods"}
    assert gap.steps == 1
    gap.fail = False
    gap.items["pods"] = []
    asyncio.run(c._cycle())
    assert c.relist_due == set()
    assert c.index.pods == {}
    assert gap.steps == 2


# -- kinds that can run out of objects are listed on a period ------------------------------------


def test_a_partitioning_deleted_in_a_watch_gap_goes_at_the_periodic_listing() -> None:
    """The last NodePartitioning is deleted while kopf's watch had a gap: kopf's next listing
    of that kind is empty, so nothing shows the gap; the periodic listing drops the ghost."""
    gap = _Gap([], relist_seconds=600)
    gap.items["nodepartitionings"] = [applied_np("n1", status_gpu(0))]
    c = gap.controller
    asyncio.run(c.sync())
    assert sorted(c.index.partitionings) == ["n1"]
    gap.items["nodepartitionings"] = []  # deleted; kopf lists the kind again: no object
    gap.now += 599
    listed = len(gap.listed)
    asyncio.run(c._cycle())
    assert gap.listed[listed:] == []  # not yet due
    assert sorted(c.index.partitionings) == ["n1"]
    gap.now += 1
    asyncio.run(c._cycle())
    assert gap.listed[listed:] == ["nodepartitionings"]  # that kind only: pods are not listed
    assert c.index.partitionings == {}
    gap.now += 300
    asyncio.run(c._cycle())
    assert gap.listed[listed:] == ["nodepartitionings"]  # the period counts from that listing
    assert gap.steps == 3


def test_a_claim_deleted_in_a_watch_gap_stops_being_demand_in_dra_mode() -> None:
    gap = _Gap([], relist_seconds=600, dra_enabled=True)
    gap.items["resourceclaims"] = [claim("c1", mig_request())]
    c = gap.controller
    asyncio.run(c.sync())
    assert sorted(c.index.claims) == ["ns/c1"]
    gap.items["resourceclaims"] = []
    gap.now += 600
    listed = len(gap.listed)
    asyncio.run(c._cycle())
    assert sorted(gap.listed[listed:]) == ["nodepartitionings", "resourceclaims"]
    assert c.index.claims == {}


def test_periodic_listing_off() -> None:
    gap = _Gap([], relist_seconds=0)
    gap.items["nodepartitionings"] = [applied_np("n1", status_gpu(0))]
    c = gap.controller
    asyncio.run(c.sync())
    gap.items["nodepartitionings"] = []
    gap.now += 100_000
    listed = len(gap.listed)
    asyncio.run(c._cycle())
    assert gap.listed[listed:] == []
    assert sorted(c.index.partitionings) == ["n1"]
