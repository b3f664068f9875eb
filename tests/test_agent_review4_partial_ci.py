"""A GPU instance whose one compute instance is smaller than it (review 4, finding 3).

``nvidia-smi mig -cgi 9`` then ``-cci 0`` (or a mig-parted ``1c.3g.40gb`` config) makes a
3g.40gb GPU instance with a single 1-slice compute instance: NVIDIA's ``1c.3g.40gb``, for
which it names no resource.  The pynvml adapter listed the CIs of every CI profile but kept
only their ids, so the reconciler took such a CI for a full one: a spec keeping 3g.40gb@4 was
``Applied`` and its MIG UUID advertised as ``nvidia.com/mig-3g.40gb`` -- a 3g pod got one of
the three compute slices.  The adapters now report every CI's compute slices and the
reconciler handles such an instance as a split one (node_agent.reconciler, step 6).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from node_agent.devices import AdvertisedDevice
from node_agent.gpu_reset import NvidiaSmi
from node_agent.metrics import AgentMetrics, MeteredNvml
from node_agent.mps import FakeSupervisor
from node_agent.nvml import Nvml, NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.nvml_pynvml import PynvmlAdapter
from node_agent.reconciler import Reconciler, ReconcileResult
from planner.catalog import default_catalog
from tests.test_agent_pynvml import FakePynvml
from tests.test_agent_reconciler import Pods, mig_spec

CAT = default_catalog()

_SLICES = {
    v: int(k.split("_")[-2])
    for k, v in vars(pynvml).items()
    if k.startswith("NVML_COMPUTE_INSTANCE_PROFILE_") and k.endswith("_SLICE")
}
"""``NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE`` index -> n."""


class SizedPynvml(FakePynvml):
    """The fake pynvml listing each CI under the CI profile of its real size, as the driver
    does: ``sizes`` (GI id, CI id) -> compute slices; a CI not in it is full-size."""

    def __init__(self, nv: FakeNvml) -> None:
        super().__init__(nv)
        self.sizes: dict[tuple[int, int], int] = {}

    def nvmlGpuInstanceGetComputeInstances(
        self, gi: Any, ci_profile_id: int, arr: Any, count_ref: Any
    ) -> int:
        g = next(x for x in self.nv.gpu_instances(gi[1]) if x.gi_id == gi[2])
        want = _SLICES[ci_profile_id - 100]  # the fake's CI profile ids are 100 + index
        full = self._gi_compute(gi)
        cis = [c for c in g.compute_instances if self.sizes.get((gi[2], c), full) == want]
        for k, c in enumerate(cis):
            arr[k] = ("ci", gi[1], gi[2], c)
        count_ref._obj.value = len(cis)
        return 0

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        out = super().nvmlComputeInstanceDestroy(ci)
        self.sizes.pop((ci[2], ci[3]), None)  # the ids are reused by the next CI
        return out


class PynvmlNode:
    """An H100 behind the real adapter (over the fake pynvml), reconciled in MIG mode."""

    def __init__(self, wrap: bool = False) -> None:
        self.nv = FakeNvml([CAT.model("H100-SXM5-80GB")], mig_enabled=True)
        self.mod = SizedPynvml(self.nv)
        adapter: Nvml = PynvmlAdapter(self.mod, NvidiaSmi(self.nv.nvidia_smi))  # type: ignore[arg-type]
        if wrap:
            adapter = MeteredNvml(adapter, AgentMetrics(CollectorRegistry()))
        self.pods = Pods()
        self.published: list[dict[str, list[AdvertisedDevice]]] = []
        self.agent = Reconciler(
            adapter,
            self.pods,
            FakeSupervisor(nvml=self.nv),
            CAT,
            mps_pipe_root="/run/mps",
            publish=self.publish,
        )

    def publish(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        self.published.append({r: list(ds) for r, ds in devices.items()})

    def run(self, *instances: tuple[str, int], gen: int = 1) -> ReconcileResult:
        return asyncio.run(
            self.agent.reconcile(mig_spec(*instances), gen, now="2026-01-01T00:00:00Z")
        )

    def partial_3g(self, ci_slices: int = 1) -> str:
        """A 3g.40gb@4 whose one CI has ``ci_slices`` compute slices (an admin's ``-cci``);
        its MIG UUID."""
        p = self.nv.model_of(0).profile("3g.40gb")
        gi = self.nv.create_gpu_instance(0, p.profile_id, 4, p.memory_slices)
        ci = self.nv.create_compute_instance(0, gi)
        self.mod.sizes[(gi, ci)] = ci_slices
        return self.nv.uuid_of(0, gi, ci)

    def advertised(self) -> set[str]:
        return {d.id for devices in self.published for ds in devices.values() for d in ds}


@pytest.mark.parametrize("wrap", [False, True], ids=["adapter", "metered"])
def test_a_free_partial_instance_is_never_advertised_and_is_replaced_by_a_whole_one(
    wrap: bool,
) -> None:
    node = PynvmlNode(wrap)
    partial = node.partial_3g()
    res = node.run(("3g.40gb", 4))
    assert partial not in node.advertised()  # not even in the withdrawal publish
    assert partial not in node.nv.mig_uuids()  # destroyed: free and not what the spec wants
    ((_gi, p, start, uuids),) = node.nv.instances(0)
    assert (p.name, start, len(uuids)) == ("3g.40gb", 4, 1)
    assert res.applied, res.status.conditions
    assert [d.id for d in res.devices["nvidia.com/mig-3g.40gb"]] == list(uuids)


def test_a_used_partial_instance_is_kept_blocks_its_gpu_by_name_and_is_not_advertised() -> None:
    node = PynvmlNode()
    partial = node.partial_3g()
    node.pods.ids = {partial}
    res = node.run(("3g.40gb", 4))
    assert not res.applied
    assert partial not in node.advertised()
    assert "nvidia.com/mig-3g.40gb" not in res.devices
    block = res.blocks[0]
    assert block.reason == "InstanceInUse"
    assert f"1c.3g.40gb@4 ({partial})" in block.message
    assert "one smaller than the instance" in block.message
    (inst,) = res.status.gpus[0].mig
    assert inst.used and inst.deviceId == partial

    res = node.run(("2g.20gb", 4), ("1g.10gb", 6), gen=2)  # the partitioner moves on
    assert not res.applied and res.blocks[0].reason == "InstanceInUse"
    assert partial in node.nv.mig_uuids()  # never destroyed under the pod
    assert partial not in node.advertised()


def test_a_two_slice_ci_of_a_3g_is_partial_and_a_full_one_is_not() -> None:
    node = PynvmlNode()
    partial = node.partial_3g(ci_slices=2)
    assert not node.run(("4g.40gb", 0), ("3g.40gb", 4)).blocks
    assert partial not in node.advertised()
    res = node.run(("4g.40gb", 0), ("3g.40gb", 4), gen=2)  # the whole 3g made in its place
    assert res.applied and res.operations == 0
    assert len(res.devices["nvidia.com/mig-3g.40gb"]) == 1


def test_the_adapter_reports_each_compute_instance_size() -> None:
    node = PynvmlNode()
    node.partial_3g()
    adapter = PynvmlAdapter(node.mod, NvidiaSmi(node.nv.nvidia_smi))  # type: ignore[arg-type]
    ((gi, sizes),) = adapter.gpu_instances_with_ci_slices(0)
    assert gi.compute_instances == (0,) and sizes == {0: 1}
    assert adapter.gpu_instances(0) == [gi]


# -- the fake NVML enforces the driver's compute-instance rules and reports sizes ------------


def test_fake_nvml_makes_partial_compute_instances_as_the_driver_does() -> None:
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    p3 = nv.model_of(0).profile("3g.40gb")
    gi = nv.create_gpu_instance(0, p3.profile_id, 4, p3.memory_slices)
    with pytest.raises(NvmlError) as e:
        nv.create_compute_instance(0, gi, slices=4)  # no 4-slice CI profile on a 3g GI
    assert e.value.code == NvmlErrorCode.NOT_SUPPORTED
    with pytest.raises(NvmlError) as e:
        nv.create_compute_instance(0, gi, slices=5)  # no such CI profile at all
    assert e.value.code == NvmlErrorCode.NOT_SUPPORTED
    assert nv.create_compute_instance(0, gi, slices=1) == 0
    with pytest.raises(NvmlError) as e:
        nv.create_compute_instance(0, gi)  # a full-size CI needs all 3 slices
    assert e.value.code == NvmlErrorCode.INSUFFICIENT_RESOURCES
    assert nv.create_compute_instance(0, gi, slices=2) == 1
    with pytest.raises(NvmlError) as e:
        nv.create_compute_instance(0, gi, slices=1)  # 1 + 2 = all 3 taken
    assert e.value.code == NvmlErrorCode.INSUFFICIENT_RESOURCES
    ((info, sizes),) = nv.gpu_instances_with_ci_slices(0)
    assert info.compute_instances == (0, 1) and sizes == {0: 1, 1: 2}
    nv.destroy_compute_instance(0, gi, 1)
    nv.destroy_compute_instance(0, gi, 0)
    assert nv.create_compute_instance(0, gi) == 0  # full-size again
    assert nv.gpu_instances_with_ci_slices(0)[0][1] == {0: 3}
    nv.inject("gpu_instances", NvmlErrorCode.GPU_IS_LOST)
    with pytest.raises(NvmlError):
        nv.gpu_instances_with_ci_slices(0)  # one port call: faults apply to it too


def test_the_reconciler_over_the_fake_treats_a_partial_instance_as_split() -> None:
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    p3 = nv.model_of(0).profile("3g.40gb")
    gi = nv.create_gpu_instance(0, p3.profile_id, 4, p3.memory_slices)
    partial = nv.uuid_of(0, gi, nv.create_compute_instance(0, gi, slices=1))
    pods = Pods()
    pods.ids = {partial}
    published: list[Mapping[str, Sequence[AdvertisedDevice]]] = []
    rec = Reconciler(nv, pods, FakeSupervisor(nvml=nv), CAT, publish=published.append)
    res = asyncio.run(rec.reconcile(mig_spec(("3g.40gb", 4)), 1, now="t"))
    assert not res.applied and res.blocks[0].reason == "InstanceInUse"
    assert not any(d.id == partial for devs in published for ds in devs.values() for d in ds)
    pods.ids = set()  # the pod is gone: destroyed and made whole
    res = asyncio.run(rec.reconcile(mig_spec(("3g.40gb", 4)), 1, now="t"))
    assert res.applied and partial not in nv.mig_uuids()
    ((_gi, sizes),) = nv.gpu_instances_with_ci_slices(0)
    assert list(sizes.values()) == [3]
