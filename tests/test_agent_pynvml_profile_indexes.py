"""The pynvml adapter asks NVML about every profile index, not a hand-picked or binding-bound set.

* Compute instances: NVML lists a CI only under the compute-instance profile it was made with.
  One made under ``NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1`` (0x7) or ``7_SLICE_NVL`` (0x8)
  -- an admin's ``nvidia-smi mig -cci``, a go-nvlib based tool -- was invisible to the adapter,
  which asked only the ``<n>_SLICE`` indices: its GI read as CI-less, so the reconciler tried to
  add a CI on every pass (INSUFFICIENT_RESOURCES) or destroyed the GI without a busy check
  (IN_USE), never naming the process on it.  Every index ``0 .. COUNT`` (at least 0..8) is
  asked now, as NVIDIA's go-nvlib does, and each CI's size is its profile's ``sliceCount``.
* GPU instances: nvidia-ml-py 12.535 (which pyproject allows) has
  ``NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA``; the RTX PRO ``+gfx`` profiles sit at 0xA/0xB and the
  driver answers them whatever the binding.  The adapter asks up to the catalog's highest index.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pynvml

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.gpu_reset import NvidiaSmi
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.nvml_pynvml import PynvmlAdapter
from node_agent.reconciler import Reconciler
from tests.test_agent_pynvml import CAT, FakePynvml, NoPods

REV1 = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1  # 0x7
NVL = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL  # 0x8


class ProfiledPynvml(FakePynvml):
    """The fake pynvml whose GIs also offer the ``1_SLICE_REV1`` CI profile (1 slice) and, on a
    7-slice GI, ``7_SLICE_NVL``; a CI recorded in ``made_under`` (GI id, CI id) -> profile index
    is listed only under that profile, as the driver lists a CI under the profile it was made
    with.  ``asked`` records every CI profile index the adapter asks about."""

    def __init__(self, nv: FakeNvml) -> None:
        super().__init__(nv)
        self.made_under: dict[tuple[int, int], int] = {}
        self.asked: list[int] = []

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: Any, idx: int, eng: int, version: int = 2
    ) -> Any:
        self.asked.append(idx)
        extra = {REV1: 1, NVL: 7}
        if idx in extra:
            assert eng == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            if extra[idx] > self._gi_compute(gi):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.id, info.sliceCount = 100 + idx, extra[idx]
            info.instanceCount = self._gi_compute(gi) // extra[idx]
            return info
        return super().nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, idx, eng, version)

    def nvmlGpuInstanceGetComputeInstances(
        self, gi: Any, ci_profile_id: int, arr: Any, count_ref: Any
    ) -> int:
        g = next(x for x in self.nv.gpu_instances(gi[1]) if x.gi_id == gi[2])
        idx = ci_profile_id - 100  # the fakes' CI profile ids are 100 + index
        if idx in (REV1, NVL):
            cis = [c for c in g.compute_instances if self.made_under.get((gi[2], c)) == idx]
        else:
            super().nvmlGpuInstanceGetComputeInstances(gi, ci_profile_id, arr, count_ref)
            listed = [arr[k][3] for k in range(count_ref._obj.value)]
            cis = [c for c in listed if (gi[2], c) not in self.made_under]
        for k, c in enumerate(cis):
            arr[k] = ("ci", gi[1], gi[2], c)
        count_ref._obj.value = len(cis)
        return 0

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        out = super().nvmlComputeInstanceDestroy(ci)
        self.made_under.pop((ci[2], ci[3]), None)  # the ids are reused by the next CI
        return out


def make(model: str, cls: type[FakePynvml] = ProfiledPynvml) -> tuple[FakeNvml, Any, PynvmlAdapter]:
    nv = FakeNvml([CAT.model(model)], mig_enabled=True)
    mod = cls(nv)
    return nv, mod, PynvmlAdapter(mod, NvidiaSmi(nv.nvidia_smi))  # type: ignore[arg-type]


def mig(*instances: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {"mode": "mig", "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in instances]}]}
    )  # fmt: skip


def reconcile(ad: PynvmlAdapter, spec: NodePartitioningSpec) -> Any:
    return asyncio.run(Reconciler(ad, NoPods(), FakeSupervisor(), CAT).reconcile(spec))


def ops(mod: FakePynvml) -> list[str]:
    """The instance creations and destructions the driver was asked for."""
    return [c for c in mod.log if c.startswith(("create", "destroy"))]


def _ci_under(nv: FakeNvml, mod: ProfiledPynvml, profile: str, idx: int, slices: int) -> int:
    """A GI of ``profile`` at its first start, with one CI of ``slices`` made under CI profile
    ``idx``; the GI's id."""
    p = nv.model_of(0).profile(profile)
    gi = nv.create_gpu_instance(0, p.profile_id, p.starts[0], p.memory_slices)
    ci = nv.create_compute_instance(0, gi, slices=slices)
    mod.made_under[(gi, ci)] = idx
    return gi


# -- compute instances under 1_SLICE_REV1 / 7_SLICE_NVL --------------------------------------


def test_a_ci_made_under_the_rev1_profile_is_listed_with_its_size() -> None:
    nv, mod, ad = make("H100-SXM5-80GB")
    gi = _ci_under(nv, mod, "1g.10gb", REV1, 1)
    ((info, sizes),) = ad.gpu_instances_with_ci_slices(0)
    assert (info.gi_id, info.compute_instances, sizes) == (gi, (0,), {0: 1})
    assert [(d.gi_id, d.ci_id) for d in ad.mig_devices(0)] == [(gi, 0)]


def test_a_busy_gi_whose_ci_is_rev1_is_kept_and_blocks_by_name_not_destroyed() -> None:
    nv, mod, ad = make("H100-SXM5-80GB")
    gi = _ci_under(nv, mod, "1g.10gb", REV1, 1)
    nv.start_process(0, gi, 0)
    res = reconcile(ad, mig(("1g.10gb", 0)))
    assert res.applied and not res.errors  # no second CI asked for (INSUFFICIENT_RESOURCES)
    assert not ops(mod)
    res = reconcile(ad, mig(("7g.80gb", 0)))
    assert not res.errors  # no GI destroy under its CI (IN_USE)
    assert not ops(mod)
    assert res.blocks[0].reason == "InstanceInUse"
    assert nv.uuid_of(0, gi, 0) in res.blocks[0].message


def test_a_free_gi_whose_ci_is_rev1_is_destroyed_ci_first() -> None:
    nv, mod, ad = make("H100-SXM5-80GB")
    gi = _ci_under(nv, mod, "1g.10gb", REV1, 1)
    res = reconcile(ad, mig(("7g.80gb", 0)))
    assert res.applied, (res.errors, res.blocks)
    assert ops(mod)[:2] == [f"destroy CI on GI {gi}", f"destroy GI {gi}"]
    assert [p.name for p, _, _ in nv.layout(0)] == ["7g.80gb"]


def test_ci_size_is_the_profiles_slice_count_not_its_index() -> None:
    """A 1-slice REV1 CI on a 3g GI is a partial CI (1 of 3 slices), and a 7-slice CI listed
    under ``7_SLICE_NVL`` is the whole 7g."""
    nv, mod, ad = make("H100-SXM5-80GB")
    g3 = _ci_under(nv, mod, "3g.40gb", REV1, 1)
    assert ad.gpu_instances_with_ci_slices(0)[0][1] == {0: 1}
    nv.destroy_compute_instance(0, g3, 0)
    nv.destroy_gpu_instance(0, g3)
    g7 = _ci_under(nv, mod, "7g.80gb", NVL, 7)
    ((info, sizes),) = ad.gpu_instances_with_ci_slices(0)
    assert (info.gi_id, sizes) == (g7, {0: 7})
    assert reconcile(ad, mig(("7g.80gb", 0))).applied  # the whole instance: kept as it is
    assert not ops(mod)


def test_every_ci_profile_index_through_0x8_is_asked_even_on_an_older_binding() -> None:
    nv, mod, ad = make("H100-SXM5-80GB")
    mod.NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x7  # a binding without REV1 / NVL
    gi = _ci_under(nv, mod, "7g.80gb", NVL, 7)
    mod.asked.clear()
    assert ad.gpu_instances(0)[0].compute_instances == (0,)
    assert sorted(mod.asked) == list(range(9)), gi
    mod.NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0xB  # a newer one: all of its indices
    mod.asked.clear()
    ad.gpu_instances(0)
    assert sorted(mod.asked) == list(range(0xB))


def test_a_profile_answered_under_two_indices_lists_its_cis_once() -> None:
    seven = 100 + pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE
    listed: list[int] = []

    class Aliased(ProfiledPynvml):
        def nvmlGpuInstanceGetComputeInstanceProfileInfo(
            self, gi: Any, idx: int, eng: int, version: int = 2
        ) -> Any:
            info = super().nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, idx, eng, version)
            if idx == NVL:
                info.id = seven  # a driver answering 7_SLICE's profile for 7_SLICE_NVL
            return info

        def nvmlGpuInstanceGetComputeInstances(
            self, gi: Any, ci_profile_id: int, arr: Any, count_ref: Any
        ) -> int:
            listed.append(ci_profile_id)
            return super().nvmlGpuInstanceGetComputeInstances(gi, ci_profile_id, arr, count_ref)

    nv, _, ad = make("H100-SXM5-80GB", Aliased)
    p = nv.model_of(0).profile("7g.80gb")
    gi = ad.create_gpu_instance(0, p.profile_id, 0, p.memory_slices)
    ci = ad.create_compute_instance(0, gi)
    listed.clear()
    assert ad.gpu_instances_with_ci_slices(0)[0][1] == {ci: 7}
    assert listed.count(seven) == 1
    ad.destroy_compute_instance(0, gi, ci)
    ad.destroy_gpu_instance(0, gi)
    assert nv.layout(0) == []


# -- GPU-instance profile indices beyond an older binding's COUNT ----------------------------


def test_gfx_instances_are_seen_with_a_binding_whose_gi_profile_count_is_0xa() -> None:
    model = "RTX-PRO-6000-Blackwell"
    gfx = [p for p in CAT.model(model).profiles if p.variant == "+gfx"]
    assert sorted(p.nvml_index for p in gfx) == [0xA, 0xB]
    nv, mod, ad = make(model, FakePynvml)
    mod.NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA  # nvidia-ml-py 12.535.161
    res = reconcile(ad, mig((gfx[0].name, 0)))
    assert res.applied and not res.errors, res.errors
    assert [(p.name, s, has_ci) for p, s, has_ci in nv.layout(0)] == [(gfx[0].name, 0, True)]
    assert [g.profile_id for g in ad.gpu_instances(0)] == [gfx[0].profile_id]

    # one made outside the agent is adopted too (a fresh adapter: no cached profiles)
    nv, mod, ad = make(model, FakePynvml)
    mod.NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA
    p2 = next(p for p in gfx if p.compute == 2)
    gi = nv.create_gpu_instance(0, p2.profile_id, 6, p2.memory_slices)
    nv.create_compute_instance(0, gi)
    assert [(g.gi_id, g.profile_id, g.start) for g in ad.gpu_instances(0)] == [
        (gi, p2.profile_id, 6)
    ]
    res = reconcile(ad, mig((p2.name, 6)))
    assert res.applied and not ops(mod)
