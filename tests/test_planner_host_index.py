"""The greedy planner's host index: per key the sorted positions of nodes that can host it,
and the indexed greedy's first-fit-in-name-order behaviour where the index matters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.greedy import plan_greedy
from planner.host_index import HostIndex
from planner.snapshot import GpuState, MigInstance, Mode, NodeState, PendingPod, Snapshot

KEYS = ("1g", "2g", "3g", "7g")
key_sets = st.frozensets(st.sampled_from(KEYS))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(key_sets, min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(0, 11), key_sets), max_size=20),
    st.lists(key_sets.filter(bool), min_size=1, max_size=3),
)
def test_index_matches_the_key_sets_after_any_updates(
    initial: list[frozenset[str]],
    updates: list[tuple[int, frozenset[str]]],
    queries: list[frozenset[str]],
) -> None:
    index = HostIndex(initial)
    keys = list(initial)
    for pos, new in updates:
        pos %= len(keys)
        index.update(pos, keys[pos], new)
        keys[pos] = new
    for k in KEYS:
        assert index.hosts(k) == [p for p, ks in enumerate(keys) if k in ks]
    covered = list(index.covering(queries))
    assert covered == sorted(set(covered)), "ascending, no repeats"
    needed = {p for p, ks in enumerate(keys) if any(q <= ks for q in queries)}
    assert needed <= set(covered), "every node holding a whole key set is visited"
    assert set(covered) <= {p for p, ks in enumerate(keys) if ks & set().union(*queries)}


def test_covering_picks_the_shortest_list_of_a_key_set() -> None:
    index = HostIndex([frozenset({"1g", "3g"}), frozenset({"1g"}), frozenset({"1g", "3g"})])
    assert list(index.covering([frozenset({"1g", "3g"})])) == [0, 2]
    assert list(index.covering([frozenset({"1g"}), frozenset({"7g"})])) == [0, 1, 2]
    assert list(index.covering([frozenset({"7g"})])) == []


def test_bad_uses_are_errors() -> None:
    index = HostIndex([frozenset({"1g"}), frozenset()])
    with pytest.raises(KeyError, match="position 1 is not listed under '1g'"):
        index.update(1, frozenset({"1g"}), frozenset())
    with pytest.raises(ValueError, match="empty key set"):
        index.covering([frozenset()])


# ---- the indexed greedy ------------------------------------------------------------------


def a100_node(name: str, gpus: int, used: list[tuple[str, int]], cpu: int = 64_000) -> NodeState:
    """``gpus`` GPUs, each holding the same USED instances ``used``."""
    return NodeState(
        name,
        Mode.MIG,
        "A100-SXM4-80GB",
        tuple(
            GpuState(i, mig=tuple(MigInstance(p, s, used=True) for p, s in used))
            for i in range(gpus)
        ),
        cpu_milli_free=cpu,
    )


def mig_pod(name: str, profile: str, count: int = 1, **kw: object) -> PendingPod:
    return PendingPod(name, {f"nvidia.com/mig-{profile}": count}, **kw)  # type: ignore[arg-type]


def test_full_nodes_are_skipped_and_the_next_node_by_name_gets_the_pod() -> None:
    # Every node has one GPU with room for exactly one 3g (3g@0 used): the k-th 3g pod in
    # order goes to the k-th node by name, whatever the node order in the snapshot.
    names = [f"node-{i}" for i in range(6)]
    snap = Snapshot(
        nodes=tuple(a100_node(n, 1, [("3g.40gb", 0)]) for n in reversed(names)),
        pods=tuple(mig_pod(f"p{i}", "3g.40gb") for i in range(7)),
    )
    plan = plan_greedy(snap)
    assert [plan.assignments[f"p{i}"].node for i in range(6)] == names
    assert plan.unplaced["p6"].startswith("capacity")


def test_a_two_unit_pod_that_fails_on_a_node_does_not_block_one_unit_pods_there() -> None:
    # node-a has room for one 3g (the 2 x 3g pods do not fit there, a remembered failure),
    # node-b for two.  The first pair goes to node-b, the second finds no room, and the
    # 1 x 3g pod still lands on node-a, first by name.
    snap = Snapshot(
        nodes=(
            a100_node("node-a", 1, [("3g.40gb", 0)]),
            a100_node("node-b", 2, [("3g.40gb", 0)]),
        ),
        pods=(
            mig_pod("a-pair", "3g.40gb", count=2),
            mig_pod("b-pair", "3g.40gb", count=2),
            mig_pod("c-single", "3g.40gb", count=1, priority=-1),
        ),
    )
    plan = plan_greedy(snap)
    assert plan.assignments["a-pair"].node == "node-b"
    assert plan.unplaced["b-pair"].startswith("capacity")
    assert plan.assignments["c-single"].node == "node-a"


def test_two_models_with_the_same_profile_name_are_scanned_in_one_name_order() -> None:
    # nvidia.com/mig-1g.10gb exists on an A100-80GB and an H100 80GB alike (exact names: an
    # H100 NVL, whose 1g is 1g.12gb, is no candidate): one merged scan in name order.
    nvl = NodeState(
        "node-a-nvl",
        Mode.MIG,
        "H100-80GB",
        (GpuState(0, mig=(MigInstance("7g.80gb", 0, used=True),)), GpuState(1)),
    )
    full = a100_node("node-0-full", 1, [("7g.80gb", 0)])
    roomy = a100_node("node-b", 1, [])
    snap = Snapshot(
        nodes=(roomy, nvl, full),
        pods=tuple(mig_pod(f"p{i}", "1g.10gb") for i in range(9)),
    )
    plan = plan_greedy(snap)
    nodes = [plan.assignments[f"p{i}"].node for i in range(9)]
    assert nodes == ["node-a-nvl"] * 7 + ["node-b"] * 2
    assert set(plan.assignments["p0"].gpus.values()) == {(1,)}
