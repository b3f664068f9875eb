"""``gpuslice status``: each waiting pod's state, read from the objects alone (no Events needed).

The document is a pure function of the nodes, pods and NodePartitionings
(:func:`gpuslice.commands.status.status_document`), tested on plain objects; the command
itself runs against the test API server (kmock), in a worker thread like ``gpuslice ungate``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import test_cli_ungate
from fake_apiserver import CLAIM_RESOURCE, NP_PATH, ApiServer, declare_dra
from test_partitioner_promises import MIG, ONE_G, SEVEN_G, T0, applied_np, gated, status_gpu
from test_partitioner_snapshot import node

from gpuslice.cli import EXIT_BAD_INPUT, main
from gpuslice.commands.status import status_document
from partitioner.reservations import RESERVATION_ANNOTATION


def reserved(pod: dict[str, Any], node_name: str, state: str, deadline: float) -> dict[str, Any]:
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": node_name,
                "state": state,
                "gpus": {ONE_G: [0]},
                "plan": "7",
                "since": T0,
                "deadline": deadline,
            }
        )
    }
    if state == "released":
        pod["spec"].pop("schedulingGates")
    return pod


def silent(node_obj: dict[str, Any]) -> dict[str, Any]:
    node_obj.setdefault("status", {})["conditions"] = [
        {"type": "GpusliceReady", "status": "False", "reason": "AgentSilent", "message": "gone"}
    ]
    return node_obj


def objects() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    applying = applied_np("n1", status_gpu(0), status_gpu(1))
    applying["metadata"]["generation"] = 3  # a new spec, not observed yet
    pods = [
        gated("old-1g", ONE_G, created=T0 - 600),
        gated("young-1g", ONE_G, created=T0 - 60),
        gated("big", SEVEN_G, created=T0 - 30),
        reserved(gated("planned", ONE_G, created=T0 - 900), "n1", "planned", T0 + 120),
        reserved(gated("released", ONE_G, created=T0 - 1000), "n2", "released", T0 - 30),
    ]
    ungated = gated("no-gate", ONE_G, created=T0 - 10)
    ungated["spec"].pop("schedulingGates")
    pods.append(ungated)
    bound = gated("running", ONE_G, created=T0 - 5000, nodeName="n2")
    bound["spec"].pop("schedulingGates")
    bound["status"] = {"phase": "Running"}
    pods.append(bound)
    odd = node("n3", {**MIG, "nvidia.com/gpu.product": "Mystery-GPU"})  # a model not known
    odd["status"]["conditions"] = [
        {"type": "GpusliceReady", "status": "False", "reason": "UnknownModel", "message": "?"}
    ]
    # n4: the one node that can be planned now (without it every gated pod here waits for a
    # node that is left out: n1 applying, n2 silent, n3 unreadable)
    nodes = [node("n1", MIG), silent(node("n2", MIG)), odd, node("cpu-only", {}), node("n4", MIG)]
    nps = [
        applying,
        applied_np("n2", status_gpu(0), status_gpu(1)),
        applied_np("n4", status_gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, True))),
    ]
    return nodes, pods, nps


def test_each_waiting_pod_says_what_it_waits_for_in_the_order_it_is_served() -> None:
    nodes, pods, nps = objects()
    doc = status_document(nodes, pods, nps, T0)
    rows = {r["pod"]: r for r in doc["pods"]}
    assert [r["pod"] for r in doc["pods"]] == [
        "ns/released",
        "ns/planned",
        "ns/old-1g",
        "ns/young-1g",
        "ns/big",
        "ns/no-gate",
    ]
    assert (rows["ns/old-1g"]["state"], rows["ns/old-1g"]["ahead"]) == ("queued", 0)
    assert (rows["ns/young-1g"]["ahead"], rows["ns/big"]["ahead"]) == (1, 0)  # per request
    assert rows["ns/young-1g"]["waiting_s"] == 60 and rows["ns/big"]["request"] == "mig-7g.80gb"
    planned = rows["ns/planned"]
    assert (planned["state"], planned["node"]) == ("planned", "n1")
    assert "plan 7: node applying it (deadline in 2m)" in planned["detail"]
    released = rows["ns/released"]
    assert (released["state"], released["node"]) == ("released", "n2")
    assert "bind deadline 30s ago" in released["detail"]
    assert "node n2 AgentSilent: gone" in released["detail"]
    assert (rows["ns/no-gate"]["state"], rows["ns/no-gate"]["ahead"]) == ("ungated", None)
    assert "ns/running" not in rows
    n1, n2, n3, _ = doc["nodes"]  # opted-in nodes only, the unreadable one too
    assert (n3["node"], n3["mode"], n3["reason"]) == ("n3", "-", "UnknownModel")
    assert (n1["node"], n1["applied"], n1["generation"], n1["planned"]) == ("n1", False, 3, 1)
    assert (n2["ready"], n2["reason"], n2["released"]) == ("False", "AgentSilent", 1)


def test_named_pods_only_and_a_pod_that_does_not_wait_says_what_it_is() -> None:
    nodes, pods, nps = objects()
    doc = status_document(nodes, pods, nps, T0, only=["ns/young-1g", "ns/running"])
    assert [(r["pod"], r["state"], r["ahead"]) for r in doc["pods"]] == [
        ("ns/young-1g", "queued", 1),  # counted behind old-1g though that one is not shown
        ("ns/running", "bound", None),
    ]


def test_a_bound_dra_pod_whose_claim_cannot_be_prepared_is_listed_with_the_agents_error() -> None:
    """DRA mode: the agent reports the claims whose prepare fails (``prepareFailures``); a pod
    bound there that has not started and names one is listed ``unprepared`` with the error,
    a started pod naming one is not, and the node counts them."""
    from test_partitioner_dra import DRA, claim_pod

    def bound(name: str, phase: str) -> dict[str, Any]:
        pod = claim_pod(name, f"cl-{name}", gate=False)
        pod["spec"].pop("schedulingGates", None)
        pod["spec"]["nodeName"] = "d1"
        pod["status"] = {"phase": phase}
        return pod

    np_obj = applied_np("d1", status_gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, True)))
    np_obj["status"]["prepareFailures"] = [
        {"claim": f"ns/cl-{n}", "uid": n, "message": "XID 79 on GPU 0", "since": "T"}
        for n in ("stuck", "started")
    ]
    pods = [bound("stuck", "Pending"), bound("started", "Running")]
    doc = status_document([node("d1", DRA)], pods, [np_obj], T0)
    (row,) = doc["pods"]
    assert (row["pod"], row["state"], row["node"]) == ("ns/stuck", "unprepared", "d1")
    assert "failed to prepare ResourceClaim ns/cl-stuck since T: XID 79 on GPU 0" in row["detail"]
    assert doc["nodes"][0]["unprepared"] == 2
    assert (
        status_document([node("d1", DRA)], pods, [np_obj], T0, only=["ns/started"])["pods"][0][
            "state"
        ]
        == "bound"
    )


# ------------------------------------------------------------------ the command, on the wire

kmock_options = test_cli_ungate.kmock_options
kubeconfig = test_cli_ungate.kubeconfig
"""The fixtures of ``gpuslice ungate``'s tests: kmock serves the fake API server, and a
kubeconfig points at it."""


async def test_the_command_reads_the_cluster_and_prints_json_tables_and_events(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods, nps = objects()
    for n in nodes:
        assert (await kmock.post("/api/v1/nodes", json=n)).status in (200, 201)
    for np_obj in nps:
        assert (await kmock.post(NP_PATH, json=np_obj)).status in (200, 201)
    await kmock.post("/api/v1/namespaces/ns", json={"metadata": {"name": "ns"}})
    for p in pods:
        resp = await kmock.post("/api/v1/namespaces/ns/pods", json=p)
        assert resp.status in (200, 201), await resp.text()
    event = {
        "metadata": {"name": "e1", "namespace": "ns"},
        "involvedObject": {"kind": "Pod", "name": "planned", "namespace": "ns"},
        "type": "Normal",
        "reason": "Reserved",
        "message": "slice planned on node n1 GPU 0",
        "lastTimestamp": "2027-01-15T08:00:00Z",
    }
    assert (await kmock.post("/api/v1/namespaces/ns/events", json=event)).status in (200, 201)
    other = {
        **event,
        "metadata": {"name": "e2", "namespace": "ns"},
        "involvedObject": {"kind": "Pod", "name": "big", "namespace": "ns"},
        "message": "about another pod",
    }
    assert (await kmock.post("/api/v1/namespaces/ns/events", json=other)).status in (200, 201)

    def run(*argv: str) -> tuple[int, str, str]:
        rc = main(["status", "--kubeconfig", str(kubeconfig), *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, out, _ = await asyncio.to_thread(run, "-o", "json")
    assert rc == 0
    doc = json.loads(out)
    assert [r["state"] for r in doc["pods"]][:2] == ["released", "planned"]
    rc, out, _ = await asyncio.to_thread(run)
    assert rc == 0 and "NODE" in out and "AgentSilent" in out and "ns/old-1g" in out
    rc, out, _ = await asyncio.to_thread(run, "-n", "ns", "planned")
    assert rc == 0 and "ns/planned" in out and "ns/old-1g" not in out
    assert "Reserved: slice planned on node n1 GPU 0" in out and "another pod" not in out
    rc, _, err = await asyncio.to_thread(run, "ns/nope")
    assert rc == EXIT_BAD_INPUT and "no such pod: ns/nope" in err
    rc, _, err = await asyncio.to_thread(run, "a/b/c")
    assert rc == EXIT_BAD_INPUT and "expected NAME or NAMESPACE/NAME" in err


@pytest.mark.parametrize("served", [True, False], ids=["claims-served", "no-dra-api"])
async def test_on_a_dra_cluster_the_command_reads_the_claims(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str], served: bool
) -> None:
    """A DRA node makes the command list ResourceClaims: a waiting claim pod shows what it
    asks for.  An API server that serves no ResourceClaim kind (404) is no error."""
    from test_partitioner_dra import DRA, claim, claim_pod, mig_request

    if served:
        declare_dra(kmock)
    assert (await kmock.post("/api/v1/nodes", json=node("d1", DRA))).status in (200, 201)
    await kmock.post("/api/v1/namespaces/ns", json={"metadata": {"name": "ns"}})
    resp = await kmock.post("/api/v1/namespaces/ns/pods", json=claim_pod("train", "cl"))
    assert resp.status in (200, 201), await resp.text()
    if served:
        body = claim("cl", mig_request())
        resp = await kmock.post(f"/apis/{CLAIM_RESOURCE.rsplit('/', 1)[0]}/namespaces/ns/"
                                "resourceclaims", json=body)  # fmt: skip
        assert resp.status in (200, 201), await resp.text()

    def run() -> tuple[int, str]:
        rc = main(["status", "--kubeconfig", str(kubeconfig), "-o", "json"])
        return rc, capsys.readouterr().out

    rc, out = await asyncio.to_thread(run)
    assert rc == 0  # a 404 for the claims is no failure
    rows = [(r["pod"], r["state"], r["request"]) for r in json.loads(out)["pods"]]
    # without its claim the pod's demand is unknown: listed as waiting for it (the controller
    # tells it WaitingForClaims and gives it back after a batch window)
    assert rows == (
        [("ns/train", "queued", "mig-3g.40gb")]
        if served
        else [("ns/train", "waiting for claims", "-")]
    )


def test_a_bad_catalog_or_kubeconfig_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--catalog", str(tmp_path / "missing.yaml")]) == EXIT_BAD_INPUT
    assert "missing.yaml" in capsys.readouterr().err
    argv = ["status", "--kubeconfig", str(tmp_path / "nope"), "--context", "x"]
    assert main(argv) == EXIT_BAD_INPUT
    assert "cannot connect" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a: [\n", "ParserError"),  # not YAML
        (  # a context that is a string, not a mapping
            "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
            'contexts: [{name: x, context: "str"}]\nclusters: []\nusers: []\n',
            "AttributeError",
        ),
        (  # numbers where the client library asserts strings
            "apiVersion: v1\nkind: Config\ncurrent-context: 5\n"
            "contexts: [{name: 5, context: {cluster: 5, user: 5}}]\n"
            "clusters: [{name: 5, cluster: {server: 5}}]\nusers: [{name: 5, user: {}}]\n",
            "AssertionError",
        ),
        (  # a server that is not a URL: found at the first call, still bad input
            "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
            "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
            'clusters: [{name: c, cluster: {server: "not a url"}}]\nusers: [{name: u, user: {}}]\n',
            "is not a URL",
        ),
    ],
)
def test_a_malformed_kubeconfig_is_bad_input_with_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, why: str
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    assert main(["status", "--kubeconfig", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert why in err and "kubectl config view" in err and "\n" not in err
    if why != "is not a URL":
        assert str(path) in err


def test_with_the_claims_read_a_failure_of_a_claim_since_deleted_strands_nobody() -> None:
    """The agent reports a prepare failure by claim name and uid; a claim of that name created
    again (another uid) is not the one that failed.  With the claims read (DRA clusters), only
    the failure of the claim now under the name lists its pod ``unprepared``; without them the
    name decides (as before).  The claims also give a waiting claim pod its request."""
    from test_partitioner_dra import DRA, claim, claim_pod, mig_request

    pod = claim_pod("stuck", "cl", gate=False)
    pod["spec"].pop("schedulingGates", None)
    pod["spec"]["nodeName"] = "d1"
    pod["status"] = {"phase": "Pending"}
    now_claim = claim("cl", mig_request(), allocated=True)
    now_claim["metadata"]["uid"] = "uid-new"
    waiting = claim_pod("queued", "cq")
    np_obj = applied_np("d1", status_gpu(0, ("3g.40gb", 0, True)))
    np_obj["status"]["prepareFailures"] = [
        {"claim": "ns/cl", "uid": "uid-old", "message": "XID 79", "since": "T"}
    ]
    objs = ([node("d1", DRA)], [pod, waiting], [np_obj])
    rows = {r["pod"]: r for r in status_document(*objs, T0)["pods"]}
    assert rows["ns/stuck"]["state"] == "unprepared"  # no claims read: the name decides
    with_claims = status_document(*objs, T0, claims=[now_claim, claim("cq", mig_request())])
    rows = {r["pod"]: r for r in with_claims["pods"]}
    assert "ns/stuck" not in rows  # that failure was of the claim deleted before
    assert (rows["ns/queued"]["state"], rows["ns/queued"]["request"]) == ("queued", "mig-3g.40gb")
    np_obj["status"]["prepareFailures"][0]["uid"] = "uid-new"
    again = status_document(*objs, T0, claims=[now_claim])
    assert [r["state"] for r in again["pods"] if r["pod"] == "ns/stuck"] == ["unprepared"]


def test_each_node_shows_its_free_slices_and_those_withheld_from_every_pod() -> None:
    """``free``: instances neither used nor unhealthy; ``withheld`` (wide): unused but kept from
    every pod, because unhealthy (the instance or its whole GPU) or ``foreign`` (processes no
    pod holds it for); used instances are in neither."""
    gpu0 = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False), ("3g.40gb", 4, True))
    gpu0["mig"][1]["unhealthy"] = True
    gpu1 = status_gpu(1, ("3g.40gb", 0, True), ("3g.40gb", 4, False))
    gpu1["mig"][0]["foreign"] = True
    gpu2 = status_gpu(2, ("7g.80gb", 0, False))
    gpu2["unhealthy"] = True  # lost: its free instance is withheld too
    gpu3 = {"index": 3, "mig": [], "mps": [{"memoryMiB": 10240, "activeThreadPercentage": 50}]}
    empty = applied_np("n2")
    doc = status_document(
        [node("n1", MIG), node("n2", MIG), node("n3", MIG)],
        [],
        [applied_np("n1", gpu0, gpu1, gpu2, gpu3), empty],
        T0,
    )
    n1, n2, n3 = doc["nodes"]
    assert n1["free"] == "1g.10gb, 3g.40gb, mps 10gb"
    assert n1["withheld"] == "1g.10gb (unhealthy), 3g.40gb (foreign), 7g.80gb (unhealthy)"
    assert (n2["free"], n2["withheld"]) == ("-", "-")  # reported, nothing on it
    assert (n3["free"], n3["withheld"]) == ("-", "-")  # no NodePartitioning yet


def test_a_pod_other_gates_hold_is_held_and_a_kept_slice_is_not_free() -> None:
    """A pod gated by Kueue too was shown ``queued`` ("waits for a plan") and counted ahead of
    the pods behind it, though gpuslice plans it only once its own gate is left; a node's only
    slice, kept for a released pod, was listed FREE while another pod asking for it queued."""
    both = gated("kueue-held", ONE_G, created=T0 - 600)
    both["spec"]["schedulingGates"].insert(0, {"name": "kueue.x-k8s.io/admission"})
    plain = gated("plain", ONE_G, created=T0 - 60)
    doc = status_document([node("n1", MIG)], [both, plain], [applied_np("n1", status_gpu(0))], T0)
    rows = {r["pod"]: r for r in doc["pods"]}
    assert rows["ns/kueue-held"]["state"] == "held"
    assert "kueue.x-k8s.io/admission" in rows["ns/kueue-held"]["detail"]
    assert rows["ns/kueue-held"]["ahead"] is None and rows["ns/plain"]["ahead"] == 0

    released = gated("released", ONE_G, created=T0 - 100)
    released["spec"].pop("schedulingGates")
    kept = {"node": "n1", "state": "released", "gpus": {ONE_G: [0]}, "plan": "7"}
    kept |= {"since": T0, "deadline": T0 + 60}
    released["metadata"]["annotations"] = {RESERVATION_ANNOTATION: json.dumps(kept)}
    np = applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)))
    doc = status_document([node("n1", MIG)], [released, gated("q", ONE_G)], [np], T0)
    (n1,) = doc["nodes"]
    assert (n1["released"], n1["free"]) == (1, "-")
    np = applied_np("n1", status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False)))
    (n1,) = status_document([node("n1", MIG)], [released], [np], T0)["nodes"]
    assert n1["free"] == "1g.10gb"  # the other one


def test_a_named_unbound_pod_asking_for_no_slice_is_said_to_be_one() -> None:
    """``gpuslice status NAME`` of a pending pod that asks for no gpuslice slice printed
    nothing (the index keeps no such pod): it says what the pod is."""
    cpu = gated("cpu-only", "cpu")
    cpu["spec"].pop("schedulingGates", None)
    doc = status_document([node("n1", MIG)], [cpu], [applied_np("n1", status_gpu(0))], T0,
                          only=["ns/cpu-only"])  # fmt: skip
    (row,) = doc["pods"]
    assert (row["pod"], row["state"], row["detail"]) == (
        "ns/cpu-only",
        "not waiting",
        "asks for no gpuslice slice",
    )


def rejected_objects() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Gated pods the partitioner never plans, beside two it does; the only MPS node is left
    out for its labels (a GPU count that is not a number)."""

    def with_limits(pod: dict[str, Any], **limits: str) -> dict[str, Any]:
        pod["spec"]["containers"][0]["resources"]["limits"].update(limits)
        return pod

    pods = [
        gated("good", ONE_G, created=T0 - 50),
        gated("wrong-model", "nvidia.com/mig-1g.12gb", created=T0 - 45),  # an H100 profile
        gated("near-miss", "nvidia.com/mig-1G.10GB", created=T0 - 40),
        with_limits(
            gated("two-mps", "nvidia.com/gpu-10gb", created=T0 - 35), **{"nvidia.com/gpu-10gb": "2"}
        ),
        with_limits(gated("half", ONE_G, created=T0 - 30), **{ONE_G: "500m"}),
        with_limits(gated("slice-and-gpu", ONE_G, created=T0 - 25), **{"nvidia.com/gpu": "1"}),
        gated("mps", "nvidia.com/gpu-20gb", created=T0 - 20),
        gated("after", ONE_G, created=T0 - 10),
    ]
    broken = node("mps1", {"gpuslice.io/partitioning": "mps", **MIG, "nvidia.com/gpu.count": "x"})
    nodes = [node("n1", MIG), broken]
    return nodes, pods, [applied_np("n1", status_gpu(0), status_gpu(1))]


def test_a_pod_the_partitioner_rejects_is_shown_rejected_with_its_unplaceable_event() -> None:
    """Before, a gated pod the partitioner never plans (a profile its node's model lacks, a
    near-miss name, two MPS slices, an unreadable request, a slice plus nvidia.com/gpu, no
    usable node of its mode) was shown ``queued``: "it waits for a plan or for a slice to
    free", and counted ahead of the pods asking for the same.  Now it is ``rejected`` with the
    text of the partitioner's ``Unplaceable`` Event (the same objects through decide), and
    the pods behind it count only those that wait."""
    from test_partitioner_promises import Cluster, events

    from partitioner.actions import EmitEvent

    nodes, pods, nps = rejected_objects()
    rows = {r["pod"]: r for r in status_document(nodes, pods, nps, T0)["pods"]}
    d = Cluster(*nodes, *pods, *nps).step(T0)
    told = {
        f"{a.ref.namespace}/{a.ref.name}": a.message
        for a in d.actions
        if isinstance(a, EmitEvent) and a.reason == "Unplaceable"
    }
    rejected = {k for k, r in rows.items() if r["state"] == "rejected"}
    assert rejected == {
        "ns/wrong-model",
        "ns/near-miss",
        "ns/two-mps",
        "ns/half",
        "ns/slice-and-gpu",
        "ns/mps",
    }
    assert set(told) == rejected and events(d, "Unplaceable")
    for key in rejected:
        assert rows[key]["detail"] == told[key], key
        assert (rows[key]["ahead"], rows[key]["node"]) == (None, None)
    assert "did you mean nvidia.com/mig-1g.10gb?" in rows["ns/near-miss"]["detail"]
    assert "node mps1, which the pod would fit, is left out: " in rows["ns/mps"]["detail"]
    assert [(rows[k]["state"], rows[k]["ahead"]) for k in ("ns/good", "ns/after")] == [
        ("queued", 0),
        ("queued", 1),
    ]


def test_a_pod_kept_only_by_a_cordon_is_told_the_same_by_status_and_the_event() -> None:
    """The only MIG node is cordoned (a driver upgrade): the controller keeps the pod gated and
    its Event names the node; ``gpuslice status`` says the same."""
    from test_partitioner_promises import Cluster

    from partitioner.actions import EmitEvent

    n1 = node("n1", MIG)
    n1["spec"]["unschedulable"] = True
    pods, nps = [gated("p", ONE_G, created=T0 - 10)], [applied_np("n1", status_gpu(0))]
    (row,) = status_document([n1], pods, nps, T0)["pods"]
    d = Cluster(n1, *pods, *nps).step(T0)
    (told,) = [
        a.message for a in d.actions if isinstance(a, EmitEvent) and a.reason == "Unplaceable"
    ]
    assert "node n1, which the pod would fit, is cordoned (spec.unschedulable)" in told
    assert row["detail"] == told
