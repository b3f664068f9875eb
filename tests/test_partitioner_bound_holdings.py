"""The controller counts what bound pods hold as the what-if reader does (before the agent reports).

The controller does not adopt a node from the raw pods: :func:`partitioner.ledger.read_gpus`
rebuilds each bound pod from its :class:`~partitioner.index.PodInfo`.  Two holdings were lost
on the way, so the controller planned over devices in use where ``read_cluster`` did not:

* ``nvidia.com/gpu.shared`` -- the replicas of time-sliced whole GPUs that NVIDIA's plugin
  names so under ``renameByDefault`` (shared/facts/gpu-operator.md section 2): the node read
  empty and got a spec reshaping GPUs the pods use, where docs/operations.md promises it is
  left out with ``TimeSlicedBeforeAgent``;
* a bound pod holding ``nvidia.com/gpu`` and a MIG slice (NVIDIA's mixed plugin serves both):
  the refusal of "whole GPUs and slices at once", meant for pods not bound yet, emptied its
  slices, so its instance read free and was promised to another pod.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_partitioner_gpu_operator_reading import gfd_node, read
from test_partitioner_promises import T0, Cluster, events, gated, reservation, running

from partitioner.actions import EmitEvent, PatchPod, SetNodeCondition, WriteSpec
from partitioner.decide import Decision
from partitioner.ledger import read_gpus
from partitioner.snapshot import NodeProblem

SHARED = "nvidia.com/gpu.shared"
SEVEN_G = "nvidia.com/mig-7g.80gb"
THREE_G = "nvidia.com/mig-3g.40gb"
FOUR_G = "nvidia.com/mig-4g.40gb"
STEPS = (0, 15, 30, 61, 75)


def _no_plan(d: Decision) -> None:
    assert not [a for a in d.actions if isinstance(a, WriteSpec)], "planned a node in use"
    assert events(d, "Reserved") == [] and events(d, "Released") == []


# --------------------------------------------------------------------------- nvidia.com/gpu.shared


def time_sliced_node(labelled: bool) -> dict[str, Any]:
    """2 x H100, MIG off, opted in as mig; with ``labelled`` GFD's time-slicing labels too."""
    n = gfd_node("ts", strategy=None, count=2)
    if labelled:
        n["metadata"]["labels"] |= {
            "nvidia.com/gpu.replicas": "4",
            "nvidia.com/gpu.sharing-strategy": "time-slicing",
        }
    n["metadata"]["resourceVersion"] = "1"
    return n


@pytest.mark.parametrize("labelled", [True, False], ids=["replicas-label", "pods-only"])
def test_pods_holding_gpu_shared_keep_their_node_out_of_plans(labelled: bool) -> None:
    node = time_sliced_node(labelled)
    pods = [running(f"ts-{i}", "ts", SHARED) for i in range(2)]
    c = Cluster(node, *pods, gated("want", SEVEN_G, created=T0 - 5))
    told: list[str] = []
    for t in STEPS:
        d = c.step(T0 + t)
        _no_plan(d)
        told += [a.reason for a in d.actions if isinstance(a, SetNodeCondition) and a.node == "ts"]
        told += [a.reason for a in d.actions if isinstance(a, EmitEvent)]
    assert reservation(c, "want") is None
    assert "TimeSlicedBeforeAgent" in told


@pytest.mark.parametrize("labelled", [True, False], ids=["replicas-label", "pods-only"])
def test_the_controller_reads_a_gpu_shared_node_as_the_what_if_does(labelled: bool) -> None:
    node = time_sliced_node(labelled)
    pods = [running(f"ts-{i}", "ts", SHARED) for i in range(2)]
    what_if = read(node, *pods).problems["ts"]
    index = Cluster(node, *pods).index()
    got = read_gpus(index, index.nodes["ts"])
    assert isinstance(got, NodeProblem), got
    assert (got.reason, got.message) == (what_if.reason, what_if.message)
    assert got.reason == "TimeSlicedBeforeAgent"
    assert f"pods hold {SHARED}" in got.message or "nvidia.com/gpu.replicas=4" in got.message


# --------------------------------------------------------------------------- whole GPU + slice


def mixed_node() -> dict[str, Any]:
    """2 x H100 under GFD's mixed strategy: GPU 0 holds 4g.40gb + 3g.40gb, GPU 1 MIG off."""
    n = gfd_node("mx", strategy="mixed", count=2)
    del n["metadata"]["labels"]["nvidia.com/mig.config"]
    del n["metadata"]["labels"]["nvidia.com/mig.config.state"]
    for profile in ("4g.40gb", "3g.40gb"):
        n["metadata"]["labels"][f"nvidia.com/mig-{profile}.count"] = "1"
        for part in ("capacity", "allocatable"):
            n["status"][part][f"nvidia.com/mig-{profile}"] = "1"
    n["metadata"]["resourceVersion"] = "1"
    return n


def test_a_bound_pod_holding_a_whole_gpu_and_a_slice_keeps_its_slice() -> None:
    both = running("both", "mx", "nvidia.com/gpu", THREE_G)
    c = Cluster(mixed_node(), both, running("four", "mx", FOUR_G))
    info = c.index().pods["ns/both"]
    assert dict(info.slices) == {THREE_G: 1} and info.whole_gpus == 1
    assert info.request_error == ""
    assert c.index().usage("mx").slices == {THREE_G: 1, FOUR_G: 1}


def test_a_slice_a_bound_pod_holds_beside_a_whole_gpu_is_not_promised_again() -> None:
    both = running("both", "mx", "nvidia.com/gpu", THREE_G)
    node = mixed_node()
    what_if = read(node, both, running("four", "mx", FOUR_G))
    assert all(g.locked for g in what_if.nodes[0].gpus)
    c = Cluster(node, both, running("four", "mx", FOUR_G), gated("want", THREE_G, created=T0 - 5))
    for t in STEPS[:4]:
        d = c.step(T0 + t)
        _no_plan(d)
        assert not [
            a for a in d.actions if isinstance(a, PatchPod) and a.pod == "ns/want" and a.on_success
        ]
    assert reservation(c, "want") is None
    assert "schedulingGates" in c.pod("want")["spec"]
