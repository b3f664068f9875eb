"""A release narrows whatever node constraints a pod came with to exactly its planned node.

:func:`partitioner.gating.release_patch` must, for any pod the planner may place on node X
(any nodeSelector, any required node affinity: terms ORed, requirements ANDed, every operator,
field selectors, empty terms), produce an update the API server accepts for a gated pod (gates
only removed, node affinity only narrowed: :mod:`simulations.replay.kube_rules`, which the
operator tests' fake API server enforces too), after which the pod fits X and no other node,
keeps its other gates, its preferred affinity, its pod (anti-)affinity and its nodeSelector.
Drawn by hypothesis over nodes with random labels; the oracle is
:func:`partitioner.eligibility.pod_fits_node`, the filter the index and the simulated
kube-scheduler use.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from partitioner.eligibility import pod_fits_node
from partitioner.gating import GATE, release_patch
from simulations.replay.kube_rules import merge_patch, update_errors

NAMES = ("n0", "n1", "n2", "n3")
KEYS = ("zone", "gpu", "rank")
VALUES = {"zone": ("a", "b"), "gpu": ("x", "y"), "rank": ("1", "5", "9")}


def _labels() -> st.SearchStrategy[dict[str, str]]:
    return st.fixed_dictionaries({}, optional={k: st.sampled_from(VALUES[k]) for k in KEYS}).map(
        dict
    )


NODES = st.tuples(*(_labels() for _ in NAMES)).map(
    lambda labels: [
        {"metadata": {"name": n, "labels": lab}, "spec": {}}
        for n, lab in zip(NAMES, labels, strict=True)
    ]
)


@st.composite
def _expression(draw: st.DrawFn) -> dict[str, Any]:
    key = draw(st.sampled_from(KEYS))
    op = draw(st.sampled_from(("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")))
    if op in ("Exists", "DoesNotExist"):
        return {"key": key, "operator": op}
    if op in ("Gt", "Lt"):
        return {"key": "rank", "operator": op, "values": [draw(st.sampled_from(("0", "4", "7")))]}
    values = draw(st.lists(st.sampled_from(VALUES[key]), min_size=1, max_size=2, unique=True))
    return {"key": key, "operator": op, "values": values}


@st.composite
def _field(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(("In", "NotIn")))
    return {"key": "metadata.name", "operator": op, "values": [draw(st.sampled_from(NAMES))]}


@st.composite
def _term(draw: st.DrawFn) -> dict[str, Any]:
    term: dict[str, Any] = {}
    expressions = draw(st.lists(_expression(), max_size=2))
    fields = draw(st.lists(_field(), max_size=1))
    if expressions:
        term["matchExpressions"] = expressions
    if fields:
        term["matchFields"] = fields
    return term  # may be empty: an empty term matches no node


@st.composite
def _pod(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}],
        "schedulingGates": [{"name": GATE}],
    }
    if draw(st.booleans()):
        spec["schedulingGates"].insert(0, {"name": "example.com/quota"})
    if draw(st.booleans()):
        key = draw(st.sampled_from(KEYS))
        spec["nodeSelector"] = {key: draw(st.sampled_from(VALUES[key]))}
    affinity: dict[str, Any] = {}
    node_affinity: dict[str, Any] = {}
    terms = draw(st.lists(_term(), max_size=3))
    if terms or draw(st.booleans()):
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": terms
        }
    if draw(st.booleans()):
        node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 10, "preference": draw(_term())}
        ]
    if node_affinity:
        affinity["nodeAffinity"] = node_affinity
    if draw(st.booleans()):
        affinity["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}
            ]
        }
    if affinity:
        spec["affinity"] = affinity
    return {
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "3"},
        "spec": spec,
        "status": {"phase": "Pending"},
    }


@settings(max_examples=300, deadline=None)
@given(NODES, _pod(), st.sampled_from(NAMES))
def test_a_release_narrows_any_constraints_to_exactly_the_planned_node(
    nodes: list[dict[str, Any]], pod: dict[str, Any], target: str
) -> None:
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assume(pod_fits_node(pod, by_name[target]))  # the planner only plans where it may go
    before = copy.deepcopy(pod)
    released = merge_patch(copy.deepcopy(pod), release_patch(pod, target))

    assert pod == before  # the patch is built without touching the pod read
    assert update_errors(pod, released) == []  # what the API server accepts while gated
    assert [n for n in NAMES if pod_fits_node(released, by_name[n])] == [target]
    gates = [g["name"] for g in released["spec"].get("schedulingGates") or ()]
    assert gates == [g["name"] for g in pod["spec"]["schedulingGates"] if g["name"] != GATE]
    assert released["spec"].get("nodeSelector") == pod["spec"].get("nodeSelector")
    old_affinity = pod["spec"].get("affinity") or {}
    new_affinity = released["spec"]["affinity"]
    assert new_affinity.get("podAntiAffinity") == old_affinity.get("podAntiAffinity")
    assert (
        new_affinity["nodeAffinity"].get("preferredDuringSchedulingIgnoredDuringExecution")
    ) == (
        (old_affinity.get("nodeAffinity") or {}).get(
            "preferredDuringSchedulingIgnoredDuringExecution"
        )
    )


def test_the_oracle_refuses_a_widening_and_sees_a_second_node() -> None:
    """The checks above can fail: dropping a requirement is refused by the API rules, and a
    pod pinned by a term that does not name the node would fit two nodes."""
    nodes = [{"metadata": {"name": n, "labels": {"zone": "a"}}, "spec": {}} for n in NAMES]
    term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    pod = {
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "containers": [],
            "schedulingGates": [{"name": GATE}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [term, copy.deepcopy(term)]
                    }
                }
            },
        },
    }
    widened = copy.deepcopy(pod)
    widened["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0] = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n0"]}]}
    assert update_errors(pod, widened) != []
    half = merge_patch(copy.deepcopy(pod), release_patch(pod, "n0"))
    half["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][1] = term  # one term left un-narrowed
    assert sum(pod_fits_node(half, n) for n in nodes) == len(NAMES)
