"""Warm slices (``DecideConfig.warm_share``, :meth:`partitioner.decide._Step.warm_slices`).

While nothing waits and no node applies a spec, the decision step keeps one free slice of each
common one-slice request, on the busiest node that can hold it beside everything it keeps.
Each test drives :func:`partitioner.decide.decide` on API objects (helpers of
``test_partitioner_promises``) and reads the specs it writes.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_partitioner_promises import (
    CONFIG,
    MIG,
    ONE_G,
    SEVEN_G,
    T0,
    Cluster,
    applied_np,
    gated,
    running,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node, np

from partitioner.actions import WriteSpec
from partitioner.decide import DecideConfig

WARM = dataclasses.replace(CONFIG, warm_share=0.05)
FOUR_G = "nvidia.com/mig-4g.40gb"


def specs(d: object) -> dict[str, list[list[tuple[str, int]]]]:
    """Node -> per GPU the (profile, start) of every instance of the spec written."""
    out: dict[str, list[list[tuple[str, int]]]] = {}
    for a in d.actions:  # type: ignore[attr-defined]
        if isinstance(a, WriteSpec):
            out[a.node] = [sorted((m.profile, m.start) for m in g.mig) for g in a.spec.gpus]
    return out


def busy_and_idle() -> Cluster:
    """n1 runs a 1g pod on GPU 0 (no free 1g anywhere); n2 runs nothing."""
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1)),
        node("n2", MIG),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        running("r1", "n1", ONE_G),
    )


def test_a_warm_slice_is_made_on_the_busy_node_beside_what_it_runs() -> None:
    c = busy_and_idle()
    d = c.step(T0, WARM)
    written = specs(d)
    assert list(written) == ["n1"]  # never on n2, where nothing runs
    gpu0 = written["n1"][0]
    assert ("1g.10gb", 0) in gpu0 and len([p for p, _ in gpu0 if p == "1g.10gb"]) == 2
    assert written["n1"][1] == []  # the idle GPU is left whole
    assert d.counts["warm"] == 1


def test_no_warm_slice_on_a_node_where_nothing_runs() -> None:
    """The busy node is full: the idle one could hold a 1g but stays whole for whole-node pods."""
    full = status_gpu(0, *(("1g.10gb", s, True) for s in range(7)))
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 7, "7g_80gb": 1}),
        applied_np("n1", full, status_gpu(1, ("7g.80gb", 0, True))),
        node("n2", MIG),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        *(running(f"r{i}", "n1", ONE_G) for i in range(7)),
        running("w", "n1", SEVEN_G),
    )
    d = c.step(T0, WARM)
    assert specs(d) == {} and d.counts.get("warm", 0) == 0


def test_no_warm_slice_when_the_setting_is_off_or_one_is_free() -> None:
    assert specs(busy_and_idle().step(T0, CONFIG)) == {}
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 2}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False)), status_gpu(1)),
        running("r1", "n1", ONE_G),
    )
    d = c.step(T0, WARM)
    assert specs(d) == {} and d.counts.get("warm", 0) == 0


def test_no_warm_slice_while_a_pod_waits_or_a_node_applies_a_spec() -> None:
    c = busy_and_idle()
    c.put(gated("p", SEVEN_G))
    assert specs(c.step(T0, WARM)) == {}  # the window is open: the pod's plan comes first
    c = busy_and_idle()
    applying = np("n2", plan="9", generation=3, observed=2, applied=True, gpus=[])
    applying["spec"]["gpus"] = [{"index": 0, "mig": [{"profile": "7g.80gb", "start": 0}]}]
    c.put(applying)
    d = c.step(T0, WARM)
    assert specs(d) == {} and d.counts.get("warm", 0) == 0


def test_a_warm_slice_never_replaces_a_free_device() -> None:
    """n1's only GPU runs a 4g pod and keeps a free 3g: a 1g fits only by destroying the 3g,
    so no warm 1g is made there (the full n2 holds the 1g pods of the mix)."""
    one_gpu = {**MIG, "nvidia.com/gpu.count": "1"}
    full = status_gpu(0, *(("1g.10gb", s, True) for s in range(7)))
    c = Cluster(
        with_alloc(node("n1", one_gpu), **{"4g_40gb": 1, "3g_40gb": 1}),
        applied_np("n1", status_gpu(0, ("4g.40gb", 0, True), ("3g.40gb", 4, False))),
        with_alloc(node("n2", one_gpu), **{"1g_10gb": 7}),
        applied_np("n2", full),
        running("big", "n1", FOUR_G),
        *(running(f"small{i}", "n2", ONE_G) for i in range(7)),
    )
    d = c.step(T0, WARM)
    assert specs(d) == {} and d.counts.get("warm", 0) == 0


def test_only_requests_of_at_least_the_share_get_a_warm_slice() -> None:
    """19 bound 1g pods and one 4g pod: at a share of 0.1 the 4g (5 %) gets none.  (f2 flags
    all 7 of its 1g slices used but runs 5 pods: bound pods decide what is free, so 1g slices
    are free and need no warm one.)"""
    one_gpu = {**MIG, "nvidia.com/gpu.count": "1"}
    c = Cluster(
        *(with_alloc(node(f"f{i}", one_gpu), **{"1g_10gb": 7}) for i in range(3)),
        *(
            applied_np(f"f{i}", status_gpu(0, *(("1g.10gb", s, True) for s in range(7))))
            for i in range(3)
        ),
        *(running(f"s{i}", f"f{i // 7}", ONE_G) for i in range(19)),
        with_alloc(node("n1", MIG), **{"4g_40gb": 1}),
        applied_np("n1", status_gpu(0, ("4g.40gb", 0, True)), status_gpu(1)),
        running("big", "n1", FOUR_G),
    )
    d = c.step(T0, dataclasses.replace(CONFIG, warm_share=0.1))
    assert specs(d) == {}
    d = c.step(T0, dataclasses.replace(CONFIG, warm_share=0.05))
    assert specs(d) == {"n1": [[("4g.40gb", 0)], [("4g.40gb", 0)]]}


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_warm_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="warm_share"):
        DecideConfig(catalog=CONFIG.catalog, warm_share=share)


def test_in_the_replay_a_warm_slice_lets_the_next_pod_start_at_once() -> None:
    """One A100 node: a long 1g pod, then a second 1g pod 600 s later.  Without warm slices
    the second waits for a batch window, a plan and the agent; with them a free 1g was made
    beside the first while nothing waited, and it is released at once."""
    from simulations.inputs.workload import Pod, Workload
    from simulations.replay.engine import ReplayPod, ReplaySettings, run_time_replay
    from simulations.replay.fake_cluster import FakeCluster

    def second_wait(share: float) -> tuple[float, int]:
        pods = [
            ReplayPod("a", {ONE_G: 1}, 0, 10_000),
            ReplayPod("b", {ONE_G: 1}, 600, 100),
        ]
        cluster = FakeCluster([FakeCluster.node("n0", "A100-SXM4-80GB", 1)])
        r = run_time_replay(
            Workload("none", (Pod("unused", 0),)),
            cluster,
            "cpsat",
            ReplaySettings(warm_share=share),
            pods=pods,
        )
        (b,) = [p for p in r.pods if p.name == "b"]
        assert b.first_bound is not None
        return b.first_bound - 600, sum(n for _, n in r.reconfigurations)

    cold, cold_changes = second_wait(0.0)
    warm, warm_changes = second_wait(0.05)
    assert cold >= 10  # the batch's idle window at least
    assert warm <= 1
    # the warm 1g is the one b's plan would have made; once b takes it, one more is kept free
    assert warm_changes == cold_changes + 1


def test_a_planner_that_raises_on_a_warm_slice_writes_nothing_and_is_counted() -> None:
    def broken(*_: object) -> object:
        raise RuntimeError("boom")

    d = busy_and_idle().step(T0, dataclasses.replace(WARM, planner=broken))
    assert specs(d) == {} and d.counts["warm_errors"] == 1 and not d.error
    # the operator logs the exception's text: which slice, which node, what was raised
    assert "RuntimeError: boom" in d.warm_error and "for node n1" in d.warm_error


def test_a_node_that_never_applies_blocks_warm_slices_only_until_its_apply_deadline() -> None:
    c = busy_and_idle()
    stuck = np("n2", plan="9", generation=3, observed=2, applied=True, gpus=[])
    stuck["spec"]["gpus"] = [{"index": 0, "mig": [{"profile": "7g.80gb", "start": 0}]}]
    stuck["metadata"]["annotations"]["gpuslice.io/planned-at"] = str(T0)
    c.put(stuck)
    d = c.step(T0 + 10, WARM)
    assert specs(d) == {} and d.next_wakeup == T0 + CONFIG.apply_deadline_s
    d = c.step(T0 + CONFIG.apply_deadline_s + 1, WARM)
    assert list(specs(d)) == ["n1"] and d.counts["warm"] == 1


def test_a_node_stuck_applying_never_gets_a_warm_slice_even_when_busiest() -> None:
    """Past its apply deadline a stuck node stops pausing warm slices (above), but it is never
    the node one is planned on: its spec may never be applied, and a second would only wait
    behind the first.  n2 runs more than n1 and would be chosen if it were not stuck."""
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1)),
        with_alloc(node("n2", MIG), **{"1g_10gb": 2}),
        running("r1", "n1", ONE_G),
        running("r2", "n2", ONE_G),
        running("r3", "n2", ONE_G),
    )
    stuck = np(
        "n2",
        plan="9",
        generation=3,
        observed=2,
        applied=True,
        gpus=[status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, True)), status_gpu(1)],
    )
    stuck["spec"]["gpus"] = [
        {
            "index": 0,
            "mig": [{"profile": "1g.10gb", "start": 0}, {"profile": "1g.10gb", "start": 1}],
        },
        {"index": 1, "mig": [{"profile": "7g.80gb", "start": 0}]},
    ]
    stuck["metadata"]["annotations"]["gpuslice.io/planned-at"] = str(T0)
    c.put(stuck)
    d = c.step(T0 + CONFIG.apply_deadline_s + 1, WARM)
    assert list(specs(d)) == ["n1"] and d.counts["warm"] == 1
