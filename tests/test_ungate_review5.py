"""``gpuslice ungate --all`` and the uninstall hook (review 5, webhook5 findings 2 and 3).

* A pod gpuslice already *released* (gate removed, required node affinity narrowed to one node,
  reservation ``state: released``) that kube-scheduler has not bound yet was never looked at:
  ``--cleanup`` then deleted its node's NodePartitioning and the pod stayed Pending for good,
  unnamed.  Now one a controller owns is evicted (its controller creates it again, ungated: the
  webhook is gone and the partitioner stopped by then), one nothing owns gets a warning naming
  it and the fix; both lose the reservation annotation.  ``--dry-run`` only reports.
* The webhook's self-managed certificate Secret (CA key included) could outlive the release:
  the hook now deletes it by name once the partitioner stopped (``--delete-secret``), with RBAC
  for exactly that Secret; cert-manager mode renders no such step.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import NP_RESOURCE, ApiServer, stored
from test_chart import VARIANTS, chart, container, env_of, one, render  # noqa: F401
from test_cli_ungate import (
    NS,
    PARTITIONER,
    UNINSTALL,
    cli,
    create,
    installed,
    kubeconfig,  # noqa: F401
    pod,
    writes,
)

from gpuslice.commands import ungate
from partitioner.gating import GATE
from partitioner.reservations import RESERVATION_ANNOTATION

SECRET = "gs-gpuslice-webhook-tls"
RELEASED = '{"gpus":{"nvidia.com/mig-1g.10gb":[0]},"node":"n1","since":1.0,"state":"released"}'
PIN = {"key": "metadata.name", "operator": "In", "values": ["n1"]}


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def released(name: str, namespace: str = "ml", owner: str | None = None) -> dict[str, Any]:
    """A pod gpuslice released to n1 that is not bound yet (``owner``: its ReplicaSet)."""
    p = pod(name, namespace, **{RESERVATION_ANNOTATION: RELEASED, "keep": "me"})
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": "1"}}
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [PIN]}]
            }
        }
    }
    if owner:
        p["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": owner,
                "uid": "0d1c6a3e-0000-4000-8000-000000000001",
                "controller": True,
            }
        ]
    return p


def partitioner_ends(api: ApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def sleep(seconds: float) -> None:
        api.objects[api.resource("v1/pods"), NS, "gs-gpuslice-partitioner-7d9f"].delete()

    monkeypatch.setattr(ungate, "_sleep", sleep)


async def add_secret(api: ApiServer) -> None:
    body = {"metadata": {"name": SECRET}, "type": "kubernetes.io/tls", "data": {"ca.key": "eA=="}}
    resp = await api.post(f"/api/v1/namespaces/{NS}/secrets", json=body)
    assert resp.status in (200, 201), await resp.text()


# -- finding 2: released pods not bound yet ----------------------------------------------------
async def test_uninstall_evicts_an_owned_released_pod_and_names_a_bare_one(
    kmock: ApiServer,
    kubeconfig: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await installed(kmock)
    await create(kmock, released("train-owned", owner="train-7c5d"))
    await create(kmock, released("train-bare"))
    bound = released("train-bound")
    bound["spec"]["nodeName"] = "n1"  # bound: the annotation stays as a record
    await create(kmock, bound)
    ungated = pod("planned", "ml", **{RESERVATION_ANNOTATION: '{"node":"n2","state":"planned"}'})
    await create(kmock, ungated)  # gate removed by hand: not pinned, only the annotation goes
    partitioner_ends(kmock, monkeypatch)
    first = len(kmock.writes)

    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL)

    assert rc == 0, err
    lines = out.splitlines()
    assert any(
        line.startswith("evicted ml/train-owned: released to node n1 but not bound")
        and "its controller (ReplicaSet train-7c5d) creates it again, ungated" in line
        for line in lines
    )
    assert "cleared the reservation of ml/train-bare (not bound)" in lines
    assert "cleared the reservation of ml/planned (not bound)" in lines
    assert not [line for line in lines if "train-bound" in line]
    assert "warning: pod ml/train-bare was released to node n1 but is not bound" in err
    assert "kubectl delete pod -n ml train-bare" in err
    assert "planned" not in err and "train-owned" not in err

    assert stored(kmock, "v1/pods", "train-owned", "ml") is None  # evicted: recreated unpinned
    bare = stored(kmock, "v1/pods", "train-bare", "ml")
    assert bare is not None and bare["metadata"]["annotations"] == {"keep": "me"}
    still = stored(kmock, "v1/pods", "train-bound", "ml")
    assert still is not None and RESERVATION_ANNOTATION in still["metadata"]["annotations"]
    planned = stored(kmock, "v1/pods", "planned", "ml")
    assert planned is not None and RESERVATION_ANNOTATION not in (
        planned["metadata"].get("annotations") or {}
    )
    # the eviction comes after the webhook is gone and the partitioner stopped (the new pod is
    # not gated again), before the NodePartitionings go
    done = writes(kmock)[first:]
    evicted = done.index("POST /api/v1/namespaces/ml/pods/train-owned/eviction")
    webhook = next(i for i, w in enumerate(done) if "mutatingwebhook" in w)
    scale = next(i for i, w in enumerate(done) if "/scale" in w)
    partitionings = [i for i, w in enumerate(done) if "nodepartitionings" in w]
    assert webhook < scale < evicted < min(partitionings)
    assert stored(kmock, NP_RESOURCE, "n1") is None

    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL)  # again: nothing left to do
    assert rc == 0 and "train" not in out and "train" not in err


async def test_dry_run_reports_released_pods_and_changes_nothing(
    kmock: ApiServer,
    kubeconfig: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    await installed(kmock)
    await create(kmock, released("train-owned", owner="train-7c5d"))
    await create(kmock, released("train-bare"))
    before = len(kmock.writes)
    rc, out, err = await cli(capsys, kubeconfig, *UNINSTALL, "--dry-run")
    assert rc == 0 and len(kmock.writes) == before
    lines = out.splitlines()
    assert any(line.startswith("would evict ml/train-owned: released to node n1") for line in lines)
    assert "would clear the reservation of ml/train-bare (not bound)" in lines
    assert "warning: pod ml/train-bare was released to node n1" in err
    assert stored(kmock, "v1/pods", "train-owned", "ml") is not None


async def test_a_pod_bound_between_the_list_and_the_eviction_is_left_alone(
    kmock: ApiServer,
    kubeconfig: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await create(kmock, released("train-owned", owner="train-7c5d"))
    original = ungate._evict

    def scheduler_binds_first(cluster: ungate.Cluster, p: dict[str, Any]) -> None:
        obj = kmock.objects[kmock.resource("v1/pods"), "ml", "train-owned"]
        obj.patch({"metadata": {"resourceVersion": "999"}, "spec": {"nodeName": "n1"}})
        original(cluster, p)  # preconditions as listed: 409

    monkeypatch.setattr(ungate, "_evict", scheduler_binds_first)
    rc, out, err = await cli(capsys, kubeconfig, "--all", "--cleanup")
    assert (rc, err) == (0, "")
    assert "ml/train-owned was bound or changed meanwhile: nothing to do" in out
    assert stored(kmock, "v1/pods", "train-owned", "ml") is not None


async def test_a_refused_eviction_is_an_error_and_the_rest_still_runs(
    kmock: ApiServer,
    kubeconfig: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    running = released("train-owned", owner="train-7c5d")
    running["status"] = {"phase": "Running"}  # the fake refuses to evict a started pod: 429
    await create(kmock, running)
    await create(kmock, released("train-bare"))
    await create(kmock, pod("ours", "default", GATE))
    rc, out, err = await cli(capsys, kubeconfig, "--all", "--cleanup")
    assert rc == 1
    assert "gpuslice ungate: error: pod ml/train-owned: 429" in err
    assert "released default/ours" in out.splitlines()
    assert "cleared the reservation of ml/train-bare (not bound)" in out.splitlines()


async def test_plain_all_leaves_released_pods_to_the_running_partitioner(
    kmock: ApiServer,
    kubeconfig: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --cleanup gpuslice stays: a released pod's node still offers its slice (and the
    partitioner evicts one that cannot bind after recreateStrandedSeconds), so `ungate --all`
    releases the gated pods and only lists the released ones (a review: it evicted them and
    cleared their promises while the partitioner ran)."""
    await create(kmock, released("train-owned", owner="train-7c5d"))
    await create(kmock, released("train-bare"))
    await create(kmock, pod("ours", "default", GATE))
    before = len(kmock.writes)
    rc, out, err = await cli(capsys, kubeconfig, "--all")
    assert (rc, err) == (0, "")
    assert "released default/ours" in out.splitlines()
    assert "2 pod(s) released by gpuslice, not bound yet, left as they are" in out
    assert len(kmock.writes) == before + 1  # the gated pod's patch only
    for name in ("train-owned", "train-bare"):
        kept = stored(kmock, "v1/pods", name, "ml")
        assert kept is not None and RESERVATION_ANNOTATION in kept["metadata"]["annotations"]


# -- finding 3: the webhook Secret -------------------------------------------------------------
async def test_delete_secret_deletes_it_once_the_partitioner_stopped(
    kmock: ApiServer,
    kubeconfig: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await installed(kmock)
    await add_secret(kmock)
    partitioner_ends(kmock, monkeypatch)
    argv = (*UNINSTALL, "--delete-secret", f"{NS}/{SECRET}")
    rc, out, _ = await cli(capsys, kubeconfig, *argv, "--dry-run")
    assert rc == 0 and f"would delete Secret {NS}/{SECRET}" in out.splitlines()
    assert stored(kmock, "v1/secrets", SECRET, NS) is not None

    first = len(kmock.writes)
    rc, out, err = await cli(capsys, kubeconfig, *argv)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines.index(f"Secret {NS}/{SECRET} deleted") > lines.index(
        f"Deployment {NS}/{PARTITIONER} scaled to 0: no partitioner pod runs"
    )
    assert stored(kmock, "v1/secrets", SECRET, NS) is None
    done = writes(kmock)[first:]
    secret = done.index(f"DELETE /api/v1/namespaces/{NS}/secrets/{SECRET}")
    assert secret > next(i for i, w in enumerate(done) if "/scale" in w)

    rc, out, _ = await cli(capsys, kubeconfig, *argv)
    assert rc == 0 and f"Secret {NS}/{SECRET} already absent" in out.splitlines()


def test_delete_secret_wants_namespace_and_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from gpuslice.cli import EXIT_BAD_INPUT, main

    argv = ["ungate", "--kubeconfig", str(tmp_path / "none"), "--all", "--delete-secret", "x"]
    assert main(argv) == EXIT_BAD_INPUT
    assert "expected NAMESPACE/NAME" in capsys.readouterr().err


def hook_args(docs: list[dict[str, Any]]) -> list[str]:
    args: list[str] = one(docs, "Job", "-ungate")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    return args


def rules(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = one(docs, kind, "-ungate")["rules"]
    return out


def test_the_hook_deletes_the_self_managed_secret_and_may_evict(chart: Any) -> None:  # noqa: F811
    docs = render(chart, VARIANTS["defaults"])
    secret = env_of(container(docs, "Deployment"))["GPUSLICE_WEBHOOK_SECRET_NAME"]
    args = hook_args(docs)
    i = args.index("--delete-secret")
    namespace = one(docs, "Deployment")["metadata"]["namespace"]
    assert args[i + 1] == f"{namespace}/{secret}"
    parser = argparse.ArgumentParser()
    ungate.add_arguments(parser)
    assert parser.parse_args(args[1:]).delete_secret == f"{namespace}/{secret}"
    assert {
        "apiGroups": [""],
        "resources": ["secrets"],
        "resourceNames": [secret],
        "verbs": ["delete"],
    } in rules(docs, "Role")
    assert {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]} in rules(
        docs, "ClusterRole"
    )


@pytest.mark.parametrize("variant", ["webhook-cert-manager", "webhook-disabled"])
def test_no_secret_step_without_a_self_managed_certificate(chart: Any, variant: str) -> None:  # noqa: F811
    docs = render(chart, VARIANTS[variant])
    assert "--delete-secret" not in hook_args(docs)
    assert not [r for r in rules(docs, "Role") if "secrets" in r["resources"]]
