"""A DRA node's GPU a whole-GPU claim holds stays a whole GPU in the spec (a review's finding:
the agent's used full-size placement, copied into the spec, became a real 7g instance)."""

from __future__ import annotations

from test_partitioner_dra import (
    DRA,
    OURS,
    T0,
    Cluster,
    allocated,
    bound_claim_pod,
    claim,
    claim_pod,
    mig_request,
)
from test_partitioner_promises import applied_np, status_gpu
from test_partitioner_snapshot import node

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.dra_shape import planned_devices, publish_set
from node_agent.dra_slices import DraGpu
from partitioner.actions import WriteSpec
from planner.catalog import default_catalog

WHOLE = {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuslice.io"}}


def test_a_gpu_held_whole_is_written_without_instances_and_published_whole_after() -> None:
    np_obj = applied_np("d1", status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1))
    np_obj["spec"]["gpus"] = []
    c = Cluster(
        node("d1", DRA),
        np_obj,
        allocated(claim("w", WHOLE), (OURS, "d1", "gpu0")),
        bound_claim_pod("bw", "w", "d1"),
        claim_pod("p", "cl"),
        claim("cl", mig_request()),
    )
    c.step(T0)
    d = c.step(T0 + 61)
    (write,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    layout = {g.index: [(m.profile, m.start) for m in g.mig] for g in write.spec.gpus}
    assert layout.get(0, []) == [], layout  # no 7g.80gb@0 from the whole-GPU report
    assert layout[1], layout  # the MIG claim's placement is planned on the other GPU
    # once the whole-GPU claim ends, the agent publishes GPU 0 whole again
    a100 = default_catalog().model("A100-SXM4-80GB")
    gpus = [DraGpu(0, "GPU-0", a100), DraGpu(1, "GPU-1", a100)]
    spec = NodePartitioningSpec.model_validate(write.spec.model_dump())
    planned, _ = planned_devices(gpus, spec)
    assert "gpu0" in publish_set(planned, allocated=set())


def test_a_gated_pod_naming_a_claim_that_does_not_exist_is_told_and_given_back() -> None:
    """A typo in ``resourceClaimName`` (or a template whose claim is never made): the pod
    asked for nothing readable, so no step looked at it again -- gated for good, no Event,
    and kube-scheduler, which would report the missing claim, never saw it."""
    from test_partitioner_snapshot import np as np_obj

    from partitioner.actions import EmitEvent, PatchPod

    template = claim_pod("tpl", "x")
    template["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "mig-3g"}]
    c = Cluster(
        node("d1", DRA),
        np_obj("d1"),
        claim_pod("typo", "gpu-claim-tpyo"),
        claim("gpu-claim", mig_request()),
        template,
    )
    told: dict[str, list[str]] = {}
    ungated: dict[str, str] = {}
    for t in range(0, 300, 30):
        d = c.step(T0 + t)
        for a in d.actions:
            if isinstance(a, EmitEvent) and a.reason == "WaitingForClaims":
                told.setdefault(a.ref.name, []).append(a.message)
            if isinstance(a, PatchPod) and a.purpose == "ungate":
                ungated[a.pod] = a.on_success[0].message
    assert told["typo"] == [
        "cannot be planned yet: ResourceClaim ns/gpu-claim-tpyo, which does not exist"
    ]
    assert "ResourceClaimTemplate ns/mig-3g (not created yet" in told["tpl"][0]
    assert len(told["tpl"]) == 1
    assert set(ungated) == {"ns/typo", "ns/tpl"}
    assert "kube-scheduler reports the missing claim" in ungated["ns/typo"]
    assert "schedulingGates" not in c.pod("typo")["spec"]
