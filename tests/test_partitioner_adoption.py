"""Adoption: a node's GPUs before its agent reports, read from labels, annotations and pods."""

from __future__ import annotations

from typing import Any

import pytest
from kube_objects import pod_object

from contract.nodepartitioning import NodePartitioning
from partitioner.actions import SetNodeCondition, WriteSpec
from partitioner.batching import BatchPolicy
from partitioner.decide import ControllerState, DecideConfig, decide
from partitioner.snapshot import ClusterView, read_cluster
from planner.catalog import default_catalog
from planner.settings import PlannerSettings, Policy
from planner.snapshot import GpuState

CAT = default_catalog()
A80 = "NVIDIA-A100-SXM4-80GB"


def node(
    name: str,
    gpus: int,
    devices: dict[str, int] | None = None,
    annotations: dict[str, str] | None = None,
    mode: str = "mig",
    **labels: str,
) -> dict[str, Any]:
    base = {
        "gpuslice.io/partitioning": mode,
        "nvidia.com/gpu.product": A80,
        "nvidia.com/gpu.count": str(gpus),
    }
    if devices is not None:
        base["nvidia.com/mig.strategy"] = "mixed"
        base |= {f"nvidia.com/mig-{p}.count": str(n) for p, n in devices.items()}
    return {
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": base | labels,
            "annotations": annotations or {},
        },
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}, "capacity": {}},
    }


def pod(
    name: str, resource: str, n: int = 1, on: str = "", phase: str = "Running"
) -> dict[str, Any]:
    return pod_object(name, {resource: n}, on, phase)


def view(*objs: dict[str, Any], nps: tuple[dict[str, Any], ...] = ()) -> ClusterView:
    return ClusterView(
        {o["metadata"]["name"]: o for o in objs if o["kind"] == "Node"},
        {f"ns/{o['metadata']['name']}": o for o in objs if o["kind"] == "Pod"},
        {o["metadata"]["name"]: o for o in nps},
    )


def gpus_of(v: ClusterView, name: str) -> tuple[GpuState, ...]:
    reading = read_cluster(v, CAT)
    assert name not in reading.problems, reading.problems[name]
    return next(n for n in reading.nodes if n.name == name).gpus


def problem_of(v: ClusterView, name: str) -> str:
    reading = read_cluster(v, CAT)
    assert name in reading.problems and name in reading.gpu_nodes
    assert all(n.name != name for n in reading.nodes)  # left out of plans
    return f"{reading.problems[name].reason}: {reading.problems[name].message}"


def instances(gpu: GpuState) -> list[tuple[str, int, bool]]:
    return [(i.profile, i.start, i.used) for i in gpu.mig]


def test_the_issue_case_a_gpu_of_seven_running_1g_pods_is_kept_and_never_planned_over() -> None:
    n = node("n", 1, {"1g.10gb": 7})
    running = [pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(7)]
    v = view(n, *running, pod("big", "nvidia.com/mig-7g.80gb"))
    (gpu,) = gpus_of(v, "n")
    assert instances(gpu) == [("1g.10gb", s, True) for s in range(7)]
    assert not gpu.locked  # one GPU, every 1g used: known exactly
    state = ControllerState()
    config = DecideConfig(
        CAT, BatchPolicy(timeout=1, idle=1), PlannerSettings(policy=Policy.GREEDY)
    )
    first = decide(state, v, 0.0, config)
    second = decide(first.state, v, 5.0, config)
    assert second.plan is not None and "ns/big" in second.plan.unplaced
    assert not second.plan.layouts and not any(isinstance(a, WriteSpec) for a in second.actions)


def test_identical_gpus_with_every_instance_of_a_profile_in_use_are_known_exactly() -> None:
    # 2 x (4 x 1g + 3g): the only split; both 3g in use, no 1g: every GPU known, none locked.
    n = node("n", 2, {"1g.10gb": 8, "3g.40gb": 2})
    v = view(
        n, pod("a", "nvidia.com/mig-3g.40gb", on="n"), pod("b", "nvidia.com/mig-3g.40gb", on="n")
    )
    gpus = gpus_of(v, "n")
    for gpu in gpus:
        assert not gpu.locked
        assert instances(gpu) == [("1g.10gb", s, False) for s in range(4)] + [("3g.40gb", 4, True)]


def test_some_instances_of_a_profile_in_use_lock_the_gpus_that_may_hold_them() -> None:
    n = node("n", 2, {"1g.10gb": 14})
    v = view(n, *[pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(9)])
    gpus = gpus_of(v, "n")
    assert all(g.locked for g in gpus)
    assert sum(i.used for g in gpus for i in g.mig) == 9  # free ones still count: 5
    assert all(len(g.mig) == 7 for g in gpus)


def test_a_node_with_nothing_in_use_is_never_locked_even_when_the_split_is_a_guess() -> None:
    n = node("n", 2, {"1g.10gb": 4, "2g.20gb": 2, "3g.40gb": 2})
    gpus = gpus_of(view(n), "n")
    assert not any(g.locked for g in gpus)
    assert sum(len(g.mig) for g in gpus) == 8


def test_the_mig_managers_applied_config_gives_the_split() -> None:
    n = node("n", 2, {"3g.40gb": 4})
    n["metadata"]["labels"] |= {
        "nvidia.com/mig.config": "all-3g.40gb",
        "nvidia.com/mig.config.state": "success",
    }
    v = view(n, *[pod(f"r{i}", "nvidia.com/mig-3g.40gb", on="n") for i in range(4)])
    gpus = gpus_of(v, "n")
    assert [instances(g) for g in gpus] == [[("3g.40gb", 0, True), ("3g.40gb", 4, True)]] * 2
    assert not any(g.locked for g in gpus)


def test_nos_annotations_give_instances_per_gpu() -> None:
    ann = {
        "nos.nebuly.com/status-gpu-0-1g.10gb-used": "7",
        "nos.nebuly.com/status-gpu-1-3g.40gb-free": "1",
        "nos.nebuly.com/status-gpu-1-3g.40gb-used": "1",
        "nos.nebuly.com/spec-gpu-0-1g.10gb": "7",
    }
    n = node("n", 3, {"1g.10gb": 7, "3g.40gb": 2}, annotations=ann)
    running = [pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(7)]
    v = view(n, *running, pod("t", "nvidia.com/mig-3g.40gb", on="n"))
    g0, g1, g2 = gpus_of(v, "n")
    # nos's per-GPU "used" is as old as nos's last report: which GPU holds the pods is not
    # taken from it, so every GPU with instances is locked while pods use them
    assert g0.locked and all(i.used for i in g0.mig) and len(g0.mig) == 7
    assert g1.locked and [i.profile for i in g1.mig] == ["3g.40gb", "3g.40gb"]  # which 3g?
    assert not g2.locked and not g2.mig


@pytest.mark.parametrize(
    ("objs", "fragment"),
    [
        (
            [
                node("n", 1, {"1g.10gb": 2}),
                *[pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(3)],
            ],
            "UnreadableMigLayout: running pods",
        ),
        (
            [
                node(
                    "n",
                    1,
                    {"3g.40gb": 2},
                    annotations={"nos.nebuly.com/status-gpu-0-7g.80gb-free": "1"},
                )
            ],
            "UnreadableMigLayout: nos's status annotations show 1 x 7g.80gb",
        ),
        (
            [node("n", 1, annotations={"nos.nebuly.com/status-gpu-4-1g.10gb-free": "1"})],
            "UnreadableNosStatus: annotation nos.nebuly.com/status-gpu-4-1g.10gb-free names GPU 4",
        ),
        (
            [node("n", 2, mode="mps"), pod("m", "nvidia.com/gpu-10gb", on="n")],
            "GpuInUseBeforeAgent",
        ),
        (
            [node("n", 1, {"1g.10gb": 1}), pod("x", "nvidia.com/mig-1g.12gb", on="n")],
            "UnreadableGpuUse: running pod ns/x holds nvidia.com/mig-1g.12gb",
        ),
        (
            [node("n", 1, {"1g.10gb": 1}), pod("x", "nvidia.com/mig-1g.10gb", n=10**30, on="n")],
            "UnreadableGpuUse",
        ),
        (
            [
                {
                    **node("n", 1),
                    "metadata": {
                        **node("n", 1)["metadata"],
                        "labels": {
                            **node("n", 1)["metadata"]["labels"],
                            "nvidia.com/mig.strategy": "single",
                            "nvidia.com/gpu.product": f"{A80}-MIG-1g.10gb",
                            "nvidia.com/gpu.count": "14",
                        },
                    },
                }
            ],
            "GpuCountUnknown: no label holds the physical GPU count",
        ),
    ],
)
def test_unreadable_nodes_are_left_out_with_the_reason(
    objs: list[dict[str, Any]], fragment: str
) -> None:
    assert fragment in problem_of(view(*objs), "n")


def test_a_finished_pod_holds_nothing_and_capacity_is_the_fallback_source() -> None:
    n = node("n", 1)
    n["status"]["capacity"] = {"nvidia.com/mig-2g.20gb": "3"}
    v = view(n, pod("done", "nvidia.com/mig-2g.20gb", on="n", phase="Succeeded"))
    (gpu,) = gpus_of(v, "n")
    assert instances(gpu) == [("2g.20gb", s, False) for s in (0, 2, 4)]


def test_whole_gpu_pods_lock_every_gpu() -> None:
    v = view(node("n", 2), pod("w", "nvidia.com/gpu", on="n"), pod("p", "nvidia.com/mig-3g.40gb"))
    gpus = gpus_of(v, "n")
    assert all(g.locked and not g.mig for g in gpus)


def test_the_agents_report_wins_and_counts_gpus_under_single() -> None:
    n = node("n", 14)
    n["metadata"]["labels"] |= {
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": f"{A80}-MIG-1g.10gb",
    }
    np_ = NodePartitioning.model_validate(
        {
            "apiVersion": "gpuslice.io/v1alpha1",
            "kind": "NodePartitioning",
            "metadata": {"name": "n", "generation": 1, "resourceVersion": "1"},
            "spec": {"mode": "mig", "gpus": []},
            "status": {
                "observedGeneration": 1,
                "gpus": [
                    {
                        "index": i,
                        "mig": [
                            {"profile": "1g.10gb", "start": s, "used": s < 2} for s in range(7)
                        ],
                    }
                    for i in range(2)
                ],
            },
        }
    ).model_dump(mode="json", exclude_none=True)
    reading = read_cluster(view(n, nps=(np_,)), CAT)
    assert reading.gpu_nodes["n"].gpu_count == 2  # not 14 MIG devices
    (state,) = reading.nodes
    assert [len(g.mig) for g in state.gpus] == [7, 7] and not any(g.locked for g in state.gpus)
    assert reading.adopted["n"].source == "agent"


def test_decide_writes_adopted_layouts_and_leaves_locked_gpus_out_of_the_spec() -> None:
    # GPU 0: 7 x 1g, 3 in use (which unknown: locked); GPU 1: empty. A 3g pod goes to GPU 1;
    # the spec must not list GPU 0 (the agent would try to reshape it).
    ann = {
        "nos.nebuly.com/status-gpu-0-1g.10gb-used": "3",
        "nos.nebuly.com/status-gpu-0-1g.10gb-free": "4",
    }
    n = node("n", 2, {"1g.10gb": 7}, annotations=ann)
    running = [pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(3)]
    np_ = {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": "n", "generation": 1, "resourceVersion": "3", "uid": "np-n"},
        "spec": {"mode": "mig", "gpus": []},
    }
    v = view(n, *running, pod("want", "nvidia.com/mig-3g.40gb"), nps=(np_,))
    config = DecideConfig(CAT, BatchPolicy(timeout=1, idle=1), PlannerSettings(policy=Policy.CPSAT))
    first = decide(ControllerState(), v, 0.0, config)
    second = decide(first.state, v, 5.0, config)
    (write,) = [a for a in second.actions if isinstance(a, WriteSpec)]
    assert [g.index for g in write.spec.gpus] == [1]
    assert [(m.profile, m.start) for m in write.spec.gpus[0].mig] in (
        [("3g.40gb", 0)],
        [("3g.40gb", 4)],
    )
    assert second.snapshot is not None  # what the planner saw: GPU 0 as adopted, locked
    locked = next(n for n in second.snapshot.nodes if n.name == "n").gpus[0]
    assert locked.locked and sum(i.used for i in locked.mig) == 3


def test_an_unreadable_node_gets_its_condition_once_and_keeps_its_partitioning() -> None:
    n = node("n", 1, {"1g.10gb": 1})
    v = view(n, *[pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(2)])
    got = decide(ControllerState(), v, 0.0, DecideConfig(CAT))
    conditions = [a for a in got.actions if isinstance(a, SetNodeCondition)]
    assert [(c.status, c.reason) for c in conditions] == [("False", "UnreadableMigLayout")]
    assert any(
        type(a).__name__ == "CreatePartitioning" for a in got.actions
    )  # the agent can report


def test_an_uneven_split_is_a_guess_and_locked_when_something_is_in_use() -> None:
    # 9 x 1g on 2 GPUs: 7 + 2, 6 + 3, 5 + 4 are all possible.
    v = view(
        node("n", 2, {"1g.10gb": 9}),
        *[pod(f"r{i}", "nvidia.com/mig-1g.10gb", on="n") for i in range(2)],
    )
    gpus = gpus_of(v, "n")
    assert gpus == gpus_of(v, "n")  # the same guess every time
    assert sum(len(g.mig) for g in gpus) == 9 and all(g.locked for g in gpus)
    assert "several ways" in " ".join(read_cluster(v, CAT).adopted["n"].notes)


def test_stale_nos_use_annotations_never_unlock_a_gpu_a_pod_may_use() -> None:
    """nos is gone (step 1 of the migration); a pod ended on GPU 0 and another started on
    GPU 2 meanwhile, the totals unchanged: nos's annotations still say GPU 0.  Trusting them
    left GPU 2 unlocked and read as free, and a plan reshaped it under the running pod."""
    ann = {
        "nos.nebuly.com/status-gpu-0-1g.10gb-used": "1",
        "nos.nebuly.com/status-gpu-2-1g.10gb-free": "1",
    }
    n = node("n", 3, {"1g.10gb": 2}, annotations=ann)
    v = view(n, pod("r", "nvidia.com/mig-1g.10gb", on="n"))
    g0, g1, g2 = gpus_of(v, "n")
    assert g0.locked and g2.locked  # either may hold the running pod's instance
    assert not g1.locked and not g1.mig


def test_a_node_nos_still_partitions_or_labels_that_disagree_are_left_out() -> None:
    """nos is still at work on a node -- a pod of nos runs there, or nos's last plan is not
    applied (its spec and status plan annotations differ) -- or gpuslice's and nos's opt-in
    labels name different modes: such a node is a node problem naming the cause and the fix
    (it was read as plannable: both agents would change the same GPUs, and removing
    gpuslice's label alone left the node opted in as the other mode through nos's)."""
    from partitioner.decide import ControllerState, DecideConfig, decide
    from planner.catalog import default_catalog

    def problems(*objs: dict[str, Any]) -> dict[str, Any]:
        config = DecideConfig(catalog=default_catalog())
        return decide(ControllerState(), view(*objs), 0, config).problems

    assert problems(node("n", 1, {}, annotations={})) == {}
    pending = {
        "nos.nebuly.com/spec-partitioning-plan": "1763899999",
        "nos.nebuly.com/status-partitioning-plan": "1763890211",
    }
    (p,) = problems(node("n", 1, {}, annotations=pending)).values()
    assert p.reason == "NosActive" and "1763899999" in p.message
    done = {**pending, "nos.nebuly.com/status-partitioning-plan": "1763899999"}
    assert problems(node("n", 1, {}, annotations=done)) == {}

    agent = pod("nos-mig-agent-8xk2p", "cpu", on="n")
    agent["metadata"]["labels"] = {"app.kubernetes.io/part-of": "nos"}
    (p,) = problems(node("n", 1, {}, annotations={}), agent).values()
    assert p.reason == "NosActive" and "nos-mig-agent-8xk2p" in p.message

    both = node("n", 1, {}, annotations={})
    both["metadata"]["labels"]["gpuslice.io/partitioning"] = "mps"
    both["metadata"]["labels"]["nos.nebuly.com/gpu-partitioning"] = "mig"
    (p,) = problems(both).values()
    assert p.reason == "ConflictingPartitioningLabels"
    assert "nos.nebuly.com/gpu-partitioning-" in p.message
