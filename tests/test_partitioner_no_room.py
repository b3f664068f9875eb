"""A batch no plannable node has room for is answered without a solve, with the same plan.

When every pod of a planning batch asks for more units of some resource than any plannable node
could offer without moving a pinned device (the batch's bound, ``_UnitBounds``, checked exact
against every valid layout in test_partitioner_batch_bounds.py), the decision step hands the
batch to the planner's greedy pass instead of CP-SAT (issue 11: most batches of a full cluster
are such).  Oracle: CP-SAT itself on the same snapshot places nothing, changes no layout and
gives the same reasons, so the skip is invisible in every Event and spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_partitioner_promises import (
    CAT,
    CONFIG,
    MIG,
    ONE_G,
    SEVEN_G,
    T0,
    Cluster,
    applied_np,
    gated,
    no_gpu_can_host_big,
    running,
    status_gpu,
)
from test_partitioner_snapshot import node

from planner.api import plan as planner_plan
from planner.geometry import enumerate_layouts
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Plan

CPSAT = PlannerSettings(policy=Policy.CPSAT, time_limit_s=5.0)
MODEL = CAT.model("A100-SXM4-80GB")
LAYOUTS = list(enumerate_layouts(MODEL))


class Recording:
    """The production planner, remembering the policy of every call."""

    def __init__(self) -> None:
        self.policies: list[Policy] = []

    def __call__(self, snapshot: Any, settings: PlannerSettings, catalog: Any) -> Plan:
        self.policies.append(settings.policy)
        return planner_plan(snapshot, settings, catalog)


def config(planner: Recording) -> Any:
    return dataclasses.replace(CONFIG, planner=planner, planner_settings=CPSAT)


def plan_step(c: Cluster, planner: Recording) -> Any:
    c.step(T0 + 100, config(planner))
    return c.step(T0 + 111, config(planner))  # the window idles out: plan


def test_a_batch_no_node_has_room_for_skips_the_solve_with_cpsat_s_plan() -> None:
    """A gated 7g pod; each GPU of the node has a used instance, so no 7g fits, though free
    slices remain (the cheaper every-GPU-full shortcut does not apply)."""
    planner = Recording()
    c = no_gpu_can_host_big()
    d = plan_step(c, planner)
    assert planner.policies == [Policy.GREEDY]
    assert d.counts["plans_without_solve"] == 1 and "plans_skipped_full" not in d.counts
    assert d.plan is not None and d.snapshot is not None
    reference = planner_plan(d.snapshot, CPSAT, CAT)
    assert reference.assignments == {} and reference.layouts == {}
    assert d.plan.unplaced == reference.unplaced
    assert d.plan.unplaced["ns/big"].startswith("capacity: no room for 1 x " + SEVEN_G)


def test_a_batch_with_one_pod_that_may_fit_is_solved() -> None:
    """The same cluster with a 1g pod waiting too (GPU 0 has free slots for it), but no free
    1g instance exists, so the fast path cannot serve it: the batch goes to CP-SAT."""
    planner = Recording()
    c = no_gpu_can_host_big(gated("small", ONE_G, created=T0 + 1))
    d = plan_step(c, planner)
    assert planner.policies == [Policy.CPSAT]
    assert "plans_without_solve" not in d.counts
    assert d.plan is not None and "ns/small" in d.plan.assignments


RESOURCES = sorted({p.resource for p in MODEL.profiles})


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=2, max_size=2),
    st.lists(st.tuples(st.sampled_from(RESOURCES), st.integers(1, 2)), min_size=1, max_size=3),
)
def test_whenever_the_solve_is_skipped_cpsat_would_place_nothing(
    gpus: list[tuple[int, int]], waiting: list[tuple[str, int]]
) -> None:
    """Random layouts with random instances in use on a 2-GPU node and random gated pods: if
    the step skips the solve, CP-SAT on the step's snapshot places nothing, changes no layout
    and says the same; if it solves, the plan is CP-SAT's."""
    statuses, users = [], []
    for index, (which, mask) in enumerate(gpus):
        layout = LAYOUTS[which % len(LAYOUTS)]
        used = [bool(mask >> i & 1) for i in range(len(layout))]
        instances = [(p.profile.name, p.start, u) for p, u in zip(layout, used, strict=True)]
        statuses.append(status_gpu(index, *instances))
        for i, (p, u) in enumerate(zip(layout, used, strict=True)):
            if u:
                users.append(running(f"u{index}-{i}", "n1", p.profile.resource))
    pods: list[dict[str, Any]] = []
    for i, (resource, count) in enumerate(waiting):
        pod = gated(f"w{i}", resource, created=T0 + i)
        pod["spec"]["containers"][0]["resources"]["limits"][resource] = str(count)
        pods.append(pod)
    planner = Recording()
    c = Cluster(node("n1", MIG), applied_np("n1", *statuses), *pods, *users)
    d = plan_step(c, planner)
    if d.plan is None or not planner.policies:
        return  # everything was served from free slices, or every GPU is full
    assert d.snapshot is not None
    if planner.policies[-1] is Policy.GREEDY:
        assert d.counts["plans_without_solve"] == 1
        reference = planner_plan(d.snapshot, CPSAT, CAT)
        assert reference.assignments == {} and reference.layouts == {}
        assert d.plan.unplaced == reference.unplaced
        assert d.plan.assignments == {}
    else:
        assert planner.policies[-1] is Policy.CPSAT and "plans_without_solve" not in d.counts


def test_the_property_above_meets_both_branches() -> None:
    """The random cases above are not all of one kind: a fixed pair of them takes each branch
    (a used 7g on one GPU and a used 1g on the other: a 7g pod is skipped, a 1g pod solved)."""
    busy7 = status_gpu(0, ("7g.80gb", 0, True))
    busy1 = status_gpu(1, ("1g.10gb", 0, True))
    for resource, expect in ((SEVEN_G, Policy.GREEDY), (ONE_G, Policy.CPSAT)):
        planner = Recording()
        c = Cluster(
            node("n1", MIG),
            applied_np("n1", busy7, busy1),
            gated("w", resource),
            running("a", "n1", SEVEN_G),
            running("b", "n1", ONE_G),
        )
        plan_step(c, planner)
        assert planner.policies == [expect]
