"""Hybrid GPUs in the contract and the node agent: MPS slices inside MIG instances.

Contract: slices inside instances only in ``mode: hybrid``, within the instance's memory minus
the MPS server reserve, each thread % at most 100 -- errors name the GPU and the instance.
Agent: a host instance is advertised as its slices (ids built on its MIG UUID), not as a MIG
device; its daemon's limits are its largest slice; a used slice pins its instance and keeps its
daemon (a spec that drops the slice is refused); a restarted agent rebuilds the table of the
held slices from the kubelet's ids; slices to remove are withdrawn before anything goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError

from contract.nodepartitioning import MPS_SERVER_RESERVE_MIB, NodePartitioningSpec
from node_agent.devices import ENV_MPS_MEM_LIMIT, ENV_MPS_PIPE, ENV_VISIBLE, AdvertisedDevice
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler, ReconcileResult
from planner.catalog import default_catalog

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")


def hybrid_spec(*instances: tuple[str, int, list[tuple[int, int]]], mode: str = "hybrid") -> dict:
    return {
        "planId": "p",
        "mode": mode,
        "gpus": [
            {
                "index": 0,
                "mig": [
                    {
                        "profile": name,
                        "start": start,
                        "mps": [{"memoryMiB": m, "activeThreadPercentage": p} for m, p in slices],
                    }
                    for name, start, slices in instances
                ],
            }
        ],
    }


# --------------------------------------------------------------------------- contract


def test_contract_accepts_slices_inside_instances_on_hybrid_specs() -> None:
    spec = NodePartitioningSpec.model_validate(
        hybrid_spec(("3g.40gb", 4, [(10240, 26), (20480, 52)]), ("4g.40gb", 0, []))
    )
    (gpu,) = spec.gpus
    assert [len(m.mps) for m in gpu.mig] == [2, 0]
    # every existing spec (no slices inside instances) stays valid in every mode
    for mode in ("mig", "hybrid"):
        NodePartitioningSpec.model_validate(hybrid_spec(("7g.80gb", 0, []), mode=mode))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            hybrid_spec(("3g.40gb", 4, [(10240, 26)]), mode="mig"),
            "GPU 0 instance 3g.40gb@4 lists MPS slices, but the spec's mode is 'mig'",
        ),
        (
            hybrid_spec(("3g.40gb", 4, [(20480, 50), (20480, 50)])),
            f"GPU 0 instance 3g.40gb@4: its MPS slices need 40960 MiB, more than the "
            f"{40 * 1024 - MPS_SERVER_RESERVE_MIB} MiB",
        ),
        (hybrid_spec(("1g.10gb", 0, [(10240, 100)])), "instance 1g.10gb@0"),
        (hybrid_spec(("7g.80gb", 0, [(1024, 101)])), "less than or equal to 100"),
    ],
)
def test_contract_refuses_bad_slices_inside_instances(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NodePartitioningSpec.model_validate(spec)


def test_crd_carries_slices_inside_instances() -> None:
    from contract.nodepartitioning import crd_manifest

    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    desired = schema["properties"]["spec"]["properties"]["gpus"]["items"]
    inst = desired["properties"]["mig"]["items"]
    assert inst["properties"]["mps"]["type"] == "array"
    actual = schema["properties"]["status"]["properties"]["gpus"]["items"]
    assert "mps" in actual["properties"]["mig"]["items"]["properties"]


# --------------------------------------------------------------------------- agent


class Pods:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    async def in_use_device_ids(self) -> set[str]:
        return set(self.ids)


class Node:
    def __init__(self) -> None:
        self.nv = FakeNvml([A100], mig_enabled=False)
        self.pods = Pods()
        self.sup = FakeSupervisor(nvml=self.nv)
        self.published: list[dict[str, list[AdvertisedDevice]]] = []
        self.agent = self.restart()

    def restart(self) -> Reconciler:
        self.agent = Reconciler(
            self.nv, self.pods, self.sup, CAT, mps_pipe_root="/run/mps", publish=self.publish
        )
        return self.agent

    def publish(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        self.published.append({r: list(ds) for r, ds in devices.items()})

    def run(self, spec: dict, gen: int = 1) -> ReconcileResult:
        parsed = NodePartitioningSpec.model_validate(spec)
        return asyncio.run(self.agent.reconcile(parsed, gen, now="t"))


def test_host_instances_are_advertised_as_their_slices_with_their_own_daemon() -> None:
    node = Node()
    res = node.run(hybrid_spec(("3g.40gb", 4, [(10240, 26), (4096, 10)]), ("4g.40gb", 0, [])))
    assert res.applied, res.status.conditions
    host = next(m for m in res.status.gpus[0].mig if m.start == 4)
    assert sorted((s.memoryMiB, s.activeThreadPercentage) for s in host.mps) == [
        (4096, 10),
        (10240, 26),
    ]
    assert set(res.devices) == {
        "nvidia.com/gpu-10gb",
        "nvidia.com/gpu-4gb",
        "nvidia.com/mig-4g.40gb",  # the instance without slices stays a MIG device
    }
    (ten,) = res.devices["nvidia.com/gpu-10gb"]
    assert ten.id.startswith(host.deviceId) and ten.env[ENV_VISIBLE] == host.deviceId
    assert ten.env[ENV_MPS_PIPE] == "/run/mps/gpu0-mig4"
    assert ten.env[ENV_MPS_MEM_LIMIT] == "0=10240M"
    daemon = node.sup.daemons["gpu0-mig4"]
    assert daemon.device_uuid == host.deviceId
    assert (daemon.default_pinned_mem_limit_mib, daemon.default_thread_percentage) == (10240, 26)
    # idempotent: nothing more to do
    again = node.run(hybrid_spec(("3g.40gb", 4, [(10240, 26), (4096, 10)]), ("4g.40gb", 0, [])))
    assert again.applied and again.operations == 0 and again.devices == res.devices


def test_a_used_slice_pins_its_instance_and_daemon() -> None:
    node = Node()
    res = node.run(hybrid_spec(("3g.40gb", 4, [(10240, 26), (4096, 10)]), ("4g.40gb", 0, [])))
    (ten,) = res.devices["nvidia.com/gpu-10gb"]
    (four,) = res.devices["nvidia.com/gpu-4gb"]
    node.pods.ids = {ten.id}
    layout = sorted((p.name, s) for p, s, _ in node.nv.layout(0))
    # a plain MIG spec that destroys the host: refused, nothing touched
    res = node.run(hybrid_spec(("7g.80gb", 0, []), mode="mig"), gen=2)
    assert not res.applied and res.blocks[0].reason == "InstanceInUse"
    assert sorted((p.name, s) for p, s, _ in node.nv.layout(0)) == layout
    # keeping the instance but not the held slice: refused too
    res = node.run(hybrid_spec(("3g.40gb", 4, [(4096, 10)]), ("4g.40gb", 0, [])), gen=3)
    assert not res.applied and res.blocks[0].reason == "SliceInUse"
    assert "gpu0-mig4" in node.sup.running()
    # keeping the held slice, dropping the free one: the free slice is withdrawn first
    node.published.clear()
    res = node.run(hybrid_spec(("3g.40gb", 4, [(10240, 26)]), ("4g.40gb", 0, [])), gen=4)
    assert res.applied
    assert four.id not in {d.id for ds in node.published[0].values() for d in ds}
    assert ten.id in {d.id for d in res.devices["nvidia.com/gpu-10gb"]}
    assert "nvidia.com/gpu-4gb" not in res.devices
    # the slice's pod ends: the host may go, and its daemon with it
    node.pods.ids = set()
    res = node.run(hybrid_spec(("7g.80gb", 0, []), mode="mig"), gen=5)
    assert res.applied and node.sup.running() == set()


def test_a_restarted_agent_rebuilds_the_held_slices_from_the_kubelet() -> None:
    node = Node()
    spec = hybrid_spec(("3g.40gb", 4, [(10240, 26), (4096, 10)]), ("4g.40gb", 0, []))
    res = node.run(spec)
    (ten,) = res.devices["nvidia.com/gpu-10gb"]
    node.pods.ids = {ten.id}
    node.restart()
    res = node.run(spec)
    assert res.applied and res.operations == 0
    host = next(m for m in res.status.gpus[0].mig if m.start == 4)
    held = {s.deviceId: s.used for s in host.mps}
    assert held[ten.id] is True and len(held) == 2  # the held one kept its id; the free re-made


def test_the_numbers_docs_hybrid_md_states() -> None:
    """docs/hybrid.md: a 10 GiB slice in an A100-80GB 3g.40gb gets 25 % of its threads; three
    12 GiB slices fit that instance, a 40 GiB one does not, and a 1g.10gb holds no 10 GiB one;
    the API server allows 40448 MiB of slices in a 3g.40gb."""
    from planner.hybrid import instance_usable_mib
    from planner.mps import thread_percentage
    from planner.settings import PlannerSettings, ThreadPolicy

    s = PlannerSettings()
    three_g = instance_usable_mib(A100.profile("3g.40gb"), s)
    assert thread_percentage(10240, three_g, ThreadPolicy.PROPORTIONAL) == 25
    assert 3 * 12 * 1024 <= three_g < 40 * 1024
    assert instance_usable_mib(A100.profile("1g.10gb"), s) < 10 * 1024
    assert 40 * 1024 - MPS_SERVER_RESERVE_MIB == 40448
    text = (Path(__file__).resolve().parent.parent / "docs" / "hybrid.md").read_text()
    for claim in ("25 %", "three 12 GiB slices", "40448 MiB", "`InstanceInUse`", "`SliceInUse`"):
        assert claim in text


def test_a_host_left_out_of_a_hybrid_spec_keeps_its_daemon_only_while_used() -> None:
    """A hybrid node relabelled to mig gets a spec listing no GPU (or a hybrid spec leaves a
    GPU out): the hosts stay as they are.  A host whose slices no pod uses loses its daemon,
    and its slices are advertised Unhealthy in the same pass, before the daemon stops (they
    were advertised Healthy naming a pipe no daemon served: a pod given one ran outside MPS,
    with no memory or thread limit); a host a pod uses keeps its daemon and its slices."""
    node = Node()
    res = node.run(hybrid_spec(("3g.40gb", 4, [(10240, 26), (10240, 26)]), ("4g.40gb", 0, [])))
    assert res.applied and sorted(node.sup.daemons) == ["gpu0-mig0", "gpu0-mig4"]
    slices = sorted(d.id for d in res.devices["nvidia.com/gpu-10gb"])
    relabelled = {"planId": "2", "mode": "mig", "gpus": []}

    node.pods.ids = {slices[0]}  # a pod holds one slice: its host's daemon stays
    res = node.run(relabelled, 2)
    assert "gpu0-mig4" in node.sup.daemons
    assert all(d.healthy for d in res.devices["nvidia.com/gpu-10gb"])

    node.pods.ids = set()  # it left: the daemon goes, its slices are Unhealthy at once
    res = node.run(relabelled, 2)
    assert "gpu0-mig4" not in node.sup.daemons
    assert node.published[-1]["nvidia.com/gpu-10gb"]
    assert not any(d.healthy for d in node.published[-1]["nvidia.com/gpu-10gb"])
    assert all(d.healthy for d in res.devices["nvidia.com/mig-4g.40gb"])  # a plain instance
    res = node.run(relabelled, 2)
    assert not any(d.healthy for d in res.devices["nvidia.com/gpu-10gb"])
