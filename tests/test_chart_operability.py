"""The chart's operability options and what operators read: ServiceAccounts, RBAC, registry,
alerts, dashboard and ``kubectl get`` columns.

What is checked, and against what:

* each variant of ``serviceAccount.create`` / ``*.serviceAccount.name``, ``rbac.create``,
  ``global.imageRegistry`` and ``prometheusRules`` renders and validates (kubernetes-validate,
  strict, oldest and newest Kubernetes; the PrometheusRule structurally), and does what it says:
  no ServiceAccount or RBAC object when off (the uninstall hook's included), the given names
  everywhere a name is used (pods, the hook Job, bindings, the admission policy), the global
  registry in every image;
* ``values.schema.json`` refuses bad values of the new keys, naming the key;
* every alert expression and every dashboard query parses as PromQL (promql-parser) and reads
  only metrics the partitioner or the agent registers; every alert is documented with what to
  do; the thresholds in values reach the expressions;
* the NodePartitioning printer columns read fields the contract has, show the values a
  status gives them, and no longer repeat NAME.

Rendering helpers come from tests/test_chart.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import kubernetes_validate
import promql_parser
import pytest
import yaml
from test_chart import (
    CHART,
    CRD_BACKED_KINDS,
    CRD_FILE,
    NAMESPACE,
    NEWEST_KUBE,
    OLDEST_KUBE,
    OPERATIONS_DOC,
    RELEASE,
    Manifest,
    check_cert_manager,
    check_service_monitor,
    load_dashboard,
    one,
    render,
    render_files,
)

from contract.nodepartitioning import PRINTER_COLUMNS, NodePartitioning, crd_manifest
from node_agent.metrics import AgentMetrics
from partitioner.metrics import Metrics
from partitioner.snapshot import PLANNED_PODS_ANNOTATION

HOOK = "helm.sh/hook"
RBAC_KINDS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
NAMES = {"partitioner": "ml-gpu-controller", "agent": "ml-gpu-node", "ungate": "ml-gpu-cleanup"}

VARIANTS: dict[str, dict[str, Any]] = {
    "existing-service-accounts": {
        "serviceAccount": {"create": False},
        "partitioner": {"serviceAccount": {"name": NAMES["partitioner"]}},
        "agent": {"serviceAccount": {"name": NAMES["agent"]}},
        "webhook": {"ungateServiceAccount": {"name": NAMES["ungate"]}},
    },
    "named-service-accounts": {
        "partitioner": {"serviceAccount": {"name": NAMES["partitioner"]}},
        "agent": {"serviceAccount": {"name": NAMES["agent"], "annotations": {"team": "ml"}}},
    },
    "no-rbac": {"rbac": {"create": False}},
    "no-rbac-no-service-accounts": {
        "rbac": {"create": False},
        "serviceAccount": {"create": False},
        "webhook": {"ungateOnUninstall": False},
    },
    "no-rbac-no-service-accounts-with-hook": {
        "rbac": {"create": False},
        "serviceAccount": {"create": False},
        "webhook": {"ungateServiceAccount": {"name": NAMES["ungate"]}},
    },
    "global-registry": {
        "global": {"imageRegistry": "mirror.example.internal:5000/cache"},
        "image": {"registry": "ghcr.io", "digest": "sha256:" + "b" * 64},
    },
    "prometheus-rules": {
        "prometheusRules": {
            "enabled": True,
            "labels": {"release": "kps"},
            "ruleLabels": {"team": "ml-platform"},
            "pendingTooLongSeconds": 3600,
            "reconcileFailureRatio": 0.25,
        }
    },
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def not_hooks(docs: list[Manifest]) -> list[Manifest]:
    """The release's own objects (the pre-delete hook's are created only at uninstall)."""
    return [d for d in docs if HOOK not in (d["metadata"].get("annotations") or {})]


def pod_spec(docs: list[Manifest], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, kind)["spec"]["template"]["spec"]
    return spec


# ---------------------------------------------------------------------------- rendering


DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")


def check_prometheus_rule(rule: Manifest, docs: list[Manifest]) -> None:
    """Structural check of a PrometheusRule (monitoring.coreos.com/v1 CRD)."""
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert set(rule["spec"]) == {"groups"}
    names = []
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, set(r)
            assert re.fullmatch(r"Gpuslice[A-Z][A-Za-z]+", r["alert"]), r["alert"]
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert DURATION.fullmatch(r["for"]), r["for"]
            assert r["labels"]["severity"] in ("critical", "warning", "info")
            assert all(isinstance(v, str) for v in r["labels"].values())
            assert set(r["annotations"]) == {"summary", "description"}
            assert all(v.strip() for v in r["annotations"].values())
            names.append(r["alert"])
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("kube", [OLDEST_KUBE, NEWEST_KUBE])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_validates_strict(chart: helm.Chart, variant: str, kube: str) -> None:
    chart.validate_schema(chart.merge_values(VARIANTS[variant]))
    docs = render(chart, VARIANTS[variant], kube_version=kube)
    assert docs
    for doc in docs:
        if doc["kind"] == "PrometheusRule":
            check_prometheus_rule(doc, docs)
            continue
        if doc["kind"] in CRD_BACKED_KINDS:
            check = check_service_monitor if doc["kind"] == "ServiceMonitor" else check_cert_manager
            check(doc, docs)
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']} at {where}: {e}")


@pytest.mark.parametrize("variant", ["no-rbac", "prometheus-rules", "existing-service-accounts"])
def test_lint_strict_reports_nothing(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and report["messages"] == []


# ----------------------------------------------------------------- ServiceAccounts and RBAC


def test_defaults_create_both_service_accounts_and_their_rbac(chart: helm.Chart) -> None:
    docs = not_hooks(render(chart, {}))
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    assert accounts == {f"{RELEASE}-gpuslice-partitioner", f"{RELEASE}-gpuslice-agent"}
    assert {d["kind"] for d in docs} >= RBAC_KINDS


def test_existing_service_accounts_are_used_by_name_everywhere(chart: helm.Chart) -> None:
    docs = render(chart, VARIANTS["existing-service-accounts"])
    assert not [d for d in not_hooks(docs) if d["kind"] == "ServiceAccount"]
    assert pod_spec(docs, "Deployment")["serviceAccountName"] == NAMES["partitioner"]
    assert pod_spec(docs, "DaemonSet")["serviceAccountName"] == NAMES["agent"]
    subjects = {
        (d["metadata"]["name"], s["name"], s["namespace"])
        for d in not_hooks(docs)
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
        for s in d["subjects"]
    }
    assert subjects == {
        (f"{RELEASE}-gpuslice-partitioner", NAMES["partitioner"], NAMESPACE),
        (f"{RELEASE}-gpuslice-agent", NAMES["agent"], NAMESPACE),
    }
    (cond,) = one(docs, "ValidatingAdmissionPolicy")["spec"]["matchConditions"]
    assert f"'system:serviceaccount:{NAMESPACE}:{NAMES['agent']}'" in cond["expression"]


def test_named_service_accounts_are_created_with_those_names(chart: helm.Chart) -> None:
    docs = not_hooks(render(chart, VARIANTS["named-service-accounts"]))
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(accounts) == {NAMES["partitioner"], NAMES["agent"]}
    assert accounts[NAMES["agent"]]["metadata"]["annotations"] == {"team": "ml"}
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    assert pod_spec(docs, "DaemonSet")["serviceAccountName"] == NAMES["agent"]


def hook_docs(docs: list[Manifest]) -> dict[str, Manifest]:
    """The pre-delete hook's objects by kind (one of each at most)."""
    hooks = [d for d in docs if HOOK in (d["metadata"].get("annotations") or {})]
    by_kind = {d["kind"]: d for d in hooks}
    assert len(by_kind) == len(hooks), [d["kind"] for d in hooks]
    return by_kind


@pytest.mark.parametrize(
    ("variant", "account", "kinds"),
    [
        # defaults: the hook brings its own ServiceAccount and roles
        ("defaults", f"{RELEASE}-gpuslice-ungate", {"ServiceAccount", "Job"} | RBAC_KINDS),
        # serviceAccount.create=false: the named account must exist; roles still bind it
        ("existing-service-accounts", NAMES["ungate"], {"Job"} | RBAC_KINDS),
        # rbac.create=false: the hook's account is created, its roles are the user's
        ("no-rbac", f"{RELEASE}-gpuslice-ungate", {"ServiceAccount", "Job"}),
        # both off: only the Job, running as the given account
        ("no-rbac-no-service-accounts-with-hook", NAMES["ungate"], {"Job"}),
    ],
)
def test_uninstall_hook_respects_the_service_account_and_rbac_toggles(
    chart: helm.Chart, variant: str, account: str, kinds: set[str]
) -> None:
    hook = hook_docs(render(chart, VARIANTS.get(variant, {})))
    assert set(hook) == kinds
    job_pod = hook["Job"]["spec"]["template"]["spec"]
    assert job_pod["serviceAccountName"] == account
    if "ServiceAccount" in hook:
        assert hook["ServiceAccount"]["metadata"]["name"] == account
        # created before the Job that uses it
        weight = hook["ServiceAccount"]["metadata"]["annotations"]["helm.sh/hook-weight"]
        assert int(weight) < int(hook["Job"]["metadata"]["annotations"]["helm.sh/hook-weight"])
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        if kind in hook:
            assert hook[kind]["subjects"] == [
                {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
            ]


@pytest.mark.parametrize(
    ("variant", "said"),
    [
        ("defaults", []),
        ("no-rbac", ["runs as ServiceAccount gs-gpuslice-ungate", "rbac-usage.yaml"]),
        ("existing-service-accounts", [f"runs as ServiceAccount {NAMES['ungate']}", "Create it"]),
        ("no-rbac-no-service-accounts", []),  # no hook: nothing to say
    ],
)
def test_notes_say_what_the_uninstall_hook_needs_when_the_chart_does_not_provide_it(
    chart: helm.Chart, variant: str, said: list[str]
) -> None:
    notes = " ".join(
        render_files(chart, VARIANTS.get(variant, {}))["gpuslice/templates/NOTES.txt"].split()
    )
    if not said:
        assert "pre-delete hook Job runs as" not in notes
    for text in said:
        assert text in notes, notes
    assert ("Create it" in notes) == (variant == "existing-service-accounts")


def test_uninstall_hook_account_annotations_sit_beside_the_hook_annotations(
    chart: helm.Chart,
) -> None:
    values = {"webhook": {"ungateServiceAccount": {"annotations": {"team": "ml"}}}}
    sa = hook_docs(render(chart, values))["ServiceAccount"]
    notes = sa["metadata"]["annotations"]
    assert notes["team"] == "ml" and notes[HOOK] == "pre-delete"


@pytest.mark.parametrize(
    "variant", ["no-rbac", "no-rbac-no-service-accounts", "no-rbac-no-service-accounts-with-hook"]
)
def test_rbac_off_renders_no_role_or_binding(chart: helm.Chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    assert not [d for d in not_hooks(docs) if d["kind"] in RBAC_KINDS]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "DaemonSet", "ValidatingAdmissionPolicy"} <= kinds  # the rest stays
    accounts = [d for d in not_hooks(docs) if d["kind"] == "ServiceAccount"]
    assert len(accounts) == (2 if VARIANTS[variant].get("serviceAccount") is None else 0)
    # the uninstall hook follows the toggles too: no role or binding, and no account unless
    # serviceAccount.create
    assert not [d for d in docs if d["kind"] in RBAC_KINDS]
    if VARIANTS[variant].get("serviceAccount") is not None:
        assert not [d for d in docs if d["kind"] == "ServiceAccount"]


# ---------------------------------------------------------------------------------- images


def images(docs: list[Manifest]) -> list[str]:
    return [
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet", "Job")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def test_global_registry_replaces_the_image_registry_everywhere(chart: helm.Chart) -> None:
    found = images(render(chart, VARIANTS["global-registry"]))
    assert len(found) >= 2
    assert set(found) == {
        "mirror.example.internal:5000/cache/gpuslice/gpuslice@sha256:" + "b" * 64
    }
    default = images(render(chart, {}))
    assert set(default) == {"ghcr.io/gpuslice/gpuslice:0.1.0"}
    empty_global = images(render(chart, {"global": {"imageRegistry": ""}}))
    assert set(empty_global) == set(default)


# --------------------------------------------------------------------------- values schema

BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"serviceAccount": {"create": "yes"}}, "/serviceAccount/create"),
    ({"serviceAccount": {"name": "x"}}, "'name' not allowed"),
    ({"rbac": {"create": 1}}, "/rbac/create"),
    ({"partitioner": {"serviceAccount": {"name": "ML_Controller"}}}, "/serviceAccount/name"),
    ({"agent": {"serviceAccount": {"name": "-node"}}}, "/agent/serviceAccount/name"),
    (
        {"webhook": {"ungateServiceAccount": {"name": "Cleanup"}}},
        "/webhook/ungateServiceAccount/name",
    ),
    ({"webhook": {"ungateServiceAccount": {"create": True}}}, "'create' not allowed"),
    ({"global": {"imageRegistry": "https://mirror"}}, "/global/imageRegistry"),
    ({"prometheusRules": {"enabled": "true"}}, "/prometheusRules/enabled"),
    ({"prometheusRules": {"pendingTooLongSeconds": 10}}, "/prometheusRules/pendingTooLongSeconds"),
    ({"prometheusRules": {"reconcileFailureRatio": 0}}, "/prometheusRules/reconcileFailureRatio"),
    ({"prometheusRules": {"reconcileFailureRatio": 1.5}}, "/prometheusRules/reconcileFailureRatio"),
    ({"prometheusRules": {"severity": "page"}}, "'severity' not allowed"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_schema_rejects_bad_values(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.validate_schema(chart.merge_values(values))


def test_global_accepts_other_charts_values(chart: helm.Chart) -> None:
    """``global`` is shared with an umbrella chart: keys of other charts pass."""
    chart.validate_schema(chart.merge_values({"global": {"storageClass": "fast", "x": {"y": 1}}}))


# ------------------------------------------------------------------ metrics: rules, dashboard


def registered_series() -> set[str]:
    """Series names the components' registries can expose (labelled families included)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {
        family.name + suffix
        for registry in (Metrics().registry, AgentMetrics().registry)
        for family in registry.collect()
        for suffix in suffixes[family.type]
    }


def selectors(node: Any) -> Iterator[str]:
    """Metric names of every vector selector in a parsed PromQL expression."""
    match node:
        case promql_parser.VectorSelector():
            assert node.name, f"selector without a metric name: {node}"
            yield node.name
        case promql_parser.MatrixSelector():
            yield from selectors(node.vector_selector)
        case promql_parser.Call():
            for arg in node.args:
                yield from selectors(arg)
        case promql_parser.AggregateExpr():
            yield from selectors(node.expr)
            if node.param is not None:
                yield from selectors(node.param)
        case promql_parser.BinaryExpr():
            yield from selectors(node.lhs)
            yield from selectors(node.rhs)
        case promql_parser.ParenExpr() | promql_parser.UnaryExpr() | promql_parser.SubqueryExpr():
            yield from selectors(node.expr)
        case promql_parser.NumberLiteral() | promql_parser.StringLiteral():
            return
        case _:
            raise AssertionError(f"unexpected PromQL node {type(node).__name__}")


def metrics_of(expr: str) -> set[str]:
    grafana = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
    for var, value in grafana.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return set(selectors(promql_parser.parse(expr)))


def alert_rules(loaded: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    docs = render(loaded, values or VARIANTS["prometheus-rules"])
    rule = one(docs, "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_selectors_walk_finds_every_metric() -> None:
    """The walker reaches selectors inside calls, aggregations, binaries and subqueries."""
    expr = (
        "histogram_quantile(0.9, sum by (le) (rate(a_bucket[5m]))) / on() group_left "
        "-(max_over_time(b[10m:1m])) or absent(c) + topk(3, d)"
    )
    assert metrics_of(expr) == {"a_bucket", "b", "c", "d"}


def test_alerts_read_only_registered_metrics_and_parse(chart: helm.Chart) -> None:
    known = registered_series()
    rules = alert_rules(chart)
    used = set()
    for r in rules:
        names = metrics_of(r["expr"])
        assert names, r["alert"]
        missing = names - known
        assert not missing, f"{r['alert']} reads metrics nobody registers: {sorted(missing)}"
        used |= names
    # the four conditions the chart promises to alert on are covered
    assert {
        "gpuslice_oldest_pending_pod_seconds",  # pods pending too long
        "gpuslice_agent_spec_degraded",  # nodes Degraded
        "gpuslice_agent_reconcile_failures_total",  # reconcile failing
        "gpuslice_planner_errors_total",  # planner errors
    } <= used


def test_dashboard_queries_parse_and_read_only_registered_metrics(chart: helm.Chart) -> None:
    known = registered_series()
    dashboard = load_dashboard(chart)
    used: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names = metrics_of(target["expr"])
            missing = names - known
            assert not missing, f"panel {panel['title']!r} reads unknown {sorted(missing)}"
            used |= names
    agent = {
        "gpuslice_agent_reconcile_passes_total",
        "gpuslice_agent_reconcile_failures_total",
        "gpuslice_agent_nvml_errors_total",
        "gpuslice_agent_devices_advertised",
        "gpuslice_agent_spec_degraded",
        "gpuslice_agent_apply_latency_seconds_bucket",
    }
    waiting = {"gpuslice_oldest_pending_pod_seconds", "gpuslice_reservations"}
    assert agent | waiting <= used


def test_dashboard_layout_has_unique_ids_and_no_overlap(chart: helm.Chart) -> None:
    dashboard = load_dashboard(chart)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and p["description"]


def test_thresholds_in_values_reach_the_expressions(chart: helm.Chart) -> None:
    rules = {r["alert"]: r for r in alert_rules(chart)}
    assert rules["GpuslicePodPendingTooLong"]["expr"].endswith("> 3600")
    assert rules["GpusliceAgentReconcileFailing"]["expr"].rstrip().endswith("> 0.25")
    assert all(r["labels"]["team"] == "ml-platform" for r in rules.values())
    rule = one(render(chart, VARIANTS["prometheus-rules"]), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert not [d for d in render(chart, {}) if d["kind"] == "PrometheusRule"]  # off by default


def test_every_alert_is_documented_with_what_to_do(chart: helm.Chart) -> None:
    doc = OPERATIONS_DOC.read_text()
    observe = doc[doc.index("## Observe") : doc.index("\n## ", doc.index("## Observe") + 1)]
    documented = dict(re.findall(r"^\| `(Gpuslice\w+)` \| [^|]+ \| ([^|]+) \|$", observe, re.M))
    alerts = {r["alert"] for r in alert_rules(chart)}
    assert set(documented) == alerts
    assert all(len(todo.strip()) > 20 for todo in documented.values())


# -------------------------------------------------------------------------- printer columns


def jsonpath(obj: Any, path: str) -> Any:
    """The first match of a simple Kubernetes JSONPath (``.a.b``, ``[N]``,
    ``[?(@.k=="v")]``), as the API server prints a column; None when nothing matches."""
    tokens = re.findall(r'\.([\w-]+)|\[(\d+)\]|\[\?\(@\.(\w+)=="([^"]*)"\)\]', path)
    assert "".join(
        f".{n}" if n else f"[{i}]" if i else f'[?(@.{k}=="{v}")]' for n, i, k, v in tokens
    ) == path, f"unsupported JSONPath {path}"
    for name, index, key, want in tokens:
        if name:
            obj = obj.get(name) if isinstance(obj, dict) else None
        elif index:
            obj = obj[int(index)] if isinstance(obj, list) and len(obj) > int(index) else None
        else:
            obj = next((o for o in obj or [] if o.get(key) == want), None)
        if obj is None:
            return None
    return obj


EXAMPLE = {
    "apiVersion": "gpuslice.io/v1alpha1",
    "kind": "NodePartitioning",
    "metadata": {
        "name": "gpu-3",
        "generation": 4,
        "creationTimestamp": "2025-06-01T10:00:00Z",
        "annotations": {PLANNED_PODS_ANNOTATION: '["ml/a"]'},
    },
    "spec": {"planId": "12", "mode": "mig", "gpus": []},
    "status": {
        "observedGeneration": 4,
        "planId": "11",
        "conditions": [
            {"type": "Applied", "status": "False", "reason": "Degraded"},
            {"type": "Degraded", "status": "True", "reason": "MIGModePending"},
        ],
        "reservations": [
            {"pod": "ml/a", "state": "planned"},
            {"pod": "ml/b", "state": "released"},
        ],
    },
}


def test_printer_columns_show_the_status_an_operator_needs() -> None:
    NodePartitioning.model_validate(EXAMPLE)  # the example is a valid object
    shown = {c["name"]: jsonpath(EXAMPLE, c["jsonPath"]) for c in PRINTER_COLUMNS}
    assert shown == {
        "Mode": "mig",
        "Plan": "12",
        "Applied": "False",
        "Degraded": "True",
        "State": "Degraded",
        "Applied-Plan": "11",
        "Degraded-Reason": "MIGModePending",
        "First-Pending": "ml/a",
        "Age": "2025-06-01T10:00:00Z",
    }
    wide = {c["name"] for c in PRINTER_COLUMNS if c.get("priority", 0) > 0}
    assert wide == {"Applied-Plan", "Degraded-Reason", "First-Pending"}
    fresh = {"apiVersion": EXAMPLE["apiVersion"], "kind": "NodePartitioning",
             "metadata": {"name": "n"}, "spec": {"mode": "mps"}}  # fmt: skip
    assert {c["name"] for c in PRINTER_COLUMNS if jsonpath(fresh, c["jsonPath"]) is None} == (
        {c["name"] for c in PRINTER_COLUMNS} - {"Mode"}
    )


def test_printer_columns_do_not_repeat_name_and_are_in_the_crd() -> None:
    (version,) = crd_manifest()["spec"]["versions"]
    assert version["additionalPrinterColumns"] == PRINTER_COLUMNS
    assert ".metadata.name" not in {c["jsonPath"] for c in PRINTER_COLUMNS}
    names = [c["name"] for c in PRINTER_COLUMNS]
    assert len(names) == len(set(names)) and names[-1] == "Age"
    committed = yaml.safe_load(CRD_FILE.read_text())
    assert committed["spec"]["versions"][0]["additionalPrinterColumns"] == PRINTER_COLUMNS


def test_printer_column_paths_exist_in_the_schema() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for column in PRINTER_COLUMNS:
        node = schema
        for name, _index, _key, _want in re.findall(
            r'\.([\w-]+)|\[(\d+)\]|\[\?\(@\.(\w+)=="([^"]*)"\)\]', column["jsonPath"]
        ):
            if name:
                if node.get("x-kubernetes-preserve-unknown-fields") or node == {"type": "object"}:
                    break  # metadata: any field
                assert name in node.get("properties", {}), (column["name"], name)
                node = node["properties"][name]
            else:
                assert node["type"] == "array", column["name"]
                node = node["items"]
    assert json.dumps(PRINTER_COLUMNS)  # plain data, as the CRD needs


def test_helm_upgrade_replaces_no_agent_by_default_and_rolling_is_an_option(
    chart: helm.Chart,
) -> None:
    """A replaced agent pod ends its node's MPS daemons (tests/test_agent_rollout.py), so the
    default DaemonSet strategy is OnDelete; MIG-only clusters may choose RollingUpdate."""
    ds = one(render(chart, {}), "DaemonSet")
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    ds = one(render(chart, {"agent": {"updateStrategy": rolling}}), "DaemonSet")
    assert ds["spec"]["updateStrategy"] == rolling
    kubernetes_validate.validate(ds, NEWEST_KUBE, strict=True)
