"""A pod's slice names must be exactly the canonical names the node agent advertises.

kube-scheduler and the kubelet match extended resource names exactly, case included, and the
agent advertises only canonical names (``nvidia.com/mig-1g.10gb``, ``nvidia.com/mig-1g.5gb.me``,
``nvidia.com/gpu-10gb``).  A slice name the webhook gates that is not canonical -- wrong case,
``+`` for ``.``, an unknown suffix, leading zeros -- could never bind to a slice gpuslice makes:
the partitioner rejects the pod naming the canonical name ("did you mean ..."), and once it has
existed for a batch window the pod loses its gate (docs/operations.md, "Pods gpuslice can never
place lose the gate") instead of being reserved and dropped a slice every retry, forever.
Human input (CLI flags, GFD labels, catalog files) keeps the catalog's case-insensitive lookup.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from test_partitioner_promises import (
    MIG,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import A100, node, np

from partitioner import gating
from partitioner.gating import GATE
from partitioner.rejection import reject_reason
from planner.catalog import UnknownProfile, default_catalog
from planner.snapshot import Mode, is_partitionable_resource, mps_gb_of

CAT = default_catalog()
A100_80 = CAT.model("A100-SXM4-80GB")
A100_40 = CAT.model("A100-SXM4-40GB")
GRACE = 60.0
"""The test config's batch window timeout: a rejected pod is given back once it is this old."""


def gates(c: Cluster, name: str) -> list[dict[str, str]]:
    return list(c.pod(name)["spec"].get("schedulingGates") or [])


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("asked", "meant", "mode"),
    [
        ("nvidia.com/mig-1G.10GB", "nvidia.com/mig-1g.10gb", Mode.MIG),
        ("nvidia.com/mig-1g.10GB", "nvidia.com/mig-1g.10gb", Mode.MIG),
        ("nvidia.com/mig-1g.10gb+me", "nvidia.com/mig-1g.10gb.me", Mode.MIG),
        ("nvidia.com/mig-1g.10gb.shared", "nvidia.com/mig-1g.10gb", Mode.MIG),
        ("nvidia.com/mig-01g.010gb", "nvidia.com/mig-1g.10gb", Mode.HYBRID),
        ("nvidia.com/gpu-010gb", "nvidia.com/gpu-10gb", Mode.MPS),
        ("nvidia.com/gpu-010gb", "nvidia.com/gpu-10gb", Mode.HYBRID),
    ],
)
def test_a_non_canonical_slice_name_is_rejected_naming_the_canonical_one(
    asked: str, meant: str, mode: Mode
) -> None:
    reason = reject_reason({asked: 1}, [(mode, A100_80)])
    assert reason is not None
    assert reason.startswith(f"unknown resource {asked}: ")
    assert f"did you mean {meant}?" in reason
    assert "exactly, case included" in reason
    # the canonical twin is the planner's to judge
    assert reject_reason({meant: 1}, [(mode, A100_80)]) is None


def test_valid_names_are_listed_as_resource_names_and_one_exact_model_is_enough() -> None:
    reason = reject_reason({"nvidia.com/mig-2g.99gb": 1}, [(Mode.MIG, A100_40)])
    assert reason is not None
    assert "valid on A100-SXM4-40GB: nvidia.com/mig-1g.5gb, nvidia.com/mig-1g.5gb.me," in reason
    assert "+me" not in reason
    # 1g.5gb.me exists on the 40 GB A100 only: one eligible node of that model is enough, and
    # the 80 GB A100 has no media-extension variant of that size to suggest
    eligible = [(Mode.MIG, A100_80), (Mode.MIG, A100_40)]
    assert reject_reason({"nvidia.com/mig-1g.5gb.me": 1}, eligible) is None
    reason = reject_reason({"nvidia.com/mig-1g.5gb.me": 1}, eligible[:1])
    assert reason is not None and "did you mean" not in reason
    assert "valid on A100-SXM4-80GB: nvidia.com/mig-1g.10gb, nvidia.com/mig-1g.10gb.me," in reason


def test_mps_sizes_parse_only_canonically_and_every_gated_name_is_a_slice_name() -> None:
    from planner.snapshot import canonical_mps_resource

    assert mps_gb_of("nvidia.com/gpu-10gb") == 10
    assert mps_gb_of("nvidia.com/gpu-010gb") is None
    assert canonical_mps_resource("nvidia.com/gpu-010gb") == "nvidia.com/gpu-10gb"
    assert canonical_mps_resource("nvidia.com/gpu-10gb") == "nvidia.com/gpu-10gb"
    assert canonical_mps_resource("nvidia.com/mig-1g.10gb") is None
    for asked in ("nvidia.com/gpu-0gb", "nvidia.com/gpu-00gb"):  # too small, however spelled
        assert reject_reason({asked: 1}, [(Mode.MPS, A100_80)]) == (
            f"unknown resource {asked}: an MPS slice needs at least 1 GB"
        )
    names = [
        "nvidia.com/gpu-10gb",
        "nvidia.com/gpu-010gb",
        "nvidia.com/gpu-0gb",
        "nvidia.com/gpu-10Gb",
        "nvidia.com/gpu-\u0661\u0660gb",  # Arabic-Indic digits: not [0-9], never gated
        "nvidia.com/gpu-10gb\n",
        "nvidia.com/mig-1G.10GB",
        "nvidia.com/mig-1g.10gb.shared",
        "nvidia.com/MIG-1g.10gb",
        "nvidia.com/gpu",
    ]
    for name in names:
        pod = {"spec": {"containers": [{"name": "c", "resources": {"limits": {name: "1"}}}]}}
        # the partitioner judges exactly the pods the webhook gates (and the chart's CEL)
        assert is_partitionable_resource(name) == (gating.admission_patch(pod) is not None), name


def test_pod_requests_resolve_exactly_and_human_input_in_any_case() -> None:
    assert A100_80.requested_profile("nvidia.com/mig-1g.10gb.me").name == "1g.10gb+me"
    for asked, meant in [
        ("nvidia.com/mig-1G.10GB", "nvidia.com/mig-1g.10gb"),
        ("nvidia.com/mig-1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
        ("nvidia.com/mig-1g.10gb.me.shared", "nvidia.com/mig-1g.10gb.me"),
    ]:
        with pytest.raises(UnknownProfile, match=re.escape(f"did you mean {meant}")):
            A100_80.requested_profile(asked)
    # a variant the model lacks is another profile, not a misspelling
    with pytest.raises(
        UnknownProfile, match=re.escape("its MIG resources: nvidia.com/mig-1g.5gb, ")
    ):
        A100_40.requested_profile("nvidia.com/mig-1g.10gb.me")
    assert A100_40.near_miss("nvidia.com/mig-1g.10gb.me") is None
    # CLI flags, GFD labels and catalog files keep the case-insensitive lookup
    assert A100_80.profile("1G.10GB+ME").name == "1g.10gb+me"
    assert A100_80.profile("nvidia.com/mig-1G.10GB").name == "1g.10gb"


# --------------------------------------------------------------------------- the decision


def _mig_cluster(*pods: dict[str, Any]) -> Cluster:
    """n1: an applied A100 80 GB MIG node with one free 1g.10gb instance, and room for more."""
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        *pods,
    )


def _run(c: Cluster, until: float) -> dict[str, list[str]]:
    """Steps every 5 s from T0 up to ``until``: the Events each reason got, in order."""
    seen: dict[str, list[str]] = {}
    t = T0
    while t <= until:
        d = c.step(t)
        for reason in ("Unplaceable", "Ungated", "Reserved", "ReservationDropped"):
            seen.setdefault(reason, []).extend(events(d, reason))
        t += 5
    return seen


def test_a_pod_asking_for_an_upper_case_mig_name_loses_its_gate_and_its_twin_is_planned() -> None:
    c = _mig_cluster(
        gated("odd", "nvidia.com/mig-1G.10GB"), gated("twin", "nvidia.com/mig-1g.10gb")
    )
    d = c.step(T0 + 5)
    (why,) = [m for m in events(d, "Unplaceable") if "mig-1G.10GB" in m]
    assert why.startswith("cannot place: unknown resource nvidia.com/mig-1G.10GB: ")
    assert "did you mean nvidia.com/mig-1g.10gb?" in why
    assert reservation(c, "odd") is None
    assert gates(c, "odd") == [{"name": GATE}]  # within its first batch window
    twin = reservation(c, "twin")
    assert twin is not None and twin.node == "n1"

    seen = _run(c, T0 + 1200)
    assert gates(c, "odd") == [] and reservation(c, "odd") is None
    (ungated,) = seen["Ungated"]
    assert "nvidia.com/mig-1G.10GB" in ungated and "did you mean nvidia.com/mig-1g.10gb?" in ungated
    # never reserved a slice it could not take (the bug: Reserved / ReservationDropped every ~70 s)
    assert not [m for m in seen["Reserved"] + seen["ReservationDropped"] if "odd" in m]
    assert seen["ReservationDropped"] == []


def test_a_pod_asking_for_an_mps_size_with_a_leading_zero_loses_its_gate() -> None:
    mps = {"gpuslice.io/partitioning": "mps", **A100}
    free = {"memoryMiB": 10 * 1024, "activeThreadPercentage": 13, "deviceId": "s0", "used": False}
    obj = np(
        "n1",
        plan="1",
        generation=2,
        observed=2,
        applied=True,
        mode="mps",
        gpus=[
            {"index": 0, "migEnabled": False, "mig": [], "mps": [free]},
            {"index": 1, "migEnabled": False, "mig": [], "mps": []},
        ],
    )
    obj["spec"]["gpus"] = [
        {"index": 0, "mps": [{"memoryMiB": 10240, "activeThreadPercentage": 13}]}
    ]
    n1 = node("n1", mps)
    n1["status"]["allocatable"]["nvidia.com/gpu-10gb"] = "1"
    c = Cluster(n1, obj, gated("odd", "nvidia.com/gpu-010gb"), gated("twin", "nvidia.com/gpu-10gb"))
    seen = _run(c, T0 + 600)
    (why,) = [m for m in seen["Unplaceable"] if "gpu-010gb" in m]
    assert "did you mean nvidia.com/gpu-10gb?" in why
    assert gates(c, "odd") == [] and reservation(c, "odd") is None
    twin = reservation(c, "twin")
    assert twin is not None and twin.node == "n1"
    assert seen["ReservationDropped"] == []
