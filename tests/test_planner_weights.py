"""The objective's placement level is lexicographic over priorities, and waiting comes last.

:func:`planner.demand.pod_weights`: the size placed of the highest priority first, then of the
next, ..., then the sum of the placed pods' waiting tiers.  A higher priority's waiting tier
used to sit above the pod counts of the priorities below it, so one old whole-GPU pod beat a
new small pod of its priority plus every lower-priority pod that fit beside it.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from planner import GpuState, Mode, NodeState, PendingPod, PlannerSettings, Snapshot, plan
from planner.demand import pod_size, pod_weights, wait_tier
from planner.settings import PlacementWeight, Policy

DAY = 86_400.0
TIERS = PlannerSettings().wait_tiers_s


def test_an_old_pod_does_not_outweigh_lower_priority_pods_that_fit_beside_a_new_one() -> None:
    pods = (
        PendingPod("a-old-7g", {"nvidia.com/mig-7g.80gb": 1}, priority=1, waited_s=17 * DAY),
        PendingPod("b-new-4g", {"nvidia.com/mig-4g.40gb": 1}, priority=1),
        *(PendingPod(f"c{i}-1g", {"nvidia.com/mig-1g.10gb": 1}, priority=0) for i in range(3)),
    )
    snap = Snapshot((NodeState("n0", Mode.MIG, "A100-SXM4-80GB", (GpuState(0),)),), pods)
    got = plan(snap, PlannerSettings(time_limit_s=10.0))
    greedy = plan(snap, PlannerSettings(policy=Policy.GREEDY))
    assert sorted(got.assignments) == ["b-new-4g", "c0-1g", "c1-1g", "c2-1g"]
    assert len(got.assignments) >= len(greedy.assignments)


_POD = st.tuples(
    st.integers(0, 2),  # priority
    st.sampled_from([0.0, 400.0, 4_000.0, 40_000.0, 3 * DAY, 20 * DAY]),  # waited
    st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]),
    st.integers(1, 2),  # units
)


def _key(
    placed: tuple[PendingPod, ...], priorities: list[int], weight: PlacementWeight
) -> tuple[int, ...]:
    """The lexicographic order the weights must follow: size placed per priority, highest
    first, then the placed pods' tiers together."""
    sizes = [
        sum(
            pod_size(p) if weight is PlacementWeight.COMPUTE else 1
            for p in placed
            if p.priority == q
        )
        for q in sorted(priorities, reverse=True)
    ]
    return (*sizes, sum(wait_tier(p, TIERS) for p in placed))


@settings(max_examples=150, deadline=None)
@given(st.lists(_POD, min_size=1, max_size=6), st.sampled_from(list(PlacementWeight)))
def test_weights_order_every_pair_of_plans_lexicographically(
    raw: list[tuple[int, float, str, int]], weight: PlacementWeight
) -> None:
    """Oracle: every subset of the pods (a plan places a subset) compared by the lexicographic
    key; the weights' sums must order every pair the same way, computed over all the pods or
    over any superset of the two subsets (the batch the solver sees)."""
    pods = [
        PendingPod(f"p{i}", {f"nvidia.com/mig-{prof}": k}, priority=q, waited_s=w)
        for i, (q, w, prof, k) in enumerate(raw)
    ]
    w_all = pod_weights(pods, TIERS, weight)
    priorities = sorted({p.priority for p in pods})
    subsets = [tuple(c) for r in range(len(pods) + 1) for c in itertools.combinations(pods, r)]
    for a, b in itertools.combinations(subsets, 2):
        ka, kb = _key(a, priorities, weight), _key(b, priorities, weight)
        sa, sb = sum(w_all[p.name] for p in a), sum(w_all[p.name] for p in b)
        assert (ka > kb) == (sa > sb) and (ka == kb) == (sa == sb), (a, b)
        union = {p.name: p for p in (*a, *b)}
        w_some = pod_weights(union.values(), TIERS, weight)
        sa2, sb2 = sum(w_some[p.name] for p in a), sum(w_some[p.name] for p in b)
        assert (sa2 > sb2) == (sa > sb) and (sa2 == sb2) == (sa == sb)
