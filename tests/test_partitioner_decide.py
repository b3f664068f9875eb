"""The decision step as a plain function: housekeeping, conditions, batching, spec writes.

These run with reservations off (nos's behaviour: pods are planned, never gated or released),
which is also the path ungated pods take; the reservation flow is in
``test_partitioner_promises.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from test_partitioner_snapshot import A100, node, np, pod, view

from contract.gen_crd import DEFAULT_PATH, crd_yaml
from partitioner.actions import (
    CreatePartitioning,
    DeletePartitioning,
    EmitEvent,
    SetNodeCondition,
    WriteSpec,
)
from partitioner.batching import BatchPolicy
from partitioner.decide import ControllerState, DecideConfig, decide
from partitioner.index import ClusterIndex
from partitioner.settings import PartitionerSettings
from planner.catalog import default_catalog
from planner.greedy import plan_greedy
from planner.snapshot import Plan

CONFIG = DecideConfig(
    catalog=default_catalog(),
    policy=BatchPolicy(timeout=60, idle=10, retry=60),
    planner=plan_greedy,
    reservation=False,
)
MIG = {"gpuslice.io/partitioning": "mig", **A100}


def run(
    state: ControllerState, objs: list[dict[str, Any]], now: float, config: DecideConfig = CONFIG
) -> Any:
    return decide(state, view(*objs), now, config)


def test_housekeeping_creates_deletes_and_switches_mode() -> None:
    objs = [
        node("new", MIG),
        node("gone-label", A100),
        np("gone-label"),
        np("gone-node"),
        node("switch", {"gpuslice.io/partitioning": "mps", **A100}),
        np("switch", plan="4", observed=1, applied=True),
        node("broken", {"gpuslice.io/partitioning": "mig", "nvidia.com/gpu.count": "1"}),
        np("broken"),
    ]
    d = run(ControllerState(), objs, 0)
    creates = [a for a in d.actions if isinstance(a, CreatePartitioning)]
    assert [(a.node, a.node_uid, a.spec.mode) for a in creates] == [("new", "uid-new", "mig")]
    assert sorted(a.node for a in d.actions if isinstance(a, DeletePartitioning)) == [
        "gone-label",
        "gone-node",
    ]
    (switch,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert (switch.node, switch.spec.mode, switch.spec.planId, switch.spec.gpus) == (
        "switch",
        "mps",
        "5",
        [],
    )
    (cond,) = [a for a in d.actions if isinstance(a, SetNodeCondition)]
    assert (cond.node, cond.status, cond.reason) == ("broken", "False", "MissingGpuLabels")
    (ev,) = [a for a in d.actions if isinstance(a, EmitEvent)]
    assert (ev.ref.kind, ev.ref.name, ev.type, ev.reason) == (
        "Node",
        "broken",
        "Warning",
        "MissingGpuLabels",
    )


def test_node_condition_is_set_once_and_cleared_when_fixed() -> None:
    broken = node("b", {"gpuslice.io/partitioning": "mig", "nvidia.com/gpu.count": "1"})
    d = run(ControllerState(), [broken], 0)
    (cond,) = [a for a in d.actions if isinstance(a, SetNodeCondition)]
    broken["status"]["conditions"] = [
        {"type": "GpusliceReady", "status": "False", "reason": cond.reason, "message": cond.message}
    ]
    assert not run(d.state, [broken], 1).actions  # same problem: nothing new
    fixed = node("b", MIG)
    fixed["status"]["conditions"] = broken["status"]["conditions"]
    d = run(d.state, [fixed, np("b")], 2)
    assert [(a.node, a.status) for a in d.actions if isinstance(a, SetNodeCondition)] == [
        ("b", "True")
    ]


def test_plan_writes_changed_nodes_only_after_the_window() -> None:
    objs = [
        node("n1", MIG),
        np("n1", observed=1, applied=True),
        pod("p", {"nvidia.com/mig-1g.10gb": "1"}),
    ]
    d = run(ControllerState(), objs, 100)
    assert d.plan is None and d.state.window.is_open and not d.actions
    d = run(d.state, objs, 110)
    assert d.plan is not None and d.plan_id == "1" and d.batch == ("ns/p",)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert w.node == "n1" and w.resource_version == "7" and w.planned_pods == ("ns/p",)
    assert [g.index for g in w.spec.gpus] == [0, 1] and w.spec.gpus[1].mig == []
    assert [i.profile for i in w.spec.gpus[0].mig] == ["1g.10gb"]
    assert [e.message for e in w.on_success] == [
        "planned nvidia.com/mig-1g.10gb on node n1 GPU 0, plan 1"
    ]
    assert d.gpus_reconfigured == 1
    assert not d.state.window.is_open


def test_a_free_instance_needs_no_write() -> None:
    gpus = [{"index": 0, "mig": [{"profile": "1g.10gb", "start": 0}]}]
    obj = np("n1", observed=1, applied=True, gpus=gpus)
    obj["spec"]["gpus"] = [{"index": 0, "mig": [{"profile": "1g.10gb", "start": 0}]}]
    objs = [node("n1", MIG), obj, pod("p", {"nvidia.com/mig-1g.10gb": "1"})]
    d = run(run(ControllerState(), objs, 0).state, objs, 10)
    assert not [a for a in d.actions if isinstance(a, WriteSpec)]
    (ev,) = [a for a in d.actions if isinstance(a, EmitEvent)]
    assert ev.message.endswith("(no repartitioning needed)") and ev.ref.name == "p"


def test_unplaced_pod_is_told_once_per_reason() -> None:
    objs = [
        node("n1", {**MIG, "nvidia.com/gpu.count": "1"}),
        np("n1", observed=1, applied=True),
        pod("big", {"nvidia.com/mig-7g.80gb": "2"}),
    ]
    d = run(run(ControllerState(), objs, 0).state, objs, 10)
    (ev,) = [a for a in d.actions if isinstance(a, EmitEvent)]
    assert ev.type == "Warning" and ev.message.startswith("cannot place: ")
    d = run(run(d.state, objs, 80).state, objs, 90)  # retried after 60 s, same reason
    assert d.plan is not None and not [a for a in d.actions if isinstance(a, EmitEvent)]


def test_an_unchanged_cluster_is_not_planned_again_until_it_changes() -> None:
    """A retry of pods no GPU can hold re-plans only after the cluster changed (or time alone
    can change the plan: ``replan_at``), and asks for no wake-up at the retry time."""
    calls: list[int] = []

    def counting(snapshot: Any, settings: Any, catalog: Any) -> Plan:
        calls.append(len(snapshot.pods))
        return plan_greedy(snapshot, settings, catalog)

    config = replace(CONFIG, planner=counting)
    objs = [
        node("n1", {**MIG, "nvidia.com/gpu.count": "1"}),
        np("n1", observed=1, applied=True),
        pod("big", {"nvidia.com/mig-7g.80gb": "2"}),
    ]
    index = ClusterIndex.from_objects(
        config.catalog,
        [o for o in objs if o["kind"] == "Node"],
        [o for o in objs if o["kind"] == "Pod"],
        [o for o in objs if o["kind"] == "NodePartitioning"],
    )
    d = decide(decide(ControllerState(), index, 0, config).state, index, 10, config)
    assert d.plan is not None and len(calls) == 1
    assert d.next_wakeup is None or d.next_wakeup >= d.state.replan_at > 10 + 60
    state = d.state
    for t in (80, 90, 200):  # retries due, nothing changed: the plan would repeat
        d = decide(state, index, t, config)
        assert d.plan is None and not d.batch
        state = d.state
    assert len(calls) == 1
    index.upsert_pod(pod("other", {"nvidia.com/mig-1g.10gb": "1"}))  # the cluster changes
    state = decide(state, index, 201, config).state
    d = decide(state, index, 212, config)
    assert d.plan is not None and len(calls) == 2 and "ns/big" in d.batch


def test_planner_failure_is_reported_and_closes_the_window() -> None:
    def broken(*_: Any) -> Plan:
        raise RuntimeError("boom")

    config = DecideConfig(catalog=default_catalog(), policy=CONFIG.policy, planner=broken)
    objs = [node("n1", MIG), np("n1"), pod("p", {"nvidia.com/mig-1g.10gb": "1"})]
    d = run(run(ControllerState(), objs, 0, config).state, objs, 10, config)
    assert "RuntimeError: boom" in d.error and not d.state.window.is_open


def test_settings_from_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("GPUSLICE_BATCH_IDLE_SECONDS", "3")
    monkeypatch.setenv("GPUSLICE_CATALOG_FILES", "a.yaml, b.json")
    monkeypatch.setenv("GPUSLICE_LOG_LEVEL", "debug")
    s = PartitionerSettings()
    assert (
        s.batch_idle_seconds == 3
        and s.catalog_files == ["a.yaml", "b.json"]
        and s.log_level == "DEBUG"
    )
    assert s.batch_policy().idle == 3 and s.planner_settings().mps_reserve_mib == 512
    assert PartitionerSettings(batch_idle_seconds=5).batch_idle_seconds == 5  # flags win


def test_committed_crd_matches_the_contract() -> None:
    assert DEFAULT_PATH.read_text() == crd_yaml(), "CRD drifted: run python -m contract.gen_crd"


def test_the_batch_plan_gets_the_mps_packing_target_of_the_clusters_pods() -> None:
    """The planner's MPS polish measures against the pods bound to MPS nodes and the waiting
    ones (partitioner/mps_target.py): their CPU, slice size and count, one count per pod; a
    pod asking for two MPS slices, which is never placed, stands for nothing."""
    seen: list[Any] = []

    def spy(snapshot: Any, settings: Any, catalog: Any) -> Plan:
        seen.append(settings)
        return plan_greedy(snapshot, settings, catalog)

    mps = {"gpuslice.io/partitioning": "mps", **A100}
    used = {"memoryMiB": 10240, "activeThreadPercentage": 13, "used": True}
    objs = [
        node("m", mps),
        np(
            "m",
            observed=1,
            applied=True,
            mode="mps",
            gpus=[{"index": 0, "mps": [used, used]}, {"index": 1, "mps": []}],
        ),
        node("g", MIG),
        np("g", observed=1, applied=True),
        pod("run-a", {"nvidia.com/gpu-10gb": "1", "cpu": "3"}, node_name="m", phase="Running"),
        pod("run-b", {"nvidia.com/gpu-10gb": "1", "cpu": "3"}, node_name="m", phase="Running"),
        pod("done", {"nvidia.com/gpu-10gb": "1", "cpu": "3"}, node_name="m", phase="Succeeded"),
        pod("on-mig", {"nvidia.com/mig-1g.10gb": "1", "cpu": "2"}, node_name="g", phase="Running"),
        pod("wait", {"nvidia.com/gpu-20gb": "1", "cpu": "500m"}),
        pod("wait-pair", {"nvidia.com/gpu-8gb": "2", "cpu": "1"}),  # never placed: no shape
    ]
    config = replace(CONFIG, planner=spy)
    d = run(ControllerState(), objs, 100, config)
    run(d.state, objs, 110, config)
    assert seen[-1].free_capacity_mps_shapes == (
        (500, 20 * 1024, 1, 1.0),
        (3000, 10 * 1024, 1, 2.0),
    )
    # a target given in the settings, or the polish off, is left alone
    for planner_settings in (
        replace(config.planner_settings, free_capacity_mps_sizes=((10 * 1024, 1.0),)),
        replace(config.planner_settings, mps_polish=False),
    ):
        seen.clear()
        given = replace(config, planner_settings=planner_settings)
        d = run(ControllerState(), objs, 100, given)
        run(d.state, objs, 110, given)
        assert seen[-1].free_capacity_mps_shapes is None


def test_a_pod_asking_for_two_mps_slices_is_rejected_with_the_fix_and_never_planned() -> None:
    """The agent's ``Allocate`` refuses a container MPS slices of two daemons (one per GPU), and
    the kubelet picks each container's devices itself: a pod asking for two MPS slices is told
    why and what to ask for instead, once, and no plan places it; a one-slice pod beside it is
    planned as before."""
    seen: list[Any] = []

    def spy(snapshot: Any, settings: Any, catalog: Any) -> Plan:
        seen.append({p.name for p in snapshot.pods})
        return plan_greedy(snapshot, settings, catalog)

    mps = {"gpuslice.io/partitioning": "mps", **A100}
    objs = [
        node("m", mps),
        np("m", observed=1, applied=True, mode="mps", gpus=[{"index": 0, "mps": []}]),
        pod("pair", {"nvidia.com/gpu-8gb": "2"}),
        pod("two-sizes", {"nvidia.com/gpu-8gb": "1", "nvidia.com/gpu-16gb": "1"}),
        pod("one", {"nvidia.com/gpu-16gb": "1"}),
    ]
    config = replace(CONFIG, planner=spy)
    told: dict[str, str] = {}
    d = run(ControllerState(), objs, 100, config)
    told.update({a.ref.name: a.message for a in d.actions if isinstance(a, EmitEvent)})
    d = run(d.state, objs, 170, config)
    assert not [a for a in d.actions if isinstance(a, EmitEvent) and a.ref.name != "one"]
    assert seen and all(names == {"ns/one"} for names in seen)
    assert told["pair"] == (
        "cannot place: more than one MPS slice: the pod asks for 2 MPS slices; a container "
        "reaches one MPS daemon (one "
        "GPU, or one MIG instance on a hybrid node), so gpuslice gives an MPS pod one slice: "
        "ask for one slice of the memory it needs (nvidia.com/gpu-16gb, if one GPU holds it), "
        "or for MIG instances (nvidia.com/mig-<profile>) to use several GPUs"
    )
    assert "nvidia.com/gpu-24gb" in told["two-sizes"]
    assert "one" not in told or not told["one"].startswith("cannot place")


def test_the_snapshot_holds_each_pods_own_requests_cpu_memory_priority_and_wait() -> None:
    """The batch's PendingPods are built positionally for speed (``planning_input``): each
    field must still carry its own value (distinct values here, so a swapped order fails)."""
    seen: list[Any] = []

    def capture(snapshot: Any, settings: Any, catalog: Any) -> Plan:
        seen.append(snapshot)
        return plan_greedy(snapshot, settings, catalog)

    asked = pod(
        "p",
        {"nvidia.com/mig-2g.20gb": "1", "cpu": "1500m", "memory": "3Gi"},
        priority=7,
    )
    asked["metadata"]["creationTimestamp"] = "1970-01-01T00:00:02Z"
    objs = [node("n1", MIG), np("n1", observed=1, applied=True), asked]
    config = replace(CONFIG, planner=capture)
    state = run(ControllerState(), objs, 5, config).state
    run(state, objs, 16, config)
    assert len(seen) == 1
    (p,) = seen[0].pods
    assert (p.name, dict(p.requests), p.cpu_milli, p.memory_mib, p.priority) == (
        "ns/p",
        {"nvidia.com/mig-2g.20gb": 1},
        1500,
        3072,
        7,
    )
    assert p.eligible_nodes == frozenset({"n1"}) and p.waited_s == 14.0


# -- devices of the other mode, left from before a node was relabelled -------------------------


def _mode_change_step(mode: str, gpus: list[dict[str, Any]], *objs: dict[str, Any]) -> list[Any]:
    """Two steps (a batch window) on node m (A100-80GB x 2, ``mode``) whose agent reports
    ``gpus``: the specs written."""
    cfg = DecideConfig(catalog=default_catalog(), policy=BatchPolicy(timeout=60, idle=10, retry=60))
    n = node("m", {"gpuslice.io/partitioning": mode, **A100})
    for g in gpus:  # the kubelet advertises what the agent reports (a host: its slices)
        hosted = [s for m in g.get("mig", ()) for s in m.get("mps", ())]
        plain = [m for m in g.get("mig", ()) if not m.get("mps")]
        for d in [*plain, *g.get("mps", ()), *hosted]:
            r = (
                f"nvidia.com/mig-{d['profile']}"
                if "profile" in d
                else f"nvidia.com/gpu-{d['memoryMiB'] // 1024}gb"
            )
            n["status"]["allocatable"][r] = str(int(n["status"]["allocatable"].get(r, "0")) + 1)
    n["status"]["capacity"] = dict(n["status"]["allocatable"])
    view_objs = [n, np("m", mode=mode, plan="3", observed=1, applied=True, gpus=gpus), *objs]
    state, specs = ControllerState(), []
    for t in (100, 111):
        d = decide(state, view(*view_objs), t, cfg)
        state = d.state
        specs += [a.spec for a in d.actions if isinstance(a, WriteSpec)]
    return specs


def test_mig_instances_on_an_mps_node_are_planned_around_or_removed() -> None:
    """A node relabelled mig -> mps whose agent still reports a MIG instance: the step used to
    take the instance for a 0 MiB MPS slice and raise building the spec (every step of the
    cluster failed until liveness restarted the partitioner, which then failed the same way).
    In use, the GPU is left out of the plan and of the spec (the agent leaves it be); free,
    it is planned as an empty GPU and its spec entry asks for MPS slices only."""
    inst = {"profile": "1g.10gb", "start": 0, "deviceId": "MIG-aaaa"}
    want = pod("p", {"nvidia.com/gpu-10gb": "1"})
    for used in (True, False):
        gpus = [
            {"index": 0, "uuid": "GPU-0", "migEnabled": True, "mig": [inst | {"used": used}]},
            {"index": 1, "uuid": "GPU-1"},
        ]
        (spec,) = _mode_change_step("mps", gpus, want)
        assert spec.mode == "mps"
        assert all(not g.mig for g in spec.gpus)
        with_slices = [g.index for g in spec.gpus if g.mps]
        assert [s.memoryMiB for g in spec.gpus for s in g.mps] == [10240]
        if used:
            assert [g.index for g in spec.gpus] == [1] and with_slices == [1]
        else:
            assert 0 in [g.index for g in spec.gpus]


def test_mps_slices_on_a_mig_node_are_planned_around() -> None:
    """A node relabelled mps -> mig (or hybrid) while an MPS pod holds a whole-GPU slice:
    the spec listed that slice in a MIG spec, which the agent refuses as a whole (InvalidSpec);
    now the GPU is left out of plan and spec until its pod leaves, and a free slice is not
    asked for again."""
    running = pod("r", {"nvidia.com/gpu-10gb": "1"}, node_name="m", phase="Running")
    wants = [pod("p", {"nvidia.com/mig-3g.40gb": "1"}), pod("q", {"nvidia.com/mig-3g.40gb": "1"})]
    for mode in ("mig", "hybrid"):
        for used in (True, False):
            slice_ = {"memoryMiB": 10240, "activeThreadPercentage": 13, "used": used}
            gpus = [
                {"index": 0, "uuid": "GPU-0", "mps": [slice_ | {"deviceId": "GPU-0-mps0"}]},
                {"index": 1, "uuid": "GPU-1"},
            ]
            (spec,) = _mode_change_step(mode, gpus, *([running] if used else []), *wants)
            assert all(not g.mps for g in spec.gpus), (mode, used)
            if used:
                assert [g.index for g in spec.gpus] == [1]


def test_a_node_whose_agent_reports_another_gpu_model_is_a_node_problem() -> None:
    """GPU Feature Discovery labels one model per node: a node with an A100-80GB and an
    A100-40GB was planned as two 80 GB GPUs (a 60 GiB MPS slice on the 40 GB one, refused by
    the agent after every plan, the pod never told).  The agent's report names each GPU's
    model: such a node is a node problem naming both models, and gets no spec."""
    cfg = DecideConfig(catalog=default_catalog(), policy=BatchPolicy(timeout=60, idle=10, retry=60))
    gpus = [
        {"index": 0, "uuid": "GPU-0", "model": "A100-SXM4-80GB"},
        {"index": 1, "uuid": "GPU-1", "model": "A100-SXM4-40GB"},
    ]
    objs = [
        node("m", {"gpuslice.io/partitioning": "mps", **A100}),
        np("m", mode="mps", plan="3", observed=1, applied=True, gpus=gpus),
        pod("p", {"nvidia.com/gpu-60gb": "1"}),
    ]
    state = ControllerState()
    for t in (100, 111):
        d = decide(state, view(*objs), t, cfg)
        state = d.state
        assert not [a for a in d.actions if isinstance(a, WriteSpec)]
    problem = d.problems["m"]
    assert problem.reason == "MixedGpuModels"
    assert "A100-SXM4-40GB" in problem.message and "A100-SXM4-80GB" in problem.message
    gpus[1]["model"] = "A100-SXM4-80GB"  # one model: planned
    objs[1] = np("m", mode="mps", plan="3", observed=1, applied=True, gpus=gpus)
    state = ControllerState()
    specs = []
    for t in (100, 111):
        d = decide(state, view(*objs), t, cfg)
        state = d.state
        specs += [a for a in d.actions if isinstance(a, WriteSpec)]
    assert specs and "m" not in d.problems


def test_a_layout_no_spec_can_hold_drops_that_node_only() -> None:
    """A plan whose layout for one node is no valid spec (a bug between the planner and the
    spec's rules: here a 0 MiB MPS slice) loses that node's part only: the other node's spec
    and reservation are written, the bad node gets a Warning Event, the step reports the
    error, and the pod planned there is not promised anything.  It raised out of the whole
    step before, every step, for every node of the cluster."""
    from planner.snapshot import Assignment, PlannedGpu, PlannedSlice

    def bad_for_m2(snapshot: Any, settings: Any, catalog: Any) -> Plan:
        layouts = {
            ("m1", 0): PlannedGpu("m1", 0, mps=(PlannedSlice(10240, 13),)),
            ("m2", 0): PlannedGpu("m2", 0, mps=(PlannedSlice(0, 13),)),
        }
        assignments = {
            "ns/a": Assignment("m1", {"nvidia.com/gpu-10gb": (0,)}),
            "ns/b": Assignment("m2", {"nvidia.com/gpu-10gb": (0,)}),
        }
        return Plan(layouts, assignments, {})

    config = replace(CONFIG, planner=bad_for_m2, reservation=True)
    mps = {"gpuslice.io/partitioning": "mps", **A100, "nvidia.com/gpu.count": "1"}
    objs = [
        node("m1", mps),
        node("m2", mps),
        np("m1", mode="mps", observed=1, applied=True),
        np("m2", mode="mps", observed=1, applied=True),
        pod("a", {"nvidia.com/gpu-10gb": "1"}),
        pod("b", {"nvidia.com/gpu-10gb": "1"}),
    ]
    d = run(run(ControllerState(), objs, 0, config).state, objs, 11, config)
    assert [a.node for a in d.actions if isinstance(a, WriteSpec)] == ["m1"]
    (told,) = [a for a in d.actions if isinstance(a, EmitEvent) and a.reason == "PlanNotWritten"]
    assert told.ref.name == "m2" and told.type == "Warning" and "memoryMiB" in told.message
    assert "node m2 not written" in d.error
    patched = {a.pod for a in d.actions if type(a).__name__ == "PatchPod"}
    assert "ns/a" in patched and "ns/b" not in patched


def test_hosts_on_a_mig_node_are_planned_around_or_made_plain_instances() -> None:
    """A hybrid node relabelled to mig whose agent still reports a host (a MIG instance with
    MPS slices inside): the specs copied the host's slices into a MIG spec, which the contract
    refuses, so every plan for the node failed.  A host with a used slice locks its GPU (left
    out of plan and spec); a free one is planned as free space and, kept, asked for as a plain
    instance (the agent then clears its slice table)."""
    host = {
        "profile": "3g.40gb",
        "start": 4,
        "deviceId": "MIG-77a3",
        "mps": [{"memoryMiB": 10240, "activeThreadPercentage": 26, "deviceId": "MIG-77a3-mps0"}],
    }
    running = pod("r", {"nvidia.com/gpu-10gb": "1"}, node_name="m", phase="Running")
    want = pod("p", {"nvidia.com/mig-7g.80gb": "1"})
    for used in (True, False):
        h = json.loads(json.dumps(host))
        h["used"] = used
        h["mps"][0]["used"] = used
        gpus = [
            {"index": 0, "uuid": "GPU-0", "migEnabled": True, "mig": [h]},
            {"index": 1, "uuid": "GPU-1", "migEnabled": True},
        ]
        specs = _mode_change_step("mig", gpus, *([running] if used else []), want)
        assert specs, used
        for spec in specs:
            assert all(not m.mps for g in spec.gpus for m in g.mig)
            if used:
                assert 0 not in [g.index for g in spec.gpus]


def test_a_pod_whose_only_node_is_left_out_is_told_the_nodes_reason() -> None:
    """The only opted-in node has a label problem (a GPU model the catalog lacks): the pod was
    told no node "matches the pod's nodeSelector, affinity and tolerations" -- it has none;
    now the reason names the node left out and why."""
    a800 = {"gpuslice.io/partitioning": "mig", **A100}
    a800["nvidia.com/gpu.product"] = "NVIDIA-A800-SXM4-80GB"
    objs = [node("n1", a800), pod("p", {"nvidia.com/mig-3g.40gb": "1"})]
    d = run(ControllerState(), objs, 0)
    (told,) = [a for a in d.actions if isinstance(a, EmitEvent) and a.ref.kind == "Pod"]
    assert "node n1, which the pod would fit, is left out: UnknownGpuModel" in told.message
    other = {**a800, "team": "b"}
    fenced = pod("q", {"nvidia.com/mig-3g.40gb": "1"}, nodeSelector={"team": "a"})
    d = run(ControllerState(), [node("n1", other), fenced], 0)
    (told,) = [a for a in d.actions if isinstance(a, EmitEvent) and a.ref.kind == "Pod"]
    assert "left out" not in told.message  # its selector rules n1 out anyway
