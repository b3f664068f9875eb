"""The CP-SAT objective's usefulness level is CPU-aware (issue 13, item 0).

Model (planner/mig_cpsat.py, "Usefulness"): a node's free GPU capacity counts for at most as
many GPUs as pods of the target workload (CPU c*, memory m*) could still get CPU and memory on
it after the plan.  Oracle for the random cases: every placement of one pod a plan can make
(node, GPU, start) scored by hand from the same definition; the planner's choice must score
the best.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st
from planner_states import gpu

from planner import (
    GpuState,
    MigInstance,
    Mode,
    NodeState,
    PendingPod,
    PlannerSettings,
    Snapshot,
    plan,
)
from planner.catalog import default_catalog
from planner.geometry import Placement, layout_errors
from planner.mig_cpsat import free_capacity_needs, largest_free_block, workload_needs

A100 = "A100-SXM4-80GB"
MODEL = default_catalog().model(A100)
SETTINGS = PlannerSettings(time_limit_s=10.0)
"""Deterministic and optimal on these small models (one worker, far from the limit)."""


def node(name: str, cpu: int, *gpus: GpuState) -> NodeState:
    return NodeState(name, Mode.MIG, A100, gpus, cpu_milli_free=cpu)


def one_pod(profile: str, cpu: int) -> PendingPod:
    return PendingPod("p", {f"nvidia.com/mig-{profile}": 1}, cpu_milli=cpu)


def test_a_pod_does_not_strand_the_last_gpu_of_a_node_short_of_cpu() -> None:
    """A 12-core 3g pod; the pods that come next need 8 cores (the target).  ``poor`` has 16
    cores, an empty GPU and a GPU with a used 4g beside which the 3g fits; ``rich`` has 64
    cores and two empty GPUs.  CPU-blind, packing puts the pod beside the used 4g (keeping an
    empty GPU whole); but then ``poor`` keeps 4 cores and its empty GPU is stranded.  CPU-aware,
    the pod goes to ``rich`` (the same churn: one instance created on one GPU)."""
    snap = Snapshot(
        (
            node("poor", 16_000, gpu(0), gpu(1, ("4g.40gb", 0, True))),
            node("rich", 64_000, gpu(0), gpu(1)),
        ),
        (one_pod("3g.40gb", 12_000),),
    )
    aware = plan(snap, replace(SETTINGS, free_capacity_cpu_milli=8_000))
    blind = plan(snap, replace(SETTINGS, free_capacity_cpu_milli=0))
    assert aware.status == blind.status == "OPTIMAL"
    assert blind.assignments["p"].node == "poor"
    assert blind.layouts["poor", 1].mig == (("4g.40gb", 0), ("3g.40gb", 4))
    assert aware.assignments["p"].node == "rich"


def test_the_target_defaults_to_the_lower_quartile_of_the_batch() -> None:
    pods = tuple(
        PendingPod(f"p{i}", {"nvidia.com/mig-1g.10gb": 1}, cpu_milli=c, memory_mib=m)
        for i, (c, m) in enumerate(
            [(4_000, 100), (1_000, 900), (16_000, 500), (2_000, 700), (8_000, 300)]
        )
    )
    snap = Snapshot((node("n", 64_000, gpu(0)),), pods)
    assert free_capacity_needs(snap, SETTINGS) == (2_000, 300)
    given_target = replace(SETTINGS, free_capacity_cpu_milli=3_000, free_capacity_memory_mib=0)
    assert free_capacity_needs(snap, given_target) == (3_000, 0)
    assert workload_needs([]) == (0, 0)


PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


def _score(
    nodes: tuple[NodeState, ...], target: int, placed: tuple[str, int, Placement] | None
) -> tuple[int, int]:
    """(-churn, usefulness) of the plan that adds ``placed`` (node, GPU, placement) or nothing,
    pod CPU applied to its node; by the module's definitions."""
    s = SETTINGS
    churn, useful = 0, 0
    for n in nodes:
        cpu = n.cpu_milli_free
        total, per_gpu = 0, s.weight_free_gpu + s.weight_free_block * MODEL.memory_slots
        for g in n.gpus:
            layout = [Placement(i.start, MODEL.profile(i.profile)) for i in g.mig]
            if placed is not None and placed[0] == n.name and placed[1] == g.index:
                layout.append(placed[2])
                churn += s.weight_create + s.weight_gpu_touched
            total += s.weight_free_gpu * (not layout) + s.weight_free_block * (
                largest_free_block(MODEL, layout)
            )
        if placed is not None and placed[0] == n.name:
            cpu -= POD_CPU
        hosts = min(len(n.gpus), max(0, cpu) // target) if target else len(n.gpus)
        if n.cpu_milli_free < target:
            hosts = 0
        useful += min(total, per_gpu * hosts)
    return (-churn, useful)


POD_CPU = 6_000


@settings(max_examples=60, deadline=None)
@example([(14, [("1g.10gb", 0)]), (6, [])], "3g.40gb")  # needs the free-instance term off
@given(
    st.lists(
        st.tuples(
            st.sampled_from((4, 6, 7, 9, 12, 14, 16, 40)),
            st.lists(st.tuples(st.sampled_from(PROFILES), st.integers(0, 6)), max_size=2),
        ),
        min_size=2,
        max_size=3,
    ),
    st.sampled_from(PROFILES[:4]),
)
def test_the_planner_s_placement_scores_best_by_the_definition(
    spec: list[tuple[int, list[tuple[str, int]]]], profile: str
) -> None:
    """Nodes of one GPU each holding random used instances (kept if they form a valid layout)
    and random CPU; one pod of ``POD_CPU``; the target is 8 cores.  The plan places the pod if
    any GPU can hold it, and its (churn, usefulness) is the best over every placement."""
    nodes = []
    for k, (cores, used) in enumerate(spec):
        layout: list[Placement] = []
        for name, start in used:
            p = MODEL.profile(name)
            if start in p.starts and not layout_errors(MODEL, [*layout, Placement(start, p)]):
                layout.append(Placement(start, p))
        nodes.append(
            node(
                f"n{k}",
                cores * 1000,
                GpuState(0, tuple(MigInstance(p.profile.name, p.start, used=True) for p in layout)),
            )
        )
    target = 8_000
    snap = Snapshot(tuple(nodes), (one_pod(profile, POD_CPU),))
    # The definition above values unallocated slots only: free instances, which the planner
    # values by the MIG target (planner/mig_target.py; tests/test_planner_mig_target.py), are
    # left out.  Learned, that target counts the pod's own new instance as a free one (a
    # layout's value sums its instances not in use now), which can tie a worse placement
    # with the best (the @example: the 3g beside a used 1g on n0 scores 2 + 4 * 0.5 slots,
    # as much as n0 left whole, so the planner may strand n0's 3g room).  That count is the
    # planner's decision (planner/mig_target.py: a layout is valued by its shape); the variant
    # that subtracts the pod's instance passes here and cost issue 9's grid two cells
    # (simulations/results/variants-2026-12-07/).
    s = replace(SETTINGS, free_capacity_cpu_milli=target, free_capacity_mig_profiles=())
    result = plan(snap, s)
    prof = MODEL.profile(profile)
    options = []
    for n in nodes:
        if n.cpu_milli_free < POD_CPU:
            continue
        layout = [Placement(i.start, MODEL.profile(i.profile)) for i in n.gpus[0].mig]
        for start in prof.starts:
            if not layout_errors(MODEL, [*layout, Placement(start, prof)]):
                options.append((n.name, 0, Placement(start, prof)))
    if not options:
        assert "p" not in result.assignments
        return
    best = max(_score(snap.nodes, target, o) for o in options)
    a = result.assignments["p"]
    (g,) = a.gpus[f"nvidia.com/mig-{profile}"]
    ((name, start),) = set(result.layouts[a.node, g].mig) - {
        (i.profile, i.start) for n in nodes if n.name == a.node for i in n.gpus[0].mig
    }
    chosen = _score(snap.nodes, target, (a.node, g, Placement(start, MODEL.profile(name))))
    assert chosen == best
