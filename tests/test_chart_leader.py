"""The chart's leader-election wiring (partitioner/leader.py), rendered and validated like
tests/test_chart.py does.

* defaults: 2 replicas, RollingUpdate that never drops below them (maxUnavailable 0), replicas
  preferring different nodes, POD_NAME from the downward API as the Lease's holderIdentity, the
  Lease named per release in the release namespace, and a Role granting exactly get/update of
  that Lease and create;
* the leaderElection values reach the partitioner's settings; leader election off renders one
  replica with Recreate and no Lease permissions;
* inconsistent values are refused with a message naming the keys (schema and template).
"""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from test_chart import (
    NAMESPACE,
    NEWEST_KUBE,
    OLDEST_KUBE,
    RELEASE,
    apply_env,
    chart,
    container,
    gpuslice_env,
    one,
    render,
)

__all__ = ["chart"]  # the module-scoped fixture, shared

LEASE_NAME = f"{RELEASE}-gpuslice-partitioner"
LEASES = ("coordination.k8s.io", "leases")


def lease_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == LEASE_NAME]
    return [
        r
        for role in roles
        for r in role["rules"]
        if (r["apiGroups"], r["resources"]) == ([LEASES[0]], [LEASES[1]])
    ]


@pytest.mark.parametrize("kube", [OLDEST_KUBE, NEWEST_KUBE])
@pytest.mark.parametrize(
    "values",
    [
        {},
        {"partitioner": {"replicas": 3, "leaderElection": {"leaseDurationSeconds": 30}}},
        {"partitioner": {"replicas": 1, "leaderElection": {"enabled": False}}},
        {"webhook": {"enabled": False}},
    ],
    ids=["defaults", "three-replicas", "no-election", "no-webhook"],
)
def test_leader_election_manifests_validate_strict(
    chart: helm.Chart, values: dict[str, Any], kube: str
) -> None:
    for doc in render(chart, values, kube_version=kube):
        if doc["kind"] in {"ServiceMonitor", "Certificate", "Issuer"}:
            continue
        kubernetes_validate.validate(doc, kube, strict=True)


def test_defaults_run_two_replicas_that_elect_a_leader(chart: helm.Chart) -> None:
    docs = render(chart, {})
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deploy["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector == deploy["spec"]["selector"]["matchLabels"]  # its own replicas only
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"][
        "podAntiAffinity"
    ]  # a one-node cluster still runs both

    env = {e["name"]: e for e in container(docs, "Deployment")["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    names = list(env)
    assert names.index("POD_NAME") < names.index("GPUSLICE_LEADER_ELECTION_IDENTITY")
    assert env["GPUSLICE_LEADER_ELECTION_IDENTITY"]["value"] == "$(POD_NAME)"  # expanded
    assert env["GPUSLICE_LEADER_ELECTION_NAMESPACE"]["value"] == NAMESPACE
    assert env["GPUSLICE_LEADER_ELECTION_LEASE_NAME"]["value"] == LEASE_NAME

    rules = lease_rules(docs)
    granted = {(v, n) for r in rules for v in r["verbs"] for n in r.get("resourceNames") or [""]}
    # leader election's own Lease, and the list of the agents' heartbeat Leases
    assert granted == {("get", LEASE_NAME), ("update", LEASE_NAME), ("create", ""), ("list", "")}
    binding = one(docs, "RoleBinding", "-partitioner")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_readiness_is_the_same_for_followers(chart: helm.Chart) -> None:
    """Followers are Ready (they serve the webhook): the probe is /readyz, not leadership."""
    c = container(render(chart, {}), "Deployment")
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}


def test_leader_election_values_reach_the_settings(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.settings import PartitionerSettings

    values = {
        "partitioner": {
            "leaderElection": {
                "leaseDurationSeconds": 30,
                "renewDeadlineSeconds": 20,
                "retryPeriodSeconds": 4,
            }
        }
    }
    env = gpuslice_env(container(render(chart, values), "Deployment"))
    env["GPUSLICE_LEADER_ELECTION_IDENTITY"] = "gs-gpuslice-partitioner-7d9-abcde"  # kubelet
    apply_env(monkeypatch, env)
    s = PartitionerSettings()
    assert s.leader_election_enabled
    assert (s.leader_election_namespace, s.leader_election_lease_name) == (NAMESPACE, LEASE_NAME)
    assert s.leader_election_identity == "gs-gpuslice-partitioner-7d9-abcde"
    assert (
        s.leader_election_lease_duration_seconds,
        s.leader_election_renew_deadline_seconds,
        s.leader_election_retry_period_seconds,
    ) == (30, 20, 4)


def test_without_leader_election_one_replica_is_recreated(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.settings import PartitionerSettings

    docs = render(chart, {"partitioner": {"replicas": 1, "leaderElection": {"enabled": False}}})
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert "affinity" not in deploy["spec"]["template"]["spec"]
    env = gpuslice_env(container(docs, "Deployment"))
    assert not [k for k in env if k.startswith("GPUSLICE_LEADER_ELECTION")]
    # only the list of the agents' heartbeat Leases (agent.leaseSeconds), nothing to elect with
    assert [r["verbs"] for r in lease_rules(docs)] == [["list"]]
    apply_env(monkeypatch, env)
    assert not PartitionerSettings().leader_election_enabled


def test_user_affinity_replaces_the_default_spread(chart: helm.Chart) -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ctl"]}]}
                ]
            }
        }
    }
    deploy = one(render(chart, {"partitioner": {"affinity": affinity}}), "Deployment")
    assert deploy["spec"]["template"]["spec"]["affinity"] == affinity


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"partitioner": {"leaderElection": {"enabled": False}}},
            "partitioner.replicas is 2 but partitioner.leaderElection.enabled is false",
        ),
        (
            {"partitioner": {"leaderElection": {"renewDeadlineSeconds": 15}}},
            "partitioner.leaderElection needs retryPeriodSeconds (2) < renewDeadlineSeconds "
            "(15) < leaseDurationSeconds (15)",
        ),
        (
            {"partitioner": {"leaderElection": {"retryPeriodSeconds": 10}}},
            "retryPeriodSeconds (10) < renewDeadlineSeconds (10)",
        ),
    ],
)
def test_templates_refuse_inconsistent_election_values(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"partitioner": {"replicas": 0}}, "/partitioner/replicas"),
        ({"partitioner": {"replicas": "2"}}, "/partitioner/replicas"),
        ({"partitioner": {"leaderElection": {"enabled": "yes"}}}, "/partitioner/leaderElection"),
        (
            {"partitioner": {"leaderElection": {"leaseDurationSeconds": 7.5}}},
            "/partitioner/leaderElection/leaseDurationSeconds",
        ),
        (
            {"partitioner": {"leaderElection": {"retryPeriodSeconds": 0}}},
            "/partitioner/leaderElection/retryPeriodSeconds",
        ),
        ({"partitioner": {"leaderElection": {"leaseSeconds": 15}}}, "/partitioner/leaderElection"),
    ],
)
def test_schema_refuses_bad_election_values(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        chart.validate_schema(chart.merge_values(values))
