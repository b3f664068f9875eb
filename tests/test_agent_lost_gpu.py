"""One GPU whose NVML reads fail (e.g. ``NVML_ERROR_GPU_IS_LOST``) is isolated for the pass.

Its devices stay advertised but Unhealthy, nothing on it is created or destroyed, the other
GPUs are reconciled and published as usual, and the status names the GPU and the error; once it
reads again it is Healthy and reconciled.  NVML itself down still fails the whole pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pynvml
import pytest

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.devices import AdvertisedDevice, parse_mps_slice_id
from node_agent.mps import FakeSupervisor
from node_agent.nvml import NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.nvml_pynvml import PynvmlAdapter
from node_agent.reconciler import Reconciler, ReconcileResult
from planner.catalog import default_catalog
from tests.test_agent_pynvml import FakePynvml
from tests.test_agent_rollout import Pods  # in-use source: the device ids pods hold

CAT = default_catalog()
READS = ("gpu_instances", "mig_devices", "running_processes")
MUTATING = (
    "set_mig_mode",
    "reset_gpu",
    "set_compute_mode",
    "create_gpu_instance",
    "create_compute_instance",
    "destroy_compute_instance",
    "destroy_gpu_instance",
)
NOW = "2026-01-01T00:00:00Z"


class Node:
    """Two (or more) GPUs, a kubelet that keeps the last device list it was given."""

    def __init__(self, *models: str, mig: bool = False) -> None:
        self.nv = FakeNvml([CAT.model(m) for m in models], mig_enabled=mig)
        self.pods = Pods()
        self.sup = FakeSupervisor(nvml=self.nv)
        self.published: list[dict[str, list[AdvertisedDevice]]] = []
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.lost: dict[int, tuple[NvmlErrorCode, tuple[str, ...]]] = {}
        self.nv.hooks.append(self._hook)
        self.agent = Reconciler(
            self.nv, self.pods, self.sup, CAT, mps_pipe_root="/run/mps", publish=self.publish
        )
        self.status = None

    def _hook(self, op: str, args: tuple[int, ...]) -> None:
        self.calls.append((op, args))
        if args and args[0] in self.lost:
            code, ops = self.lost[args[0]]
            if op in ops:
                raise NvmlError(code, op, "injected by the test")

    def lose(
        self,
        gpu: int,
        code: NvmlErrorCode = NvmlErrorCode.GPU_IS_LOST,
        ops: tuple[str, ...] = READS,
    ) -> None:
        """Every call of ``ops`` on ``gpu`` fails (and every mutating call, were one made)."""
        self.lost[gpu] = (code, ops + MUTATING)

    def publish(self, devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
        self.published.append({r: list(ds) for r, ds in devices.items()})

    def run(self, spec: NodePartitioningSpec | None, gen: int = 1) -> ReconcileResult:
        res = asyncio.run(self.agent.reconcile(spec, gen, previous=self.status, now=NOW))
        self.status = res.status
        return res

    def layout(self, gpu: int) -> list[tuple[str, int]]:
        return [(p.name, s) for p, s, ci in self.nv.layout(gpu) if ci]

    def kubelet(self) -> dict[str, AdvertisedDevice]:
        """The device list the kubelet holds: the last one published."""
        last = self.published[-1] if self.published else {}
        return {d.id: d for ds in last.values() for d in ds}


def spec(
    mode: str, gpus: dict[int, list[tuple[str, int]] | list[tuple[int, int]]]
) -> NodePartitioningSpec:
    if mode == "mig":
        body = [
            {"index": i, "mig": [{"profile": p, "start": s} for p, s in inst]}
            for i, inst in gpus.items()
        ]
    else:
        body = [
            {"index": i, "mps": [{"memoryMiB": m, "activeThreadPercentage": t} for m, t in sl]}
            for i, sl in gpus.items()
        ]
    return NodePartitioningSpec.model_validate({"planId": "p", "mode": mode, "gpus": body})


OLD = [("3g.40gb", 0), ("3g.40gb", 4)]
NEW = [("7g.80gb", 0)]


def ids_on(res: ReconcileResult, gpu: int) -> set[str]:
    g = next(g for g in res.status.gpus if g.index == gpu)
    return {i.deviceId for i in g.mig} | {s.deviceId for s in g.mps}


def two_mig_gpus() -> tuple[Node, set[str], set[str]]:
    node = Node("A100-SXM4-80GB", "A100-SXM4-80GB", mig=True)
    res = node.run(spec("mig", {0: OLD, 1: OLD}))
    assert res.applied
    return node, ids_on(res, 0), ids_on(res, 1)


def test_a_lost_gpu_does_not_stop_the_others_from_being_reconciled_and_published() -> None:
    node, _, _ = two_mig_gpus()
    node.lose(1)
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert node.layout(0) == NEW  # GPU 0 was reconciled
    assert res.fresh and node.published  # and published
    new0 = ids_on(res, 0)
    assert len(new0) == 1 and new0 <= set(node.kubelet())
    assert all(node.kubelet()[d].healthy for d in new0)
    assert node.kubelet()[next(iter(new0))].resource == "nvidia.com/mig-7g.80gb"


def test_the_lost_gpus_devices_stay_advertised_unhealthy_and_nothing_on_it_changes() -> None:
    node, _, gpu1 = two_mig_gpus()
    held = sorted(gpu1)[0]
    node.pods.ids = {held}
    node.lose(1)
    node.calls.clear()
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    kubelet = node.kubelet()
    assert gpu1 <= set(kubelet), "the lost GPU's devices must stay advertised"
    assert not any(kubelet[d].healthy for d in gpu1), "and be Unhealthy"
    assert node.layout(1) == OLD
    assert not [c for c in node.calls if c[0] in MUTATING and c[1][:1] == (1,)]
    # every publish of this pass (also a withdrawal before destroying on GPU 0) keeps them
    assert all(gpu1 <= {d.id for ds in p.values() for d in ds} for p in node.published[-2:])
    # the status keeps the GPU's last known instances (so the partitioner does not see it empty)
    assert ids_on(res, 1) == gpu1


def test_the_status_names_the_lost_gpu_and_the_nvml_error() -> None:
    node, _, _ = two_mig_gpus()
    node.lose(1)
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    degraded = next(c for c in res.status.conditions if c.type == "Degraded")
    assert degraded.status == "True"
    assert "GPU 1:" in degraded.message and "GPU_IS_LOST" in degraded.message
    assert "GPU 0:" not in degraded.message
    assert not res.applied and res.degraded
    assert 1 in res.blocks and 0 not in res.blocks


def test_recovery_makes_the_devices_healthy_and_the_gpu_is_reconciled() -> None:
    node, _, gpu1 = two_mig_gpus()
    node.lose(1)
    node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert not any(node.kubelet()[d].healthy for d in gpu1)
    node.lost.clear()
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert res.applied and node.layout(1) == NEW and node.layout(0) == NEW
    assert all(d.healthy for d in node.kubelet().values())
    assert ids_on(res, 1) <= set(node.kubelet()) and not gpu1 & set(node.kubelet())
    degraded = next(c for c in res.status.conditions if c.type == "Degraded")
    assert degraded.status == "False"


def test_a_gpu_whose_handle_or_mig_mode_is_unreadable_is_isolated_too() -> None:
    """``GPU_IS_LOST`` usually shows at ``nvmlDeviceGetHandleByIndex``: inside ``gpus()``."""
    node, _, gpu1 = two_mig_gpus()
    node.nv.inject("*", NvmlErrorCode.GPU_IS_LOST, gpu=1, times=None)
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert node.layout(0) == NEW and node.layout(1) == OLD
    kubelet = node.kubelet()
    assert gpu1 <= set(kubelet) and not any(kubelet[d].healthy for d in gpu1)
    assert "GPU_IS_LOST" in res.status.conditions[1].message
    node.nv.clear_faults()
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert res.applied and all(d.healthy for d in node.kubelet().values())


def test_mps_daemon_of_a_lost_gpu_is_kept_and_its_slices_are_unhealthy() -> None:
    node = Node("A100-SXM4-80GB", "A100-SXM4-80GB")
    sl = [(20480, 50), (20480, 50)]
    res = node.run(spec("mps", {0: sl, 1: sl}))
    assert res.applied and {"gpu0", "gpu1"} <= node.sup.running()
    gpu1 = ids_on(res, 1)
    node.pods.ids = {sorted(gpu1)[0]}
    node.lose(1)
    res = node.run(spec("mps", {0: [(40960, 100)], 1: [(40960, 100)]}), gen=2)
    assert "gpu1" in node.sup.running(), "the daemon a pod's MPS clients use must not be stopped"
    kubelet = node.kubelet()
    assert gpu1 <= set(kubelet) and not any(kubelet[d].healthy for d in gpu1)
    new0 = ids_on(res, 0)
    assert [parse_mps_slice_id(d).memory_mib for d in new0 if parse_mps_slice_id(d)] == [40960]
    assert all(kubelet[d].healthy for d in new0)


def test_nvml_down_still_fails_the_whole_pass() -> None:
    node, _, _ = two_mig_gpus()
    before = len(node.published)
    node.nv.inject("gpus", NvmlErrorCode.DRIVER_NOT_LOADED)
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert not res.fresh and len(node.published) == before
    assert node.layout(0) == OLD and "DRIVER_NOT_LOADED" in res.status.lastError


def test_a_driver_wide_error_on_one_gpu_read_fails_the_whole_pass() -> None:
    """``UNINITIALIZED``/``DRIVER_NOT_LOADED``... say NVML is down, not the GPU: as today."""
    node, _, _ = two_mig_gpus()
    before = len(node.published)
    node.lose(1, NvmlErrorCode.UNINITIALIZED)
    res = node.run(spec("mig", {0: NEW, 1: NEW}), gen=2)
    assert not res.fresh and len(node.published) == before and node.layout(0) == OLD


def test_the_real_adapter_lists_a_gpu_lost_at_its_mig_mode_with_its_error() -> None:
    """``PynvmlAdapter.gpus(isolate=True)``: an error after the device count names one GPU."""

    class LostGpu1(FakePynvml):
        def nvmlDeviceGetMigMode(self, h: object) -> list[int]:
            if h == ("gpu", 1):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return super().nvmlDeviceGetMigMode(h)

    nv = FakeNvml([CAT.model("A100-SXM4-80GB")] * 2)
    ad = PynvmlAdapter(LostGpu1(nv))
    ok, lost = ad.gpus(isolate=True)
    assert ok.read_error is None and ok.uuid == nv.gpu_uuid(0)
    assert lost.index == 1 and lost.read_error is not None
    assert lost.read_error.code == NvmlErrorCode.GPU_IS_LOST and not lost.uuid
    with pytest.raises(NvmlError) as e:  # without isolate the read raises, as before
        ad.gpus()
    assert e.value.code == NvmlErrorCode.GPU_IS_LOST
