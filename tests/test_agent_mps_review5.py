"""MPS review 5: a failed ``quit`` keeps its daemon supervised; one MPS slice per container.

* A ``quit`` that fails (:attr:`~node_agent.mps_fake.FakeMpsControl.failing`: the control pipe
  does not answer for a moment, the daemon runs on) used to be ignored: the supervisor forgot
  the daemon, which ran on untracked -- adopted as a re-created hybrid instance's daemon while
  it served the destroyed instance's MIG UUID, holding its instance with an idle MPS server
  so that it could never be destroyed, or keeping a drained GPU in ``EXCLUSIVE_PROCESS``.  Now
  a daemon that still answers after its ``quit`` stays supervised, the pass reports the error
  (not ``Applied``), nothing it serves is destroyed or re-created, and the next pass quits it.
* A container given two MPS slices got one slice's worth (the daemon caps each client at one
  slice) and, on a hybrid node, the preferred allocation could split two slices across two
  instances' daemons.  ``Allocate`` now refuses more than one MPS slice per container and
  says how to ask instead; the preferred allocation groups MPS slices by daemon.
* Review diff36b finding 3: a failed ``quit`` followed by a failed ``get_server_list`` was read
  as "the daemon is gone", but a control pipe that does not answer (a hung daemon: both
  commands time out) fails the same way, so the daemon was forgotten while it ran and the
  first bullet's outcome came back.  Now only a clear "no daemon" answer ("Cannot find MPS
  control daemon process") forgets it; silence keeps it tracked and raises ``MpsError``.  A
  restart for another device whose start fails because the old daemon runs on unanswering
  keeps the old spec, so the next ``ensure`` quits it instead of adopting it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.deviceplugin import _ResourcePlugin, _RpcFailure
from node_agent.devices import AdvertisedDevice
from node_agent.mps import MpsControlSupervisor, MpsDaemonSpec, MpsError
from node_agent.mps_fake import NOT_RUNNING, FakeMpsControl
from node_agent.nvml import ComputeMode
from node_agent.runner import TIMED_OUT
from tests.test_agent_mps_server import mig_spec
from tests.test_agent_rollout import Node, mps_spec

PIPE = "CUDA_MPS_PIPE_DIRECTORY"


def daemon_spec(tmp: Path, control: FakeMpsControl, device: str) -> MpsDaemonSpec:
    return MpsDaemonSpec("gpu0-mig0", device, str(tmp / "p"), str(tmp / "l"))


def instance_at(node: Node, start: int) -> str:
    return next(u[0] for _g, _p, s, u in node.nv.instances(0) if s == start)


# -- the supervisor ---------------------------------------------------------------------


def test_a_stop_whose_quit_fails_keeps_the_daemon_and_the_next_stop_quits_it(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("mig", ("3g.40gb", 0)))
    control = node.mps
    sup = MpsControlSupervisor(control)
    spec = daemon_spec(tmp_path, control, instance_at(node, 0))
    sup.ensure(spec)
    control.failing["quit"] = 1
    with pytest.raises(MpsError, match="quit failed"):
        sup.stop(spec.key)
    assert control.served(spec.pipe_dir) and sup.running() == {spec.key}  # still supervised
    assert sup.check() == []  # neither stopped nor dead
    sup.stop(spec.key)  # the retry
    assert not control.served(spec.pipe_dir) and sup.running() == set()
    assert control.commands.count("quit") == 2


def test_a_failed_quit_of_a_daemon_that_is_gone_forgets_it(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("mig", ("3g.40gb", 0)))
    sup = MpsControlSupervisor(node.mps)
    spec = daemon_spec(tmp_path, node.mps, instance_at(node, 0))
    sup.ensure(spec)
    node.mps.kill(spec.pipe_dir)  # the quit answers "Cannot find MPS control daemon process"
    sup.stop(spec.key)
    assert sup.running() == set()


def test_a_restart_for_another_device_whose_quit_fails_keeps_the_old_daemon(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("mig", ("3g.40gb", 0), ("3g.40gb", 4)))
    control = node.mps
    sup = MpsControlSupervisor(control)
    old = daemon_spec(tmp_path, control, instance_at(node, 0))
    new = daemon_spec(tmp_path, control, instance_at(node, 4))
    sup.ensure(old)
    control.failing["quit"] = 1
    with pytest.raises(MpsError, match="quit failed"):
        sup.ensure(new)
    assert control.daemons[old.pipe_dir].device == old.device_uuid
    sup.ensure(new)  # quit again, then started for the new device
    assert control.daemons[new.pipe_dir].device == new.device_uuid
    assert control.starts == 2 and sup.running() == {new.key}


def test_a_quit_and_probe_that_go_unanswered_keep_the_daemon(tmp_path: Path) -> None:
    """The control pipe is silent for a moment: the quit and the probe after it time out."""
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("mig", ("3g.40gb", 0)))
    control = node.mps
    sup = MpsControlSupervisor(control)
    spec = daemon_spec(tmp_path, control, instance_at(node, 0))
    sup.ensure(spec)
    control.failing.update({"quit": 1, "get_server_list": 1})
    with pytest.raises(MpsError, match="get_server_list was not answered either"):
        sup.stop(spec.key)
    assert control.served(spec.pipe_dir) and sup.running() == {spec.key}  # still tracked
    sup.stop(spec.key)  # the retry
    assert not control.served(spec.pipe_dir) and sup.running() == set()
    assert control.commands.count("quit") == 2


def test_a_hung_daemon_is_kept_until_it_answers_and_then_quit(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("mig", ("3g.40gb", 0)))
    control = node.mps
    sup = MpsControlSupervisor(control)
    spec = daemon_spec(tmp_path, control, instance_at(node, 0))
    sup.ensure(spec)
    control.hung.add(spec.pipe_dir)
    for _ in range(2):
        with pytest.raises(MpsError, match="quit failed \\(124\\)"):
            sup.stop(spec.key)
    control.hung.clear()
    assert sup.running() == {spec.key}
    sup.stop(spec.key)
    assert not control.daemons and sup.running() == set()


def test_the_fake_tells_a_gone_daemon_from_a_silent_one(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("hybrid", ("3g.40gb", 0)))
    control, env = node.mps, {PIPE: f"{node.root}/gpu0-mig0"}
    argv = ["nvidia-cuda-mps-control"]
    control.hung.add(env[PIPE])
    assert control(argv, env, "get_server_list\n") == (
        TIMED_OUT,
        "nvidia-cuda-mps-control did not finish within 60 s",
    )
    control.hung.clear()
    control.kill(env[PIPE])
    assert control(argv, env, "get_server_list\n") == (1, NOT_RUNNING)


def test_a_restart_for_another_device_over_a_hung_daemon_never_adopts_it(
    tmp_path: Path,
) -> None:
    """The old instance's daemon runs on, unanswering: the start for the new device fails
    ("already running"); once it answers, it is quit, not taken for the new device's."""
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(mig_spec("mig", ("3g.40gb", 0), ("3g.40gb", 4)))
    control = node.mps
    sup = MpsControlSupervisor(control)
    old = daemon_spec(tmp_path, control, instance_at(node, 0))
    new = daemon_spec(tmp_path, control, instance_at(node, 4))
    sup.ensure(old)
    control.hung.add(old.pipe_dir)
    with pytest.raises(MpsError, match="-d' failed"):
        sup.ensure(new)
    control.hung.clear()
    sup.ensure(new)
    assert control.daemons[new.pipe_dir].device == new.device_uuid
    assert "quit" in control.commands and control.starts == 2


# -- the reconciler ---------------------------------------------------------------------


def test_a_recreated_hybrid_instance_never_gets_the_destroyed_ones_daemon(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    assert node.run(mig_spec("hybrid", ("3g.40gb", 0), ("3g.40gb", 4))).applied
    old = instance_at(node, 0)
    node.mps.failing["quit"] = 1
    wider = mig_spec("hybrid", ("4g.40gb", 0), ("3g.40gb", 4))
    res = node.run(wider, gen=2)
    assert not res.applied and any("quit failed" in e for e in res.errors)
    assert instance_at(node, 0) == old  # what the daemon serves is not destroyed
    assert node.mps.daemons[f"{node.root}/gpu0-mig0"].device == old
    for _ in range(2):
        res = node.run(wider, gen=2)
    new = instance_at(node, 0)
    assert res.applied and new != old
    assert node.mps.daemons[f"{node.root}/gpu0-mig0"].device == new
    assert old not in node.nv.mig_uuids()


def test_a_recreated_hybrid_instance_never_gets_a_hung_daemon(tmp_path: Path) -> None:
    """Review diff36b finding 3 on the reconciler: the daemon of 3g.40gb@0 hangs (its quit and
    every probe time out) while 3g.40gb@0 is re-created as 4g.40gb@0."""
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    assert node.run(mig_spec("hybrid", ("3g.40gb", 0), ("3g.40gb", 4))).applied
    old = instance_at(node, 0)
    pipe = f"{node.root}/gpu0-mig0"
    node.mps.hung.add(pipe)
    wider = mig_spec("hybrid", ("4g.40gb", 0), ("3g.40gb", 4))
    for _ in range(2):
        res = node.run(wider, gen=2)
        assert not res.applied and any("quit failed" in e for e in res.errors)
        assert instance_at(node, 0) == old  # what the daemon serves is not destroyed
    node.mps.hung.clear()  # it answers again
    for _ in range(2):
        res = node.run(wider, gen=2)
    new = instance_at(node, 0)
    assert res.applied and new != old
    assert node.mps.daemons[pipe].device == new
    assert old not in node.nv.mig_uuids()


def test_an_unwanted_daemon_whose_quit_fails_is_quit_next_pass(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    res = node.run(mig_spec("hybrid", ("3g.40gb", 0), ("3g.40gb", 4)))
    at0 = next(
        d for d in res.devices["nvidia.com/mig-3g.40gb"] if d.env[PIPE].endswith("gpu0-mig0")
    )
    node.pods.ids = {at0.id}
    client = node.mps.connect(at0.env[PIPE])
    node.run(mig_spec("hybrid", ("3g.40gb", 0), ("3g.40gb", 4)))
    node.mps.disconnect(client)  # the pod ended: an idle server holds the instance
    node.pods.ids = set()
    node.mps.failing["quit"] = 1
    relabelled = mig_spec("mig", ("3g.40gb", 0), ("3g.40gb", 4))
    res = node.run(relabelled, gen=2)
    assert not res.applied and any("quit failed" in e for e in res.errors)
    assert node.agent.supervisor.running() == {"gpu0-mig0"}  # still supervised
    res = node.run(relabelled, gen=2)
    assert res.applied and not node.mps.daemons
    res = node.run(mig_spec("mig", ("4g.40gb", 0), ("3g.40gb", 4)), gen=3)
    assert res.applied, res.errors  # the instance is free to be destroyed
    assert not node.mps.quit_with_clients


def test_a_drained_gpu_gets_default_back_after_a_failed_quit(tmp_path: Path) -> None:
    node = Node(tmp_path, "H100-80GB")
    spec = mps_spec([(20480, 25), (20480, 25)])
    res = node.run(spec)
    held = res.devices["nvidia.com/gpu-20gb"][0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env[PIPE])
    node.run(spec)
    node.mps.disconnect(client)
    node.pods.ids = set()
    node.mps.failing["quit"] = 1
    res = node.run(None, gen=2)  # drain
    assert any("quit failed" in e for e in res.errors)
    assert node.agent.supervisor.running() == {"gpu0"}
    res = node.run(None, gen=2)
    assert res.errors == [] and not node.mps.daemons
    assert node.nv.compute_mode(0) == ComputeMode.DEFAULT


def test_a_daemon_whose_device_has_a_slice_in_use_is_still_never_stopped(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "H100-80GB")
    spec = mps_spec([(20480, 25), (20480, 25)])
    res = node.run(spec)
    held = res.devices["nvidia.com/gpu-20gb"][0]
    node.pods.ids = {held.id}
    client = node.mps.connect(held.env[PIPE])
    node.mps.failing["quit"] = 1
    for _ in range(2):
        node.run(None, gen=2)
    assert "quit" not in node.mps.commands and client not in node.mps.broken
    assert node.mps.failing["quit"] == 1


# -- the device plugin ------------------------------------------------------------------


def plugin_of(devices: list[AdvertisedDevice]) -> _ResourcePlugin:
    plugin = _ResourcePlugin(devices[0].resource, "/tmp/unused.sock")
    plugin.devices = {d.id: d for d in devices}
    return plugin


def prefer(plugin: _ResourcePlugin, size: int) -> list[str]:
    req = SimpleNamespace(
        available_deviceIDs=sorted(plugin.devices), must_include_deviceIDs=[], allocation_size=size
    )
    return plugin.prefer(req)  # type: ignore[arg-type]


def test_allocate_refuses_two_mps_slices_in_one_container_and_names_the_fix(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "H100-80GB")
    res = node.run(mps_spec([(10240, 12)] * 4))
    plugin = plugin_of(res.devices["nvidia.com/gpu-10gb"])
    two = prefer(plugin, 2)
    with pytest.raises(_RpcFailure) as refused:
        plugin.allocate(two)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    text = refused.value.details
    assert "nvidia.com/gpu-10gb: 2" in text and "nvidia.com/gpu-20gb: 1" in text
    assert "UnexpectedAdmissionError" in text
    (one,) = prefer(plugin, 1)
    assert dict(plugin.allocate([one]).envs)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "12"


def test_two_hybrid_mig_devices_in_one_container_are_still_allocated(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    res = node.run(mig_spec("hybrid", ("3g.40gb", 0), ("3g.40gb", 4)))
    plugin = plugin_of(res.devices["nvidia.com/mig-3g.40gb"])
    plugin.allocate(sorted(plugin.devices))  # MIG instances, not MPS slices


@pytest.mark.parametrize("seed", range(6))
def test_preferred_allocation_keeps_hybrid_slices_on_one_daemon(tmp_path: Path, seed: int) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB", mig=True)
    node.nv._rng.seed(seed)  # the MIG UUIDs, hence the slice ids' order
    one = {"memoryMiB": 10240, "activeThreadPercentage": 25}
    spec = NodePartitioningSpec.model_validate(
        {"planId": "p", "mode": "hybrid", "gpus": [{"index": 0, "mig": [
            {"profile": "3g.40gb", "start": 0, "mps": [one, one]},
            {"profile": "3g.40gb", "start": 4, "mps": [one]},
        ]}]}
    )  # fmt: skip
    res = node.run(spec)
    assert res.applied
    plugin = plugin_of(res.devices["nvidia.com/gpu-10gb"])
    pipes = {plugin.devices[i].env[PIPE] for i in prefer(plugin, 2)}
    assert pipes == {f"{node.root}/gpu0-mig0"}


def test_preferred_allocation_still_puts_a_drained_gpus_mps_slices_last(tmp_path: Path) -> None:
    node = Node(tmp_path, "H100-80GB", "H100-80GB")
    res = node.run(mps_spec([(10240, 12)], [(10240, 12), (10240, 12)]))
    plugin = plugin_of(res.devices["nvidia.com/gpu-10gb"])
    gpu1 = node.nv.gpu_uuid(1)
    assert plugin.devices[prefer(plugin, 1)[0]].gpu != gpu1  # the smallest group: GPU 0
    plugin.avoided = frozenset({node.nv.gpu_uuid(0)})
    assert plugin.devices[prefer(plugin, 1)[0]].gpu == gpu1
