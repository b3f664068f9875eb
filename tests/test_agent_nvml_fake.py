"""The fake NVML enforces the driver's MIG rules (facts/mig.md) and injects faults on demand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.mig_activation import MigActivation, mig_activation, pci_id_needs_reset
from node_agent.nvml import NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from planner.catalog import default_catalog
from planner.geometry import Placement, is_valid_layout

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
H100 = CAT.model("H100-80GB")


def mig_gpu(model_name: str = "A100-SXM4-80GB") -> FakeNvml:
    return FakeNvml([CAT.model(model_name)], mig_enabled=True)


def create(nv: FakeNvml, name: str, start: int, gpu: int = 0) -> int:
    p = nv.model_of(gpu).profile(name)
    gi = nv.create_gpu_instance(gpu, p.profile_id, start, p.memory_slices)
    nv.create_compute_instance(gpu, gi)
    return gi


def code_of(fn: object, *args: int) -> NvmlErrorCode:
    with pytest.raises(NvmlError) as e:
        fn(*args)  # type: ignore[operator]
    return e.value.code


def test_exact_placements_and_rejections() -> None:
    nv = mig_gpu()
    p3 = A100.profile("3g.40gb")
    p1 = A100.profile("1g.10gb")
    assert code_of(nv.create_gpu_instance, 0, p3.profile_id, 2, 4) == NvmlErrorCode.INVALID_ARGUMENT
    assert code_of(nv.create_gpu_instance, 0, p1.profile_id, 7, 1) == NvmlErrorCode.INVALID_ARGUMENT
    assert code_of(nv.create_gpu_instance, 0, 99, 0, 1) == NvmlErrorCode.INVALID_ARGUMENT
    create(nv, "3g.40gb", 4)
    # the occupied placement -> INSUFFICIENT_RESOURCES; 3g+3g+1g can never be made
    assert code_of(nv.create_gpu_instance, 0, p1.profile_id, 5, 1) == (
        NvmlErrorCode.INSUFFICIENT_RESOURCES
    )
    create(nv, "3g.40gb", 0)
    assert code_of(nv.create_gpu_instance, 0, p1.profile_id, 6, 1) == (
        NvmlErrorCode.INSUFFICIENT_RESOURCES
    )
    assert [(p.name, s, ci) for p, s, ci in nv.layout(0)] == [
        ("3g.40gb", 0, True),
        ("3g.40gb", 4, True),
    ]


def test_media_extension_and_max_count() -> None:
    nv = mig_gpu()
    create(nv, "1g.10gb+me", 0)
    me = A100.profile("1g.10gb+me")
    assert code_of(nv.create_gpu_instance, 0, me.profile_id, 1, 1) == (
        NvmlErrorCode.INSUFFICIENT_RESOURCES
    )
    nv2 = mig_gpu()
    for s in range(4):
        create(nv2, "1g.20gb", s * 2)  # fills the GPU; a fifth has no room either way
    assert len(nv2.layout(0)) == 4


def test_destroy_rules_ci_first_busy_in_use() -> None:
    nv = mig_gpu()
    gi = create(nv, "2g.20gb", 0)
    assert code_of(nv.destroy_gpu_instance, 0, gi) == NvmlErrorCode.IN_USE  # CI still there
    pid = nv.start_process(0, gi, 0)
    assert code_of(nv.destroy_compute_instance, 0, gi, 0) == NvmlErrorCode.IN_USE
    assert nv.running_processes(0, gi) == [pid]
    nv.stop_process(pid)
    nv.destroy_compute_instance(0, gi, 0)
    nv.destroy_gpu_instance(0, gi)
    assert nv.gpu_instances(0) == []
    assert code_of(nv.destroy_gpu_instance, 0, gi) == NvmlErrorCode.NOT_FOUND


def test_mig_mode_changes_only_when_idle() -> None:
    nv = FakeNvml([H100, CAT.model("V100-32GB")])
    assert code_of(nv.set_mig_mode, 1, True) == NvmlErrorCode.NOT_SUPPORTED
    p1 = H100.profile("1g.10gb")
    assert code_of(nv.create_gpu_instance, 0, p1.profile_id, 0, 1) == NvmlErrorCode.NOT_SUPPORTED
    pid = nv.start_process(0)
    # nvml.h: SUCCESS with activation status IN_USE; Hopper records nothing (ask again)
    assert nv.set_mig_mode(0, True) == NvmlErrorCode.IN_USE
    assert not nv.gpus()[0].mig_enabled and not nv.gpus()[0].mig_pending
    nv.stop_process(pid)
    assert nv.set_mig_mode(0, True) is None  # Hopper: active at once
    create(nv, "1g.10gb", 0)
    assert code_of(nv.set_mig_mode, 0, False) == NvmlErrorCode.IN_USE
    assert nv.gpus()[0].mig_enabled and not nv.gpus()[0].mig_pending


@pytest.mark.parametrize("model", ["A100-SXM4-80GB", "A100-SXM4-40GB", "A30"])
def test_ampere_mig_mode_is_pending_until_an_idle_reset(model: str) -> None:
    nv = FakeNvml([CAT.model(model)], passthrough=True)  # RESET_REQUIRED: a pass-through VM
    assert nv.set_mig_mode(0, True) == NvmlErrorCode.RESET_REQUIRED
    [info] = nv.gpus()
    assert (info.mig_enabled, info.pending_mig_enabled, info.mig_pending) == (False, True, True)
    p1 = nv.model_of(0).profiles[0]
    assert code_of(nv.create_gpu_instance, 0, p1.profile_id, 0, 1) == NvmlErrorCode.NOT_SUPPORTED
    pid = nv.start_process(0)  # the GPU is still in whole-GPU mode: a process can start
    assert code_of(nv.reset_gpu, 0) == NvmlErrorCode.IN_USE
    assert nv.gpus()[0].mig_pending
    nv.stop_process(pid)
    nv.reset_gpu(0)
    [info] = nv.gpus()
    assert info.mig_enabled and not info.mig_pending
    gi = create(nv, p1.name, 0)
    assert code_of(nv.reset_gpu, 0) == NvmlErrorCode.IN_USE  # instances: not idle
    nv.destroy_compute_instance(0, gi, 0)
    nv.destroy_gpu_instance(0, gi)
    # disabling is pending too; asking for the current mode cancels it
    assert nv.set_mig_mode(0, False) == NvmlErrorCode.RESET_REQUIRED
    assert nv.gpus()[0].mig_pending and nv.gpus()[0].mig_target is False
    assert nv.set_mig_mode(0, True) is None
    assert nv.gpus()[0].mig_enabled and not nv.gpus()[0].mig_pending


def test_reboot_applies_and_keeps_ampere_mig_mode_but_loses_hopper_mig_mode() -> None:
    nv = FakeNvml([A100, H100, CAT.model("A30")])
    nv.set_persistence_mode(0, True)  # holds the A100: the driver cannot reset it
    assert nv.set_mig_mode(0, True) == NvmlErrorCode.IN_USE  # left pending
    assert nv.set_mig_mode(1, True) is None
    create(nv, "1g.10gb", 0, gpu=1)
    nv.reboot()  # the pending mode is applied on A100; H100 comes back with MIG off
    assert [(g.mig_enabled, g.mig_pending) for g in nv.gpus()] == [
        (True, False),
        (False, False),
        (False, False),
    ]
    nv.reboot()  # and the A100's mode persists
    assert [g.mig_enabled for g in nv.gpus()] == [True, False, False]
    assert nv.gpu_instances(0) == []


def test_mig_activation_family_table() -> None:
    ampere = {m.name for m in CAT.models if mig_activation(m) is MigActivation.RESET}
    assert ampere == {"A100-SXM4-40GB", "A100-SXM4-80GB", "A30"}
    for name in ("H100-80GB", "H200-141GB", "B200", "GB200", "RTX-PRO-6000-Blackwell"):
        assert mig_activation(CAT.model(name)) is MigActivation.IMMEDIATE
    assert pci_id_needs_reset("20f3") and not pci_id_needs_reset("2330")  # A800, H100
    with pytest.raises(ValueError, match="not hexadecimal"):
        pci_id_needs_reset("GA100")


def test_uuids_are_fresh_per_compute_instance() -> None:
    nv = mig_gpu()
    gi = create(nv, "7g.80gb", 0)
    first = nv.mig_devices(0)[0].uuid
    nv.destroy_compute_instance(0, gi, 0)
    nv.create_compute_instance(0, gi)
    second = nv.mig_devices(0)[0].uuid
    assert first.startswith("MIG-") and second.startswith("MIG-") and first != second
    assert nv.gpus()[0].uuid.startswith("GPU-")


def test_fault_injection_once_always_after_and_custom_error() -> None:
    nv = mig_gpu()
    nv.inject("gpus", NvmlErrorCode.GPU_IS_LOST)
    assert code_of(nv.gpus) == NvmlErrorCode.GPU_IS_LOST
    assert nv.gpus()  # fired once only
    p = A100.profile("1g.10gb")
    nv.inject("create_gpu_instance", NvmlErrorCode.TIMEOUT, after=True)
    assert code_of(nv.create_gpu_instance, 0, p.profile_id, 0, 1) == NvmlErrorCode.TIMEOUT
    assert len(nv.gpu_instances(0)) == 1  # the driver did the work anyway
    f = nv.inject("*", NvmlErrorCode.UNKNOWN, times=None)
    for _ in range(3):
        assert code_of(nv.gpu_instances, 0) == NvmlErrorCode.UNKNOWN
    nv.faults.remove(f)

    class Boom(Exception):
        pass

    nv.inject("mig_devices", error=Boom)
    with pytest.raises(Boom):
        nv.mig_devices(0)
    assert nv.faults_raised == 6
    with pytest.raises(ValueError, match="unknown NVML operation"):
        nv.inject("create_instance")


def test_fault_probability_is_seeded() -> None:
    def failures(seed: int) -> int:
        nv = FakeNvml([A100], seed=seed)
        nv.inject("gpus", times=None, probability=0.3)
        n = 0
        for _ in range(200):
            try:
                nv.gpus()
            except NvmlError:
                n += 1
        return n

    assert failures(1) == failures(1)
    assert 30 < failures(1) < 90


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from(["A100-SXM4-80GB", "A30", "RTX-PRO-6000-Blackwell", "H100-80GB"]),
    data=st.data(),
)
def test_fake_accepts_exactly_the_layouts_geometry_calls_valid(
    model: str, data: st.DataObject
) -> None:
    """On random create/destroy sequences the fake agrees with planner.geometry validity."""
    m = CAT.model(model)
    nv = FakeNvml([m], mig_enabled=True)
    layout: dict[int, Placement] = {}  # gi id -> placement
    for _ in range(data.draw(st.integers(1, 12))):
        destroy: bool = data.draw(st.integers(0, 3)) == 0
        if layout and destroy:
            gi = data.draw(st.sampled_from(sorted(layout)))
            nv.destroy_compute_instance(0, gi, 0)
            nv.destroy_gpu_instance(0, gi)
            del layout[gi]
            continue
        prof = data.draw(st.sampled_from(m.profiles))
        start = data.draw(st.integers(0, m.memory_slots - 1))
        candidate = Placement(start, prof)
        valid = start in prof.starts and is_valid_layout(m, [*layout.values(), candidate])
        try:
            gi = nv.create_gpu_instance(0, prof.profile_id, start, prof.memory_slices)
        except NvmlError as e:
            assert not valid, f"fake refused valid {candidate} beside {list(layout.values())}"
            expected = (
                NvmlErrorCode.INVALID_ARGUMENT
                if start not in prof.starts
                else NvmlErrorCode.INSUFFICIENT_RESOURCES
            )
            assert e.code == expected
        else:
            assert valid, f"fake accepted invalid {candidate} beside {list(layout.values())}"
            nv.create_compute_instance(0, gi)
            layout[gi] = candidate
        got = sorted((p.name, s) for p, s, _ in nv.layout(0))
        assert got == sorted((p.profile.name, p.start) for p in layout.values())
