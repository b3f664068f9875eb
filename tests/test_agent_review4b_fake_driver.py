"""FakeNvml answers MIG-mode and compute-mode changes as nvml.h does (review 4 #6).

Before the fix (hunt2/pynvml #4, hunt3/agent3 #5, ``r5_fake_vs_driver.py``) the fake differed
from the real driver in three ways, and the reconciler was only tested against the fake's:

* ``set_mig_mode`` on a busy GPU *raised* ``IN_USE``; ``nvmlDeviceSetMigMode`` returns SUCCESS
  with activation status ``IN_USE`` ("idle the device and retry");
* an idle bare-metal A100 answered ``RESET_REQUIRED``, which nvml.h gives only in pass-through
  VMs (the driver resets an idle GPU itself: facts/mig.md "Ampere: GPU reset");
* ``set_compute_mode(EXCLUSIVE_PROCESS)`` with MIG on was accepted and read back; the driver
  answers ``NOT_SUPPORTED`` and the mode stays ``DEFAULT``.

With the real driver's ``IN_USE`` status on Hopper (nothing pending) the reconciler reset the
GPU (``nvidia-smi -r``) as if the mode were pending; it now reads the mode back and asks again
next pass, resetting only a GPU whose change is pending.
"""

from __future__ import annotations

import pytest

from node_agent.nvml import ComputeMode, NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from tests.test_agent_reconciler import CAT, Node, cond, mig_spec, mutations

# -- the fake, call by call -------------------------------------------------------------------


def test_busy_hopper_answers_in_use_as_activation_status_and_changes_nothing() -> None:
    nv = FakeNvml([CAT.model("H100-80GB")])
    pid = nv.start_process(0)
    assert nv.set_mig_mode(0, True) == NvmlErrorCode.IN_USE  # returned, not raised
    [info] = nv.gpus()
    assert (info.mig_enabled, info.mig_pending) == (False, False)
    nv.stop_process(pid)
    assert nv.set_mig_mode(0, True) is None and nv.mig_enabled(0)


@pytest.mark.parametrize("model", ["A100-SXM4-80GB", "A100-SXM4-40GB", "A30"])
def test_idle_bare_metal_ampere_is_current_at_once_and_a_vm_answers_reset_required(
    model: str,
) -> None:
    nv = FakeNvml([CAT.model(model)])
    assert nv.set_mig_mode(0, True) is None  # the driver reset the idle GPU itself
    assert nv.mig_enabled(0) and not nv.mig_pending(0)
    assert nv.set_mig_mode(0, False) is None and not nv.mig_enabled(0)

    vm = FakeNvml([CAT.model(model)], passthrough=True)
    assert vm.set_mig_mode(0, True) == NvmlErrorCode.RESET_REQUIRED
    assert not vm.mig_enabled(0) and vm.mig_pending(0)
    vm.reset_gpu(0)
    assert vm.mig_enabled(0) and not vm.mig_pending(0)


def test_busy_bare_metal_ampere_is_left_pending_with_in_use() -> None:
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")])
    pid = nv.start_process(0)
    assert nv.set_mig_mode(0, True) == NvmlErrorCode.IN_USE
    assert not nv.mig_enabled(0) and nv.mig_pending(0)  # pending until a reset
    nv.stop_process(pid)
    nv.reset_gpu(0)
    assert nv.mig_enabled(0) and not nv.mig_pending(0)


def test_gpu_instances_still_make_a_mig_mode_change_fail() -> None:
    nv = FakeNvml([CAT.model("H100-80GB")], mig_enabled=True)
    p = nv.model_of(0).profile("7g.80gb")
    gi = nv.create_gpu_instance(0, p.profile_id, 0, p.memory_slices)
    with pytest.raises(NvmlError) as e:
        nv.set_mig_mode(0, False)
    assert e.value.code == NvmlErrorCode.IN_USE and nv.gpu_instances(0)[0].gi_id == gi


@pytest.mark.parametrize("mode", [ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.EXCLUSIVE_THREAD])
def test_exclusive_compute_mode_with_mig_on_is_not_supported_and_stays_default(
    mode: ComputeMode,
) -> None:
    nv = FakeNvml([CAT.model("H100-80GB")], mig_enabled=True)
    with pytest.raises(NvmlError) as e:
        nv.set_compute_mode(0, mode)
    assert e.value.code == NvmlErrorCode.NOT_SUPPORTED
    assert nv.compute_mode(0) == ComputeMode.DEFAULT
    nv.set_compute_mode(0, ComputeMode.DEFAULT)  # DEFAULT is fine
    off = FakeNvml([CAT.model("H100-80GB")])
    off.set_compute_mode(0, mode)  # MIG off: accepted (MPS)
    assert off.compute_mode(0) == mode


# -- the reconciler against the driver's answers ------------------------------------------------


def test_bare_metal_ampere_enables_mig_without_a_reset() -> None:
    node = Node("A100-SXM4-80GB")
    calls = mutations(node)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert res.applied and calls == ["set_mig_mode 0"]  # no nvidia-smi -r
    assert node.layout() == [("7g.80gb", 0)]


def test_hopper_busy_at_the_switch_is_not_reset_and_is_asked_again_next_pass() -> None:
    """The real driver's IN_USE activation on Hopper: nothing pending, so no reset (which
    would only make the creates fail); an error, and the next pass asks again."""
    node = Node("H100-80GB")
    calls = mutations(node)
    jobs: list[int] = []

    def busy_for_the_switch(op: str, args: tuple[int, ...]) -> None:
        if op == "set_mig_mode" and not jobs:
            jobs.append(node.nv.start_process(0))  # a CUDA job grabs the GPU just then
        elif op == "running_processes" and jobs and node.nv.process_count():
            node.nv.stop_process(jobs[0])  # ... and is gone by the time the agent looks

    node.nv.hooks.append(busy_for_the_switch)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert calls == ["set_mig_mode 0"]  # no reset of a GPU whose mode is not pending
    assert not res.applied and not node.nv.mig_enabled(0) and not node.nv.mig_pending(0)
    assert res.errors == [
        "GPU 0: MIG mode enable was not activated (NVML activation status IN_USE: the GPU is "
        "not idle); asked again next pass"
    ]
    assert node.layout() == []
    node.nv.hooks.remove(busy_for_the_switch)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert res.applied and calls == ["set_mig_mode 0", "set_mig_mode 0"]
    assert node.layout() == [("7g.80gb", 0)]


def test_busy_bare_metal_ampere_is_pending_and_reset_once_the_processes_end() -> None:
    node = Node("A100-SXM4-80GB")
    calls = mutations(node)
    jobs: list[int] = []

    def busy_for_the_switch(op: str, args: tuple[int, ...]) -> None:
        if op == "set_mig_mode" and not jobs:
            jobs.append(node.nv.start_process(0, name="train.py"))

    node.nv.hooks.append(busy_for_the_switch)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert calls == ["set_mig_mode 0"] and node.nv.mig_pending(0)  # left pending: IN_USE
    assert cond(res, "Degraded") == ("True", "MIGModePending")
    assert f"pid {jobs[0]} (train.py)" in res.blocks[0].message
    node.nv.stop_process(jobs[0])
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert res.applied and calls == ["set_mig_mode 0", "reset_gpu 0"]  # asked once, then reset
    assert node.layout() == [("7g.80gb", 0)]
