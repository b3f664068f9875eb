"""The chart's DRA mode (values ``dra.*``), rendered offline and checked like the rest.

Checked: every manifest validates strict against Kubernetes 1.35 and the newest schema; the
chart refuses clusters older than 1.35 with a message naming the value; the DeviceClasses are
exactly node_agent.dra_slices.device_classes(); the DRA agent's ClusterRole grants exactly
rbac-usage.yaml's ``agent-dra`` calls; its env is accepted by AgentSettings in DRA mode and its
host paths are mounted at the same paths; it lands only on ``dra`` nodes the partitioner no
longer manages, never beside the device-plugin agent, and NVIDIA's device plugin (NOTES) covers
exactly the nodes neither agent does; the ResourceSlice policy lets the agent write only its
own node's slices (CEL evaluated with cel-python).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from test_chart import (
    CHART,
    NAMESPACE,
    NEWEST_KUBE,
    NODE_CLAIM,
    NODE_LABELS,
    RELEASE,
    admit,
    apply_env,
    declared_usage,
    granted,
    host_paths,
    render,
    render_files,
    schedulable,
)

from node_agent.dra_slices import device_classes

DRA = {"dra": {"enabled": True}}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def dra_agent(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [
        d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-agent-dra")
    ]
    return ds


@pytest.mark.parametrize("kube", ["1.35", NEWEST_KUBE])
def test_dra_manifests_validate_strict(chart: helm.Chart, kube: str) -> None:
    docs = render(chart, DRA, kube_version=kube)
    kinds = {d["kind"] for d in docs}
    assert {"DeviceClass", "DaemonSet", "ClusterRole"} <= kinds
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue
        kubernetes_validate.validate(doc, kube, strict=True)


def test_dra_mode_refuses_clusters_older_than_1_35(chart: helm.Chart) -> None:
    with pytest.raises(Exception, match=r"dra.enabled needs Kubernetes >= 1.35"):
        render(chart, DRA, kube_version="1.34")
    assert not [d for d in render(chart, {}, kube_version="1.34") if d["kind"] == "DeviceClass"]


def test_device_classes_are_the_drivers(chart: helm.Chart) -> None:
    rendered = [d for d in render(chart, DRA) if d["kind"] == "DeviceClass"]
    for d in rendered:
        d["metadata"].pop("labels")
    key = lambda d: d["metadata"]["name"]  # noqa: E731
    assert sorted(rendered, key=key) == sorted(device_classes(), key=key)


def test_dra_rbac_grants_exactly_the_declared_calls(chart: helm.Chart) -> None:
    docs = render(chart, DRA)
    (role,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-agent-dra")
    ]
    assert granted(role) == declared_usage()["agent-dra"]
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == role["metadata"]["name"]
    ]
    sa = dra_agent(docs)["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]


def test_dra_agent_env_and_mounts(chart: helm.Chart, monkeypatch: pytest.MonkeyPatch) -> None:
    from node_agent.settings import AgentSettings

    pod = dra_agent(render(chart, DRA))["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:2] == ["agent", "--dra"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    apply_env(monkeypatch, {k: v for k, v in env.items() if k.startswith("GPUSLICE_")})
    s = AgentSettings()  # type: ignore[call-arg]
    assert s.dra is True
    paths = host_paths(pod)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for name, path in paths.items():
        assert mounts[name] == path  # same path inside: the kubelet is told host paths
    assert s.dra_registry_dir == paths["plugins-registry"]
    assert f"{s.dra_plugin_dir}/gpu.gpuslice.io" == paths["plugin"]
    assert s.cdi_dir == paths["cdi"] and s.state_dir == paths["state"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}


def test_agents_never_share_a_node_and_nvidia_covers_the_rest(chart: helm.Chart) -> None:
    docs = render(chart, DRA)
    plugin_agent = next(
        d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-agent")
    )["spec"]["template"]["spec"]["affinity"]
    dra = dra_agent(docs)["spec"]["template"]["spec"]["affinity"]
    notes = render_files(chart, DRA)["gpuslice/templates/NOTES.txt"]
    import re

    block = re.search(r"\n( +)affinity:\n(?:\1 .*\n)+", notes)
    assert block
    nvidia = yaml.safe_load(block.group(0))["affinity"]
    labels = [
        *NODE_LABELS,
        {"gpuslice.io/partitioning": "dra"},
        {"gpuslice.io/partitioning": "dra", "gpuslice.io/managed": "true"},  # still draining
        {"gpuslice.io/partitioning": "dra", "nos.nebuly.com/gpu-partitioning": "mig"},
    ]
    placed = []
    for ls in labels:
        on = [schedulable(a, ls) for a in (plugin_agent, dra, nvidia)]
        assert sum(on) == 1, (ls, on)  # exactly one of the three serves each node
        placed.append(on[1])
    assert placed[-3:] == [True, False, True]  # gpuslice.io/partitioning=dra wins over nos


def test_the_partitioner_plans_dra_nodes_but_never_labels_them_for_the_plugin_agent() -> None:
    from partitioner.index import ClusterIndex
    from partitioner.optout import agent_selected, node_lifecycle
    from partitioner.snapshot import GpuNode, opted_in, read_node
    from planner.catalog import default_catalog

    labels = {
        "gpuslice.io/partitioning": "dra",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "8",
    }
    node = {"metadata": {"name": "n1", "labels": labels}}
    reading = read_node(node, default_catalog())
    assert isinstance(reading, GpuNode) and reading.dra
    assert opted_in(node) and not agent_selected(labels)
    # gpuslice.io/managed (the device-plugin agent's DaemonSet) is never set on a DRA node: the
    # DRA agent's DaemonSet selects only unmanaged ones.
    index = ClusterIndex.from_objects(default_catalog(), nodes=[node])
    assert node_lifecycle(index) == []


def test_the_agent_writes_only_its_own_nodes_slices(chart: helm.Chart) -> None:
    docs = render(chart, DRA)
    (policy,) = [
        d
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicy" and "agent-dra" in d["metadata"]["name"]
    ]
    spec = policy["spec"]
    assert spec["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceslices"]
    agent = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-gpuslice-agent"
    claim = {NODE_CLAIM: ["n1"]}

    def req(obj: Any, old: Any, extra: Any = claim, user: str = agent) -> dict[str, Any]:
        return {"userInfo": {"username": user, "extra": extra}, "object": obj, "oldObject": old}

    mine, theirs = {"spec": {"nodeName": "n1"}}, {"spec": {"nodeName": "n2"}}
    denied = ["the gpuslice agent on node n1 may only write ResourceSlices of that node"]
    assert admit(spec, req(mine, None)) == []
    assert admit(spec, req(mine, mine)) == []
    assert admit(spec, req(None, mine)) == []  # delete
    assert admit(spec, req(theirs, None)) == denied
    assert admit(spec, req(mine, theirs)) == denied
    assert admit(spec, req(None, theirs)) == denied
    no_claim = admit(spec, req(mine, None, {}))
    assert no_claim is not None and len(no_claim) == 2 and "carries no node claim" in no_claim[0]
    assert admit(spec, req(theirs, None, user="system:serviceaccount:x:y")) is None  # not the agent
    assert RELEASE in policy["metadata"]["name"]


def test_with_dra_the_partitioner_watches_claims_and_the_webhook_gates_claim_pods(
    chart: helm.Chart,
) -> None:
    from test_chart import container, env_of, webhook_of

    from partitioner.gating import MATCH_CONDITIONS, MATCH_CONDITIONS_DRA

    conditions = {"webhook", "self-managed-webhook", "leader-election", "stranded-eviction"}
    # with dra.publish=all the agents read no spec and write no status: the partitioner leaves
    # DRA nodes and claim pods alone (gated, they waited for a status that never came)
    publish_all = {"dra": {"enabled": True, "publish": "all"}}
    for values, dra in (({}, False), (DRA, True), (publish_all, False)):
        docs = render(chart, values)
        (role,) = [
            d
            for d in docs
            if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-partitioner")
        ]
        want = declared_usage(conditions | ({"dra"} if dra else set()))["partitioner"]
        assert {p[:3] for p in granted(role)} == {p[:3] for p in want}
        assert (("resource.k8s.io", "resourceclaims", "watch") in {p[:3] for p in want}) is dra
        env = env_of(container(docs, "Deployment"))
        assert env.get("GPUSLICE_DRA_ENABLED") == ("true" if dra else None)
        hook = webhook_of(docs)
        expected = MATCH_CONDITIONS_DRA if dra else MATCH_CONDITIONS
        assert [(c["name"], c["expression"]) for c in hook["matchConditions"]] == list(expected)


def test_dra_agents_are_scraped_fenced_and_follow_rbac_create(chart: helm.Chart) -> None:
    """The DRA agents (component ``agent-dra``) get what the device-plugin agents get: a
    headless metrics Service (so the ServiceMonitor scrapes them, and the dashboard's DRA
    panels and the alerts see DRA nodes) and a NetworkPolicy admitting only
    ``networkPolicy.metricsFrom`` to their metrics port; with ``rbac.create=false`` no
    ClusterRole or binding of theirs is rendered either."""
    docs = render(chart, DRA | {"metrics": {"serviceMonitor": {"enabled": True}}})
    pod_labels = dra_agent(docs)["spec"]["template"]["metadata"]["labels"]
    services = [
        d
        for d in docs
        if d["kind"] == "Service"
        and d["metadata"]["labels"].get("gpuslice.io/metrics") == "true"
        and d["spec"]["selector"].items() <= pod_labels.items()
    ]
    (service,) = services
    assert service["spec"]["clusterIP"] == "None"
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"
    ].items() | {("app.kubernetes.io/instance", RELEASE)}
    port = next(
        p["containerPort"]
        for c in dra_agent(docs)["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports") or ()
        if p["name"] == "metrics"
    )
    assert service["spec"]["ports"][0]["port"] == port
    policies = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and d["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ]
    (policy,) = policies
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}] and rule["from"]

    off = render(chart, DRA | {"rbac": {"create": False}})
    rbac = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert not [
        d
        for d in off
        if d["kind"] in rbac and not (d["metadata"].get("annotations") or {}).get("helm.sh/hook")
    ]
    assert dra_agent(off)  # the agent itself stays
