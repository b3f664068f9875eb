"""The reconciler, status, devices, MPS supervision, agent loop and `gpuslice agent --fake`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from contract.nodepartitioning import NodePartitioningSpec
from gpuslice.cli import main as cli_main
from node_agent.agent import Agent, FileSpecSource, InMemorySpecSource
from node_agent.devices import (
    ENV_MPS_MEM_LIMIT,
    ENV_MPS_PIPE,
    ENV_MPS_THREADS,
    ENV_VISIBLE,
    AdvertisedDevice,
    container_env,
    parse_mps_slice_id,
)
from node_agent.mps import FakeSupervisor, MpsControlSupervisor, MpsDaemonSpec, MpsError
from node_agent.nvml import ComputeMode, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler, ReconcileResult
from planner.catalog import default_catalog

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")


class Pods:
    """In-use source: scripted answers (a list consumed in order), else ``ids``; or failing."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.script: list[set[str]] = []
        self.down = False

    async def in_use_device_ids(self) -> set[str]:
        if self.down:
            raise ConnectionError("kubelet socket missing")
        return set(self.script.pop(0)) if self.script else set(self.ids)


class Node:
    def __init__(self, *models: str, mig: bool = False, passthrough: bool = False) -> None:
        self.nv = FakeNvml([CAT.model(m) for m in models], mig_enabled=mig, passthrough=passthrough)
        self.pods = Pods()
        self.sup = FakeSupervisor(nvml=self.nv)  # MPS starts only in EXCLUSIVE_PROCESS
        self.published: list[dict[str, list[AdvertisedDevice]]] = []
        self.agent = self.restart()

    def restart(self) -> Reconciler:
        self.agent = Reconciler(
            self.nv, self.pods, self.sup, CAT, mps_pipe_root="/run/mps", publish=self.publish
        )
        return self.agent

    def publish(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        self.published.append({r: list(ds) for r, ds in devices.items()})

    def run(self, spec: NodePartitioningSpec | None, gen: int = 1) -> ReconcileResult:
        return asyncio.run(self.agent.reconcile(spec, gen, now="2026-01-01T00:00:00Z"))

    def layout(self, gpu: int = 0) -> list[tuple[str, int]]:
        return [(p.name, s) for p, s, ci in self.nv.layout(gpu) if ci]


def mig_spec(*instances: tuple[str, int], gpu: int = 0, mode: str = "mig") -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p1",
            "mode": mode,
            "gpus": [{"index": gpu, "mig": [{"profile": n, "start": s} for n, s in instances]}],
        }
    )


def mps_spec(*slices: tuple[int, int], gpu: int = 0) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "mode": "mps",
            "gpus": [
                {
                    "index": gpu,
                    "mps": [{"memoryMiB": m, "activeThreadPercentage": p} for m, p in slices],
                }
            ],
        }
    )


def cond(res: ReconcileResult, type_: str) -> tuple[str, str]:
    c = next(c for c in res.status.conditions if c.type == type_)
    return c.status, c.reason


LAYOUT = (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))


def test_applies_exact_placements_from_mig_off_then_is_idempotent() -> None:
    node = Node("A100-SXM4-80GB")
    res = node.run(mig_spec(*LAYOUT), gen=3)
    # Ampere on bare metal: the driver resets the idle GPU itself; then GI + CI per instance
    assert res.applied and res.operations == 1 + 2 * len(LAYOUT)
    assert node.layout() == sorted(LAYOUT, key=lambda x: x[1])
    assert res.status.observedGeneration == 3 and res.status.planId == "p1"
    assert cond(res, "Applied") == ("True", "Applied") and cond(res, "Degraded")[0] == "False"
    gpu = res.status.gpus[0]
    assert gpu.migEnabled and all(i.deviceId.startswith("MIG-") and not i.used for i in gpu.mig)
    assert sorted(res.devices) == ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
                                   "nvidia.com/mig-3g.40gb"]  # fmt: skip
    d = res.devices["nvidia.com/mig-3g.40gb"][0]
    assert d.env == {ENV_VISIBLE: d.id} and d.healthy
    again = node.run(mig_spec(*LAYOUT), gen=3)
    assert again.applied and again.operations == 0 and again.status == res.status


def test_never_destroys_an_allocated_instance_and_degrades_without_touching_the_gpu() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(mig_spec(*LAYOUT))
    held = next(i.deviceId for i in node.run(mig_spec(*LAYOUT)).status.gpus[0].mig if i.start == 3)
    node.pods.ids = {held}
    # the new spec wants 7g: it would need the held 1g@3
    res = node.run(mig_spec(("7g.80gb", 0)), gen=2)
    assert not res.applied and res.operations == 0
    assert cond(res, "Degraded") == ("True", "InstanceInUse") and held in res.blocks[0].message
    assert node.layout() == sorted(LAYOUT, key=lambda x: x[1])
    assert [i.used for i in res.status.gpus[0].mig if i.start == 3] == [True]
    # a spec that keeps the held instance in place is applied around it
    res = node.run(mig_spec(("1g.10gb", 3), ("3g.40gb", 4)), gen=3)
    assert res.applied and node.layout() == [("1g.10gb", 3), ("3g.40gb", 4)]
    # released: the 7g spec goes through
    node.pods.ids = set()
    assert node.run(mig_spec(("7g.80gb", 0)), gen=4).applied
    assert node.layout() == [("7g.80gb", 0)]


def test_processes_make_an_instance_used_even_without_a_pod() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4)))
    gi = next(gi for gi, p, s, _ in node.nv.instances(0) if s == 4)
    node.nv.start_process(0, gi, 0)
    res = node.run(mig_spec(("4g.40gb", 0)), gen=2)
    assert cond(res, "Degraded") == ("True", "InstanceInUse")
    assert node.layout() == [("3g.40gb", 0), ("3g.40gb", 4)]


@pytest.mark.parametrize(
    ("instances", "reason"),
    [
        ((("3g.40gb", 2),), "InvalidLayout"),
        ((("3g.40gb", 0), ("3g.40gb", 4), ("1g.10gb", 6)), "InvalidLayout"),
        ((("5g.50gb", 0),), "UnknownProfile"),
    ],
)
def test_invalid_spec_is_degraded_and_nothing_is_destroyed(
    instances: tuple[tuple[str, int], ...], reason: str
) -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(mig_spec(*LAYOUT))
    res = node.run(mig_spec(*instances), gen=2)
    assert cond(res, "Degraded") == ("True", reason) and res.operations == 0
    assert "GPU 0:" in res.status.conditions[1].message
    assert node.layout() == sorted(LAYOUT, key=lambda x: x[1])
    assert res.settled  # nothing a retry could fix


def test_spec_naming_a_missing_gpu_or_non_mig_gpu_is_degraded() -> None:
    node = Node("V100-32GB")
    res = node.run(mig_spec(("1g.10gb", 0), gpu=3))
    assert cond(res, "Degraded") == ("True", "NoSuchGpu")
    res = node.run(mig_spec(("1g.10gb", 0)))
    assert cond(res, "Degraded") == ("True", "MigNotSupported")


def test_allocation_racing_the_withdrawal_cancels_the_destroy() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(mig_spec(("7g.80gb", 0)))
    uuid = node.run(mig_spec(("7g.80gb", 0))).status.gpus[0].mig[0].deviceId
    node.published.clear()
    # free at the first read, allocated by the time of the re-read after withdrawal
    node.pods.script = [set(), {uuid}]
    node.pods.ids = {uuid}
    res = node.run(mig_spec(("1g.10gb", 0)), gen=2)
    assert res.operations == 0 and node.layout() == [("7g.80gb", 0)]
    assert res.blocks[0].reason == "InUseChanged" and res.blocks[0].transient
    withdrawn = node.published[0]
    assert all(d.id != uuid for ds in withdrawn.values() for d in ds)
    assert any(d.id == uuid for d in node.published[-1]["nvidia.com/mig-7g.80gb"])
    assert not res.settled


def test_podresources_down_destroys_nothing_but_fills_free_space() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(mig_spec(("3g.40gb", 0)))
    node.pods.down = True
    res = node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4)), gen=2)
    assert node.layout() == [("3g.40gb", 0), ("3g.40gb", 4)]
    assert "PodResources unavailable" in res.status.lastError and not res.applied
    res = node.run(mig_spec(("7g.80gb", 0)), gen=3)
    assert res.blocks[0].reason == "InUseUnknown" and res.operations == 0
    assert cond(res, "Applied") == ("False", "Waiting") and cond(res, "Degraded")[0] == "False"
    node.pods.down = False
    assert node.run(mig_spec(("7g.80gb", 0)), gen=3).applied


def test_nvml_failure_mid_create_is_completed_by_the_next_pass() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.nv.inject("create_compute_instance", NvmlErrorCode.UNKNOWN)
    res = node.run(mig_spec(*LAYOUT))
    assert not res.applied and "create_compute_instance" in res.status.lastError
    assert cond(res, "Applied") == ("False", "InProgress")
    res = node.run(mig_spec(*LAYOUT))
    assert res.applied and res.status.lastError == ""
    # a destroy that timed out after the CI was gone leaves a bare GI: destroyed next pass
    node.nv.inject("destroy_compute_instance", NvmlErrorCode.TIMEOUT, after=True)
    node.run(mig_spec(("7g.80gb", 0)), gen=2)
    assert node.run(mig_spec(("7g.80gb", 0)), gen=2).applied
    assert node.layout() == [("7g.80gb", 0)]


def test_mps_slices_env_daemon_and_restart_rebuild_from_in_use_ids() -> None:
    node = Node("A100-SXM4-80GB")
    res = node.run(mps_spec((10240, 12), (10240, 12), (20480, 25)))
    assert res.applied and node.sup.running() == {"gpu0"}
    daemon = node.sup.daemons["gpu0"]
    assert daemon.pipe_dir == "/run/mps/gpu0" and daemon.device_uuid == res.status.gpus[0].uuid
    ten = res.devices["nvidia.com/gpu-10gb"]
    assert len(ten) == 2 and len(res.devices["nvidia.com/gpu-20gb"]) == 1
    d = ten[0]
    assert d.env[ENV_VISIBLE] == res.status.gpus[0].uuid
    assert d.env[ENV_MPS_PIPE] == "/run/mps/gpu0"
    assert d.env[ENV_MPS_MEM_LIMIT] == "0=10240M" and d.env[ENV_MPS_THREADS] == "12"
    assert container_env(ten)[ENV_MPS_MEM_LIMIT] == "0=20480M"
    node.pods.ids = {d.id}
    node.restart()  # the agent crashed: its slice table is gone
    res = node.run(mps_spec((10240, 12), (10240, 12), (20480, 25)))
    assert res.applied and d.id in {x.id for x in res.devices["nvidia.com/gpu-10gb"]}
    assert [s.used for s in res.status.gpus[0].mps].count(True) == 1
    # MIG wanted while a slice is held: Degraded, the slice and daemon stay
    res = node.run(mig_spec(("7g.80gb", 0)), gen=2)
    assert cond(res, "Degraded") == ("True", "GpuBusy") and node.sup.running() == {"gpu0"}
    node.pods.ids = set()
    res = node.run(mig_spec(("7g.80gb", 0)), gen=3)
    assert res.applied and node.sup.running() == set() and "nvidia.com/gpu-10gb" not in res.devices


def test_mps_daemon_failure_marks_slices_unhealthy_then_recovers() -> None:
    node = Node("A30")
    node.sup.fail_next = 1
    res = node.run(mps_spec((4096, 16)))
    assert not res.applied and not res.devices["nvidia.com/gpu-4gb"][0].healthy
    res = node.run(mps_spec((4096, 16)))
    assert res.applied and res.devices["nvidia.com/gpu-4gb"][0].healthy


def test_mps_gpu_is_set_exclusive_process_only_while_idle_and_back_to_default_for_mig() -> None:
    node = Node("A100-SXM4-80GB")
    mode_calls: list[tuple[int, int]] = []  # (mode, processes on the GPU at the call)
    node.nv.hooks.append(
        lambda op, args: (
            mode_calls.append((args[1], node.nv.processes_on(args[0])))
            if op == "set_compute_mode"
            else None
        )
    )
    stray = node.nv.start_process(0)  # something runs on the GPU outside MPS
    res = node.run(mps_spec((10240, 50)))
    assert not res.applied and node.sup.running() == set() and mode_calls == []
    assert "EXCLUSIVE_PROCESS" in res.status.lastError and "1 process(es)" in res.status.lastError
    assert [d.healthy for d in res.devices["nvidia.com/gpu-10gb"]] == [False]
    assert node.nv.compute_mode(0) == ComputeMode.DEFAULT

    node.nv.stop_process(stray)
    res = node.run(mps_spec((10240, 50)))
    assert res.applied and node.sup.running() == {"gpu0"}
    assert node.nv.compute_mode(0) == ComputeMode.EXCLUSIVE_PROCESS
    assert mode_calls == [(ComputeMode.EXCLUSIVE_PROCESS, 0)]
    assert node.run(mps_spec((10240, 50))).operations == 0  # set once, not every pass

    node.nv.reboot()  # compute mode and daemons are gone: both come back
    node.sup.kill("gpu0")
    res = node.run(mps_spec((10240, 50)))
    assert res.applied and node.nv.compute_mode(0) == ComputeMode.EXCLUSIVE_PROCESS

    res = node.run(mig_spec(("7g.80gb", 0)), gen=2)  # back to MIG: DEFAULT before MIG mode on
    assert res.applied and node.nv.compute_mode(0) == ComputeMode.DEFAULT
    assert mode_calls[-1] == (ComputeMode.DEFAULT, 0)


def test_fake_supervisor_refuses_mps_outside_exclusive_process() -> None:
    nv = FakeNvml([A100])
    sup = FakeSupervisor(nvml=nv)
    spec = MpsDaemonSpec("gpu0", nv.gpu_uuid(0), "/run/mps/gpu0", "/var/log/mps/gpu0")
    with pytest.raises(MpsError, match="compute mode DEFAULT"):
        sup.ensure(spec)
    nv.set_compute_mode(0, ComputeMode.EXCLUSIVE_PROCESS)
    sup.ensure(spec)
    assert sup.running() == {"gpu0"}
    # hybrid daemons serve a MIG device: the GPU's compute mode is not theirs to check
    nv.set_compute_mode(0, ComputeMode.DEFAULT)
    sup.ensure(MpsDaemonSpec("gpu0-mig0", "MIG-x", "/run/mps/gpu0-mig0", "/var/log/mps/m"))
    assert sup.running() == {"gpu0", "gpu0-mig0"}


def test_mps_spec_larger_than_the_gpu_is_degraded() -> None:
    node = Node("A30")
    res = node.run(mps_spec((20480, 50), (8192, 50)))
    assert cond(res, "Degraded") == ("True", "InvalidSpec")


def test_hybrid_runs_one_daemon_per_mig_instance() -> None:
    node = Node("A100-SXM4-80GB")
    res = node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4), mode="hybrid"))
    assert res.applied and node.sup.running() == {"gpu0-mig0", "gpu0-mig4"}
    d = res.devices["nvidia.com/mig-3g.40gb"][0]
    assert d.env[ENV_MPS_PIPE].startswith("/run/mps/gpu0-mig")
    res = node.run(mig_spec(("7g.80gb", 0)), gen=2)
    assert res.applied and node.sup.running() == set()


def test_withdrawal_keeps_slices_of_a_daemon_that_is_down_unhealthy() -> None:
    """Re-advertising before a destroy must not make a slice whose daemon failed allocatable:
    its client would run outside MPS and hold the GPU the daemon then waits for."""
    node = Node("A30")
    node.sup.fail_next = 2
    res = node.run(mps_spec((4096, 16), (8192, 33)))
    assert not res.applied and node.sup.running() == set()
    assert not any(d.healthy for ds in res.devices.values() for d in ds)
    node.published.clear()
    res = node.run(mps_spec((4096, 16)), gen=2)  # drops the 8 GiB slice: withdraw first
    withdrawal = node.published[0]
    assert [d.healthy for d in withdrawal["nvidia.com/gpu-4gb"]] == [False]
    assert not withdrawal.get("nvidia.com/gpu-8gb")  # the doomed slice is withdrawn
    res = node.run(mps_spec((4096, 16)), gen=2)
    assert res.applied and [d.healthy for d in res.devices["nvidia.com/gpu-4gb"]] == [True]


def test_mps_daemon_limits_are_the_largest_slice_and_follow_the_table() -> None:
    """Limits a client cannot raise: the daemon's defaults cap every client of the GPU."""
    node = Node("A100-SXM4-80GB")
    res = node.run(mps_spec((10240, 12), (20480, 25)))
    assert res.applied
    d = node.sup.daemons["gpu0"]
    assert (d.default_pinned_mem_limit_mib, d.default_thread_percentage) == (20480, 25)
    assert d.limit_commands() == [
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 20480M",
    ]
    node.pods.ids = {res.devices["nvidia.com/gpu-10gb"][0].id}  # the small slice is held
    res = node.run(mps_spec((10240, 12), (4096, 5)), gen=2)  # the big free slice goes
    assert res.applied and node.sup.starts == 1 and node.sup.limit_updates == 1
    d = node.sup.daemons["gpu0"]  # same daemon, its clients untouched, limits lowered
    assert (d.default_pinned_mem_limit_mib, d.default_thread_percentage) == (10240, 12)


def test_hybrid_daemon_of_a_slot_with_a_new_instance_is_restarted_for_it() -> None:
    node = Node("A100-SXM4-80GB")
    assert node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4), mode="hybrid")).applied
    old = node.sup.daemons["gpu0-mig0"].device_uuid
    res = node.run(mig_spec(("4g.40gb", 0), ("3g.40gb", 4), mode="hybrid"), gen=2)
    new = {i.start: i.deviceId for i in res.status.gpus[0].mig}
    # the old instance's daemon is stopped before its instance goes, a new one started after
    assert res.applied and new[0] != old and node.sup.starts == 3 and node.sup.restarts == 0
    assert node.sup.daemons["gpu0-mig0"].device_uuid == new[0]  # not the destroyed 3g
    assert node.sup.daemons["gpu0-mig4"].device_uuid == new[4]


def test_hybrid_daemon_of_a_held_instance_survives_a_change_to_mig() -> None:
    """The finding: nothing guarded the daemon a running pod uses; a hybrid->mig spec change
    must keep it while the pod holds the instance."""
    node = Node("A100-SXM4-80GB")
    res = node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4), mode="hybrid"))
    held = next(d for d in res.devices["nvidia.com/mig-3g.40gb"] if d.id.startswith("MIG-"))
    node.pods.ids = {held.id}
    start = next(i.start for i in res.status.gpus[0].mig if i.deviceId == held.id)
    res = node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4)), gen=2)
    assert res.applied and node.sup.running() == {f"gpu0-mig{start}"}
    node.pods.ids = set()
    res = node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4)), gen=3)
    assert res.applied and node.sup.running() == set()


def test_mps_control_supervisor_limits_restarts_and_adoption() -> None:
    calls: list[str] = []
    up: dict[str, str] = {}  # pipe dir -> device of the running daemon

    def runner(argv: Sequence[str], env: Mapping[str, str], stdin: str | None) -> tuple[int, str]:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        calls.append(stdin.strip() if stdin else " ".join(argv[1:]))
        if stdin == "get_server_list\n":
            return (0, "4242\n") if pipe in up else (1, "cannot connect")
        if list(argv)[-1] == "-d":
            up[pipe] = env["CUDA_VISIBLE_DEVICES"]
        if stdin == "quit\n":
            up.pop(pipe, None)
        return 0, ""

    def spec(device: str, mem: int | None, pct: int) -> MpsDaemonSpec:
        return MpsDaemonSpec("k", device, "/tmp/gpuslice-t/p", "/tmp/gpuslice-t/l", pct, mem)

    sup = MpsControlSupervisor(runner)
    sup.ensure(spec("GPU-1", 20480, 25))
    assert calls == [
        "get_server_list",
        "-d",
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 20480M",
    ]
    calls.clear()
    sup.ensure(spec("GPU-1", 20480, 25))
    assert calls == ["get_server_list"]  # unchanged: nothing sent
    calls.clear()
    sup.ensure(spec("GPU-1", 10240, 12))  # new limits: defaults and the running server
    assert calls == [
        "get_server_list",
        "set_default_active_thread_percentage 12",
        "set_default_device_pinned_mem_limit 0 10240M",
        "set_active_thread_percentage 4242 12",
        "set_device_pinned_mem_limit 4242 0 10240M",
    ]
    calls.clear()
    sup.ensure(spec("MIG-2", None, 100))  # another device at this key: restarted
    assert calls == ["get_server_list", "quit", "-d", "set_default_active_thread_percentage 100"]
    assert up == {"/tmp/gpuslice-t/p": "MIG-2"}
    calls.clear()
    adopted = MpsControlSupervisor(runner)  # the agent restarted; the daemon runs on
    adopted.ensure(spec("MIG-2", None, 100))
    assert calls == [
        "get_server_list",
        "set_default_active_thread_percentage 100",
        "set_active_thread_percentage 4242 100",
    ]


def test_slice_ids_are_self_describing_and_fit_the_kubelet_limit() -> None:
    node = Node("H100-80GB")
    res = node.run(mps_spec((40960, 50)))
    sid = res.devices["nvidia.com/gpu-40gb"][0].id
    parsed = parse_mps_slice_id(sid)
    assert parsed is not None and parsed.memory_mib == 40960 and parsed.thread_percentage == 50
    assert len(sid) <= 63


def test_container_env_for_mps_slices_of_two_gpus_is_refused() -> None:
    node = Node("A30", "A30")
    spec = NodePartitioningSpec.model_validate(
        {"mode": "mps", "gpus": [{"index": i, "mps": [{"memoryMiB": 4096, "activeThreadPercentage": 16}]} for i in (0, 1)]}
    )  # fmt: skip
    res = node.run(spec)
    with pytest.raises(ValueError, match="one MPS control daemon"):
        container_env(res.devices["nvidia.com/gpu-4gb"])


def test_mps_control_supervisor_commands() -> None:
    calls: list[tuple[list[str], dict[str, str], str | None]] = []
    alive = {"up": False}

    def runner(argv: Sequence[str], env: Mapping[str, str], stdin: str | None) -> tuple[int, str]:
        calls.append((list(argv), dict(env), stdin))
        if stdin == "get_server_list\n":
            return (0 if alive["up"] else 1), ""
        if list(argv)[-1] == "-d":
            alive["up"] = True
        if stdin == "quit\n":
            alive["up"] = False
        return 0, ""

    sup = MpsControlSupervisor(runner)
    spec = MpsDaemonSpec(
        "gpu0", "GPU-1", "/tmp/gpuslice-test-mps/pipe", "/tmp/gpuslice-test-mps/log", 100
    )
    sup.ensure(spec)
    sup.ensure(spec)  # running: no second start
    assert [c[0] for c in calls].count(["nvidia-cuda-mps-control", "-d"]) == 1
    start = next(c for c in calls if c[0][-1] == "-d")
    assert start[1] == {
        "CUDA_VISIBLE_DEVICES": "GPU-1",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/gpuslice-test-mps/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/tmp/gpuslice-test-mps/log",
    }
    assert ("set_default_active_thread_percentage 100\n") in [c[2] for c in calls]
    assert sup.running() == {"gpu0"}
    sup.stop("gpu0")
    assert calls[-1][2] == "quit\n" and sup.running() == set()
    failing = MpsControlSupervisor(lambda argv, env, stdin: (1, "no driver"))
    with pytest.raises(MpsError, match="no driver"):
        failing.ensure(spec)


async def test_agent_loop_applies_new_generations_and_writes_status_once() -> None:
    node = Node("A100-SXM4-80GB")
    source = InMemorySpecSource("n1", mig_spec(*LAYOUT))
    agent = Agent(node.agent, source, resync_seconds=60, retry_seconds=0.01, clock=lambda: "t0")
    res = await agent.run_once()
    assert res.applied and source.status_writes == 1
    await agent.run_once()
    assert source.status_writes == 1  # unchanged status is not rewritten
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    source.set_spec(mig_spec(("7g.80gb", 0)))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if source.obj is not None and source.obj.applied and source.obj.metadata.generation == 2:
            break
    stop.set()
    await asyncio.wait_for(task, 2)
    assert source.obj is not None and source.obj.applied
    assert node.layout() == [("7g.80gb", 0)]


def test_gpuslice_agent_fake_once_with_a_spec_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "mode: mig\ngpus:\n- index: 1\n  mig: [{profile: 3g.40gb, start: 4}, {profile: 4g.40gb, start: 0}]\n"
    )
    rc = cli_main(
        ["agent", "--fake", "--fake-gpus", "A100-SXM4-80GB:2", "--spec", str(spec), "--once",
         "-o", "json"]
    )  # fmt: skip
    assert rc == 0
    status = json.loads(capsys.readouterr().out)
    assert [(i["profile"], i["start"]) for i in status["gpus"][1]["mig"]] == [
        ("4g.40gb", 0),
        ("3g.40gb", 4),
    ]
    written = json.loads((tmp_path / "spec.yaml.status.json").read_text())
    assert written["conditions"][0]["status"] == "True"


def test_gpuslice_agent_fake_rejects_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["agent", "--fake", "--fake-gpus", "A100-SXM4-80GB:0", "--once"]) == 2
    assert "COUNT >= 1" in capsys.readouterr().err
    assert cli_main(["agent", "--fake", "--fake-gpus", "Z99:1", "--once"]) == 2
    assert "unknown GPU model" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: sideways\n")
    assert cli_main(["agent", "--fake", "--spec", str(bad), "--once"]) == 2
    assert "not a valid NodePartitioning spec" in capsys.readouterr().err


async def test_file_spec_source_bumps_generation_on_change(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"mode": "mig", "gpus": []}))
    src = FileSpecSource(f, poll_seconds=0.01)
    obj = await src.get()
    assert obj is not None and obj.metadata.generation == 1
    assert (await src.get()).metadata.generation == 1  # type: ignore[union-attr]
    f.write_text(json.dumps({"mode": "mps", "gpus": []}))
    await asyncio.wait_for(src.wait_change(5), 2)
    obj = await src.get()
    assert obj is not None and obj.metadata.generation == 2 and obj.spec.mode == "mps"


# -- MIG-mode activation per family (Ampere: pending until a GPU reset; Hopper+: immediate) ------


def mutations(node: Node) -> list[str]:
    """Record the agent's mode-changing NVML calls (``op gpu``) from now on."""
    seen: list[str] = []
    node.nv.hooks.append(
        lambda op, args: (
            seen.append(f"{op} {args[0]}") if op in ("set_mig_mode", "reset_gpu") else None
        )
    )
    return seen


def test_ampere_pending_mig_mode_is_activated_by_a_reset_of_the_idle_gpu() -> None:
    node = Node("A30", passthrough=True)  # RESET_REQUIRED: a pass-through VM
    calls = mutations(node)
    res = node.run(mig_spec(("2g.12gb", 0), ("1g.6gb", 2), ("1g.6gb", 3)))
    assert res.applied and calls == ["set_mig_mode 0", "reset_gpu 0"]
    assert node.nv.mig_enabled(0) and not node.nv.mig_pending(0)
    assert node.layout() == [("2g.12gb", 0), ("1g.6gb", 2), ("1g.6gb", 3)]


def test_hopper_mig_mode_is_immediate_and_needs_no_reset() -> None:
    node = Node("H100-80GB")
    calls = mutations(node)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert res.applied and res.operations == 3 and calls == ["set_mig_mode 0"]


def test_pending_mig_mode_without_nvidia_smi_is_degraded_and_retried_each_pass() -> None:
    node = Node("A100-SXM4-80GB", passthrough=True)
    node.nv.tool_present = False  # the agent was not given the host driver's nvidia-smi
    calls = mutations(node)
    for gen in (1, 2):
        res = node.run(mig_spec(*LAYOUT), gen=gen)
        assert not res.applied and res.settled and res.blocks[0].reason == "MIGModePending"
        assert cond(res, "Applied") == ("False", "Degraded")
        assert cond(res, "Degraded") == ("True", "MIGModePending")
        msg = res.status.conditions[1].message
        assert msg.startswith("GPU 0: MIG mode enable is pending and the GPU reset failed")
        assert "NVIDIA_DRIVER_CAPABILITIES=utility, or GPUSLICE_NVIDIA_SMI" in msg
        assert msg.endswith(
            "reset GPU 0 yourself (nvidia-smi -r -i 00000000:07:00.0) or reboot the node"
        )
        assert not res.status.gpus[0].migEnabled and "nvidia.com/mig-3g.40gb" not in res.devices
    # asked for once, then only the reset is retried
    assert calls == ["set_mig_mode 0", "reset_gpu 0", "reset_gpu 0"]
    node.nv.tool_present = True
    res = node.run(mig_spec(*LAYOUT), gen=2)
    assert res.applied and calls[-1] == "reset_gpu 0"
    assert node.layout() == sorted(LAYOUT, key=lambda x: x[1])


def test_pending_mig_mode_names_the_processes_that_block_the_reset() -> None:
    node = Node("A100-SXM4-80GB", passthrough=True)
    calls = mutations(node)
    jobs: list[int] = []

    def start_after_request(op: str, args: tuple[int, ...]) -> None:
        if op == "running_processes" and node.nv.mig_pending(0) and not jobs:
            jobs.append(node.nv.start_process(0, name="train.py"))  # grabs the GPU meanwhile
            jobs.append(node.nv.start_process(0, name="infer"))

    node.nv.hooks.append(start_after_request)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert not res.applied and res.settled and calls == ["set_mig_mode 0"]  # no reset tried
    assert cond(res, "Degraded") == ("True", "MIGModePending")
    assert res.blocks[0].message == (
        f"GPU 0: MIG mode enable is pending a GPU reset, which these processes block: "
        f"pid {jobs[0]} (train.py), pid {jobs[1]} (infer); the agent resets the GPU once they "
        "have ended"
    )
    for pid in jobs:
        node.nv.stop_process(pid)
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert res.applied and calls == ["set_mig_mode 0", "reset_gpu 0"]
    assert node.layout() == [("7g.80gb", 0)]


def test_pending_mig_mode_is_applied_by_a_reboot_as_well() -> None:
    node = Node("A100-SXM4-80GB", passthrough=True)
    calls = mutations(node)
    node.nv.hooks.append(
        lambda op, args: (
            node.nv.start_process(0)
            if op == "running_processes" and node.nv.mig_pending(0) and not node.nv.process_count()
            else None
        )
    )
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert cond(res, "Degraded") == ("True", "MIGModePending") and calls == ["set_mig_mode 0"]
    node.nv.hooks.pop()
    node.nv.reboot()  # the job is gone; the pending mode is applied at boot
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert res.applied and calls == ["set_mig_mode 0"]
    assert node.layout() == [("7g.80gb", 0)]


def test_reset_turns_persistence_mode_off_around_nvidia_smi_r_and_restores_it() -> None:
    node = Node("A30")
    node.nv.set_persistence_mode(0, True)  # held like this, the GPU refuses a reset
    tool: list[str] = []
    real = node.nv.nvidia_smi

    def recording(
        argv: Sequence[str], env: Mapping[str, str], stdin: str | None
    ) -> tuple[int, str]:
        tool.append(" ".join(argv[1:]))
        return real(argv, env, stdin)

    node.nv.nvidia_smi = recording  # type: ignore[method-assign]
    res = node.run(mig_spec(("4g.24gb", 0)))
    assert res.applied and node.nv.mig_enabled(0) and node.nv.persistence_mode(0)
    bus = "00000000:07:00.0"
    assert tool == [f"-pm 0 -i {bus}", f"-r -i {bus}", f"-pm 1 -i {bus}"]


def test_a_reset_refused_by_another_client_is_degraded_with_the_remedy() -> None:
    node = Node("A100-SXM4-80GB", passthrough=True)
    node.nv.inject("reset_gpu", NvmlErrorCode.IN_USE, times=1)  # e.g. dcgm holds the GPU
    res = node.run(mig_spec(("7g.80gb", 0)))
    assert cond(res, "Degraded") == ("True", "MIGModePending")
    assert "another client holds the GPU (nvidia-persistenced, DCGM" in res.blocks[0].message
    res = node.run(mig_spec(("7g.80gb", 0)))  # the client went away: the next pass resets
    assert res.applied and node.layout() == [("7g.80gb", 0)]


@pytest.mark.parametrize(
    ("model", "after_reboot"),
    [
        ("A100-SXM4-80GB", []),  # MIG mode persisted: only the instances are re-created
        ("H100-80GB", ["set_mig_mode 0"]),  # MIG mode lost: re-enabled, no reset
    ],
)
def test_reboot_keeps_ampere_mig_mode_and_hopper_loses_it_and_the_plan_is_recreated(
    model: str, after_reboot: list[str]
) -> None:
    node = Node(model)
    spec = mig_spec(("3g.40gb", 0), ("3g.40gb", 4))
    assert node.run(spec).applied
    calls = mutations(node)
    node.nv.reboot()
    node.restart()
    assert node.nv.mig_enabled(0) is (model.startswith("A100")) and node.layout() == []
    res = node.run(spec)
    assert res.applied and calls == after_reboot
    assert node.layout() == [("3g.40gb", 0), ("3g.40gb", 4)]


def test_ampere_back_to_mps_resets_and_a_pending_enable_is_cancelled_by_an_mps_spec() -> None:
    node = Node("A100-SXM4-80GB", mig=True, passthrough=True)
    calls = mutations(node)
    res = node.run(mps_spec((20480, 25)))  # MIG off is pending too: reset, then MPS
    assert res.applied and calls == ["set_mig_mode 0", "reset_gpu 0"]
    assert not node.nv.mig_enabled(0) and node.sup.running() == {"gpu0"}

    node.nv.tool_present = False
    res = node.run(mig_spec(("7g.80gb", 0)), gen=2)
    assert cond(res, "Degraded") == ("True", "MIGModePending") and node.nv.mig_pending(0)
    assert node.sup.running() == set() and "nvidia.com/gpu-20gb" not in res.devices
    # the operator gives up on MIG: asking for the current mode cancels the pending enable
    calls.clear()
    res = node.run(mps_spec((20480, 25)), gen=3)
    assert res.applied and calls == ["set_mig_mode 0"] and not node.nv.mig_pending(0)
    assert node.sup.running() == {"gpu0"} and len(res.devices["nvidia.com/gpu-20gb"]) == 1
