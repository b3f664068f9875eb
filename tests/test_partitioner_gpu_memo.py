"""The planner's view of a GPU is memoised across nodes and steps (partitioner.ledger
``_planner_gpu``): a memo hit must be what building the view anew gives, whatever device
fields differ.  Small domains make GPUs that differ in one field only meet in one run."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner import ledger
from partitioner.ledger import Device, GpuSlots

DEVICE_FIELDS = {
    "resource": st.sampled_from(["", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu-10gb"]),
    "key": st.integers(0, 2),
    "compute": st.integers(0, 1),
    "used": st.booleans(),
    "pinned": st.booleans(),
    "mig_profile": st.sampled_from(["", "1g.10gb"]),
    "memory_mib": st.sampled_from([0, 10240]),
    "thread_percentage": st.sampled_from([None, 50]),
}
devices = st.builds(Device, **DEVICE_FIELDS)
gpus = st.builds(
    GpuSlots,
    index=st.integers(0, 1),
    devices=st.lists(devices, min_size=1, max_size=3),
    frozen=st.just(False),
    locked=st.booleans(),
)


@st.composite
def views_asked(draw: st.DrawFn) -> list[tuple[GpuSlots, bool]]:
    """GPUs, each followed by variants that differ from it in one field (of one device, of
    the GPU, or the node's mode): the memo meets near-misses, not only strangers."""
    out: list[tuple[GpuSlots, bool]] = []
    for g in draw(st.lists(gpus, min_size=1, max_size=4)):
        mps = draw(st.booleans())
        out.append((g, mps))
        for _ in range(draw(st.integers(1, 4))):
            what = draw(st.sampled_from([*DEVICE_FIELDS, "index", "locked", "mode"]))
            v = GpuSlots(g.index, [replace(d) for d in g.devices], locked=g.locked)
            vm = mps
            if what == "index":
                v.index = 1 - g.index
            elif what == "locked":
                v.locked = not g.locked
            elif what == "mode":
                vm = not mps
            else:
                d = v.devices[draw(st.integers(0, len(v.devices) - 1))]
                setattr(d, what, draw(DEVICE_FIELDS[what]))
            out.append((v, vm))
    return out


@settings(max_examples=300, deadline=None)
@given(views_asked())
def test_a_memoised_gpu_view_is_the_view_built_anew(seq: list[tuple[GpuSlots, bool]]) -> None:
    ledger._GPU_STATES.clear()
    for g, mps in seq:
        assert ledger._planner_gpu(g, mps) == ledger._gpu_state(g, mps)


def test_the_memo_is_bounded() -> None:
    ledger._GPU_STATES.clear()
    for i in range(ledger._GPU_STATES_MAX + 10):
        g = GpuSlots(0, [Device("nvidia.com/mig-1g.10gb", i, 1, False, mig_profile="1g.10gb")])
        assert ledger._planner_gpu(g, False).mig[0].start == i
    assert len(ledger._GPU_STATES) <= ledger._GPU_STATES_MAX
