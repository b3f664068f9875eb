"""``gpuslice ungate`` against the test API server (kmock, Kubernetes' pod rules enforced).

The command uses the ``kubernetes`` client (synchronous), so it runs in a worker thread while
the fake API server serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from fake_apiserver import MWC_RESOURCE, ApiServer, declare, stored

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
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "k", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
                "current-context": "k",
            }
        )
    )
    return path


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
