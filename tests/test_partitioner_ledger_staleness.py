"""A plan never destroys a device the agent's report may not show used yet.

The reproduction (found by the 4-node default replay: one pod disrupted): pod A runs on one of
two free 1g instances and the agent reported it; A ends and pod B binds to the *other*
instance before the agent's next report.  Counting alone sees one bound pod and one used
instance, so the other instance (B's) looked free and a plan could destroy it.
"""

from __future__ import annotations

from typing import Any

from test_partitioner_snapshot import A100, node, np, pod

from partitioner.index import ClusterIndex
from partitioner.ledger import Hold, build_ledgers
from partitioner.reservations import Reservation, State
from planner.catalog import default_catalog

MIG = {"gpuslice.io/partitioning": "mig", **A100, "nvidia.com/gpu.count": "1"}
ONE_G = {"nvidia.com/mig-1g.10gb": "1"}


def _status(used0: bool, used1: bool) -> list[dict[str, Any]]:
    return [
        {
            "index": 0,
            "migEnabled": True,
            "mig": [
                {"profile": "1g.10gb", "start": 0, "used": used0},
                {"profile": "1g.10gb", "start": 1, "used": used1},
            ],
        }
    ]


def _report(index: ClusterIndex, rv: str, used0: bool, used1: bool) -> None:
    obj = np("n1", observed=1, applied=True, gpus=_status(used0, used1))
    obj["metadata"]["resourceVersion"] = rv
    index.upsert_partitioning(obj)


def _pinned(index: ClusterIndex) -> list[bool]:
    ledgers, problems = build_ledgers(index, (), (), {})
    assert not problems
    ledger = ledgers["n1"]
    ledger.pin()
    return [d.pinned for d in ledger.gpus[0].devices]


def _bound(name: str, rv: str, *, finished: bool = False) -> dict[str, Any]:
    obj = pod(name, ONE_G, node_name="n1", phase="Succeeded" if finished else "Running")
    obj["metadata"]["resourceVersion"] = rv
    return obj


def test_a_pod_swap_between_reports_pins_the_free_instances() -> None:
    index = ClusterIndex.from_objects(default_catalog(), [node("n1", MIG)])
    index.upsert_pod(_bound("a", "10"))
    _report(index, "11", True, False)
    assert _pinned(index) == [True, False]  # the report is fresh: instance 1 is free

    index.upsert_pod(_bound("a", "12", finished=True))  # A ends ...
    index.upsert_pod(_bound("b", "13"))  # ... B takes instance 1; no report yet
    assert _pinned(index) == [True, True]  # counts agree (1 and 1), but B may be on either

    _report(index, "14", False, True)  # the agent reports B
    assert _pinned(index) == [False, True]


def test_the_partitioners_own_status_writes_do_not_count_as_a_report() -> None:
    index = ClusterIndex.from_objects(default_catalog(), [node("n1", MIG)])
    index.upsert_pod(_bound("a", "10"))
    _report(index, "11", True, False)
    index.upsert_pod(_bound("a", "12", finished=True))
    index.upsert_pod(_bound("b", "13"))
    obj = np("n1", observed=1, applied=True, gpus=_status(True, False))
    obj["metadata"]["resourceVersion"] = "14"
    obj["status"]["reservations"] = []  # only the partitioner's field changed
    index.upsert_partitioning(obj)
    assert _pinned(index) == [True, True]


def test_a_frozen_gpus_free_unhealthy_instance_hides_no_bound_pod_elsewhere() -> None:
    """DRA promise harness seed 40000526, here on a device-plugin node (the ledger is shared).
    GPU 0 is frozen (drained for a waiting pod) and holds pod a's instance and a free one an
    XID hit; GPU 1 holds pod b's instance and one free.  The bound pods' units on frozen GPUs
    leave the count with the frozen GPUs' devices, and the free unhealthy instance (used in the
    planner's view) was counted as a bound pod's: b's unit looked like a's, and both of GPU 1's
    instances were free to promise."""
    two = {**MIG, "nvidia.com/gpu.count": "2"}
    index = ClusterIndex.from_objects(default_catalog(), [node("n1", two)])
    index.upsert_pod(pod("a", ONE_G, node_name="n1", phase="Running"))
    index.upsert_pod(pod("b", ONE_G, node_name="n1", phase="Running"))
    gpus = [
        {
            "index": 0,
            "migEnabled": True,
            "mig": [
                {"profile": "1g.10gb", "start": 0, "used": False, "unhealthy": True},
                {"profile": "1g.10gb", "start": 1, "used": True},
            ],
        },
        {
            "index": 1,
            "migEnabled": True,
            "mig": [
                {"profile": "1g.10gb", "start": 0, "used": True},
                {"profile": "1g.10gb", "start": 1, "used": False},
            ],
        },
    ]
    index.upsert_partitioning(np("n1", observed=1, applied=True, gpus=gpus))
    for frozen, free in (({}, 1), ({"n1": frozenset({0})}, 1)):
        ledgers, problems = build_ledgers(index, (), (), frozen)
        assert not problems
        assert ledgers["n1"].free()["nvidia.com/mig-1g.10gb"] == free, frozen


def test_no_drain_freezes_the_gpu_a_spec_in_flight_makes_a_promised_instance_on() -> None:
    """DRA promise harness seed 70001335.  Plan 2 is being applied: it makes a 4g on GPU 1 for
    pod g (a hold of that plan), where GPU 1 now holds a free 2g.  A drain for a 2g pod chose
    GPU 1 (its free 2g fits), and the frozen GPU's free devices, the 4g too once made, went to
    no pod: the DRA agent withholds them.  The counts could not tell (the 4g is not there yet)."""
    two = {**MIG, "nvidia.com/gpu.count": "2"}
    index = ClusterIndex.from_objects(default_catalog(), [node("n1", two)])
    index.upsert_pod(pod("g", {"nvidia.com/mig-4g.40gb": "1"}))
    gpus = [
        {"index": 0, "migEnabled": True, "mig": [{"profile": "7g.80gb", "start": 0, "used": True}]},
        {"index": 1, "migEnabled": True, "mig": [{"profile": "2g.20gb", "start": 0}]},
    ]
    index.upsert_partitioning(np("n1", plan="2", generation=2, observed=1, gpus=gpus))
    ledgers, problems = build_ledgers(index, ("n1",), (), {})
    assert not problems
    ledger = ledgers["n1"]
    assert ledger.busy
    r = Reservation("n1", State.PLANNED, {"nvidia.com/mig-4g.40gb": (1,)}, "2", 0.0, 300.0)
    ledger.add_hold(Hold(index.pods["ns/g"], r))
    assert ledger.breaks_holds([1])
    assert not ledger.breaks_holds([0])
    # a hold of two resources on two GPUs: either GPU is one it expects
    two_res = Reservation(
        "n1", State.PLANNED, {"nvidia.com/mig-4g.40gb": (1,), "nvidia.com/mig-3g.40gb": (0,)},
        "2", 0.0, 300.0,
    )  # fmt: skip
    ledger.holds[-1] = Hold(index.pods["ns/g"], two_res)
    assert ledger.breaks_holds([0]) and ledger.breaks_holds([1])
    ledger.holds[-1] = Hold(index.pods["ns/g"], r)
    ledger.busy = False  # applied: the 4g exists, and the counts tell (no free 4g elsewhere)
    assert not ledger.breaks_holds([0])


def test_no_drain_while_the_used_flags_predate_a_pod_change_and_slices_are_held() -> None:
    """The device-plugin side of DRA harness seed 70002048 (there the allocations say which
    device a pod holds; here nothing does).  GPU 0 shows its 1g@0 used, but pod a, which held
    it, has ended and pod b has bound since: b is on GPU 0 or GPU 1, and a drain of GPU 0
    counted with the stale flags could leave the hold of pod h (one 1g) without a device.  The
    drain waits for the agent's next report; with fresh flags the count decides."""
    two = {**MIG, "nvidia.com/gpu.count": "2"}
    index = ClusterIndex.from_objects(default_catalog(), [node("n1", two)])
    index.upsert_pod(_bound("a", "10"))
    gpus = [
        {"index": i, "migEnabled": True, "mig": [
            {"profile": "1g.10gb", "start": 0, "used": i == 0},
            {"profile": "1g.10gb", "start": 1, "used": False},
        ]}
        for i in (0, 1)
    ]  # fmt: skip
    obj = np("n1", observed=1, applied=True, gpus=gpus)
    obj["metadata"]["resourceVersion"] = "11"
    index.upsert_partitioning(obj)
    index.upsert_pod(pod("h", ONE_G))

    def drain_breaks_hold() -> bool:
        ledgers, problems = build_ledgers(index, (), (), {})
        assert not problems
        ledger = ledgers["n1"]
        r = Reservation("n1", State.PLANNED, {"nvidia.com/mig-1g.10gb": (1,)}, "", 0.0, 300.0)
        ledger.add_hold(Hold(index.pods["ns/h"], r))
        return ledger.breaks_holds([0])

    assert not drain_breaks_hold()  # fresh flags: GPU 1 keeps two free 1g for h
    index.upsert_pod(_bound("a", "12", finished=True))
    index.upsert_pod(_bound("b", "13"))
    assert drain_breaks_hold()  # b may sit on GPU 1: not now
