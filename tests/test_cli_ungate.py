"""``gpuslice ungate`` against the test API server (kmock, Kubernetes' pod rules enforced),
including the uninstall hook's steps (``--stop-partitioner``, ``--delete-lease``, ``--cleanup``).

The command is synchronous (kubernetes_asyncio on an event loop of its own), so it runs in a
worker thread while the fake API server serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock
import pytest
from fake_apiserver import (
    LEASE_RESOURCE,
    MWC_RESOURCE,
    NP_PATH,
    NP_RESOURCE,
    ApiServer,
    declare,
    declare_leases,
    stored,
    write_kubeconfig,
)

from gpuslice.cli import EXIT_BAD_INPUT, main
from gpuslice.commands import ungate
from partitioner.gating import GATE
from partitioner.reservations import RESERVATION_ANNOTATION

KUEUE = "kueue.x-k8s.io/admission"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


@pytest.fixture
def kubeconfig(kmock: ApiServer, tmp_path: Path) -> Path:
    declare(kmock)
    return write_kubeconfig(kmock, tmp_path / "kubeconfig")


def pod(name: str, namespace: str = "default", *gates: str, **annotations: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = annotations
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox"}]}
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


async def create(api: ApiServer, body: dict[str, Any]) -> None:
    ns = body["metadata"]["namespace"]
    resp = await api.post(f"/api/v1/namespaces/{ns}/pods", json=body)
    assert resp.status in (200, 201), await resp.text()


async def cli(
    capsys: pytest.CaptureFixture[str], kubeconfig: Path, *argv: str
) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(main, ["ungate", "--kubeconfig", str(kubeconfig), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def spec_of(api: ApiServer, name: str, namespace: str = "default") -> dict[str, Any]:
    obj = stored(api, "v1/pods", name, namespace)
    assert obj is not None
    return obj


def pod_patches(api: ApiServer) -> list[str]:
    return [
        r.url.path.rsplit("/", 1)[-1]
        for r in list(api)
        if str(r.method).upper().endswith("PATCH") and "/pods/" in r.url.path
    ]


RESERVED = {RESERVATION_ANNOTATION: '{"node":"n1","state":"planned"}', "keep": "me"}


async def cluster(api: ApiServer) -> None:
    await create(api, pod("ours", "default", GATE, **RESERVED))
    await create(api, pod("both", "ml", KUEUE, GATE))
    await create(api, pod("kueue", "ml", KUEUE))
    await create(api, pod("free", "default"))


async def test_all_releases_every_gpuslice_gate_and_nothing_else(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await cluster(kmock)
    rc, out, err = await cli(capsys, kubeconfig, "--all")
    assert (rc, err) == (0, "")
    assert sorted(out.splitlines()) == [
        "2 pod(s) released",
        "released default/ours",
        "released ml/both",
    ]
    ours = spec_of(kmock, "ours")
    assert "schedulingGates" not in ours["spec"]
    assert ours["metadata"]["annotations"] == {"keep": "me"}  # the reservation is cleared
    assert spec_of(kmock, "both", "ml")["spec"]["schedulingGates"] == [{"name": KUEUE}]
    assert spec_of(kmock, "kueue", "ml")["spec"]["schedulingGates"] == [{"name": KUEUE}]
    assert sorted(pod_patches(kmock)) == ["both", "ours"]
    kinds = {
        r.headers.get("Content-Type", "").split(";")[0]
        for r in list(kmock)
        if str(r.method).upper().endswith("PATCH")
    }
    assert kinds == {"application/merge-patch+json"}  # not strategic: gates merge by name there

    rc, out, _ = await cli(capsys, kubeconfig, "--all")  # idempotent
    assert (rc, out) == (0, "0 pod(s) released\n")


async def test_namespace_and_dry_run(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await cluster(kmock)
    rc, out, _ = await cli(capsys, kubeconfig, "--all", "-n", "ml", "--dry-run")
    assert (rc, out) == (0, "would release ml/both\n1 pod(s) would release\n")
    assert pod_patches(kmock) == []
    rc, out, _ = await cli(capsys, kubeconfig, "--all", "--namespace", "ml")
    assert (rc, out) == (0, "released ml/both\n1 pod(s) released\n")
    assert GATE in [g["name"] for g in spec_of(kmock, "ours")["spec"]["schedulingGates"]]


async def test_named_pods_missing_and_ungated_ones_are_reported(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await cluster(kmock)
    rc, out, err = await cli(capsys, kubeconfig, "ours", "ml/kueue", "ml/nope")
    assert rc == 1
    assert out.splitlines() == [
        "released default/ours",
        "ml/kueue is not gated by gpuslice: nothing to do",
        "1 pod(s) released, 1 failed",
    ]
    assert err.startswith("gpuslice ungate: error: pod ml/nope: 404")


async def test_a_conflict_is_retried_on_the_re_read_pod(
    kmock: ApiServer,
    kubeconfig: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Someone changes each pod between our read and our patch: the first pod is still gated
    after the change (released on the retry), the second was released by the partitioner."""
    await create(kmock, pod("a", "default", GATE))
    await create(kmock, pod("b", "default", GATE))
    original = ungate.Cluster.patch
    changed: list[str] = []

    def racing_patch(self: ungate.Cluster, ns: str, name: str, body: dict[str, Any]) -> None:
        if name not in changed:
            changed.append(name)
            obj = kmock.objects[kmock.resource("v1/pods"), ns, name]
            change: dict[str, Any] = {"metadata": {"resourceVersion": f"77{name}"}}
            if name == "b":
                change["spec"] = {"schedulingGates": None}
            obj.patch(change)
        original(self, ns, name, body)

    monkeypatch.setattr(ungate.Cluster, "patch", racing_patch)
    rc, out, err = await cli(capsys, kubeconfig, "--all")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        "released default/a",
        "default/b is not gated by gpuslice: nothing to do",
        "1 pod(s) released",
    ]
    assert pod_patches(kmock) == ["a", "a", "b"]  # a: 409, retried; b: 409, re-read, ungated
    assert "schedulingGates" not in spec_of(kmock, "a")["spec"]


async def test_a_pod_deleted_before_its_patch_is_done_not_a_failure(
    kmock: ApiServer,
    kubeconfig: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod deleted between the listing and its patch (404), or between a 409 and the re-read,
    is gone: nothing of it is left gated, so it is reported as such and the command (the
    uninstall hook) still succeeds.  A named pod that is missing from the start is an error
    (test above)."""
    for name in ("a", "b", "c"):
        await create(kmock, pod(name, "default", GATE))
    original = ungate.Cluster.patch

    def racing_patch(self: ungate.Cluster, ns: str, name: str, body: dict[str, Any]) -> None:
        key = (kmock.resource("v1/pods"), ns, name)
        if name == "a":  # deleted before our patch: 404
            del kmock.objects[key]
        elif name == "b" and body["metadata"].get("resourceVersion") != "77b":
            kmock.objects[key].patch({"metadata": {"resourceVersion": "77b"}})
            original(self, ns, name, body)  # 409: changed meanwhile...
        elif name == "b":
            raise AssertionError("pod b was patched again though it is gone")
        original(self, ns, name, body)

    original_get = ungate.Cluster.get

    def deleted_before_re_read(self: ungate.Cluster, ns: str, name: str) -> dict[str, Any]:
        if name == "b":  # ...and deleted before the re-read: 404
            del kmock.objects[(kmock.resource("v1/pods"), ns, name)]
        return original_get(self, ns, name)

    monkeypatch.setattr(ungate.Cluster, "patch", racing_patch)
    monkeypatch.setattr(ungate.Cluster, "get", deleted_before_re_read)
    rc, out, err = await cli(capsys, kubeconfig, "--all")
    assert (rc, err) == (0, ""), f"a deleted pod made gpuslice ungate fail: {err}"
    assert out.splitlines() == [
        "default/a is gone (deleted meanwhile): nothing to do",
        "default/b is gone (deleted meanwhile): nothing to do",
        "released default/c",
        "1 pod(s) released",
    ]
    assert "schedulingGates" not in spec_of(kmock, "c")["spec"]


async def test_remove_webhook_then_release(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await create(kmock, pod("ours", "default", GATE))
    mwc = {"metadata": {"name": "gs-gpuslice"}, "webhooks": []}
    await kmock.post(f"/apis/{MWC_RESOURCE}", json=mwc)
    rc, out, _ = await cli(capsys, kubeconfig, "--all", "--remove-webhook", "gs-gpuslice")
    assert rc == 0
    assert out.splitlines() == [
        "MutatingWebhookConfiguration gs-gpuslice deleted",
        "released default/ours",
        "1 pod(s) released",
    ]
    assert stored(kmock, MWC_RESOURCE, "gs-gpuslice") is None
    rc, out, _ = await cli(capsys, kubeconfig, "--all", "--remove-webhook", "gs-gpuslice")
    assert (rc, out.splitlines()[0]) == (
        0,
        "MutatingWebhookConfiguration gs-gpuslice already absent",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "name the pods to release, or give --all"),
        (("--all", "p1"), "either --all or pod names"),
        (("a/b/c",), "pod 'a/b/c': expected NAME or NAMESPACE/NAME"),
        (("/p1",), "pod '/p1': expected NAME or NAMESPACE/NAME"),
        (("ml/p1", "-n", "default"), "pod 'ml/p1' is not in --namespace default"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    rc = main(["ungate", "--kubeconfig", str(tmp_path / "none"), *argv])
    assert rc == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_unreadable_kubeconfig_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    assert main(["ungate", "--all", "--kubeconfig", str(missing)]) == EXIT_BAD_INPUT
    assert f"cannot connect: kubeconfig {missing}" in capsys.readouterr().err


async def test_unreachable_api_server_exits_1(
    kmock: kmock.KubernetesEmulator, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
        "current-context": "k",
    }
    path.write_text(json.dumps(config))
    rc, _, err = await cli(capsys, path, "--all")
    assert rc == 1
    assert "gpuslice ungate: error: pods: cannot reach the API server" in err


# ------------------------------------------------------------------ uninstall: --cleanup

DEPLOYMENTS = "apps/v1/deployments"
NS = "gpu-system"
PARTITIONER = "gs-gpuslice-partitioner"
UNINSTALL = (
    "--all",
    "--remove-webhook",
    "gs-gpuslice",
    "--stop-partitioner",
    f"{NS}/{PARTITIONER}",
    "--delete-lease",
    f"{NS}/{PARTITIONER}",
    "--cleanup",
)
SELECTOR = {"app.kubernetes.io/instance": "gs", "app.kubernetes.io/component": "partitioner"}
KUBELET_READY = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
OURS = {"type": "GpusliceReady", "status": "False", "reason": "Draining", "message": "..."}


def node(name: str, labels: dict[str, str], conditions: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"conditions": conditions},
    }


async def installed(api: ApiServer) -> None:
    """A cluster with gpuslice running: what the uninstall hook finds."""
    declare_leases(api)
    api.resources[DEPLOYMENTS] = kmock.ResourceInfo(
        kind="Deployment",
        singular="deployment",
        namespaced=True,
        verbs={"list", "watch", "get", "create", "patch", "delete"},
        subresources={"scale"},
    )
    deployment = {
        "metadata": {"name": PARTITIONER, "namespace": NS},
        "spec": {"replicas": 2, "selector": {"matchLabels": SELECTOR}},
    }
    await api.post(f"/apis/apps/v1/namespaces/{NS}/deployments", json=deployment)
    await api.post(
        f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases",
        json={"metadata": {"name": PARTITIONER, "namespace": NS}, "spec": {}},
    )
    await api.post(f"/apis/{MWC_RESOURCE}", json={"metadata": {"name": "gs-gpuslice"}})
    controller = pod("gs-gpuslice-partitioner-7d9f", NS)
    controller["metadata"]["labels"] = {**SELECTOR, "app.kubernetes.io/name": "gpuslice"}
    hook = pod("gs-gpuslice-ungate-x2k4", NS)  # the hook's own pod: not waited for
    hook["metadata"]["labels"] = {"app.kubernetes.io/component": "ungate"}
    mps = pod("infer", "ml")
    mps["spec"]["nodeName"] = "n1"
    mps["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu-10gb": "1"}}
    mig = pod("train", "ml")
    mig["spec"]["nodeName"] = "n1"
    mig["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": "1"}}
    for p in (controller, hook, mps, mig, pod("ours", "default", GATE, **RESERVED)):
        await create(api, p)
    nodes = [
        node("n1", {"gpuslice.io/partitioning": "mps", MANAGED: "true"}, [KUBELET_READY, OURS]),
        node("n2", {MANAGED: "true"}, [KUBELET_READY]),
        node("n3", {"kubernetes.io/os": "linux"}, [KUBELET_READY]),
    ]
    for n in nodes:
        await api.post("/api/v1/nodes", json=n)
    for name in ("n1", "n2"):
        np = {"metadata": {"name": name}, "spec": {"mode": "mps", "gpus": []}}
        await api.post(NP_PATH, json=np)


MANAGED = "gpuslice.io/managed"


def writes(api: ApiServer) -> list[str]:
    return [f"{w.method} {w.path}" for w in api.writes]


async def test_uninstall_stops_the_partitioner_then_releases_then_cleans_up(
    kmock: ApiServer,
    kubeconfig: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await installed(kmock)
    first_write = len(kmock.writes)
    waited: list[float] = []

    def partitioner_ends(seconds: float) -> None:  # the ReplicaSet deletes its pod meanwhile
        waited.append(seconds)
        kmock.objects[kmock.resource("v1/pods"), NS, "gs-gpuslice-partitioner-7d9f"].delete()

    monkeypatch.setattr(ungate, "_sleep", partitioner_ends)
    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL)

    assert rc == 0, err
    assert out.splitlines() == [
        "MutatingWebhookConfiguration gs-gpuslice deleted",
        f"Deployment {NS}/{PARTITIONER} scaled to 0: no partitioner pod runs",
        f"Lease {NS}/{PARTITIONER} deleted",
        "released default/ours",
        "1 pod(s) released",
        "NodePartitioning n1 deleted",
        "NodePartitioning n2 deleted",
        "removed condition GpusliceReady from node n1",
        "removed label gpuslice.io/managed from node n1",
        "removed label gpuslice.io/managed from node n2",
    ]
    assert waited == [1.0]  # one wait: the hook's own pod did not count
    assert "1 running pod(s) use MPS slices: ml/infer" in err  # not ml/train: MIG survives
    deployment = stored(kmock, DEPLOYMENTS, PARTITIONER, NS)
    assert deployment is not None and deployment["spec"]["replicas"] == 0
    assert stored(kmock, LEASE_RESOURCE, PARTITIONER, NS) is None
    assert stored(kmock, NP_RESOURCE, "n1") is None and stored(kmock, NP_RESOURCE, "n2") is None
    n1 = stored(kmock, "v1/nodes", "n1")
    assert n1 is not None and n1["status"]["conditions"] == [KUBELET_READY]
    assert n1["metadata"]["labels"] == {"gpuslice.io/partitioning": "mps"}  # the user's stays
    # in this order: nothing is cleaned while a partitioner could re-create it
    done = writes(kmock)[first_write:]
    order = ["mutatingwebhook", "scale", "leases", "pods", "nodepartitionings", "nodes"]
    kinds = [next(k for k in order if k in w) for w in done]
    assert kinds == sorted(kinds, key=order.index) and set(kinds) == set(order)
    assert not [w for w in done if w.endswith("/nodes/n3") or "/nodes/n3/" in w]

    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL)  # again: nothing left to do
    assert rc == 0
    assert out.splitlines() == [
        "MutatingWebhookConfiguration gs-gpuslice already absent",
        f"Deployment {NS}/{PARTITIONER} scaled to 0: no partitioner pod runs",
        f"Lease {NS}/{PARTITIONER} already absent",
        "0 pod(s) released",
    ]


async def test_uninstall_dry_run_changes_nothing(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await installed(kmock)
    before = len(kmock.writes)
    rc, out, _ = await cli(capsys, kubeconfig, *UNINSTALL, "--dry-run")
    assert rc == 0 and len(kmock.writes) == before
    assert out.splitlines() == [
        "would delete MutatingWebhookConfiguration gs-gpuslice",
        f"would scale Deployment {NS}/{PARTITIONER} to 0 replicas",
        f"would delete Lease {NS}/{PARTITIONER}",
        "would release default/ours",
        "1 pod(s) would release",
        "would delete NodePartitioning n1",
        "would delete NodePartitioning n2",
        "would remove condition GpusliceReady from node n1",
        "would remove label gpuslice.io/managed from node n1",
        "would remove label gpuslice.io/managed from node n2",
    ]


async def test_a_partitioner_that_does_not_stop_is_an_error_and_the_rest_still_runs(
    kmock: ApiServer,
    kubeconfig: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await installed(kmock)
    ticks = iter(range(0, 10_000, 30))
    monkeypatch.setattr(ungate, "_clock", lambda: float(next(ticks)))
    monkeypatch.setattr(ungate, "_sleep", lambda s: None)
    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL, "--wait-seconds", "60")
    assert rc == 1
    assert (
        f"Deployment {NS}/{PARTITIONER}: pod(s) gs-gpuslice-partitioner-7d9f still running "
        "after 60 s" in err
    )
    assert "NodePartitioning n1 deleted" in out.splitlines()  # every step runs


async def test_a_node_changed_meanwhile_is_read_again(
    kmock: ApiServer,
    kubeconfig: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kubelet updates n1's status between our list and our patch: 409, re-read, retry."""
    await installed(kmock)
    pods = kmock.resource("v1/pods")
    monkeypatch.setattr(
        ungate, "_sleep", lambda s: kmock.objects[pods, NS, "gs-gpuslice-partitioner-7d9f"].delete()
    )
    original = ungate.Cluster.patch_node
    raced: list[str] = []

    pressure = {"type": "DiskPressure", "status": "False"}

    def kubelet_races(
        self: ungate.Cluster, name: str, body: dict[str, Any], status: bool = False
    ) -> None:
        if status and not raced:
            raced.append(name)
            obj = kmock.objects[kmock.resource("v1/nodes"), None, name]
            conditions = [KUBELET_READY, OURS, pressure]
            meta = {"resourceVersion": "999"}
            obj.patch({"metadata": meta, "status": {"conditions": conditions}})
        original(self, name, body, status)

    monkeypatch.setattr(ungate.Cluster, "patch_node", kubelet_races)
    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL)
    assert (rc, raced) == (0, ["n1"]), err
    n1 = stored(kmock, "v1/nodes", "n1")
    assert n1 is not None
    assert n1["status"]["conditions"] == [KUBELET_READY, pressure]
    assert "removed condition GpusliceReady from node n1" in out.splitlines()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--cleanup",), "--cleanup removes gpuslice from the whole cluster: give it with --all"),
        (("--all", "--stop-partitioner", "gpuslice"), "expected NAMESPACE/DEPLOYMENT"),
        (("--all", "--delete-lease", "a/b/c"), "expected NAMESPACE/NAME"),
        (("--all", "--stop-partitioner", "a/b", "--wait-seconds", "0"), "--wait-seconds 0"),
    ],
)
def test_uninstall_flags_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    assert main(["ungate", "--kubeconfig", str(tmp_path / "none"), *argv]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


async def test_an_expired_continue_token_starts_the_list_over(
    kmock: ApiServer, kubeconfig: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """The pod list spans pages and the API server no longer keeps the continue token (410
    Expired, after an etcd compaction): the uninstall hook released no pod and exited 1,
    leaving every gated pod gated with nothing left to release it.  The list starts over once,
    as kubectl's pager does, and every pod is released once."""
    from gpuslice import cluster_client

    monkeypatch.setattr(cluster_client, "_PAGE", 2)  # stands for 500 on a big cluster
    for i in range(5):
        await create(kmock, pod(f"p{i}", "default", GATE))
    kmock.expire_continues = 1
    rc, _, err = await cli(capsys, kubeconfig, "--all")
    assert rc == 0, err
    assert not [i for i in range(5) if spec_of(kmock, f"p{i}")["spec"].get("schedulingGates")]
    kmock.expire_continues = 2  # twice in one listing: told, not looped
    for i in range(5, 10):
        await create(kmock, pod(f"p{i}", "default", GATE))
    rc, _, err = await cli(capsys, kubeconfig, "--all")
    assert rc != 0 and "410" in err


def test_mps_clients_include_sidecars() -> None:
    from gpuslice.commands.ungate import mps_clients

    base = {"metadata": {"namespace": "ns", "name": "p"}, "status": {"phase": "Running"}}
    sidecar = {"name": "s", "restartPolicy": "Always",
               "resources": {"limits": {"nvidia.com/gpu-10gb": "1"}}}  # fmt: skip
    plain_init = {**sidecar, "restartPolicy": None}
    pod_with = base | {"spec": {"nodeName": "n", "containers": [], "initContainers": [sidecar]}}
    pod_init = base | {"spec": {"nodeName": "n", "containers": [], "initContainers": [plain_init]}}
    assert mps_clients(iter([pod_with])) == ["ns/p"]
    assert mps_clients(iter([pod_init])) == []  # done before the app starts
