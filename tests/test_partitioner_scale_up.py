"""With the cluster autoscaler: gated pods the cluster has no room for are handed to it.

The cluster autoscaler adds nodes for pods kube-scheduler found unschedulable; a gated pod is
never tried, so behind gpuslice's gate a full cluster would never grow.  With
``scale_up_after_s`` (off by default) a gated pod the plan cannot place for lack of capacity
loses its gate once it has waited that long (decision step 7c); it stays a candidate gpuslice
plans for, without a reservation.
"""

from __future__ import annotations

from dataclasses import replace

from test_partitioner_preemption import PLAN_AT, full_of_7g, gates
from test_partitioner_promises import (
    CONFIG,
    MIG,
    SEVEN_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    running,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from partitioner.gating import GATE
from partitioner.settings import PartitionerSettings

SCALE_UP = replace(CONFIG, scale_up_after_s=300, preemption=False)


def test_off_by_default_the_pod_keeps_waiting_gated() -> None:
    c = full_of_7g(gated("big", SEVEN_G))
    for t in range(int(PLAN_AT), int(T0) + 1200, 30):
        d = c.step(t, replace(CONFIG, preemption=False))
        assert events(d, "ReleasedForScaleUp") == []
    assert gates(c, "big") == [{"name": GATE}]


def test_a_pod_no_node_has_room_for_loses_the_gate_after_the_wait() -> None:
    c = full_of_7g(gated("big", SEVEN_G))
    released: list[tuple[float, str]] = []
    for t in range(int(PLAN_AT), int(T0) + 700, 10):
        d = c.step(t, SCALE_UP)
        released += [(t - T0, m) for m in events(d, "ReleasedForScaleUp")]
    ((at, message),) = released
    assert 300 <= at < 400  # once it has waited 300 s, at the next plan
    assert message.startswith(f"waited {at:.0f} s and no node has room for {SEVEN_G}")
    assert "cluster autoscaler" in message
    assert gates(c, "big") == []
    assert reservation(c, "big") is None


def test_a_pod_a_plan_can_place_is_never_released_for_scale_up() -> None:
    """Room on the node (one GPU empty): the pod is planned there, gated, as always."""
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 1}),
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1)),
        running("busy", "n1", SEVEN_G),
        gated("waits", SEVEN_G, created=T0 - 3600),  # waited an hour already
    )
    planned = 0
    for t in range(int(T0), int(T0) + 200, 10):
        d = c.step(t, SCALE_UP)
        assert events(d, "ReleasedForScaleUp") == []
        if d.plan is not None:
            assert dict(d.plan.assignments["ns/waits"].gpus) == {SEVEN_G: (1,)}
            planned += 1
    assert planned  # planned on GPU 1 (this harness's agent never applies it)
    assert gates(c, "waits") == [{"name": GATE}]


def test_a_pod_with_a_drain_in_progress_keeps_its_promise() -> None:
    """The drain started first (drain wait below the scale-up wait): the GPU being emptied is
    its promise, so it keeps the gate."""
    c = full_of_7g(gated("big", SEVEN_G))
    config = replace(SCALE_UP, scale_up_after_s=2000)
    for t in range(int(PLAN_AT), int(T0) + 2600, 10):
        d = c.step(t, config)
        assert events(d, "ReleasedForScaleUp") == []
    assert gates(c, "big") == [{"name": GATE}]


def test_the_setting_reaches_the_decision_step_and_refuses_a_negative_wait() -> None:
    settings = PartitionerSettings(metrics_port=0, health_port=0, scale_up_after_seconds=600)
    assert settings.decide_config(CONFIG.catalog).scale_up_after_s == 600
    assert PartitionerSettings(metrics_port=0, health_port=0).scale_up_after_seconds == 0
    try:
        replace(CONFIG, scale_up_after_s=-1)
    except ValueError as e:
        assert "scale_up_after_s must be >= 0" in str(e)
    else:
        raise AssertionError("a negative scale_up_after_s was accepted")
