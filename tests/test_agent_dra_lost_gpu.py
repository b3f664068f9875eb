"""One GPU NVML cannot read (``GPU_IS_LOST``) in DRA mode: isolated, like the device-plugin agent.

Checked, each for a GPU lost at its handle (its ``gpus()`` entry unreadable) and for one whose
instance and process reads fail: NodePrepareResources answers a claim on the lost GPU with an
error naming the GPU and the NVML error while the other claims prepare; a claim prepared there
before the loss is neither re-made, released nor destroyed (prepare and unprepare answer the
error, the kubelet retries) and answers the same devices once the GPU reads again; the start-up
clean-up skips the lost GPU (its instances and an unfinished prepare's record stay) and cleans
the others; a shaped round reconciles and publishes the other GPUs, withdraws the lost GPU's
free placements but keeps its allocated device published, creates and destroys nothing on it,
and reports ``Degraded``/``GpuUnreadable`` naming the GPU and the error, until it reads again;
mode ``all`` withdraws the lost GPU's devices but the prepared ones; NVML itself down (or a
driver-wide code on one GPU's read) fails the round and publishes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import ApiServer

from node_agent.dra_checkpoint import ClaimRecord, PreparedDevice
from node_agent.dra_prepare import gpu_models
from node_agent.dra_slices import DRIVER
from node_agent.nvml import NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from tests import test_agent_draplugin
from tests.test_agent_dra_prepare import CAT, preparer
from tests.test_agent_dra_shaped import (
    H100,
    CountingNvml,
    alloc,
    conditions,
    kmock_options,  # noqa: F401  (the fixture: kmock serves tests/fake_apiserver.ApiServer)
    layout,
    np_of,
    p,
    patch_spec,
    published,
    put_claim,
    put_np,
    ref,
    round_ok,
    setup,
    spec,
    tainted,
)
from tests.test_agent_draplugin import Node, placement
from tests.test_agent_lost_gpu import MUTATING, READS

dirs = test_agent_draplugin.dirs
node = test_agent_draplugin.node
"""The fixtures of the kubelet-plugin tests: a plugin on two H100s behind a fake kubelet."""

LOSSES = ("handle", "reads")
"""How GPU 1 is lost: at its handle (``gpus()`` lists it unreadable, every call on it fails),
or only its instance and process reads (and any mutating call) fail."""


class Lost:
    """Records every NVML call and makes one GPU unreadable (see :data:`LOSSES`)."""

    def __init__(self, nv: FakeNvml) -> None:
        self.nv = nv
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.gpu: int | None = None
        self.code = NvmlErrorCode.GPU_IS_LOST
        nv.hooks.append(self._hook)

    def _hook(self, op: str, args: tuple[int, ...]) -> None:
        self.calls.append((op, args))
        if self.gpu is not None and args[:1] == (self.gpu,) and op in READS + MUTATING:
            raise NvmlError(self.code, op, "injected by the test")

    def lose(
        self, gpu: int, how: str = "handle", code: NvmlErrorCode = NvmlErrorCode.GPU_IS_LOST
    ) -> None:
        self.calls.clear()
        if how == "handle":
            self.nv.inject("*", code, gpu=gpu, times=None)
        else:
            self.gpu, self.code = gpu, code

    def recover(self) -> None:
        self.nv.clear_faults()
        self.gpu = None

    def mutations(self, gpu: int) -> list[tuple[str, tuple[int, ...]]]:
        """The mutating calls tried on ``gpu`` since it was lost."""
        return [c for c in self.calls if c[0] in MUTATING and c[1][:1] == (gpu,)]


def names_gpu_1_lost(message: str) -> bool:
    return "GPU 1" in message and "GPU_IS_LOST" in message


# -- NodePrepareResources ----------------------------------------------------------------------


@pytest.mark.parametrize("how", LOSSES)
async def test_a_claim_on_the_lost_gpu_fails_naming_it_and_the_others_prepare(
    node: Node, how: str
) -> None:
    a = node.claims.put("train", "uid-a", ("gpu", placement(0, "3g.40gb", 4)))
    b = node.claims.put("infer", "uid-b", ("gpu", placement(1, "1g.10gb", 0)))
    c = node.claims.put("whole", "uid-c", ("gpu", "gpu1"))
    lost = Lost(node.nv)
    lost.lose(1, how)
    reply = await node.kubelet.prepare(DRIVER, a, b, c)
    assert reply["uid-a"].error == ""
    assert [d.device_name for d in reply["uid-a"].devices] == [placement(0, "3g.40gb", 4)]
    assert {(p.name, s) for p, s, _ in node.nv.layout(0)} == {("3g.40gb", 4)}
    for uid in ("uid-b", "uid-c"):
        assert names_gpu_1_lost(reply[uid].error), reply[uid].error
        assert not reply[uid].devices
        assert node.plugin.preparer.checkpoint.get(uid) is None
    assert not lost.mutations(1)
    lost.recover()  # the kubelet retries once the GPU reads again
    reply = await node.kubelet.prepare(DRIVER, b)
    assert reply["uid-b"].error == "" and node.nv.layout(1)


@pytest.mark.parametrize("how", LOSSES)
async def test_a_claim_prepared_on_the_lost_gpu_is_left_alone_until_it_reads_again(
    node: Node, how: str
) -> None:
    a = node.claims.put("train", "uid-a", ("gpu", placement(1, "3g.40gb", 0)))
    other = node.claims.put("infer", "uid-o", ("gpu", placement(0, "2g.20gb", 2)))
    first = (await node.kubelet.prepare(DRIVER, a))["uid-a"]
    assert first.error == ""
    made = node.nv.mig_uuids_of(1)
    lost = Lost(node.nv)
    lost.lose(1, how)
    again = await node.kubelet.prepare(DRIVER, a)  # a kubelet restart prepares it again
    assert names_gpu_1_lost(again["uid-a"].error), again["uid-a"].error
    gone = await node.kubelet.unprepare(DRIVER, a)
    assert names_gpu_1_lost(gone["uid-a"].error), gone["uid-a"].error
    assert (await node.kubelet.prepare(DRIVER, other))["uid-o"].error == ""
    assert not lost.mutations(1)
    rec = node.plugin.preparer.checkpoint.get("uid-a")
    assert rec is not None and rec.state == "completed"
    lost.recover()
    assert node.nv.mig_uuids_of(1) == made
    assert (await node.kubelet.prepare(DRIVER, a))["uid-a"] == first
    assert (await node.kubelet.unprepare(DRIVER, a))["uid-a"].error == ""
    assert node.nv.mig_uuids_of(1) == {}


# -- the start-up clean-up ---------------------------------------------------------------------


def _instance(nv: FakeNvml, gpu: int, profile: str, start: int) -> str:
    prof = H100.profile(profile)
    gi = nv.create_gpu_instance(gpu, prof.profile_id, start, prof.memory_slices)
    ci = nv.create_compute_instance(gpu, gi)
    return nv.mig_uuids_of(gpu)[(gi, ci)]


@pytest.mark.parametrize("how", LOSSES)
def test_the_start_up_clean_up_skips_the_lost_gpu_and_cleans_the_others(how: str) -> None:
    nv = FakeNvml([H100, H100], mig_enabled=True)
    for gpu in (0, 1):
        _instance(nv, gpu, "1g.10gb", 6)  # unknown, idle
    prep = preparer(nv)
    for gpu in (0, 1):  # an agent that died mid-prepare on each GPU
        uuid = _instance(nv, gpu, "3g.40gb", 0)
        dev = PreparedDevice(
            "gpu", p(gpu, "3g.40gb", 0), gpu, nv.gpu_uuid(gpu), "3g.40gb", 0, uuid, "cdi"
        )
        prep.checkpoint.put(ClaimRecord("team", f"c{gpu}", f"uid-{gpu}", "started", [dev]))
    lost = Lost(nv)
    lost.lose(1, how)
    prep.clean_unknown()  # does not raise
    assert layout(nv, 0) == set()
    assert prep.checkpoint.get("uid-0") is None
    assert not lost.mutations(1)
    rec = prep.checkpoint.get("uid-1")
    assert rec is not None and rec.state == "started"  # rolled back once the GPU reads again
    lost.recover()
    assert layout(nv, 1) == {("3g.40gb", 0), ("1g.10gb", 6)}
    prep.clean_unknown()
    assert layout(nv, 1) == set() and len(prep.checkpoint) == 0


# -- publish rounds ----------------------------------------------------------------------------


def degraded(api: ApiServer) -> tuple[str, str, str]:
    (c,) = [c for c in np_of(api)["status"]["conditions"] if c["type"] == "Degraded"]
    return c["status"], c["reason"], c["message"]


@pytest.mark.parametrize("how", LOSSES)
async def test_a_shaped_round_isolates_the_lost_gpu_and_serves_the_others(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path, how: str
) -> None:
    nv = CountingNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    both = [("3g.40gb", 0), ("3g.40gb", 4)]
    await put_np(kmock, spec("p1", {0: both, 1: both}))
    await round_ok(driver)
    assert layout(nv, 1) == set(both)
    await put_claim(kmock, "train", [p(1, "3g.40gb", 4)])
    driver.preparer.prepare(ref(1), alloc(p(1, "3g.40gb", 4)))
    lost = Lost(nv)
    lost.lose(1, how)
    # GPU 1's idle 3g@0 is no longer planned and its 1g@0 is new: both would change GPU 1
    await patch_spec(kmock, spec("p2", {0: [("7g.80gb", 0)], 1: [("1g.10gb", 0), ("3g.40gb", 4)]}))
    await round_ok(driver)
    assert layout(nv, 0) == {("7g.80gb", 0)}  # GPU 0 reconciled
    assert not lost.mutations(1)  # nothing created or destroyed on GPU 1
    # GPU 1: its free placement withdrawn, the allocated one kept, for no other claim
    assert published(kmock) == {p(0, "7g.80gb", 0), p(1, "3g.40gb", 4)}
    assert tainted(kmock) == {p(1, "3g.40gb", 4): "unreadable"}
    status, reason, message = degraded(kmock)
    assert (status, reason) == ("True", "GpuUnreadable")
    assert names_gpu_1_lost(message) and "GPU 0" not in message, message
    assert conditions(kmock)["Applied"] == ("False", "Degraded", 2)
    assert driver.failures == 0
    lost.recover()
    await round_ok(driver)
    assert layout(nv, 1) == {("1g.10gb", 0), ("3g.40gb", 4)}
    assert published(kmock) == {p(0, "7g.80gb", 0), p(1, "1g.10gb", 0), p(1, "3g.40gb", 4)}
    assert tainted(kmock) == {}
    assert degraded(kmock) == ("False", "AsExpected", "")
    assert conditions(kmock)["Applied"] == ("True", "Applied", 2)


async def test_mode_all_withdraws_the_lost_gpus_devices_but_the_prepared_ones(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path
) -> None:
    nv = FakeNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path), shaped=False)
    driver.preparer.prepare(ref(1), alloc(p(1, "3g.40gb", 4)))
    lost = Lost(nv)
    lost.lose(1)
    await round_ok(driver)
    targets = driver.preparer.targets
    gpu0 = {n for n, t in targets.items() if t.gpu == 0}
    assert published(kmock) == gpu0 | {p(1, "3g.40gb", 4)}
    assert tainted(kmock) == {p(1, "3g.40gb", 4): "unreadable"}
    assert not lost.mutations(1)
    lost.recover()
    await round_ok(driver)
    assert published(kmock) == set(targets) and tainted(kmock) == {}


@pytest.mark.parametrize("shaped", [True, False])
@pytest.mark.parametrize(
    "down",
    ["count", "one GPU"],
    ids=["device count unreadable", "driver-wide code on one GPU"],
)
async def test_nvml_down_fails_the_round_and_publishes_nothing(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path, shaped: bool, down: str
) -> None:
    nv = FakeNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path), shaped=shaped)
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0)], 1: [("3g.40gb", 0)]}))
    await round_ok(driver)
    before, writes = published(kmock), driver.publisher.writes
    if down == "count":
        nv.inject("gpus", NvmlErrorCode.DRIVER_NOT_LOADED, times=None)
    else:
        Lost(nv).lose(1, "handle", NvmlErrorCode.UNINITIALIZED)
    await patch_spec(kmock, spec("p2", {0: [("7g.80gb", 0)], 1: [("7g.80gb", 0)]}))
    assert not await driver.publish_once()
    assert driver.failures == 1
    assert published(kmock) == before and driver.publisher.writes == writes


def test_a_gpu_lost_before_the_agent_starts_is_left_out_and_the_others_are_served() -> None:
    """Before, the agent read every GPU's model at start without isolating one: a GPU lost then
    stopped the whole DRA agent ("NVML is not usable"), every GPU of the node unserved."""
    nv = FakeNvml([H100, H100])
    nv.inject("*", NvmlErrorCode.GPU_IS_LOST, gpu=1, times=None)
    assert sorted(gpu_models(nv, CAT)) == [0]
    assert sorted(preparer(nv).models) == [0]
    nv.clear_faults()
    nv.inject("gpus", NvmlErrorCode.DRIVER_NOT_LOADED)  # NVML itself down: still an error
    with pytest.raises(NvmlError):
        gpu_models(nv, CAT)
