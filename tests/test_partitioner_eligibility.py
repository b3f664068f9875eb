"""Pod -> node filters: nodeSelector, required node affinity, taints and tolerations, cordon."""

from __future__ import annotations

from typing import Any

import pytest

from partitioner.eligibility import affinity_matches, eligible_nodes, pod_fits_node, tolerates


def node(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def pod(**spec: Any) -> dict[str, Any]:
    return {"spec": spec}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": op, "values": list(values)}]}


NODES = [
    node("a", {"zone": "x", "gpus": "8"}),
    node("b", {"zone": "y", "gpus": "2"}),
    node("c", {}),
]


def test_node_selector_needs_every_label() -> None:
    assert eligible_nodes(pod(nodeSelector={"zone": "x"}), NODES) == {"a"}
    assert eligible_nodes(pod(nodeSelector={"zone": "x", "gpus": "2"}), NODES) == set()
    assert eligible_nodes(pod(), NODES) == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        (expr("zone", "In", "x", "y"), {"a", "b"}),
        (expr("zone", "NotIn", "x"), {"b", "c"}),  # NotIn matches a missing label
        (expr("zone", "Exists"), {"a", "b"}),
        (expr("zone", "DoesNotExist"), {"c"}),
        (expr("gpus", "Gt", "4"), {"a"}),
        (expr("gpus", "Lt", "4"), {"b"}),
        (expr("zone", "Gt", "4"), set()),  # non-integer label never compares
        (expr("zone", "Bogus", "x"), set()),
        ({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["c"]}]}, {"c"}),
        (
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["c"]}]},
            {"a", "b"},
        ),
        ({}, set()),  # an empty term matches nothing
    ],
)
def test_required_affinity_operators(term: dict[str, Any], expected: set[str]) -> None:
    assert eligible_nodes(pod(affinity=required(term)), NODES) == expected


@pytest.mark.parametrize(
    ("label", "op", "bound", "matches"),
    [
        # kube-scheduler reads both with strconv.ParseInt(v, 10, 64); Python's int() also
        # takes '_', spaces, '+' on the bound, other scripts' digits and any size
        ("1_000", "Gt", "500", False),
        ("\u0663", "Gt", "1", False),  # an Arabic-Indic 3
        ("99999999999999999999", "Gt", "0", False),  # beyond int64
        ("100", "Gt", "1_0", False),  # a bound that does not parse fails its term
        ("100", "Gt", "+5", False),  # not a label value: labels.NewRequirement refuses it
        ("100", "Lt", " 500", False),
        ("100", "Lt", "99999999999999999999", False),
        ("9223372036854775807", "Gt", "9223372036854775806", True),
        ("0" * 70 + "7", "Gt", "006", True),  # leading zeros: still 7 > 6
        ("-5", "Lt", "0", True),
    ],
)
def test_gt_and_lt_parse_integers_the_way_kube_scheduler_does(
    label: str, op: str, bound: str, matches: bool
) -> None:
    n = node("n", {"mem": label})
    assert pod_fits_node(pod(affinity=required(expr("mem", op, bound))), n) is matches


def test_affinity_terms_are_ored_and_expressions_anded() -> None:
    both = {
        "matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["x", "y"]},
            {"key": "gpus", "operator": "Lt", "values": ["4"]},
        ]
    }
    assert eligible_nodes(pod(affinity=required(both)), NODES) == {"b"}
    either = required(expr("zone", "In", "x"), expr("zone", "DoesNotExist"))
    assert eligible_nodes(pod(affinity=either), NODES) == {"a", "c"}
    assert affinity_matches({"affinity": {"nodeAffinity": {}}}, NODES[0])


def test_hard_taints_need_a_toleration_soft_ones_do_not() -> None:
    gpu = node("g", taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    soft = node("s", taints=[{"key": "x", "effect": "PreferNoSchedule"}])
    evict = node("e", taints=[{"key": "maint", "effect": "NoExecute"}])
    assert not pod_fits_node(pod(), gpu)
    assert pod_fits_node(pod(), soft)
    assert not pod_fits_node(pod(), evict)
    tol = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}
    assert pod_fits_node(pod(tolerations=[tol]), gpu)
    assert not pod_fits_node(pod(tolerations=[{**tol, "value": "absent"}]), gpu)
    assert pod_fits_node(pod(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]), gpu)
    assert pod_fits_node(pod(tolerations=[{"operator": "Exists"}]), evict)  # tolerates all
    assert not pod_fits_node(
        pod(tolerations=[{"key": "maint", "operator": "Exists", "effect": "NoSchedule"}]), evict
    )


def test_cordoned_node_needs_the_unschedulable_toleration() -> None:
    cordoned = node("k", unschedulable=True)
    assert not pod_fits_node(pod(), cordoned)
    tol = {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
    assert pod_fits_node(pod(tolerations=[tol]), cordoned)


def test_toleration_equal_defaults() -> None:
    taint = {"key": "k", "effect": "NoSchedule"}
    assert tolerates({"key": "k"}, taint)  # operator Equal, empty value, any effect
    assert not tolerates({"key": "k", "operator": "Weird"}, taint)
