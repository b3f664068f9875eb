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
