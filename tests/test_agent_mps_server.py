"""The MPS server outlives its clients: what the agent may and may not count as "in use".

Read on a real H100 80GB (driver 580.159.04) by ``scripts/mps_smoke.py``; the capture is
``tests/fixtures/hardware/h100-sxm-80gb-580.159.04.mps-smoke.json``:

* while a client runs, NVML's compute-process list names the client *and* the daemon's
  ``nvidia-cuda-mps-server``;
* after the last client ended, the server is still listed (and ``get_server_list`` still names
  it, with ``get_client_list`` empty) until the daemon quits.

The fake control binary (:class:`~node_agent.mps_fake.FakeMpsControl`) is held to that
capture here, and the agent, driven through the production supervisor, must repartition a GPU
(or a hybrid instance) whose pods have ended although the idle server is still on it: an agent
that counted the server as a pod's process kept the GPU "busy" for ever.  A client still
connected keeps everything, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.reconciler import MPS_SERVER
from tests.test_agent_rollout import Node, mps_spec

CAPTURE = (
    Path(__file__).parent / "fixtures" / "hardware" / "h100-sxm-80gb-580.159.04.mps-smoke.json"
)


def mig_spec(mode: str, *instances: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p2",
            "mode": mode,
            "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in instances]}],
        }
    )


def names(node: Node, gpu: int, gi: int | None = None) -> list[str]:
    return sorted(node.nv.process_name(p) for p in node.nv.running_processes(gpu, gi))


def test_the_hardware_capture_shows_an_idle_server_that_the_fake_reproduces(
    tmp_path: Path,
) -> None:
    cap = json.loads(CAPTURE.read_text())
    assert cap["ok"] is True and all(cap["checks"].values())
    busy = [p["name"].rsplit("/", 1)[-1] for p in cap["nvml_processes_8192m"]]
    assert MPS_SERVER in busy and len(busy) == 2  # the client and the server
    idle = cap["after_last_client"]
    assert [p["name"] for p in idle["nvml_processes"]] == [MPS_SERVER]
    assert (
        idle["servers"] == [idle["nvml_processes"][0]["pid"]] and idle["nvml_mps_processes"] == []
    )

    node = Node(tmp_path, "H100-80GB")
    assert node.run(mps_spec([(8192, 25), (16384, 50)])).applied
    client = node.mps.connect(f"{node.root}/gpu0")
    assert names(node, 0) == sorted(["cuda-app", MPS_SERVER])
    node.mps.disconnect(client)
    assert names(node, 0) == [MPS_SERVER]  # idle, still there
    rc, out = node.mps(
        ["nvidia-cuda-mps-control"],
        {"CUDA_MPS_PIPE_DIRECTORY": f"{node.root}/gpu0"},
        "get_server_list\n",
    )
    assert rc == 0 and out.split() == [str(node.nv.running_processes(0)[0])]


def test_an_mps_gpu_whose_pods_ended_switches_to_mig_despite_the_idle_server(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "H100-80GB")  # Hopper: the MIG switch needs no reset
    res = node.run(mps_spec([(20480, 25), (20480, 25)]))
    held = res.devices["nvidia.com/gpu-20gb"][0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env["CUDA_MPS_PIPE_DIRECTORY"])

    to_mig = mig_spec("mig", ("3g.40gb", 0), ("3g.40gb", 4))
    res = node.run(to_mig, gen=2)  # the pod runs: nothing moves
    assert not res.applied and not node.nv.mig_enabled(0) and node.mps.served(f"{node.root}/gpu0")

    node.mps.disconnect(client)
    node.pods.ids = set()
    assert names(node, 0) == [MPS_SERVER]
    for _ in range(3):
        res = node.run(to_mig, gen=2)
        if res.applied:
            break
    assert res.applied, (res.blocks, res.errors)
    assert node.nv.mig_enabled(0) and len(node.nv.instances(0)) == 2
    assert not node.mps.daemons and not node.mps.broken and not node.mps.quit_with_clients
    assert sorted(res.devices) == ["nvidia.com/mig-3g.40gb"]


def test_a_hybrid_instance_whose_pods_ended_is_repartitioned_despite_its_idle_server(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    res = node.run(mig_spec("hybrid", ("3g.40gb", 0), ("3g.40gb", 4)))
    assert res.applied
    at0 = next(
        d
        for d in res.devices["nvidia.com/mig-3g.40gb"]
        if "mig0" in d.env["CUDA_MPS_PIPE_DIRECTORY"]
    )
    node.pods.ids = {at0.id}
    client = node.mps.connect(at0.env["CUDA_MPS_PIPE_DIRECTORY"])
    gi0 = next(g for g, _p, start, _u in node.nv.instances(0) if start == 0)

    wider = mig_spec("hybrid", ("4g.40gb", 0), ("3g.40gb", 4))
    res = node.run(wider, gen=2)
    assert not res.applied and any(g == gi0 for g, *_ in node.nv.instances(0))

    node.mps.disconnect(client)
    node.pods.ids = set()
    assert names(node, 0, gi0) == [MPS_SERVER]
    res = node.run(wider, gen=2)
    assert res.applied, (res.blocks, res.errors)
    layout = sorted((p.name, start) for _g, p, start, _u in node.nv.instances(0))
    assert layout == [("3g.40gb", 4), ("4g.40gb", 0)]
    assert not node.mps.broken and not node.mps.quit_with_clients
    # the new instance at slot 0 has a daemon of its own again, serving the new device
    new0 = next(u[0] for _g, _p, start, u in node.nv.instances(0) if start == 0)
    assert node.mps.daemons[f"{node.root}/gpu0-mig0"].device == new0


def test_a_connected_client_keeps_its_gpu_whatever_the_spec_says(tmp_path: Path) -> None:
    """The other side: a client the kubelet no longer reports (a stale PodResources read) is
    still a process on the GPU, so the daemon stays and nothing is repartitioned."""
    node = Node(tmp_path, "H100-80GB")
    res = node.run(mps_spec([(20480, 25), (20480, 25)]))
    client = node.mps.connect(res.devices["nvidia.com/gpu-20gb"][0].env["CUDA_MPS_PIPE_DIRECTORY"])
    node.pods.ids = set()  # the in-use read misses it
    for _ in range(3):
        res = node.run(mig_spec("mig", ("7g.80gb", 0)), gen=2)
    assert not res.applied and not node.nv.mig_enabled(0)
    assert node.mps.served(f"{node.root}/gpu0") and client not in node.mps.broken
    assert not node.mps.quit_with_clients
