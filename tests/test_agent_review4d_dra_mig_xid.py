"""The DRA agent, as the device-plugin agent was fixed in 9028a27 (review 4 #6 and the XID race).

* MIG activation: ``set_mig_mode`` succeeds with an activation status (nvml.h).  The preparer
  took any status as "pending" and reset the GPU; on a busy Hopper (``IN_USE``: nothing
  pending, "idle the device and retry") that reset a GPU whose mode was not pending.  It now
  reads the mode back (:meth:`DraPreparer._mig_activation`, the reconciler's rule): pending
  (Ampere, or ``RESET_REQUIRED`` in a pass-through VM) is reset, not recorded (Hopper) fails the
  prepare, which the kubelet retries.
* Reused GPU instance ids: an XID event naming GI id ``n`` that came in before an unprepare
  destroyed that instance and a prepare created another with the same id was resolved, at the
  round, to the new instance's placement -- a healthy instance blamed, the one hit (gone) not.
  Each GI destroy and create is now stamped with the ledger's count of events, and such an
  event marks the whole GPU.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from node_agent.dra_claims import ClaimError
from node_agent.dra_driver import DraDriver
from node_agent.dra_prepare import DraPreparer
from node_agent.nvml import NvmlError, NvmlErrorCode, XidEvent
from node_agent.nvml_fake import FakeNvml
from node_agent.xid import XidLedger, XidWatcher
from tests.test_agent_dra_prepare import A100, H100, dev, layout, placement, preparer, ref

# -- MIG activation ---------------------------------------------------------------------------


def calls_of(nv: FakeNvml) -> list[str]:
    """Records every NVML operation from here on."""
    calls: list[str] = []
    nv.hooks.append(lambda op, args: calls.append(op))
    return calls


def test_busy_hopper_at_the_switch_is_not_reset_and_the_retry_enables_mig() -> None:
    nv = FakeNvml([H100])
    prep = preparer(nv)
    jobs: list[int] = []

    def busy_for_the_switch(op: str, args: tuple[int, ...]) -> None:
        if op == "set_mig_mode" and not jobs:
            jobs.append(nv.start_process(0))  # a CUDA job grabs the GPU just then

    nv.hooks.append(busy_for_the_switch)
    calls = calls_of(nv)
    with pytest.raises(ClaimError) as e:
        prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 0))])
    assert "reset_gpu" not in calls  # its mode is not pending: nothing to reset
    assert "MIG mode enable was not activated" in str(e.value), e.value
    assert "IN_USE" in str(e.value)
    assert not nv.mig_enabled(0) and not nv.mig_pending(0)
    assert prep.checkpoint.get(ref(1).uid) is None

    nv.stop_process(jobs[0])  # the job ends; the kubelet retries
    got = prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 0))])
    assert [d.device for d in got] == [placement(0, "3g.40gb", 0)]
    assert nv.mig_enabled(0) and layout(nv, 0) == {("3g.40gb", 0)}
    assert "reset_gpu" not in calls


def test_busy_ampere_at_the_switch_is_pending_and_reset_once_idle() -> None:
    nv = FakeNvml([A100])
    prep = preparer(nv)
    jobs: list[int] = []

    def busy_for_the_switch(op: str, args: tuple[int, ...]) -> None:
        if op == "set_mig_mode" and not jobs:
            jobs.append(nv.start_process(0))
        elif op == "reset_gpu" and jobs:
            nv.stop_process(jobs[0])  # gone by the time of the reset

    nv.hooks.append(busy_for_the_switch)
    calls = calls_of(nv)
    prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 4, A100))])
    assert calls.count("reset_gpu") == 1  # left pending (IN_USE): activated by the reset
    assert nv.mig_enabled(0) and layout(nv, 0) == {("3g.40gb", 4)}


@pytest.mark.parametrize("passthrough", [False, True])
def test_idle_ampere_is_reset_only_in_a_pass_through_vm(passthrough: bool) -> None:
    nv = FakeNvml([A100], passthrough=passthrough)
    prep = preparer(nv)
    calls = calls_of(nv)
    prep.prepare(ref(1), [dev(placement(0, "7g.80gb", 0, A100))])
    assert calls.count("reset_gpu") == (1 if passthrough else 0)
    assert nv.mig_enabled(0) and layout(nv, 0) == {("7g.80gb", 0)}


def test_create_planned_on_a_busy_hopper_is_left_to_prepare_without_a_reset() -> None:
    nv = FakeNvml([H100])
    prep = preparer(nv)
    jobs: list[int] = []

    def busy_for_the_switch(op: str, args: tuple[int, ...]) -> None:
        if op == "set_mig_mode" and not jobs:
            jobs.append(nv.start_process(0))

    nv.hooks.append(busy_for_the_switch)
    calls = calls_of(nv)
    assert prep.create_planned([placement(0, "3g.40gb", 0)]) == 0
    assert "reset_gpu" not in calls and not nv.mig_pending(0) and layout(nv, 0) == set()


# -- reused GPU instance ids ------------------------------------------------------------------


def driver_of(prep: DraPreparer, nv: FakeNvml, ledger: XidLedger) -> DraDriver:
    """A driver whose XID path alone is used (no plugin server, no publisher)."""
    plugin: Any = SimpleNamespace(preparer=prep)
    return DraDriver(plugin, SimpleNamespace(), xids=XidWatcher(nv, ledger))  # type: ignore[arg-type]


def gi_of(nv: FakeNvml, gpu: int, start: int) -> int:
    return next(gi for gi, _, s, _ in nv.instances(gpu) if s == start)


def test_an_xid_before_its_gi_id_was_reused_marks_the_whole_gpu_not_the_new_instance() -> None:
    nv = FakeNvml([H100, H100], mig_enabled=True)
    prep = preparer(nv)
    ledger = XidLedger()
    driver = driver_of(prep, nv, ledger)
    old, new = placement(0, "3g.40gb", 0), placement(0, "3g.40gb", 4)
    prep.prepare(ref(1), [dev(old)])
    gi = gi_of(nv, 0, 0)
    ledger.add(XidEvent(0, 48, gi_id=gi, ci_id=0))  # double-bit ECC on claim 1's instance
    prep.unprepare(ref(1).uid)  # before the round: its instance is destroyed ...
    prep.prepare(ref(2), [dev(new)])  # ... and another placement gets the same GI id
    assert gi_of(nv, 0, 4) == gi
    asyncio.run(driver._take_xids())
    [m] = prep.xid_marks
    assert (m.gpu, m.xid, m.device) == (0, 48, "")  # the whole GPU, not 3g@4 by guess
    assert f"GPU instance {gi} was destroyed or created" in m.where
    assert prep.xid_mark_of(new) is m and prep.xid_mark_of(old) is m
    assert prep.xid_mark_of(placement(1, "3g.40gb", 0)) is None  # GPU 1 untouched


def test_an_xid_after_the_reuse_names_the_new_instance_and_stamps_are_dropped() -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = preparer(nv)
    ledger = XidLedger()
    driver = driver_of(prep, nv, ledger)
    prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 0))])
    prep.unprepare(ref(1).uid)
    prep.prepare(ref(2), [dev(placement(0, "3g.40gb", 4))])
    gi = gi_of(nv, 0, 4)
    ledger.add(XidEvent(0, 48, gi_id=gi, ci_id=0))  # came in after the changes
    asyncio.run(driver._take_xids())
    [m] = prep.xid_marks
    assert m.device == placement(0, "3g.40gb", 4)  # the instance it names, as before
    assert prep._gi_changed == {}  # no event still to come is older than those stamps


def test_an_xid_kept_for_a_gpu_not_served_yet_keeps_its_number() -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = preparer(nv)
    ledger = XidLedger()
    driver = driver_of(prep, nv, ledger)
    prep.pending[5] = NvmlError(NvmlErrorCode.GPU_IS_LOST, "gpus", "lost at start")
    ledger.add(XidEvent(5, 48))
    asyncio.run(driver._take_xids())
    assert driver._xid_later == [(0, XidEvent(5, 48))] and prep.xid_marks == ()


def test_unnumbered_events_are_resolved_as_before() -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = preparer(nv)
    prep.xid_clock = lambda: 7
    prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 0))])
    gi = gi_of(nv, 0, 0)
    assert prep.mark_xids([XidEvent(0, 48, gi_id=gi, ci_id=0)]) == []
    assert [m.device for m in prep.xid_marks] == [placement(0, "3g.40gb", 0)]


# -- what the warnings say ----------------------------------------------------------------------


def test_the_xid_warning_says_what_each_publishing_mode_does() -> None:
    from node_agent.dra_driver import _xid_does
    from node_agent.dra_shape import XID_DEVICES
    from node_agent.dra_slices import UNUSABLE_TAINT_KEY

    shaped = _xid_does(True, True)
    assert "withdrawn from the ResourceSlices while free" in shaped
    assert "allocated ones stay published, tainted NoSchedule" in shaped
    assert "untainted" in _xid_does(True, False)
    every = _xid_does(False, True)  # dra.publish=all, taints kept: nothing withdrawn
    assert "withdrawn" not in every and f"NoSchedule taint {UNUSABLE_TAINT_KEY}" in every
    dropped = _xid_does(False, False)
    assert "withdrawn from the ResourceSlices with every free device of the GPU" in dropped
    assert "allocated ones stay published" in XID_DEVICES
