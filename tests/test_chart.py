"""The Helm chart (``charts/gpuslice``), rendered offline and checked against Kubernetes' schemas.

What is checked, and against what:

* every manifest of the default values and of several variants validates, in strict mode, with
  kubernetes-validate against Kubernetes 1.30 (the oldest supported release; 1.29 is refused)
  and the newest schema it ships; the one CRD-backed kind (ServiceMonitor) is checked
  structurally instead;
* the chart's CRD equals the one generated from the contract (:func:`crd_manifest`);
* ``helm lint --strict`` reports nothing; ``values.schema.json`` and the template guards reject
  bad values with a message naming the key;
* RBAC grants exactly the API calls each component declares in ``rbac-usage.yaml``;
* the agent lands only on opted-in nodes, and the NOTES' NVIDIA device-plugin affinity selects
  exactly the other nodes; the agent's privileges and host mounts are the documented ones;
* the env the chart sets is accepted by the components' own settings classes, with the same
  defaults, and a catalog override reaches them as readable files;
* the Grafana dashboard queries exactly the metrics the operations guide documents;
* the admission webhook's configuration selects pods as partitioner/gating.py does (its
  matchConditions are the Python constants), reaches the partitioner's webhook port and settings,
  and gets its certificate in both modes; the pre-delete hook releases every gated pod.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_python import _native

from contract.catalog_files import load_catalog
from contract.nodepartitioning import crd_manifest

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpuslice"
CRD_FILE = CHART / "crds" / "nodepartitioning.yaml"
RBAC_USAGE = CHART / "rbac-usage.yaml"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"

RELEASE, NAMESPACE = "gs", "gpu-system"
OLDEST_KUBE = "1.30"
NEWEST_KUBE = kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())

# Kinds whose schema comes from a third-party CRD, not from Kubernetes: checked structurally.
CRD_BACKED_KINDS = {"ServiceMonitor", "Certificate", "Issuer"}

Manifest = dict[str, Any]

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "service-monitor": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}}
        }
    },
    "custom-catalog": {
        "catalog": {
            "files": {
                "10-extra.yaml": "models:\n  - name: T4-16GB\n    memory_mib: 15360\n",
                "20-extra.json": {"models": [{"name": "V100-32GB", "memory_mib": 32768}]},
            }
        }
    },
    "custom-images-resources": {
        "image": {
            "registry": "registry.example.internal:5000",
            "repository": "ml/gpuslice",
            "tag": "0.1.0-rc1",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "regcred"}],
        "partitioner": {
            "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
            ],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "priorityClassName": "system-cluster-critical",
        },
        "agent": {
            "resources": {
                "requests": {"cpu": "100m", "memory": "64Mi"},
                "limits": {"memory": "1Gi"},
            },
            "tolerations": [{"operator": "Exists"}],
            "priorityClassName": "system-node-critical",
            "runtimeClassName": "",
        },
    },
    "digest-pinned": {"image": {"digest": "sha256:" + "a" * 64}},
    "json-logs": {"logging": {"format": "json", "level": "DEBUG"}},
    "privileged-agent-no-mps": {"agent": {"privileged": True, "hostIPC": True, "hostPID": False}},
    "policy-audit-only": {"admissionPolicy": {"validationActions": ["Warn", "Audit"]}},
    "network-policy-open": {
        "networkPolicy": {"metricsFrom": [], "extraIngress": [{"ports": [{"port": 9443}]}]}
    },
    "minimal": {
        "metrics": {"service": {"enabled": False}, "grafanaDashboard": {"enabled": False}},
        "admissionPolicy": {"enabled": False},
        "webhook": {"enabled": False, "ungateOnUninstall": False},
    },
    "webhook-cert-manager": {"webhook": {"certificates": {"mode": "cert-manager"}}},
    "webhook-cert-manager-issuer": {
        "webhook": {
            "timeoutSeconds": 10,
            "excludeNamespaces": ["batch-system"],
            "certificates": {
                "mode": "cert-manager",
                "certManager": {
                    "issuerRef": {
                        "group": "cert-manager.io",
                        "kind": "ClusterIssuer",
                        "name": "ca",
                    },
                    "duration": "2160h",
                    "renewBefore": "720h",
                },
            },
        }
    },
    "webhook-disabled": {"webhook": {"enabled": False}},
    "reservations-off": {"partitioner": {"reservations": {"enabled": False}}},
    "no-agent-lease": {"agent": {"leaseSeconds": 0}},
    "no-stranded-eviction": {"partitioner": {"reservations": {"recreateStrandedSeconds": 0}}},
}


# ------------------------------------------------------------------------------------ rendering


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render_files(
    chart: helm.Chart, values: dict[str, Any], kube_version: str | None = None
) -> dict[str, str]:
    """Template path -> rendered text. ``kube_version`` plays the cluster's version.

    ``Chart.render`` does not expose the renderer's ``kube_version`` option (``helm template
    --kube-version``), so the native call is made directly for that case.
    """
    if kube_version is None:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)
    opts = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": f"v{kube_version}.0"}
    rendered = _native.call_string(
        "helm_render", chart._raw(), json.dumps(values), json.dumps(opts)
    )
    files: dict[str, str] = json.loads(rendered)
    return files


def manifests(files: dict[str, str]) -> list[Manifest]:
    out: list[Manifest] = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            out.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return out


def render(
    chart: helm.Chart, values: dict[str, Any], kube_version: str | None = None
) -> list[Manifest]:
    return manifests(render_files(chart, values, kube_version))


def one(docs: list[Manifest], kind: str, name_suffix: str = "") -> Manifest:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {len(found)}"
    return found[0]


def container(docs: list[Manifest], kind: str) -> dict[str, Any]:
    pod = one(docs, kind)["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    c: dict[str, Any] = pod["containers"][0]
    return c


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


# ------------------------------------------------------------------------ schema validation


def check_service_monitor(sm: Manifest, docs: list[Manifest]) -> None:
    """Structural check of a ServiceMonitor: it must select the metrics Services by their labels
    and scrape a port they all name."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == NAMESPACE
    spec = sm["spec"]
    assert set(spec) <= {"namespaceSelector", "selector", "endpoints", "jobLabel"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    want = spec["selector"]["matchLabels"]
    services = [
        s
        for s in docs
        if s["kind"] == "Service" and want.items() <= s["metadata"]["labels"].items()
    ]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services} == {
        "partitioner",
        "agent",
    }
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"}
        assert re.fullmatch(r"(\d+(ms|s|m|h))+", ep["interval"])
        for s in services:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}


DURATION = re.compile(r"([0-9]+(\.[0-9]+)?(h|m|s))+")


def check_cert_manager(doc: Manifest, docs: list[Manifest]) -> None:
    """Structural check of cert-manager's Issuer and Certificate (cert-manager.io/v1 CRDs): the
    fields used exist in its API, and every issuerRef names an Issuer of the chart or an
    external (Cluster)Issuer."""
    assert doc["apiVersion"] == "cert-manager.io/v1"
    assert doc["metadata"]["namespace"] == NAMESPACE
    spec = doc["spec"]
    if doc["kind"] == "Issuer":
        assert list(spec) in (["selfSigned"], ["ca"]), spec
        if "ca" in spec:
            ca_certs = [
                d
                for d in docs
                if d["kind"] == "Certificate"
                and d["spec"]["secretName"] == spec["ca"]["secretName"]
            ]
            assert len(ca_certs) == 1 and ca_certs[0]["spec"]["isCA"] is True
        return
    allowed = {
        "secretName",
        "dnsNames",
        "duration",
        "renewBefore",
        "privateKey",
        "usages",
        "issuerRef",
        "isCA",
        "commonName",
    }
    assert set(spec) <= allowed, set(spec) - allowed
    assert spec["secretName"] and spec["issuerRef"]["name"]
    for key in ("duration", "renewBefore"):
        assert DURATION.fullmatch(spec[key]), spec[key]
    assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
    assert set(spec["privateKey"]) <= {"algorithm", "size", "rotationPolicy"}
    assert set(spec.get("usages", [])) <= {"digital signature", "key encipherment", "server auth"}
    ref = spec["issuerRef"]
    assert set(ref) <= {"name", "kind", "group"} and ref.get("kind", "Issuer") in (
        "Issuer",
        "ClusterIssuer",
    )
    if ref.get("kind", "Issuer") == "Issuer":
        issuers = [d for d in docs if d["kind"] == "Issuer"]
        assert ref["name"] in {i["metadata"]["name"] for i in issuers} or not issuers


@pytest.mark.parametrize("kube", [OLDEST_KUBE, NEWEST_KUBE])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_validates_strict(chart: helm.Chart, variant: str, kube: str) -> None:
    docs = render(chart, VARIANTS[variant], kube_version=kube)
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_BACKED_KINDS:
            check = check_service_monitor if doc["kind"] == "ServiceMonitor" else check_cert_manager
            check(doc, docs)
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(
                f"{variant}: {doc['kind']}/{doc['metadata']['name']} at {where}: {e.message}"
            )
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{variant}: {e.message}")


def test_strict_validation_has_teeth(chart: helm.Chart) -> None:
    """The validator used above rejects a typo'd field, so a pass means something."""
    ds = one(render(chart, {}), "DaemonSet")
    ds["spec"]["template"]["spec"]["hostIpc"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, NEWEST_KUBE, strict=True)


def test_chart_refuses_kubernetes_older_than_1_30_so_agents_are_always_confined(
    chart: helm.Chart,
) -> None:
    """Before 1.30 nothing could confine an agent to its own node (no policy, no node claim):
    the chart is not installable there, instead of installing without the policy."""
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.30.0-0"
    with pytest.raises(Exception, match=r"needs Kubernetes >= 1\.30 \(this cluster: v1\.29\.0\)"):
        render_files(chart, {}, kube_version="1.29")
    new = render_files(chart, {}, kube_version="1.30")
    docs = manifests(new)
    policy = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert "WARNING" not in new["gpuslice/templates/NOTES.txt"]


def test_network_policies_admit_only_scrapers_to_the_metrics_ports(chart: helm.Chart) -> None:
    docs = render(chart, {})
    policies = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] == "NetworkPolicy"
    }
    assert sorted(policies) == ["agent", "partitioner"]
    for component, kind in (("partitioner", "Deployment"), ("agent", "DaemonSet")):
        pol = policies[component]["spec"]
        labels = one(docs, kind)["spec"]["template"]["metadata"]["labels"]
        assert pol["podSelector"]["matchLabels"].items() <= labels.items()
        assert pol["policyTypes"] == ["Ingress"]
        ports = {p["name"]: p["containerPort"] for p in container(docs, kind)["ports"]}
        rule, *webhook = pol["ingress"]
        assert rule["ports"] == [{"port": ports["metrics"], "protocol": "TCP"}]
        assert rule["from"] == [
            {"namespaceSelector": {"matchLabels": {"gpuslice.io/metrics-scraper": "true"}}}
        ]
        # The API server (not a pod) calls the partitioner's admission webhook: from anywhere.
        want = (
            [{"ports": [{"port": ports["webhook"], "protocol": "TCP"}]}]
            if "webhook" in ports
            else []
        )
        assert webhook == want
    notes = render_files(chart, {})["gpuslice/templates/NOTES.txt"]
    assert "gpuslice.io/metrics-scraper=true" in notes

    open_docs = render(chart, VARIANTS["network-policy-open"])
    for pol in (d for d in open_docs if d["kind"] == "NetworkPolicy"):
        first, *_, extra = pol["spec"]["ingress"]
        assert "from" not in first and extra == {"ports": [{"port": 9443}]}
    off = render(chart, {"networkPolicy": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]


def test_admission_policy_targets_the_agent_and_its_node(chart: helm.Chart) -> None:
    docs = render(chart, {})
    spec = one(docs, "ValidatingAdmissionPolicy")["spec"]
    agent_sa = one(docs, "ServiceAccount", "-agent")["metadata"]["name"]
    assert spec["failurePolicy"] == "Fail"
    rule, leases = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["gpuslice.io"]
    assert set(rule["resources"]) == {"nodepartitionings", "nodepartitionings/status"}
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    assert (leases["apiGroups"], leases["resources"]) == (["coordination.k8s.io"], ["leases"])
    (cond,) = spec["matchConditions"]
    assert f"'system:serviceaccount:{NAMESPACE}:{agent_sa}'" in cond["expression"]
    (var,) = spec["variables"]
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name']" in var["expression"]
    exprs = [" ".join(v["expression"].split()) for v in spec["validations"]]
    assert any(e.endswith("request.name == variables.nodeName") for e in exprs)
    assert any(e.endswith("request.subResource == 'status'") for e in exprs)
    assert any("object.spec.holderIdentity == variables.nodeName" in e for e in exprs)


# ------------------------------------------------------------------------------ CRD and lint


def test_chart_crd_equals_generated_contract(chart: helm.Chart) -> None:
    if not CRD_FILE.exists():
        pytest.skip(f"{CRD_FILE.relative_to(ROOT)} not generated yet (written from crd_manifest())")
    assert yaml.safe_load(CRD_FILE.read_text()) == crd_manifest()
    assert [c["filename"] for c in chart.crds] == ["gpuslice/crds/nodepartitioning.yaml"]
    assert yaml.safe_load(chart.crds[0]["data"]) == crd_manifest()
    for kube in (OLDEST_KUBE, NEWEST_KUBE):
        kubernetes_validate.validate(crd_manifest(), kube, strict=True)


@pytest.mark.parametrize("variant", ["defaults", "service-monitor", "custom-catalog"])
def test_lint_strict_reports_nothing(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert report["messages"] == []


def test_usage_list_is_not_packaged(chart: helm.Chart) -> None:
    assert RBAC_USAGE.exists()
    assert "rbac-usage.yaml" not in {f["name"] for f in chart.files}


# ---------------------------------------------------------------------------- values checks


def test_default_values_pass_the_schema(chart: helm.Chart) -> None:
    chart.validate_schema(chart.values)
    for values in VARIANTS.values():
        chart.validate_schema(chart.merge_values(values))


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"webhook": {"certificates": {"mode": "vault"}}}, "/webhook/certificates/mode"),
    ({"webhook": {"timeoutSeconds": 31}}, "/webhook/timeoutSeconds"),
    ({"webhook": {"port": 0}}, "/webhook/port"),
    ({"webhook": {"excludeNamespaces": ["Kube_System"]}}, "/webhook/excludeNamespaces/0"),
    (
        {"webhook": {"certificates": {"certManager": {"issuerRef": {"kind": "ClusterIssuer"}}}}},
        "/webhook/certificates/certManager/issuerRef",
    ),
    (
        {"webhook": {"certificates": {"certManager": {"duration": "1 year"}}}},
        "/webhook/certificates/certManager/duration",
    ),
    ({"logging": {"format": "xml"}}, "/logging/format"),
    ({"logging": {"level": "verbose"}}, "/logging/level"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"partitioner": {"batchTimeout": 30}}, "'batchTimeout' not allowed"),
    ({"partitioner": {"batch": {"timeoutSeconds": 0}}}, "/partitioner/batch/timeoutSeconds"),
    ({"partitioner": {"batch": {"idleSeconds": "10s"}}}, "/partitioner/batch/idleSeconds"),
    ({"partitioner": {"planner": {"policy": "optimal"}}}, "/partitioner/planner/policy"),
    (
        {"partitioner": {"planner": {"weights": {"destroy": -1}}}},
        "/partitioner/planner/weights/destroy",
    ),
    ({"partitioner": {"metricsPort": 70000}}, "/partitioner/metricsPort"),
    (
        {"partitioner": {"planner": {"freeCapacity": {"mpsSizes": "10gb:3"}}}},
        "/partitioner/planner/freeCapacity/mpsSizes",
    ),
    (
        {"partitioner": {"planner": {"freeCapacity": {"migProfiles": "7g:3"}}}},
        "/partitioner/planner/freeCapacity/migProfiles",
    ),
    (
        {"agent": {"hostPaths": {"devicePluginDir": "var/lib/kubelet/device-plugins"}}},
        "/agent/hostPaths/devicePluginDir",
    ),
    ({"agent": {"hostPaths": {"mpsPipeRoot": "/run/nvidia/mps/"}}}, "/agent/hostPaths/mpsPipeRoot"),
    (
        {"agent": {"tolerations": [{"key": "x", "operator": "Maybe"}]}},
        "/agent/tolerations/0/operator",
    ),
    ({"agent": {"resources": {"limits": {"memory": "lots"}}}}, "/agent/resources/limits/memory"),
    ({"agent": {"leaseSeconds": 5}}, "/agent/leaseSeconds"),
    ({"agent": {"leaseSeconds": -1}}, "/agent/leaseSeconds"),
    ({"agent": {"leaseSeconds": "40s"}}, "/agent/leaseSeconds"),
    # The settings' own bounds, refused by the schema first (before, helm install succeeded and
    # the partitioner or agent exited 2 at every start).
    (
        {"partitioner": {"planner": {"weights": {"freeBlock": 1000001}}}},
        "/partitioner/planner/weights/freeBlock",
    ),
    (
        {"partitioner": {"planner": {"freeCapacity": {"cpuMilli": 2000000000}}}},
        "/partitioner/planner/freeCapacity/cpuMilli",
    ),
    (
        {"partitioner": {"reservations": {"drainQueueLimit": 1e10}}},
        "/partitioner/reservations/drainQueueLimit",
    ),
    ({"agent": {"leaseSeconds": 1e10}}, "/agent/leaseSeconds"),
    (
        {"partitioner": {"planner": {"freeCapacity": {"mpsSizes": "10:0"}}}},
        "/partitioner/planner/freeCapacity/mpsSizes",
    ),
    (
        {"partitioner": {"planner": {"freeCapacity": {"mpsSizes": "0:1"}}}},
        "/partitioner/planner/freeCapacity/mpsSizes",
    ),
    (
        {"partitioner": {"planner": {"freeCapacity": {"migProfiles": "1g.10gb:0.0"}}}},
        "/partitioner/planner/freeCapacity/migProfiles",
    ),
    ({"catalog": {"files": {"a,b.yaml": "models: []"}}}, "invalid propertyName 'a,b.yaml'"),
    ({"catalog": {"files": {"extra.yaml": {"gpus": []}}}}, "/catalog/files/extra.yaml"),
    (
        {"metrics": {"serviceMonitor": {"interval": "30 seconds"}}},
        "/metrics/serviceMonitor/interval",
    ),
    (
        {"admissionPolicy": {"validationActions": ["Deny", "Warn"]}},
        "/admissionPolicy/validationActions",
    ),
    ({"admissionPolicy": {"validationActions": []}}, "/admissionPolicy/validationActions"),
    ({"networkPolicy": {"metricsFrom": "monitoring"}}, "/networkPolicy/metricsFrom"),
    ({"networkPolicy": {"metricsFrom": [{}]}}, "/networkPolicy/metricsFrom/0"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_schema_rejects_bad_values(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.validate_schema(chart.merge_values(values))
    with pytest.raises(helm.HelmValuesError):  # install and template validate too
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"partitioner": {"batch": {"timeoutSeconds": 5, "idleSeconds": 30}}},
            "partitioner.batch.idleSeconds (30) must not exceed partitioner.batch.timeoutSeconds (5)",
        ),
        (
            {"partitioner": {"metricsPort": 9000, "healthPort": 9000}},
            "partitioner.metricsPort and partitioner.healthPort are both 9000",
        ),
        (
            {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
            "metrics.serviceMonitor.enabled needs metrics.service.enabled=true",
        ),
        (
            {"webhook": {"port": 8081}},
            "webhook.port (8081) must differ from partitioner.metricsPort and "
            "partitioner.healthPort",
        ),
        (
            {"partitioner": {"planner": {"timeLimitSeconds": 300}}},
            "partitioner.liveness.staleSeconds (120) must exceed "
            "partitioner.planner.timeLimitSeconds (300)",
        ),
    ],
)
def test_templates_reject_inconsistent_values(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# ------------------------------------------------------------------------------------- RBAC

Permission = tuple[str, str, str, str]  # (apiGroup, resource, verb, resourceName or "")

# usage key -> (role kind, role name suffix, workload kind) as rendered
ROLES = {
    "partitioner": ("ClusterRole", "-partitioner", "Deployment"),
    "partitioner-namespaced": ("Role", "-partitioner", "Deployment"),
    "agent": ("ClusterRole", "-agent", "DaemonSet"),
    "agent-namespaced": ("Role", "-agent", "DaemonSet"),
    "ungate": ("ClusterRole", "-ungate", "Job"),
    "ungate-namespaced": ("Role", "-ungate", "Job"),
}
# variant -> the `when:` conditions of rbac-usage.yaml that hold in it
RBAC_VARIANTS = {
    "defaults": {
        "webhook",
        "self-managed-webhook",
        "leader-election",
        "agent-lease",
        "stranded-eviction",
    },
    "webhook-cert-manager": {"webhook", "leader-election", "agent-lease", "stranded-eviction"},
    "webhook-disabled": {"leader-election", "agent-lease", "stranded-eviction"},
    "reservations-off": {"leader-election", "agent-lease", "stranded-eviction"},
    "no-agent-lease": {"webhook", "self-managed-webhook", "leader-election", "stranded-eviction"},
    "no-stranded-eviction": {"webhook", "self-managed-webhook", "leader-election", "agent-lease"},
}


def declared_usage(
    conditions: set[str] = RBAC_VARIANTS["defaults"], names: dict[str, str] | None = None
) -> dict[str, set[Permission]]:
    """rbac-usage.yaml: component -> permissions, keeping the entries whose ``when`` holds and
    mapping symbolic resourceNames through ``names``."""
    doc = yaml.safe_load(RBAC_USAGE.read_text())
    names = names or {}
    return {
        component: {
            (e["apiGroup"], e["resource"], v, names.get(n, n))
            for e in entries
            if e.get("when") is None or e["when"] in conditions
            for v in e["verbs"]
            for n in e.get("resourceNames") or [""]
        }
        for component, entries in doc.items()
    }


def granted(role: Manifest) -> set[Permission]:
    out: set[Permission] = set()
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {role['metadata']['name']}: {rule}"
        out |= {
            (g, r, v, n)
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
            for n in rule.get("resourceNames") or [""]
        }
    return out


def object_names(docs: list[Manifest]) -> dict[str, str]:
    """The objects rbac-usage.yaml names symbolically, as rendered."""
    names = {}
    mwcs = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    if mwcs:
        names["webhook-configuration"] = mwcs[0]["metadata"]["name"]
    env = env_of(container(docs, "Deployment"))
    if "GPUSLICE_WEBHOOK_SECRET_NAME" in env:
        names["webhook-secret"] = env["GPUSLICE_WEBHOOK_SECRET_NAME"]
    if "GPUSLICE_LEADER_ELECTION_LEASE_NAME" in env:
        names["lease"] = env["GPUSLICE_LEADER_ELECTION_LEASE_NAME"]
    names["partitioner-deployment"] = one(docs, "Deployment")["metadata"]["name"]
    return names


@pytest.mark.parametrize("component", sorted(ROLES))
@pytest.mark.parametrize("variant", sorted(RBAC_VARIANTS))
def test_rbac_grants_exactly_the_declared_calls(
    chart: helm.Chart, variant: str, component: str
) -> None:
    docs = render(chart, VARIANTS[variant])
    kind, suffix, workload_kind = ROLES[component]
    want = declared_usage(RBAC_VARIANTS[variant], object_names(docs))[component]
    roles = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    if not want:
        assert roles == [], f"{variant}: {component} needs no {kind}"
        return
    (role,) = roles
    have = granted(role)
    assert not want - have, f"{component} misses permissions it uses: {sorted(want - have)}"
    assert not have - want, f"{component} has permissions it never uses: {sorted(have - want)}"

    binding = one(docs, f"{kind}Binding", suffix)
    workload = one(docs, workload_kind)["spec"]["template"]["spec"]
    sa = one(
        docs, "ServiceAccount", suffix if component != "partitioner-namespaced" else "-partitioner"
    )
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": kind,
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    if kind == "Role":
        assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert workload["serviceAccountName"] == sa["metadata"]["name"]


def test_agent_cannot_write_spec_and_partitioner_writes_status_by_patch_only() -> None:
    """The agent owns the status but for ``status.reservations``, which the partitioner
    writes by a merge patch of the status subresource (partitioner/writer.py): RBAC names a
    subresource or does not grant it, so without this rule every reservation write was
    refused (403) in a real cluster -- the agents never learned which GPUs are drained."""
    usage = declared_usage()
    writes = {"create", "update", "patch", "delete", "deletecollection"}
    assert not {p for p in usage["agent"] if p[1] == "nodepartitionings" and p[2] in writes}
    assert {p[2] for p in usage["partitioner"] if p[1] == "nodepartitionings/status"} == {"patch"}
    assert not {p for p in usage["agent"] if p[1] in {"pods", "secrets", "configmaps"}}


# ------------------------------------------------------------------------ agent placement

NODE_LABELS: list[dict[str, str]] = [
    {},
    {"nos.nebuly.com/gpu-partitioning": "mig"},
    {"nos.nebuly.com/gpu-partitioning": "mps"},
    {"nos.nebuly.com/gpu-partitioning": "hybrid"},  # not a nos mode
    {"gpuslice.io/partitioning": "mig"},
    {"gpuslice.io/partitioning": "mps"},
    {"gpuslice.io/partitioning": "hybrid"},
    {"gpuslice.io/partitioning": "off"},
    {"gpuslice.io/partitioning": "mig", "nos.nebuly.com/gpu-partitioning": "mps"},
    {"nvidia.com/gpu.present": "true"},
    {"gpuslice.io/managed": "true"},  # opted out, still draining (partitioner/optout.py)
    {"gpuslice.io/partitioning": "off", "gpuslice.io/managed": "true"},
    {"gpuslice.io/managed": "false"},
]
OPTED_IN = [1, 2, 4, 5, 6, 8, 10, 11]


def matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """A nodeSelectorTerm's matchExpressions (ANDed), with Kubernetes' operator semantics."""
    for expr in term["matchExpressions"]:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def schedulable(affinity: dict[str, Any], labels: dict[str, str]) -> bool:
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return any(matches(t, labels) for t in terms["nodeSelectorTerms"])  # terms are ORed


def test_agent_runs_only_on_opted_in_nodes(chart: helm.Chart) -> None:
    affinity = one(render(chart, {}), "DaemonSet")["spec"]["template"]["spec"]["affinity"]
    placed = [i for i, labels in enumerate(NODE_LABELS) if schedulable(affinity, labels)]
    assert placed == OPTED_IN


def test_the_partitioner_labels_managed_exactly_the_nodes_the_agent_selects(
    chart: helm.Chart,
) -> None:
    """partitioner/optout.py puts ``gpuslice.io/managed`` only where the DaemonSet's opt-in
    terms already place the agent, so the label never brings the agent to a node by itself
    (only keeps it while the node drains)."""
    from partitioner.optout import MANAGED_LABEL, agent_selected

    affinity = one(render(chart, {}), "DaemonSet")["spec"]["template"]["spec"]["affinity"]
    for labels in NODE_LABELS:
        opt_in = {k: v for k, v in labels.items() if k != MANAGED_LABEL}
        assert agent_selected(opt_in) == schedulable(affinity, opt_in), labels


def test_notes_device_plugin_affinity_selects_the_other_nodes(chart: helm.Chart) -> None:
    """The NVIDIA device plugin snippet in NOTES.txt must cover exactly the nodes the agent
    does not: none twice (double-booked GPUs), none left without a device plugin."""
    notes = render_files(chart, {})["gpuslice/templates/NOTES.txt"]
    block = re.search(r"\n( +)affinity:\n(?:\1 .*\n)+", notes)
    assert block, "NOTES.txt lost its device-plugin affinity snippet"
    nvidia = yaml.safe_load(block.group(0))["affinity"]
    agent = one(render(chart, {}), "DaemonSet")["spec"]["template"]["spec"]["affinity"]
    for labels in NODE_LABELS:
        assert schedulable(agent, labels) != schedulable(nvidia, labels), labels


# --------------------------------------------------------------------- pods and privileges


def host_paths(pod: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}


def test_agent_privileges_are_the_documented_minimum(chart: helm.Chart) -> None:
    docs = render(chart, {})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(docs, "DaemonSet")
    assert pod["hostIPC"] is False  # MPS shares memory through <mpsPipeRoot>/shm instead
    # NVML names a GPU's processes by host PID through /proc: without the host's PID namespace
    # the agent cannot tell its idle MPS server from a pod's process
    assert pod["hostPID"] is True and not pod.get("hostNetwork")
    assert pod["runtimeClassName"] == "nvidia"
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["runAsUser"] == 0 and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}

    paths = host_paths(pod)
    assert sorted(paths.values()) == [
        "/run/gpuslice",
        "/run/nvidia/mps",
        "/run/nvidia/mps/shm",
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/var/log/nvidia-mps",
    ]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    shm = paths.pop("mps-shm")  # the daemons' /dev/shm, the clients' too (Allocate mounts it)
    assert mounts["mps-shm"]["mountPath"] == "/dev/shm"
    for name, path in paths.items():  # same path inside: the agent hands host paths to kubelet
        assert mounts[name]["mountPath"] == path
    assert mounts["pod-resources"].get("readOnly") is True
    assert not any(
        mounts[n].get("readOnly") for n in ("device-plugins", "mps-pipes", "mps-logs", "mps-shm")
    )

    env = env_of(c)
    assert env["GPUSLICE_DEVICE_PLUGIN_DIR"] == paths["device-plugins"]
    assert env["GPUSLICE_POD_RESOURCES_SOCKET"] == paths["pod-resources"] + "/kubelet.sock"
    assert env["GPUSLICE_MPS_PIPE_ROOT"] == paths["mps-pipes"]
    assert env["GPUSLICE_MPS_LOG_ROOT"] == paths["mps-logs"]
    assert env["GPUSLICE_STATE_DIR"] == paths["state"]
    # the agent's device plugin mounts exactly this directory into MPS clients at /dev/shm
    from node_agent.devices import mps_shm_directory

    assert mps_shm_directory(env["GPUSLICE_MPS_PIPE_ROOT"]) == shm
    assert env["NVIDIA_MIG_CONFIG_DEVICES"] == "all"
    node_name = next(e for e in c["env"] if e["name"] == "GPUSLICE_NODE_NAME")
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # its own pod: a PodResources List without it is incomplete (node_agent.podresources)
    own = {e["name"]: e.get("valueFrom") for e in c["env"]}
    assert own["GPUSLICE_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert own["GPUSLICE_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_agent_privileged_and_mig_only_variant(chart: helm.Chart) -> None:
    docs = render(chart, VARIANTS["privileged-agent-no-mps"])
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    sc = container(docs, "DaemonSet")["securityContext"]
    assert sc["privileged"] is True and "capabilities" not in sc
    assert pod["hostIPC"] is True  # still available for those who want it
    assert pod["hostPID"] is False  # a cluster without MPS may leave the host's PID namespace


def test_partitioner_is_unprivileged_and_elects_a_leader(chart: helm.Chart) -> None:
    docs = render(chart, {})
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2  # leader election: tests/test_chart_leader.py
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert not host_paths(pod)
    assert not any(pod.get(k) for k in ("hostIPC", "hostPID", "hostNetwork"))
    sc = container(docs, "Deployment")["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_partitioner_probes_ask_liveness_and_readiness_separately(chart: helm.Chart) -> None:
    c = container(render(chart, {"partitioner": {"healthPort": 9000}}), "Deployment")
    assert {"name": "health", "containerPort": 9000, "protocol": "TCP"} in c["ports"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert env_of(c)["GPUSLICE_HEALTH_PORT"] == "9000"


def test_custom_images_resources_and_tolerations_reach_the_pods(chart: helm.Chart) -> None:
    values = VARIANTS["custom-images-resources"]
    docs = render(chart, values)
    for kind, comp in (("Deployment", "partitioner"), ("DaemonSet", "agent")):
        pod = one(docs, kind)["spec"]["template"]["spec"]
        c = container(docs, kind)
        assert c["image"] == "registry.example.internal:5000/ml/gpuslice:0.1.0-rc1"
        assert c["imagePullPolicy"] == "Always"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert c["resources"] == values[comp]["resources"]
        assert pod["tolerations"] == values[comp]["tolerations"]
        assert pod["priorityClassName"] == values[comp]["priorityClassName"]
    assert "runtimeClassName" not in one(docs, "DaemonSet")["spec"]["template"]["spec"]
    pinned = container(render(chart, VARIANTS["digest-pinned"]), "DaemonSet")["image"]
    assert pinned == "ghcr.io/gpuslice/gpuslice@sha256:" + "a" * 64


def test_names_fit_kubernetes_limits_with_a_long_release_name(chart: helm.Chart) -> None:
    files = chart.render({}, name="r" * 53, namespace=NAMESPACE)
    for doc in manifests(files):
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        kubernetes_validate.validate(doc, NEWEST_KUBE, strict=True)


# ---------------------------------------------------------------- settings and catalog env


def apply_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("GPUSLICE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def gpuslice_env(c: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in env_of(c).items() if k.startswith("GPUSLICE_")}


@pytest.mark.parametrize("variant", ["defaults", "json-logs", "custom-catalog"])
def test_partitioner_settings_accept_the_chart_env(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    from partitioner.settings import PartitionerSettings

    env = gpuslice_env(container(render(chart, VARIANTS[variant]), "Deployment"))
    fields = {f"GPUSLICE_{name.upper()}" for name in PartitionerSettings.model_fields}
    assert not set(env) - fields, f"chart sets env the partitioner ignores: {set(env) - fields}"
    apply_env(monkeypatch, env)
    from_chart = PartitionerSettings()
    if variant == "defaults":  # the chart's defaults are the code's defaults...
        apply_env(monkeypatch, {})
        # ...except the webhook's and leader election's: the code has them off and knows no
        # release's object names.
        release_specific = {
            "webhook_enabled": True,
            "webhook_service_name": f"{RELEASE}-gpuslice-webhook",
            "webhook_namespace": NAMESPACE,
            "webhook_configuration_name": f"{RELEASE}-gpuslice-webhook",
            "webhook_secret_name": f"{RELEASE}-gpuslice-webhook-tls",
            "leader_election_enabled": True,
            "leader_election_namespace": NAMESPACE,
            "leader_election_lease_name": f"{RELEASE}-gpuslice-partitioner",
            "leader_election_identity": "$(POD_NAME)",  # the kubelet expands it
            "agent_lease_namespace": NAMESPACE,  # where the agents keep their Leases
        }
        assert {k: getattr(from_chart, k) for k in release_specific} == release_specific
        assert from_chart == PartitionerSettings(**release_specific)
    if variant == "json-logs":
        assert (from_chart.log_format, from_chart.log_level) == ("json", "DEBUG")


def test_partitioner_values_reach_its_settings(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.settings import PartitionerSettings

    values = {
        "partitioner": {
            "batch": {"timeoutSeconds": 30, "idleSeconds": 2.5, "retrySeconds": 0},
            "planner": {
                "policy": "greedy",
                "timeLimitSeconds": 0.25,
                "weights": {"destroy": 7, "gpuTouched": 0},
                "mpsReserveMiB": 1024,
                "mpsThreadPolicy": "full",
                "mpsPolish": False,
                "placementWeight": "pods",
                "freeCapacity": {
                    "cpuMilli": 4000,
                    "memoryMiB": 0,
                    "mpsSizes": "10:3,20:1",
                    "migProfiles": "7g.80gb:3, 4g.40gb",
                },
            },
            "reservations": {
                "enabled": False,
                "applyDeadlineSeconds": 60,
                "bindDeadlineSeconds": 30,
                "cooldownSeconds": 0,
                "pluginLagSeconds": 45,
                "recreateStrandedSeconds": 1800,
                "drainAfterSeconds": 7200,
                "drainFraction": 0.25,
                "drainOvertaken": 4,
                "drainQueueLimit": 2.5,
                "warmSliceShare": 0.05,
            },
            "liveness": {"staleSeconds": 300, "failedSteps": 0},
        }
    }
    apply_env(monkeypatch, gpuslice_env(container(render(chart, values), "Deployment")))
    s = PartitionerSettings()
    assert (s.batch_timeout_seconds, s.batch_idle_seconds, s.batch_retry_seconds) == (30, 2.5, 0)
    p = s.planner_settings()
    assert (p.policy, p.time_limit_s, p.weight_destroy, p.weight_gpu_touched) == (
        "greedy",
        0.25,
        7,
        0,
    )
    assert p.mps_reserve_mib == 1024 and p.placement_weight == "pods" and p.mps_polish is False
    assert p.mps_thread_policy == "full"
    assert (p.free_capacity_cpu_milli, p.free_capacity_memory_mib) == (4000, 0)
    assert p.free_capacity_mps_sizes == ((10240, 3.0), (20480, 1.0))
    assert p.free_capacity_mig_profiles == (
        ("nvidia.com/mig-7g.80gb", 3.0),
        ("nvidia.com/mig-4g.40gb", 1.0),
    )
    assert (s.reservation, s.apply_deadline_seconds, s.bind_deadline_seconds) == (False, 60, 30)
    assert (s.cooldown_seconds, s.drain_after_seconds, s.drain_fraction) == (0, 7200, 0.25)
    assert s.drain_overtaken == 4 and s.decide_config(load_catalog()).drain_overtaken == 4
    assert s.decide_config(load_catalog()).drain_queue_limit == 2.5
    assert s.decide_config(load_catalog()).warm_share == 0.05
    assert s.decide_config(load_catalog()).plugin_lag_s == 45
    assert s.decide_config(load_catalog()).recreate_stranded_s == 1800
    assert (s.liveness_stale_seconds, s.liveness_failed_steps) == (300, 0)


def test_large_integer_values_reach_the_settings(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Helm reads a values file's numbers as floats, and ``quote`` prints one of a million or
    more in float notation (``1.23456789e+08``): integer settings read such a whole number as
    the integer (a seed of 123456789 stopped the partitioner at every start)."""
    from partitioner.settings import PartitionerSettings

    values = {
        "partitioner": {
            "planner": {
                "seed": 123456789,
                "weights": {"destroy": 1000000},
                "mpsReserveMiB": 2000000,
                "freeCapacity": {"cpuMilli": 64000000, "memoryMiB": 1048576},
            },
            "liveness": {"failedSteps": 1000000},
        }
    }
    env = gpuslice_env(container(render(chart, values), "Deployment"))
    assert "e+" in env["GPUSLICE_PLANNER_SEED"]  # as Helm renders it
    apply_env(monkeypatch, env)
    s = PartitionerSettings()
    p = s.planner_settings()
    assert (p.seed, p.weight_destroy, p.mps_reserve_mib) == (123456789, 1000000, 2000000)
    assert (p.free_capacity_cpu_milli, p.free_capacity_memory_mib) == (64000000, 1048576)
    assert s.liveness_failed_steps == 1000000
    monkeypatch.setenv("GPUSLICE_LIVENESS_FAILED_STEPS", "1.5e+00")  # a fraction: refused
    with pytest.raises(ValueError, match="liveness_failed_steps"):
        PartitionerSettings()


def numeric_schema_leaves(
    node: dict[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """(values path, schema) of every number or integer the schema's objects declare."""
    for key, sub in node.get("properties", {}).items():
        types = sub.get("type")
        types = set(types) if isinstance(types, list) else {types}
        if "properties" in sub:
            yield from numeric_schema_leaves(sub, (*path, key))
        elif types & {"number", "integer"}:
            yield (*path, key), sub


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out


def test_every_number_the_schema_admits_starts_the_components(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each number of ``partitioner.*`` and ``agent.*`` at the schema's ``maximum`` (or, where
    the schema has none, a vast 10^12) renders, and the settings of every component whose env it
    changes accept that env (as Helm renders it: ``2.147483647e+09``).  So whatever the schema
    admits starts; whatever a setting's bound refuses, the schema refuses first.  Before, a seed
    over 10^9, weights over 10^6 and sizes, drain queue limits and Lease lengths over 10^9
    passed ``helm install`` and then stopped the component at every start."""
    from node_agent.settings import AgentSettings
    from partitioner.settings import PartitionerSettings

    schema = json.loads((CHART / "values.schema.json").read_text())
    base = render(chart, {})
    base_env = {kind: gpuslice_env(container(base, kind)) for kind in ("Deployment", "DaemonSet")}
    started: set[str] = set()
    for path, leaf in numeric_schema_leaves(schema):
        if path[0] not in ("partitioner", "agent"):
            continue
        value = leaf.get("maximum", 10**12)
        key = ".".join(path)
        try:
            docs = render(chart, nested(path, value))
        except helm.HelmValuesError:  # the schema refused it: nothing starts with it
            assert "maximum" not in leaf, f"{key}={value}: the schema's own maximum is refused"
            continue
        except helm.HelmRenderError:  # a guard refused it with the other values' defaults
            continue
        for kind, settings_cls in (
            ("Deployment", PartitionerSettings),
            ("DaemonSet", AgentSettings),
        ):
            env = gpuslice_env(container(docs, kind))
            if env == base_env[kind]:
                continue
            apply_env(
                monkeypatch, env | ({"GPUSLICE_NODE_NAME": "n1"} if kind == "DaemonSet" else {})
            )
            try:
                if settings_cls is PartitionerSettings:
                    settings = PartitionerSettings()
                    settings.planner_settings()
                    settings.decide_config(load_catalog())
                else:
                    AgentSettings()  # type: ignore[call-arg]
            except ValueError as err:
                pytest.fail(f"{key}={value} passes the schema but stops the {kind}: {err}")
            started.add(key)
    assert {
        "partitioner.planner.seed",
        "partitioner.planner.weights.freeBlock",
        "partitioner.planner.mpsReserveMiB",
        "partitioner.planner.freeCapacity.cpuMilli",
        "partitioner.planner.freeCapacity.memoryMiB",
        "partitioner.reservations.drainQueueLimit",
        "agent.leaseSeconds",
    } <= started


def test_agent_settings_accept_the_chart_env(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_settings = pytest.importorskip(
        "node_agent.settings", reason="node_agent/settings.py not written yet"
    )
    settings_cls = agent_settings.AgentSettings
    env = gpuslice_env(container(render(chart, {}), "DaemonSet"))
    env["GPUSLICE_NODE_NAME"] = "gpu-node-1"  # the downward API's value at run time
    fields = {f"GPUSLICE_{name.upper()}" for name in settings_cls.model_fields}
    assert not set(env) - fields, f"chart sets env the agent ignores: {set(env) - fields}"
    apply_env(monkeypatch, env)
    from_chart = settings_cls()
    assert from_chart.node_name == "gpu-node-1"
    apply_env(monkeypatch, {"GPUSLICE_NODE_NAME": "gpu-node-1"})
    assert from_chart == settings_cls()  # the chart's defaults are the code's defaults


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin agent", "DRA agent"])
def test_both_agents_get_the_lease_seconds_and_their_namespace(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch, dra: bool
) -> None:
    """agent.leaseSeconds reaches both agents as GPUSLICE_LEASE_SECONDS, and both know their
    namespace (GPUSLICE_POD_NAMESPACE, where the Lease lives and the agent Role grants it)."""
    from node_agent.settings import AgentSettings

    def agent_container(values: dict[str, Any]) -> dict[str, Any]:
        docs = render(chart, {**({"dra": {"enabled": True}} if dra else {}), **values})
        suffix = "-agent-dra" if dra else "-agent"
        (ds,) = [
            d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith(suffix)
        ]
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        return c

    default = agent_container({})
    assert env_of(default)["GPUSLICE_LEASE_SECONDS"] == "40"
    field_refs = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in default["env"]
        if "valueFrom" in e
    }
    assert field_refs["GPUSLICE_POD_NAMESPACE"] == "metadata.namespace"
    env = gpuslice_env(agent_container({"agent": {"leaseSeconds": 90}}))
    assert env["GPUSLICE_LEASE_SECONDS"] == "90"
    apply_env(monkeypatch, {**env, "GPUSLICE_NODE_NAME": "n1", "GPUSLICE_POD_NAMESPACE": NAMESPACE})
    settings = AgentSettings()  # type: ignore[call-arg]
    assert (settings.lease_seconds, settings.pod_namespace, settings.dra) == (90, NAMESPACE, dra)
    off = gpuslice_env(agent_container({"agent": {"leaseSeconds": 0}}))
    apply_env(monkeypatch, {**off, "GPUSLICE_NODE_NAME": "n1"})
    assert AgentSettings().lease_seconds == 0  # type: ignore[call-arg]


def documented_catalog_example() -> dict[str, Any]:
    """The catalog example commented in values.yaml, as values."""
    text = (CHART / "values.yaml").read_text()
    block = text.split("  # Example:\n", 1)[1].split("\n  files: {}", 1)[0]
    example: dict[str, Any] = yaml.safe_load(
        "\n".join(line.removeprefix("  # ") for line in block.splitlines())
    )
    return {"catalog": example}


@pytest.mark.parametrize("variant", ["custom-catalog", "documented-example"])
def test_catalog_override_reaches_both_components(
    chart: helm.Chart, tmp_path: Path, variant: str
) -> None:
    values = documented_catalog_example() if variant == "documented-example" else VARIANTS[variant]
    docs = render(chart, values)
    cm = one(docs, "ConfigMap", "-catalog")
    assert sorted(cm["data"]) == sorted(values["catalog"]["files"])
    for kind in ("Deployment", "DaemonSet"):
        pod = one(docs, kind)["spec"]["template"]["spec"]
        c = container(docs, kind)
        (vol,) = [
            v
            for v in pod["volumes"]
            if v.get("configMap", {}).get("name") == cm["metadata"]["name"]
        ]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
        paths = env_of(c)["GPUSLICE_CATALOG_FILES"].split(",")
        assert paths == [f"{mount['mountPath']}/{k}" for k in sorted(cm["data"])]
    # What the components read: the ConfigMap's files, in the env's order.
    files = []
    for key in sorted(cm["data"]):
        (tmp_path / key).write_text(cm["data"][key])
        files.append(tmp_path / key)
    catalog = load_catalog(files)
    for doc in values["catalog"]["files"].values():
        models = (yaml.safe_load(doc) if isinstance(doc, str) else doc)["models"]
        for model in models:
            assert catalog.model(model["name"]).memory_mib == model["memory_mib"]


def test_catalog_change_rolls_the_pods(chart: helm.Chart) -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = one(render(chart, values), "DaemonSet")["spec"]["template"]
        value: str = pod["metadata"]["annotations"]["checksum/catalog"]
        return value

    assert checksum({}) != checksum(VARIANTS["custom-catalog"])


# ----------------------------------------------------------------------------------- metrics

DASHBOARD_METRICS = {
    "gpuslice_pending_pods",
    "gpuslice_batch_size",
    "gpuslice_plan_duration_seconds",
    "gpuslice_pods_planned_total",
    "gpuslice_pods_unplaceable_total",
    "gpuslice_gpus_reconfigured_total",
    "gpuslice_spec_to_applied_seconds",
    "gpuslice_spec_conflicts_total",
    "gpuslice_oldest_pending_pod_seconds",
    "gpuslice_reservations",
    "gpuslice_pods_stranded",
    "gpuslice_nodes_left_out",
    "gpuslice_planner_errors_total",
    "gpuslice_step_failures_total",
    "gpuslice_agent_reconcile_passes_total",
    "gpuslice_agent_reconcile_failures_total",
    "gpuslice_agent_reconcile_duration_seconds",
    "gpuslice_agent_nvml_operations_total",
    "gpuslice_agent_nvml_errors_total",
    "gpuslice_agent_devices_advertised",
    "gpuslice_agent_apply_latency_seconds",
    "gpuslice_agent_spec_applied",
    "gpuslice_agent_spec_degraded",
    "gpuslice_agent_foreign_slices",
    "gpuslice_agent_dra_prepare_failures",
}


def dashboard_series(dashboard: dict[str, Any]) -> set[str]:
    """Every series name the dashboard's queries read (e.g. ``..._seconds_bucket``)."""
    return {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"\bgpuslice_[a-z_]+", target["expr"])
    }


def base_name(series: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", series)


def load_dashboard(chart: helm.Chart) -> dict[str, Any]:
    cm = one(render(chart, {}), "ConfigMap", "-dashboard")
    (text,) = cm["data"].values()
    dashboard: dict[str, Any] = json.loads(text)
    return dashboard


def test_dashboard_queries_the_documented_metrics(chart: helm.Chart) -> None:
    dashboard = load_dashboard(chart)
    assert dashboard["uid"] == "gpuslice"
    assert {base_name(s) for s in dashboard_series(dashboard)} == DASHBOARD_METRICS
    documented = set(re.findall(r"^\| `(gpuslice_[a-z_]+)[`{]", OPERATIONS_DOC.read_text(), re.M))
    assert documented >= DASHBOARD_METRICS
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_components_export_the_dashboard_metrics(chart: helm.Chart) -> None:
    """Every series the dashboard reads is one the partitioner's or the agents' registry
    exposes (tests/test_chart_operability.py parses the queries and the alert rules)."""
    from node_agent.metrics import AgentMetrics
    from partitioner.metrics import Metrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = {  # series names by type: labelled families have no samples before first use
        family.name + suffix
        for registry in (Metrics().registry, AgentMetrics().registry)
        for family in registry.collect()
        for suffix in suffixes[family.type]
    }
    missing = dashboard_series(load_dashboard(chart)) - exported
    assert not missing, f"the dashboard reads series no component exports: {sorted(missing)}"


# ------------------------------------------------------------- admission policy, evaluated

AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-gpuslice-agent"
NODE_CLAIM = "authentication.kubernetes.io/node-name"


def admission_request(
    user: str = AGENT_USER, node: str | None = "gpu-1", name: str = "gpu-1", sub: str = "status"
) -> dict[str, Any]:
    extra = {NODE_CLAIM: [node]} if node is not None else {}
    return {
        "userInfo": {"username": user, "extra": extra},
        "resource": {
            "group": "gpuslice.io",
            "version": "v1alpha1",
            "resource": "nodepartitionings",
        },
        "name": name,
        "subResource": sub,
        "operation": "UPDATE",
    }


def lease_request(
    name: str = "gpuslice-agent-gpu-1", holder: str | None = "gpu-1", node: str = "gpu-1"
) -> dict[str, Any]:
    """The agent's merge PATCH of a Lease, as the API server presents it (``object``: the
    Lease after the patch)."""
    spec = {"holderIdentity": holder} if holder is not None else {}
    return {
        **admission_request(node=node, name=name, sub=""),
        "resource": {"group": "coordination.k8s.io", "version": "v1", "resource": "leases"},
        "object": {"metadata": {"name": name}, "spec": spec},
    }


def admit(policy: dict[str, Any], request: dict[str, Any]) -> list[str] | None:
    """Evaluate a ValidatingAdmissionPolicy's CEL as the API server does, in order: None when
    the match conditions exclude the request, else the messages of the failed validations."""
    celpy = pytest.importorskip("celpy", reason="cel-python (test dependency) not installed")
    env = celpy.Environment()

    def evaluate(expr: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expr)).evaluate(activation)

    activation: dict[str, Any] = {  # the API server binds object and oldObject too
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(request.get("object")),
        "oldObject": celpy.json_to_cel(request.get("oldObject")),
    }
    if not all(evaluate(c["expression"], activation) for c in policy["matchConditions"]):
        return None
    variables: dict[str, Any] = {}
    for var in policy["variables"]:
        activation["variables"] = celpy.json_to_cel(variables)
        variables[var["name"]] = evaluate(var["expression"], activation)
    activation["variables"] = celpy.json_to_cel(variables)
    failed = []
    for check in policy["validations"]:
        if not evaluate(check["expression"], activation):
            if "messageExpression" in check:
                failed.append(str(evaluate(check["messageExpression"], activation)))
            else:
                failed.append(" ".join(check["message"].split()))
    return failed


@pytest.mark.parametrize(
    ("request_", "outcome"),
    [
        (admission_request(), []),
        (
            admission_request(name="gpu-2"),
            ["the gpuslice agent on node gpu-1 may only write NodePartitioning gpu-1, not gpu-2"],
        ),
        (admission_request(node=None), ["carries no node claim"]),
        (
            admission_request(sub=""),
            ["may only write the status of NodePartitioning gpu-1; the spec belongs"],
        ),
        # Not the agent: the policy does not apply (RBAC alone governs the partitioner).
        (
            admission_request(
                user=f"system:serviceaccount:{NAMESPACE}:{RELEASE}-gpuslice-partitioner",
                name="gpu-2",
                sub="",
            ),
            None,
        ),
        (
            admission_request(
                user=f"system:serviceaccount:other:{RELEASE}-gpuslice-agent", name="gpu-2"
            ),
            None,
        ),
        (lease_request(), []),
        (
            lease_request(name="gpuslice-agent-gpu-2", holder="gpu-2"),
            ["may only write its own heartbeat Lease gpuslice-agent-gpu-1 (holderIdentity gpu-1)"],
        ),
        (lease_request(holder="gpu-2"), ["may only write its own heartbeat Lease"]),
        (lease_request(holder=None), ["may only write its own heartbeat Lease"]),
        (lease_request(name="gpuslice-partitioner"), ["not gpuslice-partitioner"]),
        (
            lease_request(name="gpuslice-agent-n-0123456789", node="n" * 239, holder="n" * 239),
            [],
        ),
    ],
    ids=[
        "own-node-status",
        "other-node",
        "no-node-claim",
        "own-spec",
        "partitioner",
        "other-namespace",
        "own-lease",
        "other-nodes-lease",
        "own-lease-other-holder",
        "lease-without-holder",
        "leader-lease",
        "hashed-lease-name",
    ],
)
def test_admission_policy_decisions(
    chart: helm.Chart, request_: dict[str, Any], outcome: list[str] | None
) -> None:
    policy = one(render(chart, {}), "ValidatingAdmissionPolicy")["spec"]
    failed = admit(policy, request_)
    if outcome is None:
        assert failed is None
        return
    assert failed is not None
    assert len(failed) == len(outcome) and all(
        want in got for want, got in zip(outcome, failed, strict=True)
    ), failed


# ------------------------------------------------------------------------- admission webhook


def webhook_of(docs: list[Manifest]) -> dict[str, Any]:
    (hook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    return hook


NAMESPACE_LABELS: list[tuple[dict[str, str], bool]] = [
    ({"kubernetes.io/metadata.name": "ml"}, True),
    ({"kubernetes.io/metadata.name": "kube-system"}, False),
    ({"kubernetes.io/metadata.name": NAMESPACE}, False),
    ({"kubernetes.io/metadata.name": "ml", "gpuslice.io/gating": "disabled"}, False),
    ({"kubernetes.io/metadata.name": "ml", "gpuslice.io/gating": "enabled"}, True),
]


def test_without_reservations_no_webhook_is_rendered_or_served(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """partitioner.reservations.enabled=false: nothing would ever release a gated pod (the
    partitioner only removes the gate again), so the chart renders no webhook and does not turn
    it on in the partitioner, whatever webhook.enabled says; docs/operations.md says so."""
    from partitioner.settings import PartitionerSettings

    docs = render(chart, VARIANTS["reservations-off"])
    webhook_kinds = {"MutatingWebhookConfiguration", "Certificate", "Issuer"}
    left = [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if d["kind"] in webhook_kinds or d["metadata"]["name"].endswith("-webhook")
    ]
    assert left == [], f"reservations off, yet the chart renders the webhook's {left}"
    env = env_of(container(docs, "Deployment"))
    assert env["GPUSLICE_RESERVATION"] == "false"
    assert not any(k.startswith("GPUSLICE_WEBHOOK_") for k in env), (
        "reservations off: the partitioner Deployment must not turn the webhook on"
    )
    apply_env(monkeypatch, gpuslice_env(container(docs, "Deployment")))
    s = PartitionerSettings()
    assert not s.webhook_enabled and not s.reservation
    ports = {p["name"] for p in container(docs, "Deployment").get("ports", [])}
    assert "webhook" not in ports
    # The same with cert-manager: no Certificate for a webhook nobody serves.
    cm = {**VARIANTS["reservations-off"], **VARIANTS["webhook-cert-manager"]}
    assert not [d for d in render(chart, cm) if d["kind"] in webhook_kinds]
    row = next(
        line
        for line in OPERATIONS_DOC.read_text().splitlines()
        if line.startswith("| `enabled` | `GPUSLICE_RESERVATION`")
    )
    assert "installs no admission webhook" in row, "docs/operations.md must say so"


def test_webhook_selects_pods_as_gating_does(chart: helm.Chart) -> None:
    from partitioner.gating import MATCH_CONDITIONS, OPT_OUT_LABEL, OPT_OUT_VALUE

    docs = render(chart, {})
    hook = webhook_of(docs)
    assert hook["name"] == "slice-gate.gpuslice.io"
    assert (hook["failurePolicy"], hook["sideEffects"], hook["admissionReviewVersions"]) == (
        "Ignore",
        "None",
        ["v1"],
    )
    assert hook["timeoutSeconds"] == 5
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert [(c["name"], c["expression"]) for c in hook["matchConditions"]] == list(MATCH_CONDITIONS)
    for labels, seen in NAMESPACE_LABELS:
        assert matches(hook["namespaceSelector"], labels) == seen, labels
    assert matches(hook["objectSelector"], {"app": "x"})
    assert not matches(hook["objectSelector"], {OPT_OUT_LABEL: OPT_OUT_VALUE})
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert "caBundle" not in hook["clientConfig"]  # self-managed: the partitioner sets it
    assert "annotations" not in mwc["metadata"]
    custom = webhook_of(render(chart, VARIANTS["webhook-cert-manager-issuer"]))
    assert matches(custom["namespaceSelector"], {"kubernetes.io/metadata.name": "ml"})
    assert not matches(custom["namespaceSelector"], {"kubernetes.io/metadata.name": "batch-system"})
    assert custom["timeoutSeconds"] == 10


def test_webhook_reaches_the_partitioners_webhook_server(chart: helm.Chart) -> None:
    from partitioner.webhook import WEBHOOK_PATH

    docs = render(chart, {})
    service_ref = webhook_of(docs)["clientConfig"]["service"]
    service = one(docs, "Service", "-webhook")
    assert service_ref == {
        "name": service["metadata"]["name"],
        "namespace": NAMESPACE,
        "path": WEBHOOK_PATH,
        "port": 443,
    }
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (443, "webhook")
    deploy = one(docs, "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    c = container(docs, "Deployment")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["webhook"] == 9443 == int(env_of(c)["GPUSLICE_WEBHOOK_PORT"])


@pytest.mark.parametrize("variant", ["defaults", "webhook-cert-manager"])
def test_webhook_settings_name_the_rendered_objects(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    from partitioner.certs import service_dns_names
    from partitioner.settings import PartitionerSettings

    docs = render(chart, VARIANTS[variant])
    c = container(docs, "Deployment")
    apply_env(monkeypatch, gpuslice_env(c))
    s = PartitionerSettings()
    service = one(docs, "Service", "-webhook")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert s.webhook_enabled
    assert (s.webhook_service_name, s.webhook_namespace) == (service["metadata"]["name"], NAMESPACE)
    if variant == "defaults":
        assert s.webhook_cert_mode == "self-managed"
        assert s.webhook_configuration_name == mwc["metadata"]["name"]
        assert s.webhook_secret_name == f"{RELEASE}-gpuslice-webhook-tls"
        assert s.webhook_cert_dir.startswith("/tmp/")  # on the writable emptyDir
        assert not [d for d in docs if d["kind"] in CRD_BACKED_KINDS]
        return
    # cert-manager: the Certificate names the Service, its Secret is mounted where the
    # partitioner reads, and the CA injector is pointed at it.
    assert s.webhook_cert_mode == "files"
    cert = one(docs, "Certificate", "-webhook")
    assert cert["spec"]["dnsNames"] == list(service_dns_names(s.webhook_service_name, NAMESPACE))
    assert mwc["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{NAMESPACE}/{cert['metadata']['name']}"
    }
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName")]
    assert vol["secret"]["secretName"] == cert["spec"]["secretName"]
    # not issued yet (an issuer not Ready): the partitioner starts and plans without it
    assert vol["secret"]["optional"] is True
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["mountPath"] == s.webhook_cert_dir and mount["readOnly"] is True
    # The chart's own CA signs the serving certificate, so its renewals keep the caBundle.
    ca_issuer = one(docs, "Issuer", "-webhook-ca")
    ca_cert = one(docs, "Certificate", "-webhook-ca")
    assert cert["spec"]["issuerRef"]["name"] == ca_issuer["metadata"]["name"]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    assert ca_cert["spec"]["isCA"] is True


def test_cert_manager_with_an_existing_issuer(chart: helm.Chart) -> None:
    docs = render(chart, VARIANTS["webhook-cert-manager-issuer"])
    assert not [d for d in docs if d["kind"] == "Issuer"]
    cert = one(docs, "Certificate")
    assert cert["spec"]["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "ClusterIssuer",
        "name": "ca",
    }
    assert (cert["spec"]["duration"], cert["spec"]["renewBefore"]) == ("2160h", "720h")


HOOK_KINDS = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job"]


@pytest.mark.parametrize("variant", ["defaults", "webhook-disabled", "reservations-off"])
def test_pre_delete_hook_releases_every_gated_pod(chart: helm.Chart, variant: str) -> None:
    import argparse

    from gpuslice.commands import ungate

    docs = render(chart, VARIANTS[variant])
    hook = {kind: one(docs, kind, "-ungate") for kind in HOOK_KINDS}
    weights = {}
    for kind, doc in hook.items():
        notes = doc["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-delete"
        policy = set(notes["helm.sh/hook-delete-policy"].split(","))
        assert policy == {"before-hook-creation", "hook-succeeded"}
        weights[kind] = int(notes["helm.sh/hook-weight"])
    assert max(w for k, w in weights.items() if k != "Job") < weights["Job"]  # RBAC first
    job = hook["Job"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] >= 1
    (c,) = pod["containers"]
    assert c["image"] == container(docs, "Deployment")["image"]
    args = c["args"]
    deployment = one(docs, "Deployment")["metadata"]["name"]
    stop = ["--stop-partitioner", f"{NAMESPACE}/{deployment}", "--wait-seconds", "120"]
    lease_name = env_of(container(docs, "Deployment"))["GPUSLICE_LEADER_ELECTION_LEASE_NAME"]
    lease = ["--delete-lease", f"{NAMESPACE}/{lease_name}"]
    if variant == "defaults":
        mwc = one(docs, "MutatingWebhookConfiguration")["metadata"]["name"]
        secret_name = env_of(container(docs, "Deployment"))["GPUSLICE_WEBHOOK_SECRET_NAME"]
        secret = ["--delete-secret", f"{NAMESPACE}/{secret_name}"]  # self-managed certificates
        webhook = ["--remove-webhook", mwc]
        assert args == ["ungate", "--all", *webhook, *stop, *lease, *secret, "--cleanup"]
    else:
        assert args == ["ungate", "--all", *stop, *lease, "--cleanup"]
    parser = argparse.ArgumentParser()
    ungate.add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    assert parsed.all and ungate._targets(parsed) == []  # valid input to the command
    assert not [
        d
        for d in render(chart, {"webhook": {"ungateOnUninstall": False}})
        if d["metadata"]["name"].endswith("-ungate")
    ]


@pytest.mark.parametrize("delay", [0, 5, 200, 300])
def test_the_ungate_hook_waits_out_the_partitioners_shutdown(chart: helm.Chart, delay: int) -> None:
    """The hook removes the Lease and the NodePartitionings only once the partitioner's pods
    ended: it waits at least their terminationGracePeriodSeconds (shutdownDelaySeconds + 30),
    and its Job's deadline leaves room after that.  Before, it waited 120 s whatever the
    delay, so with a delay of 200 s it deleted both under a partitioner still leading."""
    docs = render(chart, {"partitioner": {"shutdownDelaySeconds": delay}})
    grace = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    job = one(docs, "Job", "-ungate")["spec"]
    args = job["template"]["spec"]["containers"][0]["args"]
    wait = float(args[args.index("--wait-seconds") + 1])
    assert wait >= max(120, grace + 30)
    assert job["activeDeadlineSeconds"] >= wait + 180


def test_the_partitioner_lists_agent_leases_only_where_agents_keep_them(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With agent.leaseSeconds the partitioner lists the Leases in the release namespace
    (its Role may list them: rbac-usage); with 0 it lists none (no Role rule to refuse it)."""
    from partitioner.settings import PartitionerSettings

    env = gpuslice_env(container(render(chart, VARIANTS["defaults"]), "Deployment"))
    apply_env(monkeypatch, env)
    s = PartitionerSettings()
    assert (s.agent_lease_namespace, s.lease_poll_seconds) == (NAMESPACE, 10)
    env = gpuslice_env(container(render(chart, VARIANTS["no-agent-lease"]), "Deployment"))
    apply_env(monkeypatch, env)
    assert PartitionerSettings().lease_poll_seconds == 0


def test_webhook_is_called_again_when_a_later_webhook_adds_a_slice(chart: helm.Chart) -> None:
    """``reinvocationPolicy: Never`` let a pod through ungated when a webhook after gpuslice's
    (a policy engine's mutate rule) added its slice request: gpuslice's matchConditions had
    not selected it yet.  ``IfNeeded`` calls it again; gating an already gated pod adds
    nothing (no second gate for the API server to reject)."""
    from partitioner.gating import GATE, admission_patch

    assert webhook_of(render(chart, {}))["reinvocationPolicy"] == "IfNeeded"
    gated_pod = {
        "metadata": {"name": "p", "namespace": "ml"},
        "spec": {
            "schedulingGates": [{"name": GATE}],
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}],
        },
    }
    assert not admission_patch(gated_pod)
