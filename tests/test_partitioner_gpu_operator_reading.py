"""How gpuslice reads nodes labelled by a real GPU Operator (GFD v0.17+, operator v25+).

Nodes carry the full label set GFD and the operator write (``cuda.*``, every
``gpu.deploy.*``, ``mig.capable``, ``replicas``, ``sharing-strategy``): shared/facts/
gpu-operator.md sections 1 and 3.  Each test pins one misreading a review reproduced:

* under ``mig.strategy=single`` the agent's GPU count (NVML) wins over the annotation and the
  MIG manager's stale ``mig.config`` once it has reported; a disagreeing one is named;
* ``-MIG-INVALID`` honours the ``gpuslice.io/gpu-count`` annotation its own problem asks for;
* a deleted (not ``false``) operand deploy label on an operator-managed node is read as on;
* single-strategy nodes warn that GFD relabels the product, and a pod refused for selecting
  the product it had is told so.
"""

from __future__ import annotations

import copy
from typing import Any

from test_partitioner_promises import CONFIG

from partitioner.actions import EmitEvent
from partitioner.adoption import adopt
from partitioner.decide import ControllerState, decide
from partitioner.index import ClusterIndex
from partitioner.node_labels import (
    SINGLE_RELABELS,
    GpuLabels,
    LabelProblem,
    read_gpu_labels,
    with_operands_off,
)
from partitioner.rejection import product_selector_hint
from partitioner.snapshot import ClusterReading, NodeProblem, read_kubectl_list, read_node
from planner.catalog import default_catalog
from planner.snapshot import Mode

CAT = default_catalog()
H100 = "NVIDIA-H100-80GB-HBM3"
DEPLOY = (
    "container-toolkit",
    "dcgm",
    "dcgm-exporter",
    "driver",
    "gpu-feature-discovery",
    "node-status-exporter",
    "operator-validator",
)


def gfd_node(
    name: str,
    *,
    strategy: str | None = "single",
    product: str = H100,
    count: int = 8,
    memory: int = 81559,
    mig_config: str = "all-disabled",
    annotations: dict[str, str] | None = None,
    operands_off: bool = True,
) -> dict[str, Any]:
    """A Node as the GPU Operator and GFD label it, opted in to gpuslice as ``mig``."""
    labels = {
        "kubernetes.io/hostname": name,
        "nvidia.com/cuda.driver-version.full": "570.124.06",
        "nvidia.com/cuda.runtime-version.full": "12.8",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.machine": "PowerEdge-XE9680",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.memory": str(memory),
        "nvidia.com/mig.config": mig_config,
        "nvidia.com/mig.config.state": "success",
        "gpuslice.io/partitioning": "mig",
        **{f"nvidia.com/gpu.deploy.{op}": "true" for op in DEPLOY},
    }
    if operands_off:
        labels["nvidia.com/gpu.deploy.mig-manager"] = "false"
        labels["nvidia.com/gpu.deploy.device-plugin"] = "false"
    if strategy is not None:
        labels["nvidia.com/mig.strategy"] = strategy
    capacity = {"cpu": "224", "memory": "2113405Mi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": dict(annotations or {})},
        "spec": {},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def partitioning(name: str, per_gpu: list[list[tuple[int, bool]]]) -> dict[str, Any]:
    """A NodePartitioning whose agent reports GPUs ``0..len(per_gpu)-1``, each holding
    1g.10gb instances at the given (start, used)."""
    return {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": name, "generation": 3},
        "spec": {
            "planId": "5",
            "mode": "mig",
            "gpus": [
                {"index": i, "mig": [{"profile": "1g.10gb", "start": s} for s, _ in mig]}
                for i, mig in enumerate(per_gpu)
            ],
        },
        "status": {
            "observedGeneration": 3,
            "planId": "5",
            "conditions": [
                {"type": "Applied", "status": "True", "reason": "Applied", "observedGeneration": 3}
            ],
            "gpus": [
                {
                    "index": i,
                    "uuid": f"GPU-{i}",
                    "model": "H100-80GB",
                    "migEnabled": True,
                    "mig": [
                        {"profile": "1g.10gb", "start": s, "deviceId": f"MIG-{i}-{s}", "used": u}
                        for s, u in mig
                    ],
                }
                for i, mig in enumerate(per_gpu)
            ],
        },
    }


def pod(name: str, requests: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": "u-" + name},
        "spec": {
            "containers": [{"name": "c", "resources": {"requests": requests, "limits": requests}}],
            **spec,
        },
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }


def read(*items: dict[str, Any]) -> ClusterReading:
    return read_kubectl_list({"apiVersion": "v1", "kind": "List", "items": list(items)}, CAT)


def single_node(annotations: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    """Single strategy still valid after gpuslice's agent made 4 + 3 x 1g.10gb on 2 GPUs."""
    return gfd_node(
        "h100-0",
        product=f"{H100}-MIG-1g.10gb",
        count=7,
        memory=9984,
        annotations=annotations,
        **kw,
    )


FOUR_USED_THREE_FREE = [[(s, True) for s in range(4)], [(s, False) for s in range(3)]]


# --------------------------------------------------------------------------- 1. agent's count


def test_single_the_agents_count_beats_a_stale_mig_config() -> None:
    """``mig.config=all-1g.10gb`` (state success) stays on a gpuslice node forever (the MIG
    manager is off there); with 7 devices it read as 1 GPU and dropped the agent's GPU 1."""
    reading = read(
        single_node(mig_config="all-1g.10gb"),
        partitioning("h100-0", FOUR_USED_THREE_FREE),
        pod("want-4g", {"nvidia.com/mig-4g.40gb": "1"}),
    )
    assert not reading.problems
    assert reading.gpu_nodes["h100-0"].gpu_count == 2
    (state,) = reading.nodes
    assert [g.index for g in state.gpus] == [0, 1]
    assert [(m.profile, m.start, m.used) for m in state.gpus[1].mig] == [
        ("1g.10gb", 0, False),
        ("1g.10gb", 1, False),
        ("1g.10gb", 2, False),
    ]
    notes = reading.adopted["h100-0"].notes
    assert notes[0] == "GPU count 2 from the agent's NodePartitioning status (NVML)"
    (mismatch,) = [n for n in notes if "disagree" in n or "the agent reports 2" in n]
    assert "nvidia.com/mig.config=all-1g.10gb" in mismatch
    assert (
        "kubectl label node h100-0 nvidia.com/mig.config- nvidia.com/mig.config.state-" in mismatch
    )


def test_single_the_agents_count_beats_an_annotation_that_says_fewer() -> None:
    reading = read(
        single_node({"gpuslice.io/gpu-count": "1"}, mig_config="all-balanced"),
        partitioning("h100-0", FOUR_USED_THREE_FREE),
    )
    assert not reading.problems
    assert [g.index for g in reading.nodes[0].gpus] == [0, 1]
    (mismatch,) = [n for n in reading.adopted["h100-0"].notes if "the agent reports 2" in n]
    assert "labels give 1 GPU(s) (annotation gpuslice.io/gpu-count)" in mismatch
    assert "kubectl annotate node h100-0 gpuslice.io/gpu-count-" in mismatch


def test_single_an_annotation_that_says_more_invents_no_gpu() -> None:
    """annotation=3, the agent reports 2 full GPUs: a 7g pod was planned on GPU 2, which does
    not exist (the agent answers NoSuchGpu and the reservation is stuck)."""
    full = [[(s, True) for s in range(7)], [(s, True) for s in range(7)]]
    node = single_node({"gpuslice.io/gpu-count": "3"}, mig_config="all-balanced")
    node["metadata"]["labels"]["nvidia.com/gpu.count"] = "14"
    reading = read(
        node, partitioning("h100-0", full), pod("want-7g", {"nvidia.com/mig-7g.80gb": "1"})
    )
    assert not reading.problems
    assert reading.gpu_nodes["h100-0"].gpu_count == 2
    assert [g.index for g in reading.nodes[0].gpus] == [0, 1]
    assert any("labels give 3 GPU(s)" in n for n in reading.adopted["h100-0"].notes)


def test_single_an_agreeing_count_adds_no_note() -> None:
    reading = read(
        single_node({"gpuslice.io/gpu-count": "2"}),
        partitioning("h100-0", FOUR_USED_THREE_FREE),
    )
    notes = reading.adopted["h100-0"].notes
    assert reading.gpu_nodes["h100-0"].gpu_count == 2
    assert not any("the agent reports" in n for n in notes), notes


def test_mixed_the_agents_count_beats_gfds_and_the_difference_is_named() -> None:
    """The agent lists every GPU NVML shows (an unreadable one from its last state), so a
    GFD ``gpu.count`` above it names a GPU that is gone or of a model GFD did not count; the
    plan put a 7g on such a GPU 1 that did not exist (a review's r2b).  The agent's count is
    used under ``mixed`` too, and the label's named in a note."""
    node = gfd_node("h100-0", strategy="mixed", count=2)
    labels = read_gpu_labels(node["metadata"]["labels"], {}, CAT, "h100-0")
    assert isinstance(labels, GpuLabels)
    from contract.nodepartitioning import NodePartitioning

    np = NodePartitioning.model_validate(partitioning("h100-0", [[(0, False)]]))
    got = adopt(node, Mode.MIG, labels, np, (), CAT)
    assert not isinstance(got, LabelProblem)
    assert got.gpu_count == 1 and [g.index for g in got.gpus] == [0] and got.source == "agent"
    assert got.notes[0].startswith("GPU count 1 from the agent's NodePartitioning status")
    assert any("label nvidia.com/gpu.count" in n and "reports 1" in n for n in got.notes)


def test_a_reported_gpu_of_a_model_the_catalog_does_not_know_keeps_the_node_out() -> None:
    """A display GPU at index 0 beside A100s: GFD labels and counts the A100s only; the
    agent names the other by its NVML name.  Skipped as unknown, it was planned as an A100
    (a 7g on the display GPU) while a real A100 fell out of every plan (a review's r2)."""
    node = gfd_node("h100-0", strategy="mixed", count=2)
    labels = read_gpu_labels(node["metadata"]["labels"], {}, CAT, "h100-0")
    assert isinstance(labels, GpuLabels)
    from contract.nodepartitioning import NodePartitioning

    raw = partitioning("h100-0", [[], [(0, False)]])
    raw["status"]["gpus"][0]["model"] = "NVIDIA T400 4GB"
    np = NodePartitioning.model_validate(raw)
    got = adopt(node, Mode.MIG, labels, np, (), CAT)
    assert isinstance(got, LabelProblem) and got.reason == "MixedGpuModels"
    assert "GPU 0 as 'NVIDIA T400 4GB', a model the GPU catalog does not know" in got.message
    assert "kubectl label node h100-0 gpuslice.io/partitioning-" in got.message


def test_compute_instance_devices_wait_for_the_agent_then_its_report_rules() -> None:
    """GFD names a device whose compute instance is smaller than its GPU instance
    ``1c.3g.40gb``.  Read as a profile, it shut the node out for good with advice to add it to
    the catalog (a review's r3).  Before the agent reports, how many GPU instances hold such
    devices is unknown: the node waits for the report; after it, the report rules."""
    node = gfd_node("h100-0", strategy="mixed", count=2)
    node["metadata"]["labels"]["nvidia.com/mig-1c.3g.40gb.count"] = "3"
    node["metadata"]["labels"]["nvidia.com/mig-4g.40gb.count"] = "1"
    labels = read_gpu_labels(node["metadata"]["labels"], {}, CAT, "h100-0")
    assert isinstance(labels, GpuLabels)
    assert labels.split_devices == ("nvidia.com/mig-1c.3g.40gb.count",)
    assert labels.mig_devices == {"4g.40gb": 1}
    before = adopt(node, Mode.MIG, labels, None, (), CAT)
    assert isinstance(before, LabelProblem) and before.reason == "ComputeInstancesBeforeAgent"
    assert "nvidia.com/mig-1c.3g.40gb.count" in before.message and "catalog" not in before.message
    from contract.nodepartitioning import NodePartitioning

    np = NodePartitioning.model_validate(partitioning("h100-0", [[(0, True)], []]))
    after = adopt(node, Mode.MIG, labels, np, (), CAT)
    assert not isinstance(after, LabelProblem) and after.gpu_count == 2
    # a compute-instance name of a GPU instance the model does not have is still refused
    node["metadata"]["labels"]["nvidia.com/mig-1c.5g.50gb.count"] = "1"
    bad = read_gpu_labels(node["metadata"]["labels"], {}, CAT, "h100-0")
    assert isinstance(bad, LabelProblem) and bad.reason == "UnknownMigProfile"


def test_a_node_gfd_labels_mig_incapable_is_not_planned_as_mig() -> None:
    """``nvidia.com/mig.capable=false`` (NVML: MIG unsupported, e.g. a VM without MIG) was
    ignored: only the catalog's flag was read, and an H100 there was planned as MIG."""
    node = gfd_node("h100-vm", strategy="mixed", count=1)
    node["metadata"]["labels"]["nvidia.com/mig.capable"] = "false"
    got = read_node(node, CAT)
    assert isinstance(got, NodeProblem) and got.reason == "MigNotSupported"
    assert "nvidia.com/mig.capable=false" in got.message and "use mode mps" in got.message
    node["metadata"]["labels"]["gpuslice.io/partitioning"] = "mps"
    assert not isinstance(read_node(node, CAT), NodeProblem)


# --------------------------------------------------------------------------- 2. -MIG-INVALID


def test_invalid_single_reads_the_count_annotation() -> None:
    node = gfd_node(
        "h100-0",
        product=f"{H100}-MIG-INVALID",
        count=0,
        memory=0,
        mig_config="all-balanced",
        annotations={"gpuslice.io/gpu-count": "8"},
    )
    reading = read(node, pod("p", {"nvidia.com/mig-1g.10gb": "1"}))
    assert not reading.problems, reading.problems
    assert reading.gpu_nodes["h100-0"].gpu_count == 8
    assert len(reading.nodes[0].gpus) == 8
    assert "default/p" in reading.candidates
    labels = reading.gpu_nodes["h100-0"].labels
    assert labels is not None and labels.mig_devices is None
    assert labels.count_source == "annotation gpuslice.io/gpu-count"


def test_invalid_single_refuses_a_bad_count_annotation() -> None:
    labels = {"nvidia.com/gpu.product": f"{H100}-MIG-INVALID", "nvidia.com/mig.strategy": "single"}
    got = read_gpu_labels(labels, {"gpuslice.io/gpu-count": "eight"}, CAT)
    assert isinstance(got, LabelProblem) and got.reason == "InvalidGpuLabels"
    assert "gpuslice.io/gpu-count='eight'" in got.message
    without = read_gpu_labels(labels, {}, CAT)
    assert isinstance(without, GpuLabels) and without.gpu_count is None


# --------------------------------------------------------------------------- 3. deploy labels


def test_a_deleted_operand_label_on_an_operator_node_is_read_as_on() -> None:
    node = gfd_node("h100-0", strategy="mixed", operands_off=False)
    reading = read(node, pod("p", {"nvidia.com/mig-3g.40gb": "1"}))
    problem = reading.problems["h100-0"]
    assert problem.reason == "MigManagerEnabled"
    assert "nvidia.com/gpu.deploy.mig-manager is missing" in problem.message
    assert "nvidia.com/gpu.deploy.device-plugin is missing" in problem.message
    assert "puts it back as true" in problem.message
    assert (
        "kubectl label node h100-0 nvidia.com/gpu.deploy.mig-manager=false "
        "nvidia.com/gpu.deploy.device-plugin=false --overwrite" in problem.message
    )
    assert not reading.candidates


def test_a_missing_mig_manager_label_on_a_node_that_is_not_mig_capable_is_fine() -> None:
    """The operator adds ``mig-manager=true`` only to MIG-capable nodes; the device plugin's
    label comes back everywhere."""
    labels = dict(gfd_node("l4", strategy=None, operands_off=False)["metadata"]["labels"])
    labels |= {
        "nvidia.com/mig.capable": "false",
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "nvidia.com/gpu.memory": "23034",
    }
    got = read_gpu_labels(labels, {}, CAT, "l4")
    assert isinstance(got, LabelProblem) and got.reason == "NvidiaDevicePluginEnabled"
    assert "mig-manager" not in got.message
    labels["nvidia.com/gpu.deploy.device-plugin"] = "false"
    assert isinstance(read_gpu_labels(labels, {}, CAT, "l4"), GpuLabels)


def test_missing_operand_labels_without_the_operator_are_fine() -> None:
    bare = {"nvidia.com/gpu.product": H100, "nvidia.com/gpu.count": "8"}
    assert isinstance(read_gpu_labels(bare, {}, CAT), GpuLabels)
    # gpu.deploy.operands=false: the operator strips every deploy label and adds none back
    stripped = bare | {"nvidia.com/gpu.deploy.operands": "false"}
    assert isinstance(read_gpu_labels(stripped, {}, CAT), GpuLabels)
    # without mig.capable the operator goes by the product name (a100/h100/a30)
    managed = bare | {
        "nvidia.com/gpu.deploy.driver": "true",
        "nvidia.com/gpu.deploy.device-plugin": "false",
    }
    got = read_gpu_labels(managed, {}, CAT)
    assert isinstance(got, LabelProblem) and got.reason == "MigManagerEnabled"


def test_with_operands_off_writes_the_missing_labels_as_false() -> None:
    node = gfd_node("h100-0", strategy="mixed", operands_off=False)
    fixed, notes = with_operands_off(node)
    labels = fixed["metadata"]["labels"]
    assert labels["nvidia.com/gpu.deploy.mig-manager"] == "false"
    assert labels["nvidia.com/gpu.deploy.device-plugin"] == "false"
    assert "nvidia.com/gpu.deploy.mig-manager" not in node["metadata"]["labels"]  # a copy
    assert len(notes) == 2 and all("it is missing" in n for n in notes)
    assert isinstance(read_gpu_labels(labels, {}, CAT, "h100-0"), GpuLabels)


# --------------------------------------------------------------------------- 4. product relabel


def test_single_strategy_nodes_warn_that_gfd_relabels_the_product() -> None:
    for product, count in ((f"{H100}-MIG-1g.10gb", 7), (f"{H100}-MIG-INVALID", 0), (H100, 8)):
        labels = gfd_node("n", product=product, count=count)["metadata"]["labels"]
        got = read_gpu_labels(labels, {"gpuslice.io/gpu-count": "1"}, CAT, "n")
        assert isinstance(got, GpuLabels), (product, got)
        assert SINGLE_RELABELS in got.notes, product
    mixed = read_gpu_labels(gfd_node("n", strategy="mixed")["metadata"]["labels"], {}, CAT, "n")
    assert isinstance(mixed, GpuLabels) and SINGLE_RELABELS not in mixed.notes
    assert "mig.strategy=mixed" in SINGLE_RELABELS


def test_a_pod_selecting_the_product_single_relabelled_is_told_why() -> None:
    """gpuslice planned the pod on the plain H100 product; after the agent reshaped GPU 0 GFD
    relabelled it -MIG-INVALID and the pod matched no node."""
    node = gfd_node("h100-0", product=f"{H100}-MIG-INVALID", count=0)
    node["metadata"]["annotations"]["gpuslice.io/gpu-count"] = "8"
    p = pod("p", {"nvidia.com/mig-3g.40gb": "1"}, nodeSelector={"nvidia.com/gpu.product": H100})
    reading = read(node, p)
    assert reading.rejected["default/p"].startswith("no eligible node")
    hint = product_selector_hint(p, [node])
    assert reading.rejected["default/p"].endswith(hint)  # plan --snapshot says it
    index = ClusterIndex.from_objects(CAT, [node], [p], [])
    d = decide(ControllerState(), index, 1e9, CONFIG)
    told = [e.message for e in d.actions if isinstance(e, EmitEvent) and e.reason == "Unplaceable"]
    assert told and told[0].endswith(hint)  # and so does the controller's Event
    assert f"selects nvidia.com/gpu.product={H100}" in hint
    assert f"node h100-0 is now labelled {H100}-MIG-INVALID" in hint
    assert "mig.strategy=mixed" in hint
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100]}
                        ]
                    }
                ]
            }
        }
    }
    assert "node h100-0" in product_selector_hint(pod("q", {}, affinity=affinity), [node])


def test_no_product_hint_where_the_product_is_not_the_cause() -> None:
    node = gfd_node("h100-0", product=f"{H100}-MIG-INVALID", count=0)
    selects = {"nvidia.com/gpu.product": H100}
    assert product_selector_hint(pod("p", {}), [node]) == ""  # selects no product
    mixed = copy.deepcopy(node)
    mixed["metadata"]["labels"]["nvidia.com/mig.strategy"] = "mixed"
    assert product_selector_hint(pod("p", {}, nodeSelector=selects), [mixed]) == ""
    other = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert product_selector_hint(pod("p", {}, nodeSelector=other), [node]) == ""
    # another selector term the node does not meet either: the product is not the only cause
    zone = selects | {"topology.kubernetes.io/zone": "b"}
    assert product_selector_hint(pod("p", {}, nodeSelector=zone), [node]) == ""


# --------------------------------------------------------------------------- 5. time-slicing


def running(name: str, node: str, requests: dict[str, str]) -> dict[str, Any]:
    p = pod(name, requests, nodeName=node)
    p["status"] = {"phase": "Running"}
    return p


def sliced_problem(reading: ClusterReading, node: str) -> str:
    problem = reading.problems[node]
    assert problem.reason == "TimeSlicedBeforeAgent", problem
    assert "wait for its report" in problem.message
    assert "catalog override" not in problem.message
    return problem.message


def test_time_sliced_single_node_is_not_read_as_too_many_instances() -> None:
    """replicas=4 under single: 60 pods share 56 x 1g.10gb; read as 60 instances on 56."""
    node = gfd_node(
        "a", product=f"{H100}-MIG-1g.10gb-SHARED", count=56, memory=9984, mig_config="all-1g.10gb"
    )
    node["metadata"]["labels"] |= {
        "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
    }
    pods = [running(f"ts{i}", "a", {"nvidia.com/gpu": "1"}) for i in range(60)]
    message = sliced_problem(read(node, *pods), "a")
    assert (
        "label nvidia.com/gpu.replicas=4, nvidia.com/gpu.sharing-strategy=time-slicing" in message
    )
    assert "default/ts0, default/ts1, default/ts2 and 57 more" in message


def test_time_sliced_whole_gpus_are_not_read_as_more_gpus_than_the_node_has() -> None:
    node = gfd_node("b", strategy=None, product=f"{H100}-SHARED", count=8)
    node["metadata"]["labels"]["nvidia.com/gpu.replicas"] = "4"
    pods = [running(f"ts{i}", "b", {"nvidia.com/gpu": "1"}) for i in range(10)]
    assert "nvidia.com/gpu.replicas=4" in sliced_problem(read(node, *pods), "b")


def test_renamed_shared_resources_are_replicas_not_profiles() -> None:
    """renameByDefault: ``nvidia.com/mig-1g.10gb.shared`` was 'not a profile ... name it so in
    a catalog override file'; ``nvidia.com/gpu.shared`` was not read at all (GPUs free)."""
    node = gfd_node("c", strategy="mixed", count=1)
    node["metadata"]["labels"]["nvidia.com/mig-1g.10gb.count"] = "7"
    got = read(node, running("x", "c", {"nvidia.com/mig-1g.10gb.shared": "1"}))
    assert "pods hold nvidia.com/mig-1g.10gb.shared" in sliced_problem(got, "c")
    plain = gfd_node("d", strategy=None, count=2)
    got = read(plain, running("y", "d", {"nvidia.com/gpu.shared": "1"}))
    assert "pods hold nvidia.com/gpu.shared" in sliced_problem(got, "d")


def test_time_slicing_labels_without_pods_on_the_devices_are_fine() -> None:
    node = gfd_node("b", strategy=None, product=f"{H100}-SHARED", count=8)
    node["metadata"]["labels"]["nvidia.com/gpu.replicas"] = "4"
    reading = read(node, running("cpu", "b", {"cpu": "1"}))
    assert not reading.problems and reading.gpu_nodes["b"].gpu_count == 8
    node["metadata"]["labels"]["nvidia.com/gpu.replicas"] = "1"  # no sharing: a whole GPU
    reading = read(node, running("w", "b", {"nvidia.com/gpu": "1"}))
    assert not reading.problems and all(g.locked for g in reading.nodes[0].gpus)
