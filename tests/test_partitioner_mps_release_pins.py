"""A released MPS pod may be given any free slice of its size: none of them is planned away.

The kubelet allocates from the agent's preferred allocation, which packs onto the GPU with the
fewest free slices of the size, not the GPU the reservation expects (MPS slices count no compute
for the ledger to follow).  Until the pod binds, every free slice of that size is pinned, on
every GPU: a plan written in the release's step dropped GPU 1's free slice, which the kubelet
then gave the pod (the agent refused the spec, ``SliceInUse``).
"""

from __future__ import annotations

from typing import Any

from test_partitioner_promises import CONFIG, T0, Cluster, events, gated, reservation, running
from test_partitioner_snapshot import A100, node
from test_partitioner_snapshot import np as np_obj

from contract.nodepartitioning import NodePartitioning
from node_agent.deviceplugin import preferred_allocation
from node_agent.devices import advertised_devices, mps_slice_id
from partitioner.actions import WriteSpec
from planner.catalog import default_catalog
from planner.mps import thread_percentage
from planner.settings import PlannerSettings

CAT = default_catalog()
SET = PlannerSettings()
GIB = 1024
MPS_A100 = {"gpuslice.io/partitioning": "mps", **A100}
UUIDS = {
    0: "GPU-ffff0000-0000-0000-0000-000000000000",
    1: "GPU-aaaa1111-0000-0000-0000-000000000000",
}
TEN, FORTY = "nvidia.com/gpu-10gb", "nvidia.com/gpu-40gb"


def _gpu(index: int, *slices: tuple[int, bool]) -> dict[str, Any]:
    usable = CAT.model("A100-SXM4-80GB").memory_mib - SET.mps_reserve_mib
    out = []
    for k, (gb, used) in enumerate(slices):
        pct = thread_percentage(gb * GIB, usable, SET.mps_thread_policy)
        out.append(
            {
                "memoryMiB": gb * GIB,
                "activeThreadPercentage": pct,
                "deviceId": mps_slice_id(UUIDS[index], k, gb * GIB, pct),
                "used": used,
            }
        )
    return {
        "index": index,
        "uuid": UUIDS[index],
        "model": "A100-SXM4-80GB",
        "migEnabled": False,
        "mps": out,
    }


def _np(*gpus: dict[str, Any]) -> dict[str, Any]:
    obj = np_obj(
        "n1", plan="1", generation=2, observed=2, applied=True, gpus=list(gpus), mode="mps"
    )
    obj["spec"]["gpus"] = [
        {
            "index": g["index"],
            "mps": [
                {"memoryMiB": s["memoryMiB"], "activeThreadPercentage": s["activeThreadPercentage"]}
                for s in g["mps"]
            ],
        }
        for g in gpus
    ]
    return obj


def test_a_plan_in_the_release_step_keeps_every_free_slice_of_the_released_size() -> None:
    g0 = _gpu(0, (50, True), (10, False), (10, False))  # the ledger expects p here
    g1 = _gpu(1, (30, True), (10, False), (20, False))  # the kubelet gives p this GPU's 10
    npo = _np(g0, g1)
    n1 = node("n1", MPS_A100)
    devs = advertised_devices(
        NodePartitioning.model_validate(npo).status.gpus,  # type: ignore[union-attr]
        mps_pipe_root="/run/gpuslice/mps",
    )
    n1["status"]["allocatable"].update(
        {r: str(sum(d.healthy for d in ds)) for r, ds in devs.items()}
    )
    c = Cluster(
        n1,
        npo,
        running("r50", "n1", "nvidia.com/gpu-50gb"),
        running("r30", "n1", "nvidia.com/gpu-30gb"),
        gated("q", FORTY, created=T0),
    )
    c.step(T0, CONFIG)  # opens q's batch window
    c.put(gated("p", TEN, created=T0 + 10.5))
    d = c.step(T0 + 11, CONFIG)
    assert events(d, "Released")  # p released to a free 10 GiB slice
    by_id = {x.id: x for x in devs[TEN] if x.healthy}
    (pick,) = preferred_allocation(list(by_id), [], 1, lambda i: by_id[i].gpu)
    assert pick.startswith(UUIDS[1])  # the kubelet's choice: GPU 1, not the expected GPU 0
    for a in d.actions:  # no spec of this step drops a free 10 GiB slice of GPU 1
        if isinstance(a, WriteSpec):
            for g in a.spec.gpus:
                if g.index == 1:
                    assert 10 * GIB in [s.memoryMiB for s in g.mps], g
    r = reservation(c, "p")
    assert r is not None and r.state.value == "released"
