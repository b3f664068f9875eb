"""The webhook gates exactly the pods that ask for a slice by ``partitioner.quantities``' rule,
and only pods the chart's ``matchConditions`` (CEL, evaluated with cel-python) send it.

``pod_requests`` follows kube-scheduler: app containers add up, sidecars (init containers with
``restartPolicy: Always``) add to them, ordinary init containers count as a max; limits stand
in for absent requests.  The CEL selects by resource *names* (it cannot read quantities), so a
pod naming a slice resource with a zero amount reaches the webhook, which must decline it; a
pod with a positive amount anywhere must be selected and gated.
"""

from __future__ import annotations

from typing import Any

import kopf
from hypothesis import given, settings
from hypothesis import strategies as st
from test_partitioner_match_conditions import selected

from partitioner import gating
from partitioner.quantities import pod_requests
from partitioner.webhook import gate_pod

SLICES = ["nvidia.com/mig-1g.10gb", "nvidia.com/gpu-10gb"]
AMOUNTS = st.sampled_from(["0", "1", "1.0", "2k", "500m", "0.0", "0m", "2"])
QUANTITIES = st.dictionaries(
    st.sampled_from([*SLICES, "cpu", "nvidia.com/gpu"]), AMOUNTS, max_size=2
)


@st.composite
def containers(draw: st.DrawFn, init: bool) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "c"}
    resources: dict[str, Any] = {}
    if draw(st.booleans()):  # limits only, requests only, or both (equal, as validation wants)
        limits = draw(QUANTITIES)
        resources["limits"] = limits
        if draw(st.booleans()):
            resources["requests"] = dict(limits)
    elif draw(st.booleans()):
        resources["requests"] = draw(QUANTITIES)
    c["resources"] = resources
    if init and draw(st.booleans()):
        c["restartPolicy"] = "Always"
    return c


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": draw(st.lists(containers(False), min_size=1, max_size=3))}
    init = draw(st.lists(containers(True), max_size=3))
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def gated(pod: dict[str, Any]) -> bool:
    patch = kopf.Patch(body=kopf.Body(pod))
    gate_pod(kopf.Body(pod), patch)
    gates = (patch.get("spec") or {}).get("schedulingGates")
    assert gates is None or gates[-1] == {"name": gating.GATE}
    return gates is not None


@settings(max_examples=200, deadline=None)
@given(pods())
def test_gated_iff_a_slice_is_asked_for(pod: dict[str, Any]) -> None:
    requests = pod_requests(pod)
    asks = any(requests.get(r, 0) > 0 for r in SLICES)
    assert gated(pod) == asks
    if asks:  # the API server sends it to the webhook
        assert selected(pod)


def test_zero_amounts_are_sent_but_not_gated() -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {SLICES[0]: "0"}}}],
            "initContainers": [
                {"name": "s", "restartPolicy": "Always", "resources": {"limits": {SLICES[1]: "0"}}}
            ],
        },
    }
    assert selected(pod) and not gated(pod)
    pod["spec"]["initContainers"][0]["resources"]["limits"][SLICES[1]] = "1"
    assert gated(pod)
