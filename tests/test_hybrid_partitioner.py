"""The partitioner's glue for hybrid nodes: the agent's report of slices inside instances becomes
planner input, and a plan's slices inside instances become the spec.

A hybrid A100-80GB node whose agent reports a 3g.40gb at slot 4 hosting a held 10 GiB slice and
a free one, and a whole free 4g.40gb at slot 0.  The ledger counts the slices as
``nvidia.com/gpu-10gb`` devices and the host as no MIG device; the planner sees the host with
its slices (the held one pins it); a new 10 GiB pod takes the free slice without any change; a
MIG pod that would need the host's slots cannot have them; an MPS pod is not rejected as "no
MPS node"; and the unchanged GPU's spec entry keeps the host's slices.
"""

from __future__ import annotations

from typing import Any

from test_partitioner_snapshot import A100, node, np, pod

from contract.nodepartitioning import NodePartitioning
from partitioner.decide import _desired_now, _desired_planned
from partitioner.index import ClusterIndex
from partitioner.ledger import build_ledgers
from partitioner.rejection import reject_reason
from planner import Mode, PendingPod, PlannerSettings, Snapshot, default_catalog, plan

CAT = default_catalog()
HYBRID = {"gpuslice.io/partitioning": "hybrid", **A100, "nvidia.com/gpu.count": "1"}
HELD = "MIG-77a3-mps0-10240m-26p"
FREE = "MIG-77a3-mps1-10240m-26p"


def _status() -> list[dict[str, Any]]:
    return [
        {
            "index": 0,
            "migEnabled": True,
            "mig": [
                {"profile": "4g.40gb", "start": 0, "deviceId": "MIG-0001", "used": False},
                {
                    "profile": "3g.40gb",
                    "start": 4,
                    "deviceId": "MIG-77a3",
                    "used": True,
                    "mps": [
                        {"memoryMiB": 10240, "activeThreadPercentage": 26, "deviceId": HELD,
                         "used": True},
                        {"memoryMiB": 10240, "activeThreadPercentage": 26, "deviceId": FREE,
                         "used": False},
                    ],
                },
            ],
        }
    ]  # fmt: skip


def _index() -> ClusterIndex:
    index = ClusterIndex.from_objects(CAT, [node("n1", HYBRID)])
    holder = pod("a", {"nvidia.com/gpu-10gb": "1"}, node_name="n1", phase="Running")
    holder["metadata"]["resourceVersion"] = "10"
    index.upsert_pod(holder)
    obj = np("n1", observed=1, applied=True, gpus=_status(), mode="hybrid")
    obj["metadata"]["resourceVersion"] = "11"
    index.upsert_partitioning(obj)  # the agent reported after the pod bound: fresh
    return index


def test_the_ledger_counts_slices_inside_instances_and_the_planner_sees_them() -> None:
    ledgers, problems = build_ledgers(_index(), (), (), {})
    assert not problems
    ledger = ledgers["n1"]
    ledger.pin()
    assert ledger.total()["nvidia.com/gpu-10gb"] == 2
    assert ledger.total()["nvidia.com/mig-3g.40gb"] == 0  # a host is no MIG device
    assert ledger.free()["nvidia.com/gpu-10gb"] == 1
    assert ledger.free()["nvidia.com/mig-4g.40gb"] == 1
    state = ledger.node_state()
    assert state.mode is Mode.HYBRID
    (gpu,) = state.gpus
    host = next(i for i in gpu.mig if i.start == 4)
    assert host.profile == "3g.40gb" and not host.used and host.pinned
    assert sorted(s.used for s in host.mps) == [False, True]

    s = PlannerSettings(time_limit_s=5.0)
    more = PendingPod("ns/b", {"nvidia.com/gpu-10gb": 1})
    result = plan(Snapshot((state,), (more,)), s)
    assert result.assignments["ns/b"].hosts == {"nvidia.com/gpu-10gb": (4,)}
    assert not result.layouts  # the free slice is taken as it is
    big = PendingPod("ns/c", {"nvidia.com/mig-7g.80gb": 1})
    result = plan(Snapshot((state,), (big,)), s)
    assert "ns/c" in result.unplaced  # the host holds a used slice: its slots stay


def test_a_mps_pod_may_go_to_a_hybrid_node() -> None:
    model = CAT.model("A100-SXM4-80GB")
    assert reject_reason({"nvidia.com/gpu-10gb": 1}, [(Mode.HYBRID, model)]) is None
    assert reject_reason({"nvidia.com/gpu-10gb": 1}, [(Mode.MIG, model)]) is not None


def test_specs_keep_and_carry_slices_inside_instances() -> None:
    obj = np("n1", observed=1, applied=True, gpus=_status(), mode="hybrid")
    current = NodePartitioning.model_validate(obj)
    kept = _desired_now(current, 0, Mode.HYBRID)
    assert kept is not None
    host = next(m for m in kept.mig if m.start == 4)
    assert [(s.memoryMiB, s.activeThreadPercentage) for s in host.mps] == [(10240, 26)] * 2
    assert next(m for m in kept.mig if m.start == 0).mps == []

    node_state = build_ledgers(_index(), (), (), {})[0]["n1"].node_state()
    more = PendingPod("ns/b", {"nvidia.com/gpu-20gb": 1})
    result = plan(Snapshot((node_state,), (more,)), PlannerSettings(time_limit_s=5.0))
    planned = result.layouts[("n1", 0)]
    desired = _desired_planned(planned)
    hosted = {
        m.start: [(s.memoryMiB, s.activeThreadPercentage) for s in m.mps] for m in desired.mig
    }
    (start,) = result.assignments["ns/b"].hosts["nvidia.com/gpu-20gb"]
    assert any(mib == 20480 and 1 <= pct <= 100 for mib, pct in hosted[start])
    assert any(mib == 10240 for mib, _ in hosted[4])  # the held slice stays in its host


def test_decide_writes_a_hybrid_spec_with_slices_inside_instances() -> None:
    """The whole decision step (batch window, bounds, planner, spec conversion) on a hybrid
    node: a 10 GiB MPS pod and a 3g.40gb pod become one spec with a host and a whole instance."""
    from dataclasses import replace

    from test_partitioner_decide import CONFIG, run

    from partitioner.actions import WriteSpec
    from partitioner.decide import ControllerState
    from planner.greedy import plan_greedy

    objs = [
        node("n1", HYBRID),
        np("n1", observed=1, applied=True, mode="hybrid"),
        pod("mps", {"nvidia.com/gpu-10gb": "1"}),
        pod("mig", {"nvidia.com/mig-3g.40gb": "1"}),
    ]
    for planner in (plan_greedy, plan):
        config = replace(CONFIG, planner=planner)
        d = run(ControllerState(), objs, 100, config)
        d = run(d.state, objs, 110, config)
        assert d.plan is not None and sorted(d.batch) == ["ns/mig", "ns/mps"], d.plan
        assert not d.plan.unplaced
        (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
        assert w.spec.mode == "hybrid"
        (gpu,) = w.spec.gpus
        hosts = [m for m in gpu.mig if m.mps]
        (host,) = hosts
        assert [s.memoryMiB for s in host.mps] == [10240]
        assert any(m.profile == "3g.40gb" and not m.mps for m in gpu.mig)


def test_a_hybrid_node_whose_kubelet_lists_none_of_its_slices_is_seen() -> None:
    """The host instance is no resource of its own: what the kubelet must list are its slices
    and the whole 4g.  None listed: the device plugin is gone (``unlisted`` names a resource
    the agent reports, never the host's empty one); one listed: the plugin is there."""
    index = _index()
    ledgers, _ = build_ledgers(index, (), (), {})
    assert ledgers["n1"].unlisted() == "nvidia.com/gpu-10gb"
    listed = node("n1", HYBRID)
    listed["status"]["allocatable"]["nvidia.com/mig-4g.40gb"] = "1"
    listed["metadata"]["resourceVersion"] = "12"
    index.upsert_node(listed)
    ledgers, _ = build_ledgers(index, (), (), {})
    assert ledgers["n1"].unlisted() == ""


def test_a_released_hosted_slice_pins_every_free_slice_of_its_size_on_its_gpu() -> None:
    """A released pod's 10 GiB slice on a hybrid GPU with two hosts, each with one free 10 GiB
    slice: the device plugin gives it the lowest device id (here in the 3g host), while the
    ledger pinned the first host's.  A plan then made the 3g host a whole instance for another
    pod, and the kubelet admitting the released pod there made the agent refuse the spec.
    Every free slice of that size on the expected GPU is pinned while the pod is unbound."""
    from partitioner.ledger import Hold
    from partitioner.reservations import RESERVATION_ANNOTATION, Reservation, State


    a, b = "MIG-zzzz0000-0000-0000-0000-000000000000", "MIG-aaaa0000-0000-0000-0000-000000000000"

    def free_slice(uuid: str) -> dict[str, Any]:
        return {"memoryMiB": 10240, "activeThreadPercentage": 26,
                "deviceId": f"{uuid}-mps0-10240m-26p", "used": False}  # fmt: skip

    status = [{"index": 0, "uuid": "GPU-0", "migEnabled": True, "mig": [
        {"profile": "4g.40gb", "start": 0, "deviceId": a, "used": False, "mps": [free_slice(a)]},
        {"profile": "3g.40gb", "start": 4, "deviceId": b, "used": False, "mps": [free_slice(b)]},
    ]}]  # fmt: skip
    hybrid = {**HYBRID, "nvidia.com/gpu.count": "1"}
    for state, pinned in ((State.RELEASED, [True, True]), (State.PLANNED, [True, False])):
        index = ClusterIndex.from_objects(CAT, [node("n1", hybrid)])
        p = pod("p", {"nvidia.com/gpu-10gb": "1"})
        r = Reservation("n1", state, {"nvidia.com/gpu-10gb": (0,)}, "1", 0, 1e9)
        p["metadata"]["annotations"] = {RESERVATION_ANNOTATION: r.to_json()}
        index.upsert_pod(p)
        obj = np("n1", observed=1, applied=True, gpus=status, mode="hybrid")
        obj["metadata"]["resourceVersion"] = "11"
        index.upsert_partitioning(obj)
        ledger = build_ledgers(index, (), (), {})[0]["n1"]
        held = index.pods["ns/p"]
        assert held.reservation is not None
        ledger.add_hold(Hold(held, held.reservation))
        ledger.pin()
        gpu = ledger.node_state().gpus[0]
        assert [s.used for m in gpu.mig for s in m.mps] == pinned, state
        if state is State.RELEASED:  # neither host may be destroyed under the pod
            result = plan(
                Snapshot((ledger.node_state(),), (PendingPod("ns/q", {"nvidia.com/mig-3g.40gb": 1}),)),
                PlannerSettings(time_limit_s=5),
            )
            assert "ns/q" in result.unplaced
