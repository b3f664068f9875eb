"""A limit command that fails is sent again at the next pass; nothing is Healthy meanwhile.

A daemon's limits (``set_default_*`` and the running servers' ``set_*``) are what a client
cannot change (node_agent.mps): a daemon that runs without them -- or with the limits of the
slices it served before -- is nos #38 again.  The supervisor used to record a daemon's spec
before sending its limits, so after one failed command the next ``ensure`` found nothing to do:
the daemon kept no (or stale) limits for good while its slices were advertised Healthy and the
node reported ``Applied``.  Here the production supervisor drives the fake control binary,
whose :attr:`~node_agent.mps_fake.FakeMpsControl.failing` makes commands fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.devices import AdvertisedDevice
from node_agent.mps import FakeSupervisor, MpsControlSupervisor, MpsDaemonSpec, MpsError
from node_agent.mps_fake import FakeMpsControl
from node_agent.nvml import ComputeMode
from node_agent.nvml_fake import FakeNvml
from planner.catalog import default_catalog
from tests.test_agent_rollout import Node, mps_spec

PINNED = "set_default_device_pinned_mem_limit"
SERVER_PINNED = "set_device_pinned_mem_limit"


def gpu0(node: Node, devices: dict[str, list[AdvertisedDevice]]) -> list[AdvertisedDevice]:
    """The devices of GPU 0's daemon in ``devices``."""
    pipe = f"{node.root}/gpu0"
    return [
        d for ds in devices.values() for d in ds if d.env.get("CUDA_MPS_PIPE_DIRECTORY") == pipe
    ]


def defaults(node: Node) -> dict[str, str]:
    return node.mps.defaults(f"{node.root}/gpu0")


def server_limits(node: Node) -> dict[str, str]:
    return dict(node.mps.daemons[f"{node.root}/gpu0"].server_limits)


# -- the supervisor -------------------------------------------------------------------


def spec(tmp: Path, control: FakeMpsControl, mib: int, pct: int) -> MpsDaemonSpec:
    """GPU 0's daemon with ``mib`` MiB and ``pct`` % as limits."""
    return MpsDaemonSpec(
        key="gpu0",
        device_uuid=control.nvml.gpu_uuid(0),
        pipe_dir=str(tmp / "mps" / "gpu0"),
        log_dir=str(tmp / "log" / "gpu0"),
        default_thread_percentage=pct,
        default_pinned_mem_limit_mib=mib,
    )


@pytest.fixture
def control() -> FakeMpsControl:
    nv = FakeNvml([default_catalog().model("A100-SXM4-80GB")])
    nv.set_compute_mode(0, ComputeMode.EXCLUSIVE_PROCESS)
    return FakeMpsControl(nv)


def test_the_supervisor_resends_limits_a_failed_command_left_out_at_start(
    tmp_path: Path, control: FakeMpsControl
) -> None:
    sup = MpsControlSupervisor(control)
    s = spec(tmp_path, control, 20480, 25)
    control.failing[PINNED] = 1
    with pytest.raises(MpsError, match=PINNED):
        sup.ensure(s)
    assert sup.running() == {"gpu0"}
    assert PINNED not in control.defaults(s.pipe_dir)  # the daemon runs without it

    sup.ensure(s)  # same spec: sent again all the same
    assert control.defaults(s.pipe_dir) == {
        "set_default_active_thread_percentage": "25",
        PINNED: "0 20480M",
    }
    assert sup.limits_pending() == set()
    sent = len(control.commands)
    sup.ensure(s)  # in force now: nothing more to send
    assert control.commands[sent:] == ["get_server_list"]
    assert control.starts == 1


def test_the_supervisor_resends_a_changed_limit_to_the_running_server(
    tmp_path: Path, control: FakeMpsControl
) -> None:
    sup = MpsControlSupervisor(control)
    old = spec(tmp_path, control, 20480, 25)
    new = spec(tmp_path, control, 40960, 50)
    sup.ensure(old)
    control.connect(old.pipe_dir)  # a client: the daemon's server runs
    control.failing[SERVER_PINNED] = 1
    with pytest.raises(MpsError, match=SERVER_PINNED):
        sup.ensure(new)
    daemon = control.daemons[old.pipe_dir]
    assert daemon.server_limits.get(SERVER_PINNED) != "0 40960M"  # stale on the server

    sup.ensure(new)
    assert daemon.defaults[PINNED] == "0 40960M"
    assert daemon.server_limits == {
        "set_active_thread_percentage": "50",
        SERVER_PINNED: "0 40960M",
    }
    assert sup.limits_pending() == set()


def test_a_daemon_is_limits_pending_until_sent_or_stopped_and_a_fake_one_never_is(
    tmp_path: Path, control: FakeMpsControl
) -> None:
    sup = MpsControlSupervisor(control)
    s = spec(tmp_path, control, 20480, 25)
    control.failing[PINNED] = 1
    with pytest.raises(MpsError):
        sup.ensure(s)
    assert sup.running() == {"gpu0"} and sup.limits_pending() == {"gpu0"}
    sup.stop("gpu0")
    assert sup.limits_pending() == set() and sup.running() == set()
    fake = FakeSupervisor()
    fake.ensure(s)
    assert fake.limits_pending() == set()


# -- the reconciler ---------------------------------------------------------------------


def test_a_limit_failing_at_the_daemons_start_is_retried_and_unhealthy_meanwhile(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB")
    target = mps_spec([(20480, 25), (10240, 13)])
    node.mps.failing[PINNED] = 2  # two passes in a row
    for _ in range(2):
        res = node.run(target)
        assert not res.applied and any(PINNED in e for e in res.errors)
        assert len(gpu0(node, res.devices)) == 2
        assert not any(d.healthy for d in gpu0(node, res.devices))
        assert not any(d.healthy for d in gpu0(node, node.published[-1]))
        assert PINNED not in defaults(node)

    res = node.run(target)
    assert res.applied and res.errors == []
    assert all(d.healthy for d in gpu0(node, res.devices))
    assert defaults(node) == {"set_default_active_thread_percentage": "25", PINNED: "0 20480M"}
    assert node.mps.starts == 1  # limits sent again, the daemon never restarted


def test_a_limit_failing_at_a_change_is_retried_with_the_servers_limits(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB")
    res = node.run(mps_spec([(20480, 25), (10240, 13)]))
    assert res.applied
    held = next(d for d in gpu0(node, res.devices) if "10240m" in d.id)
    node.pods.ids = {held.id}
    node.mps.connect(f"{node.root}/gpu0")  # the pod's client: the server runs

    bigger = mps_spec([(40960, 50), (10240, 13)])
    node.mps.failing[PINNED] = 1
    res = node.run(bigger, 2)
    assert not res.applied
    assert not any(d.healthy for d in gpu0(node, res.devices))
    assert defaults(node)[PINNED] == "0 20480M"  # stale: a 40 GiB slice is advertised

    res = node.run(bigger, 2)
    assert res.applied and res.errors == []
    assert all(d.healthy for d in gpu0(node, res.devices))
    assert defaults(node) == {"set_default_active_thread_percentage": "50", PINNED: "0 40960M"}
    assert server_limits(node) == {"set_active_thread_percentage": "50", SERVER_PINNED: "0 40960M"}
    assert node.mps.quit_with_clients == [] and node.mps.starts == 1


def test_the_withdrawal_publish_keeps_a_limits_pending_daemons_slices_unhealthy(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB")
    assert node.run(mps_spec([(20480, 25), (10240, 13)])).applied
    changed = mps_spec([(40960, 50), (10240, 13)])
    node.mps.failing[PINNED] = 1
    assert not node.run(changed, 2).applied

    # the next plan drops the 10 GiB slice: its withdrawal is published before the daemons
    # are synced, and must not advertise the pending daemon's slices Healthy either
    before = len(node.published)
    res = node.run(mps_spec([(40960, 50), (5120, 7), (5120, 7)]), 3)
    withdrawal = node.published[before]
    assert len(node.published) == before + 2
    assert gpu0(node, withdrawal) and not any(d.healthy for d in gpu0(node, withdrawal))
    assert res.applied and all(d.healthy for d in gpu0(node, res.devices))
    assert defaults(node)[PINNED] == "0 40960M"
