"""The DRA driver's prepare/unprepare on the fake NVML (node_agent.dra_prepare).

Checked: a claim's MIG instance is created at exactly its placement (MIG mode switched on first,
after a GPU reset on Ampere) and its CDI spec written; prepare is idempotent; an instance
another claim holds is never touched, whatever the allocation says; unknown idle instances in
the way are removed and used ones refused; unprepare refuses while processes run and then
destroys; an agent restart (checkpoint file) keeps everything; a crash mid-prepare is rolled
back; a reboot's lost instances are recreated.  A hypothesis state machine drives random
claims that the ResourceSlice counters allow (the scheduler's check, node_agent.dra_slices),
processes, unprepares, re-prepares and agent restarts, and checks that every counter-valid
allocation is prepared and no prepared claim's instance ever moves or vanishes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from node_agent.cdi import spec_path
from node_agent.dra_checkpoint import Checkpoint, ClaimRecord
from node_agent.dra_claims import AllocatedDevice, ClaimError, ClaimRef
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_slices import device_name, gpu_counters, placement_counters
from node_agent.nvml import NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from planner.catalog import default_catalog

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
H100 = CAT.model("H100-80GB")
NODE = "node-a"


def ref(n: int) -> ClaimRef:
    return ClaimRef("team", f"claim-{n}", f"uid-{n:04d}")


def dev(device: str, request: str = "gpu") -> AllocatedDevice:
    return AllocatedDevice(request, NODE, device)


def placement(gpu: int, profile: str, start: int, model=H100) -> str:
    return device_name(gpu, model.profile(profile), start)


def preparer(nv: FakeNvml, tmp: Path | None = None) -> DraPreparer:
    return DraPreparer(
        nv,
        CAT,
        node=NODE,
        checkpoint=Checkpoint(tmp / "dra.json" if tmp else None),
        cdi_dir=tmp / "cdi" if tmp else None,
    )


def layout(nv: FakeNvml, gpu: int) -> set[tuple[str, int]]:
    return {(p.name, s) for p, s, _ in nv.layout(gpu)}


def test_prepare_creates_the_instance_at_its_placement_and_writes_cdi(tmp_path: Path) -> None:
    nv = FakeNvml([H100, H100])
    prep = preparer(nv, tmp_path)
    got = prep.prepare(ref(1), [dev(placement(1, "3g.40gb", 4)), dev(placement(1, "1g.10gb", 0))])
    assert nv.mig_enabled(1) and not nv.mig_enabled(0)
    assert layout(nv, 1) == {("3g.40gb", 4), ("1g.10gb", 0)}
    uuids = set(nv.mig_uuids())
    assert {d.uuid for d in got} == uuids
    spec = json.loads(spec_path(tmp_path / "cdi", "uid-0001").read_text())
    assert spec["kind"] == "gpu.gpuslice.io/claim"
    names = {d["name"] for d in spec["devices"]}
    assert names == {f"uid-0001-{d.device}" for d in got}
    assert {d.cdi_id for d in got} == {f"gpu.gpuslice.io/claim={n}" for n in names}
    (env,) = {e for d in spec["devices"] for e in d["containerEdits"]["env"]}
    assert env == "NVIDIA_VISIBLE_DEVICES=" + ",".join(
        d.uuid for d in sorted(got, key=lambda d: d.device)
    )


def test_prepare_is_idempotent_and_survives_an_agent_restart(tmp_path: Path) -> None:
    nv = FakeNvml([H100])
    first = preparer(nv, tmp_path).prepare(ref(1), [dev(placement(0, "2g.20gb", 2))])
    before = nv.calls
    again = preparer(nv, tmp_path)  # a new agent process reading the checkpoint
    assert again.clean_unknown() == []
    assert again.prepare(ref(1), [dev(placement(0, "2g.20gb", 2))]) == first
    assert layout(nv, 0) == {("2g.20gb", 2)}
    assert set(nv.mig_uuids()) == {first[0].uuid}
    assert nv.calls > before  # it looked, but created nothing
    again.unprepare("uid-0001")
    assert layout(nv, 0) == set()
    assert not spec_path(tmp_path / "cdi", "uid-0001").exists()
    again.unprepare("uid-0001")  # twice is fine


def test_another_claims_instance_is_never_touched() -> None:
    nv = FakeNvml([H100])
    prep = preparer(nv)
    (held,) = prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 4))])
    for stale in (placement(0, "3g.40gb", 4), placement(0, "1g.10gb", 5), "gpu0"):
        with pytest.raises(ClaimError, match="team/claim-1"):
            prep.prepare(ref(2), [dev(stale)])
        assert set(nv.mig_uuids()) == {held.uuid}
        assert prep.checkpoint.get("uid-0002") is None
    # a two-device claim that fails on its second device leaves nothing behind
    with pytest.raises(ClaimError):
        prep.prepare(ref(3), [dev(placement(0, "1g.10gb", 0)), dev(placement(0, "1g.10gb", 6))])
    assert set(nv.mig_uuids()) == {held.uuid}


def test_unknown_instances_idle_removed_used_refused() -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    big = nv.create_gpu_instance(0, H100.profile("7g.80gb").profile_id, 0, 8)
    nv.create_compute_instance(0, big)
    pid = nv.start_process(0, big, 0)
    prep = preparer(nv)
    with pytest.raises(ClaimError, match="runs processes outside any claim"):
        prep.prepare(ref(1), [dev(placement(0, "1g.10gb", 0))])
    assert layout(nv, 0) == {("7g.80gb", 0)}
    assert prep.clean_unknown() and layout(nv, 0) == {("7g.80gb", 0)}  # used: kept
    nv.stop_process(pid)
    prep.prepare(ref(1), [dev(placement(0, "1g.10gb", 0))])
    assert layout(nv, 0) == {("1g.10gb", 0)}


def test_an_exact_unknown_idle_instance_is_adopted() -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    gi = nv.create_gpu_instance(0, H100.profile("4g.40gb").profile_id, 0, 4)
    (got,) = preparer(nv).prepare(ref(1), [dev(placement(0, "4g.40gb", 0))])
    assert [i[0] for i in nv.instances(0)] == [gi]  # the same GI, given its compute instance
    assert got.uuid in nv.mig_uuids()


def test_unprepare_waits_for_processes_to_end() -> None:
    nv = FakeNvml([H100])
    prep = preparer(nv)
    (d,) = prep.prepare(ref(1), [dev(placement(0, "1g.20gb", 6))])
    g, gi, ci = nv.mig_uuids()[d.uuid]
    pid = nv.start_process(g, gi, ci)
    with pytest.raises(ClaimError, match="still runs processes"):
        prep.unprepare("uid-0001")
    assert set(nv.mig_uuids()) == {d.uuid}
    nv.stop_process(pid)
    prep.unprepare("uid-0001")
    assert nv.mig_uuids() == {} and len(prep.checkpoint) == 0


def test_whole_gpu_switches_mig_off_and_placements_on_ampere_with_a_reset() -> None:
    nv = FakeNvml([A100], mig_enabled=True)
    prep = preparer(nv)
    (whole,) = prep.prepare(ref(1), [dev("gpu0")])
    assert whole.uuid == nv.gpu_uuid(0) and not nv.mig_enabled(0)
    with pytest.raises(ClaimError, match="prepared whole"):
        prep.prepare(ref(2), [dev(placement(0, "1g.10gb", 0, A100))])
    prep.unprepare("uid-0001")
    prep.prepare(ref(2), [dev(placement(0, "1g.10gb", 0, A100))])  # pending -> GPU reset
    assert nv.mig_enabled(0) and not nv.mig_pending(0)
    assert layout(nv, 0) == {("1g.10gb", 0)}


def test_a_crash_mid_prepare_is_rolled_back_at_start(tmp_path: Path) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    gi = nv.create_gpu_instance(0, H100.profile("1g.10gb").profile_id, 3, 1)
    nv.create_compute_instance(0, gi)
    assert len(nv.mig_uuids()) == 1
    cp = Checkpoint(tmp_path / "dra.json")
    started = ClaimRecord("team", "claim-1", "uid-0001", "started", [])
    cp.put(started)
    prep = preparer(nv, tmp_path)
    assert prep.checkpoint.get("uid-0001") is not None
    prep.clean_unknown()
    assert prep.checkpoint.get("uid-0001") is None and nv.mig_uuids() == {}


def test_a_roll_back_nvml_refuses_at_start_is_logged_and_left_not_a_crash_loop(
    tmp_path: Path,
) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = preparer(nv, tmp_path)
    (made,) = prep.prepare(ref(1), [dev(placement(0, "3g.40gb", 0))])
    rec = prep.checkpoint.get("uid-0001")
    assert rec is not None
    prep.checkpoint.put(ClaimRecord(rec.namespace, rec.name, rec.uid, "started", rec.devices))
    nv.inject("destroy_gpu_instance", times=None)  # every destroy refused
    again = preparer(nv, tmp_path)  # the agent starts again
    assert again.clean_unknown() == []  # before: the NvmlError failed the start, every time
    kept = again.checkpoint.get("uid-0001")
    assert kept is not None and kept.state == "started"
    nv.clear_faults()
    preparer(nv, tmp_path).clean_unknown()  # the next start rolls it back
    assert preparer(nv, tmp_path).checkpoint.get("uid-0001") is None
    assert made.uuid not in nv.mig_uuids()


def test_a_failed_prepare_whose_roll_back_fails_too_still_names_the_cause(
    tmp_path: Path,
) -> None:
    nv = FakeNvml([H100, H100], mig_enabled=True)
    prep = preparer(nv, tmp_path)
    big, small = placement(0, "4g.40gb", 0), placement(1, "1g.10gb", 4)
    # GPU 0's device is made; GPU 1's compute instance fails, and so does every destroy
    nv.inject("create_compute_instance", NvmlErrorCode.TIMEOUT, gpu=1, times=None)
    nv.inject("destroy_gpu_instance", NvmlErrorCode.IN_USE, times=None)
    with pytest.raises(ClaimError) as err:
        prep.prepare(ref(1), [dev(big, "a"), dev(small, "b")])
    message = str(err.value)
    assert "create_compute_instance: NVML_ERROR_TIMEOUT" in message  # the cause, not only
    assert "destroy_gpu_instance: NVML_ERROR_IN_USE" in message  # what the roll-back met
    assert "team/claim-1" in message and message.count("team/claim-1") == 1
    kept = prep.checkpoint.get("uid-0001")
    assert kept is not None and kept.state == "started"  # rolled back later
    nv.clear_faults()
    assert prep.prepare(ref(1), [dev(big, "a"), dev(small, "b")])  # the kubelet's retry
    assert (layout(nv, 0), layout(nv, 1)) == ({("4g.40gb", 0)}, {("1g.10gb", 4)})


def test_lost_instances_are_prepared_again_after_a_reboot(tmp_path: Path) -> None:
    nv = FakeNvml([H100])
    prep = preparer(nv, tmp_path)
    devices = [dev(placement(0, "3g.40gb", 0)), dev(placement(0, "3g.40gb", 4), "other")]
    first = prep.prepare(ref(1), devices)
    nv.reboot()  # MIG mode off, instances gone
    again = preparer(nv, tmp_path).prepare(ref(1), devices)
    assert [(d.device, d.cdi_id) for d in again] == [(d.device, d.cdi_id) for d in first]
    assert {d.uuid for d in again} == set(nv.mig_uuids())
    assert layout(nv, 0) == {("3g.40gb", 0), ("3g.40gb", 4)}


def test_a_corrupt_checkpoint_is_kept_aside(tmp_path: Path) -> None:
    (tmp_path / "dra.json").write_text("{not json")
    cp = Checkpoint(tmp_path / "dra.json")
    assert len(cp) == 0
    assert (tmp_path / "dra.json.corrupt").read_text() == "{not json"


# -- random claims the counters allow ------------------------------------------------------

MODELS = [H100, A100]


def fits(allocated: list[str], new: list[str], targets: dict) -> bool:
    """The scheduler's counter check (facts/dra.md section 2) over the published devices."""
    used: dict[tuple[int, str], int] = {}
    for name in allocated + new:
        t = targets[name]
        for k, v in placement_counters(MODELS[t.gpu], t.profile, t.start).items():
            used[(t.gpu, k)] = used.get((t.gpu, k), 0) + v
    return all(v <= gpu_counters(MODELS[g])[k] for (g, k), v in used.items())


class PrepareMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nv = FakeNvml(MODELS)
        self.prep = preparer(self.nv)
        self.claims: dict[int, list[str]] = {}
        self.uuids: dict[int, dict[str, str]] = {}
        self.procs: dict[int, list[int]] = {}
        self.next = 0

    def _allocated(self) -> list[str]:
        return [d for ds in self.claims.values() for d in ds]

    @rule(data=st.data(), k=st.integers(1, 3))
    def prepare(self, data: st.DataObject, k: int) -> None:
        names = sorted(self.prep.targets)
        new = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=k, unique=True))
        if not fits(self._allocated(), new, self.prep.targets):
            event("allocation the counters refuse")
            return  # the scheduler would not allocate this
        event(f"prepared a claim beside {min(len(self.claims), 3)}+ others")
        self.next += 1
        got = self.prep.prepare(ref(self.next), [dev(d, f"r{i}") for i, d in enumerate(new)])
        self.claims[self.next] = new
        self.uuids[self.next] = {d.device: d.uuid for d in got}

    @rule(data=st.data(), k=st.integers(1, 3))
    def stale_allocation(self, data: st.DataObject, k: int) -> None:
        """An allocation the counters refuse (made against an older publication, or by
        another tool): prepare fails and no prepared claim is touched (the invariant)."""
        names = sorted(self.prep.targets)
        new = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=k, unique=True))
        if fits(self._allocated(), new, self.prep.targets):
            return
        event("stale allocation refused")
        self.next += 1
        with pytest.raises(ClaimError):
            self.prep.prepare(ref(self.next), [dev(d, f"r{i}") for i, d in enumerate(new)])

    @rule(data=st.data())
    def run_process(self, data: st.DataObject) -> None:
        if not self.claims:
            return
        n = data.draw(st.sampled_from(sorted(self.claims)))
        for d in self.prep.checkpoint.get(f"uid-{n:04d}").devices:
            if d.profile is None:
                self.procs.setdefault(n, []).append(self.nv.start_process(d.gpu))
            else:
                g, gi, ci = self.nv.mig_uuids()[d.uuid]
                self.procs.setdefault(n, []).append(self.nv.start_process(g, gi, ci))

    @rule(data=st.data(), finish=st.booleans())
    def unprepare(self, data: st.DataObject, finish: bool) -> None:
        if not self.claims:
            return
        n = data.draw(st.sampled_from(sorted(self.claims)))
        if finish:
            for pid in self.procs.pop(n, []):
                self.nv.stop_process(pid)
        if self.procs.get(n):
            with pytest.raises(ClaimError):
                self.prep.unprepare(f"uid-{n:04d}")
            event("unprepare refused while in use")
            return
        self.prep.unprepare(f"uid-{n:04d}")
        gone = set(self.uuids.pop(n).values())
        del self.claims[n]
        assert not gone & set(self.nv.mig_uuids())

    @rule(data=st.data())
    def prepare_again(self, data: st.DataObject) -> None:
        if not self.claims:
            return
        n = data.draw(st.sampled_from(sorted(self.claims)))
        got = self.prep.prepare(ref(n), [dev(d, f"r{i}") for i, d in enumerate(self.claims[n])])
        assert {d.device: d.uuid for d in got} == self.uuids[n]

    @rule()
    def restart_agent(self) -> None:
        cp = self.prep.checkpoint
        self.prep = DraPreparer(self.nv, CAT, node=NODE, checkpoint=cp)
        assert self.prep.clean_unknown() == []

    @invariant()
    def prepared_instances_stay(self) -> None:
        have = self.nv.mig_uuids()
        for n in self.claims:
            for name, uuid in self.uuids[n].items():
                t = self.prep.targets[name]
                if t.profile is None:
                    assert uuid == self.nv.gpu_uuid(t.gpu) and not self.nv.mig_enabled(t.gpu)
                    continue
                g, gi, _ = have[uuid]
                (inst,) = [i for i in self.nv.instances(g) if i[0] == gi]
                assert (g, inst[1].name, inst[2]) == (t.gpu, t.profile.name, t.start)
        assert len(self.prep.checkpoint) == len(self.claims)


TestPrepareMachine = PrepareMachine.TestCase
TestPrepareMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
