"""An agent rollout (the agent pod replaced, same node, same NodePartitioning) on the fake node.

The node: fake GPUs (:class:`~node_agent.nvml_fake.FakeNvml`), the production MPS supervisor
(:class:`~node_agent.mps.MpsControlSupervisor`) driving an emulated ``nvidia-cuda-mps-control``
(:class:`~node_agent.mps_fake.FakeMpsControl`) whose daemons are host processes, pods that hold
devices (in-use ids) and MPS clients connected to the daemons.  A "new agent" is a new
supervisor and a new reconciler: nothing of the old one's memory survives.

* Daemons that outlive the agent (they run outside the agent's container) are adopted: no
  second ``-d``, no ``quit``, limits sent again, clients untouched, no NVML call that changes
  anything, the same device ids advertised, the slices pods hold reported used.
* MIG instances and their pods are untouched by a rollout whatever runs where.
* Daemons that die with the agent's container (the chart today: they run in it) leave their
  clients broken -- what docs/operations.md says a rollout does to MPS pods -- and the new
  agent starts them again for new clients, without touching the layout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.agent import Agent, InMemorySpecSource
from node_agent.devices import AdvertisedDevice, parse_mps_slice_id
from node_agent.mps import MpsControlSupervisor
from node_agent.mps_fake import FakeMpsControl
from node_agent.nvml import ComputeMode
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler, ReconcileResult
from planner.catalog import default_catalog

CAT = default_catalog()


class Pods:
    """In-use source: the device ids pods hold."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    async def in_use_device_ids(self) -> set[str]:
        return set(self.ids)


class Node:
    """One fake GPU node whose agent can be replaced (see the module docstring)."""

    def __init__(self, tmp: Path, *models: str, mig: bool = False) -> None:
        self.nv = FakeNvml([CAT.model(m) for m in models], mig_enabled=mig)
        self.mps = FakeMpsControl(self.nv)
        self.pods = Pods()
        self.root = str(tmp / "mps")
        self.logs = str(tmp / "mps-log")
        self.published: list[dict[str, list[AdvertisedDevice]]] = []
        self.mutations = 0
        self.nv.hooks.append(self._count)
        self.agent = self.new_agent()

    def _count(self, op: str, args: tuple[int, ...]) -> None:
        if op.startswith(("set_", "create_", "destroy_", "reset_")):
            self.mutations += 1

    def new_agent(self) -> Reconciler:
        """A new agent process: fresh supervisor and reconciler, same host."""
        self.agent = Reconciler(
            self.nv,
            self.pods,
            MpsControlSupervisor(self.mps),
            CAT,
            mps_pipe_root=self.root,
            mps_log_root=self.logs,
            publish=self.publish,
        )
        return self.agent

    def publish(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        self.published.append({r: list(ds) for r, ds in devices.items()})

    def run(self, spec: NodePartitioningSpec | None, gen: int = 1) -> ReconcileResult:
        return asyncio.run(self.agent.reconcile(spec, gen, now="2026-01-01T00:00:00Z"))


def mps_spec(*gpus: Sequence[tuple[int, int]]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p1",
            "mode": "mps",
            "gpus": [
                {"index": i, "mps": [{"memoryMiB": m, "activeThreadPercentage": p} for m, p in g]}
                for i, g in enumerate(gpus)
            ],
        }
    )


def ids(devices: Mapping[str, Sequence[AdvertisedDevice]]) -> dict[str, list[str]]:
    return {r: sorted(d.id for d in ds) for r, ds in devices.items()}


SPEC = mps_spec([(20480, 25), (20480, 25), (10240, 12)], [(40960, 50), (40960, 50)])


def running_mps_node(tmp: Path) -> tuple[Node, ReconcileResult, list[int]]:
    """Two MPS GPUs, one slice of each held by a pod whose CUDA process is an MPS client."""
    node = Node(tmp, "A100-SXM4-80GB", "A100-SXM4-80GB")
    res = node.run(SPEC)
    assert res.applied and node.mps.starts == 2
    held = [res.devices["nvidia.com/gpu-20gb"][0], res.devices["nvidia.com/gpu-40gb"][0]]
    node.pods.ids = {d.id for d in held}
    clients = [node.mps.connect(f"{node.root}/gpu0"), node.mps.connect(f"{node.root}/gpu1")]
    assert node.run(SPEC).applied
    return node, res, clients


def parse_gpu(node: Node, device_id: str) -> int:
    sid = parse_mps_slice_id(device_id)
    assert sid is not None
    return node.nv.gpu_index_of(sid.gpu_uuid)


def test_rollout_adopts_running_mps_daemons_and_leaves_their_clients_alone(tmp_path: Path) -> None:
    node, before, clients = running_mps_node(tmp_path)
    node.mps.commands.clear()
    mutations = node.mutations

    node.new_agent()  # the agent pod was replaced; the daemons run on
    res = node.run(SPEC)

    assert res.applied and res.operations == 0 and node.mutations == mutations
    assert "-d" not in node.mps.commands and "quit" not in node.mps.commands
    assert node.mps.starts == 2 and not node.mps.broken and not node.mps.quit_with_clients
    # the limits of the largest slice of each GPU are sent again, to the daemon and its server
    assert "set_default_active_thread_percentage 25" in node.mps.commands
    assert "set_default_device_pinned_mem_limit 0 40960M" in node.mps.commands
    assert node.mps.defaults(f"{node.root}/gpu0") == {
        "set_default_active_thread_percentage": "25",
        "set_default_device_pinned_mem_limit": "0 20480M",
    }
    server = node.nv.running_processes(0)
    sent = f"set_active_thread_percentage {server[0]} "
    assert any(c.startswith(sent) for c in node.mps.commands)
    assert [node.nv.compute_mode(g) for g in (0, 1)] == [ComputeMode.EXCLUSIVE_PROCESS] * 2
    # what the kubelet sees is unchanged, and the held slices are reported used
    assert ids(res.devices) == ids(before.devices)
    assert all(d.healthy for ds in res.devices.values() for d in ds)
    used = [s.deviceId for g in res.status.gpus for s in g.mps if s.used]
    assert sorted(used) == sorted(node.pods.ids)
    # and the adopted daemons are the agent's own from now on: a later change reaches them
    node.pods.ids = set()
    for c in clients:
        node.mps.disconnect(c)
    smaller = mps_spec([(10240, 12)] * 7, [(40960, 50), (40960, 50)])
    assert node.run(smaller, gen=2).applied
    assert node.mps.defaults(f"{node.root}/gpu0")["set_default_active_thread_percentage"] == "12"


def test_rollout_during_a_drain_stops_only_the_adopted_daemons_nobody_uses(tmp_path: Path) -> None:
    node, _, clients = running_mps_node(tmp_path)
    node.mps.disconnect(clients[1])  # GPU 1's pod has ended
    node.pods.ids = {i for i in node.pods.ids if parse_gpu(node, i) == 0}

    node.new_agent()  # replaced while its NodePartitioning is gone (opted out)
    res = node.run(None)

    assert res.draining and list(res.held) == sorted(node.pods.ids)
    assert node.mps.served(f"{node.root}/gpu0") and not node.mps.served(f"{node.root}/gpu1")
    assert not node.mps.broken and not node.mps.quit_with_clients
    assert node.nv.compute_mode(1) == ComputeMode.DEFAULT
    assert node.nv.compute_mode(0) == ComputeMode.EXCLUSIVE_PROCESS


def test_daemons_dying_with_the_agent_container_break_their_clients_then_come_back(
    tmp_path: Path,
) -> None:
    """Today's chart: the daemons run in the agent's container, so a rollout ends them."""
    node, before, clients = running_mps_node(tmp_path)
    mutations = node.mutations

    node.mps.kill_all()  # the old agent's container is gone, with its processes
    node.new_agent()
    res = node.run(SPEC)

    assert node.mps.broken == set(clients)  # what a rollout does to running MPS pods today
    assert res.applied and node.mps.starts == 4  # both daemons started again, for new clients
    assert node.mutations == mutations  # compute mode still EXCLUSIVE_PROCESS: no NVML change
    assert ids(res.devices) == ids(before.devices)
    assert node.mps.connect(f"{node.root}/gpu0") not in node.mps.broken


def test_rollout_leaves_mig_instances_and_their_devices_as_they_are(tmp_path: Path) -> None:
    node = Node(tmp_path, "H100-80GB", mig=True)
    spec = NodePartitioningSpec.model_validate(
        {
            "planId": "p1",
            "mode": "mig",
            "gpus": [{"index": 0, "mig": [{"profile": "3g.40gb", "start": 0},
                                          {"profile": "2g.20gb", "start": 4},
                                          {"profile": "1g.10gb", "start": 6}]}],
        }
    )
    before = node.run(spec)
    assert before.applied
    held = before.devices["nvidia.com/mig-3g.40gb"][0].id
    node.pods.ids = {held}
    gi = next(g for g, p, _s, _u in node.nv.instances(0) if p.name == "3g.40gb")
    pid = node.nv.start_process(0, gi, 0)  # the pod's CUDA process on its instance
    layout = node.nv.instances(0)
    mutations = node.mutations

    node.new_agent()
    res = node.run(spec)

    assert res.applied and res.operations == 0 and node.mutations == mutations
    assert node.nv.instances(0) == layout and pid in node.nv.running_processes(0, gi)
    assert ids(res.devices) == ids(before.devices)
    assert [i.used for g in res.status.gpus for i in g.mig] == [True, False, False]
    assert node.mps.commands == []  # no MPS probing on a node that never ran MPS


def test_hybrid_rollout_adopts_the_daemon_of_each_mig_instance(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    spec = NodePartitioningSpec.model_validate(
        {
            "planId": "p1",
            "mode": "hybrid",
            "gpus": [{"index": 0, "mig": [{"profile": "3g.40gb", "start": 0},
                                          {"profile": "3g.40gb", "start": 4}]}],
        }
    )
    res = node.run(spec)
    assert res.applied and node.mps.starts == 2
    held = res.devices["nvidia.com/mig-3g.40gb"][0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env["CUDA_MPS_PIPE_DIRECTORY"])
    node.mps.commands.clear()

    node.new_agent()
    res = node.run(spec)

    assert res.applied and node.mps.starts == 2 and "-d" not in node.mps.commands
    assert client not in node.mps.broken and not node.mps.quit_with_clients


def test_agent_loop_after_a_rollout_writes_the_same_status(tmp_path: Path) -> None:
    node, _, _ = running_mps_node(tmp_path)
    source = InMemorySpecSource("n1", SPEC)
    first = asyncio.run(Agent(node.agent, source).run_once())
    node.new_agent()
    second = asyncio.run(Agent(node.agent, source).run_once())
    assert first.applied and second.applied and second.status.gpus == first.status.gpus
    assert any(s.used for g in second.status.gpus for s in g.mps)
