"""Whether empty GPUs can hold a request: an exact check, against a brute force from mig.md.

Counting compute and memory slices is necessary, not sufficient: two ``+me`` instances never
share a GPU, and fixed starts leave holes.  A request no layout of the node's empty GPUs holds
is refused as ``no eligible node`` (it can never be placed there), not left waiting as
``capacity``.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from planner import GpuState, Mode, NodeState, PendingPod, PlannerSettings, Snapshot, plan
from planner.catalog import default_catalog
from planner.demand import fits_empty_gpus
from planner.geometry import enumerate_layouts

CAT = default_catalog()
MODELS = ["A30-24GB", "A100-SXM4-40GB", "A100-SXM4-80GB"]


def _brute(model_name: str, n: int, request: Counter[str]) -> bool:
    """Some tuple of one full layout per GPU whose instances cover the request."""
    model = CAT.model(model_name)
    layouts = {
        frozenset(Counter(p.profile.name for p in lay).items()) for lay in enumerate_layouts(model)
    }
    counts = [Counter(dict(c)) for c in layouts]
    for combo in itertools.product(counts, repeat=n):
        total: Counter[str] = Counter()
        for c in combo:
            total.update(c)
        if all(total[p] >= k for p, k in request.items()):
            return True
    return False


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(MODELS),
    st.integers(1, 2),
    st.data(),
)
def test_fits_empty_gpus_agrees_with_a_brute_force(
    model_name: str, n: int, data: st.DataObject
) -> None:
    model = CAT.model(model_name)
    names = sorted(p.name for p in model.profiles)
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    request = Counter({p: data.draw(st.integers(1, 3)) for p in chosen})
    per_profile = {model.profile(p): k for p, k in request.items()}
    assert fits_empty_gpus(model, n, per_profile) == _brute(model_name, n, request)


def test_a_request_no_layout_holds_is_no_eligible_node_not_capacity() -> None:
    # A30: 1g.6gb+me and 2g.12gb+me are both media instances, at most one per GPU
    pod = PendingPod("p", {"nvidia.com/mig-1g.6gb+me": 1, "nvidia.com/mig-2g.12gb+me": 1})
    snap = Snapshot((NodeState("n0", Mode.MIG, "A30-24GB", (GpuState(0),)),), (pod,))
    got = plan(snap, PlannerSettings(time_limit_s=5.0))
    assert got.unplaced["p"].startswith("no eligible node"), got.unplaced["p"]
    assert "no layout of its 1 empty GPU(s)" in got.unplaced["p"]
    two = Snapshot((NodeState("n0", Mode.MIG, "A30-24GB", (GpuState(0), GpuState(1))),), (pod,))
    assert "p" in plan(two, PlannerSettings(time_limit_s=5.0)).assignments  # one per GPU fits
