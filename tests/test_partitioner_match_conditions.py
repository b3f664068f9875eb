"""The webhook's CEL ``matchConditions`` select exactly the pods ``gating.wants_gate`` selects.

The API server evaluates :data:`partitioner.gating.MATCH_CONDITIONS` (all must be true) before
calling the webhook; the webhook then decides with :func:`partitioner.gating.wants_gate` (plus
"gate not there yet").  If they disagreed, pods would be gated that gpuslice never plans, or
pods that ask for a slice would skip the webhook.  cel-python evaluates the expressions as the
API server's CEL does (RE2 ``matches``, ``has`` on absent fields).
"""

from __future__ import annotations

from typing import Any

import celpy
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.gating import (
    GATE,
    MATCH_CONDITIONS,
    MATCH_CONDITIONS_DRA,
    OPT_OUT_LABEL,
    admission_patch,
    wants_gate,
)

_ENV = celpy.Environment()
_PROGRAMS = [(name, _ENV.program(_ENV.compile(expr))) for name, expr in MATCH_CONDITIONS]
_PROGRAMS_DRA = [(name, _ENV.program(_ENV.compile(expr))) for name, expr in MATCH_CONDITIONS_DRA]


def selected(pod: dict[str, Any], claims: bool = False) -> bool:
    activation = {"object": celpy.json_to_cel(pod)}
    programs = _PROGRAMS_DRA if claims else _PROGRAMS
    return all(bool(program.evaluate(activation)) for _, program in programs)


RESOURCES = st.one_of(
    st.sampled_from(
        [
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/mig-7g.80gb",
            "nvidia.com/gpu-10gb",
            "nvidia.com/gpu-1gb",
            "nvidia.com/gpu",
            "nvidia.com/gpu-gb",
            "nvidia.com/gpu-10GB",
            "nvidia.com/gpu-10gbx",
            "nvidia.com/gpu-10gb\n",
            "nvidia.com/gpu-\u0661\u0660gb",  # Arabic-Indic digits
            "xnvidia.com/mig-1g.10gb",
            "nvidia.com/mig",
            "cpu",
            "memory",
        ]
    ),
    st.from_regex(r"nvidia\.com/(gpu|mig)-[0-9a-z.]{0,6}", fullmatch=True),
)
QUANTITIES = st.dictionaries(RESOURCES, st.just("1"), max_size=3)


@st.composite
def containers(draw: st.DrawFn) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "c"}
    resources: dict[str, Any] = {}
    for part in ("limits", "requests"):
        if draw(st.booleans()):
            resources[part] = draw(QUANTITIES)
    if resources or draw(st.booleans()):
        c["resources"] = resources
    return c


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "default"}
    labels = draw(
        st.dictionaries(
            st.sampled_from([OPT_OUT_LABEL, "app", "gpuslice.io/other"]),
            st.sampled_from(["disabled", "enabled", "Disabled", ""]),
            max_size=2,
        )
    )
    if labels or draw(st.booleans()):
        meta["labels"] = labels
    kinds = draw(
        st.lists(st.sampled_from(["DaemonSet", "ReplicaSet", "Job", "StatefulSet"]), max_size=2)
    )
    if kinds:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": k, "name": "o", "uid": str(i)}
            for i, k in enumerate(kinds)
        ]
    spec: dict[str, Any] = {"containers": draw(st.lists(containers(), min_size=1, max_size=3))}
    init = draw(st.lists(containers(), max_size=2))
    if init:
        spec["initContainers"] = init
    node = draw(st.sampled_from([None, "", "n1"]))
    if node is not None:
        spec["nodeName"] = node
    if draw(st.booleans()):
        spec["schedulingGates"] = [{"name": draw(st.sampled_from([GATE, "other.io/gate"]))}]
    claims = draw(st.sampled_from([None, 0, 1, 2]))
    if claims is not None:  # DRA: claims named by the pod (an empty list is allowed)
        spec["resourceClaims"] = [
            {"name": f"c{i}", "resourceClaimTemplateName": "t"} for i in range(claims)
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@settings(max_examples=160, deadline=None)
@given(pods(), st.booleans())
def test_match_conditions_select_exactly_the_pods_wants_gate_selects(
    pod: dict[str, Any], claims: bool
) -> None:
    assert selected(pod, claims) == wants_gate(pod, claims)
    if not selected(pod, claims):  # the webhook is not called: it must not have wanted to gate
        assert admission_patch(pod, claims) is None


def test_each_condition_can_exclude_a_pod() -> None:
    """Every condition is load-bearing: for each, a pod that only it excludes."""
    base = {
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu-10gb": "1"}}}]
        },
    }
    assert selected(base) and wants_gate(base)
    variants = {
        "asks-for-a-slice": {"spec": {"containers": [{"name": "c"}]}},
        "not-bound": {"spec": {**base["spec"], "nodeName": "n1"}},
        "not-opted-out": {"metadata": {"name": "p", "labels": {OPT_OUT_LABEL: "disabled"}}},
        "not-a-daemonset-pod": {
            "metadata": {"name": "p", "ownerReferences": [{"kind": "DaemonSet", "name": "d"}]}
        },
    }
    assert set(variants) == {name for name, _ in MATCH_CONDITIONS}
    for name, change in variants.items():
        pod = {**base, **change}
        failing = [
            n
            for n, program in _PROGRAMS
            if not program.evaluate({"object": celpy.json_to_cel(pod)})
        ]
        assert failing == [name]
        assert not wants_gate(pod)
