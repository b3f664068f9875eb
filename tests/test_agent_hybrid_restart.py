"""Hybrid hosts across an agent restart, and the limits of a hybrid daemon whose host becomes a
whole MIG device (node_agent.reconciler, "Crash safety" and step 5; node_agent.mps, Limits).

* A restarted agent rebuilds a host's slice table from the slices pods hold; a host none of
  whose slices is held is rebuilt empty and looked like a whole MIG device.  It was advertised
  as ``nvidia.com/mig-3g.40gb`` whenever its GPU's plan did not run in that pass (a PodResources
  failure on the re-read after the withdrawal; any lasting block on the GPU), a device the spec
  does not contain: a pod given it made the spec impossible for good.  Such a *lost host* is
  now not advertised at all until the plan has filled its table.
* A host made a whole instance keeps its daemon; the daemon kept the pinned-memory limit of
  the host's largest slice (a limit is never cleared by sending none), capping the pod given
  the whole instance.  It now gets the instance's memory, on its running server too, and an
  adopted daemon (agent restart) gets it again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from contract.nodepartitioning import NodePartitioningSpec, NodePartitioningStatus
from node_agent.devices import AdvertisedDevice
from node_agent.nvml_fake import FakeNvml
from tests.test_agent_reconciler import Node
from tests.test_agent_rollout import Node as McNode

HOST = {"memoryMiB": 10240, "activeThreadPercentage": 26}


def spec(host_slices: int = 2, other: str = "3g.40gb", gpus: bool = True) -> NodePartitioningSpec:
    """Hybrid A100-80GB: ``3g.40gb@0`` hosting ``host_slices`` 10 GiB slices, ``other@4``."""
    mig: list[dict[str, object]] = [
        {"profile": "3g.40gb", "start": 0, "mps": [HOST] * host_slices},
        {"profile": other, "start": 4},
    ]
    return NodePartitioningSpec.model_validate(
        {"planId": "p", "mode": "hybrid", "gpus": [{"index": 0, "mig": mig}] if gpus else []}
    )


def uuid_at(node: Node | McNode, start: int) -> str:
    nv: FakeNvml = node.nv
    return next(u for _gi, _p, s, us in nv.instances(0) if s == start for u in us)


def advertised(devices: dict[str, list[AdvertisedDevice]]) -> dict[str, str]:
    """Device id -> resource."""
    return {d.id: r for r, ds in devices.items() for d in ds}


def test_a_free_host_is_not_advertised_whole_when_the_re_read_after_withdrawal_fails() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    assert node.run(spec()).applied
    host, other = uuid_at(node, 0), uuid_at(node, 4)
    node.restart()
    node.published.clear()

    class Flaky:  # answers the pass's first read, fails the re-read after the withdrawal
        calls = 0

        async def in_use_device_ids(self) -> set[str]:
            Flaky.calls += 1
            if Flaky.calls > 1:
                raise ConnectionError("PodResources UNAVAILABLE")
            return set()

    node.agent._in_use = Flaky()
    res = node.run(spec())
    assert res.blocks[0].reason == "InUseChanged" and not res.applied
    assert node.published  # the pass did publish (withdrawal, then the final devices)
    for devices in node.published:
        assert host not in advertised(devices)
    assert advertised(res.devices) == {other: "nvidia.com/mig-3g.40gb"}

    node.agent._in_use = node.pods  # PodResources answers again: the plan fills the table
    res = node.run(spec())
    assert res.applied, res.status.conditions
    got = advertised(res.devices)
    assert host not in got
    assert sorted(r for d, r in got.items() if d.startswith(host)) == ["nvidia.com/gpu-10gb"] * 2
    assert all(host not in advertised(devices) for devices in node.published)


def test_a_free_host_is_not_advertised_whole_while_its_gpu_is_blocked() -> None:
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(spec())
    host, other = uuid_at(node, 0), uuid_at(node, 4)
    gi4 = next(gi for gi, _p, s, _u in node.nv.instances(0) if s == 4)
    pid = node.nv.start_process(0, gi4, 0)  # a stray process on the instance the spec replaces
    node.restart()
    node.published.clear()
    for _ in range(2):  # a lasting block: every pass
        res = node.run(spec(other="2g.20gb"), gen=2)
        assert res.blocks[0].reason == "InstanceInUse"
        assert host not in advertised(res.devices)
    host_status = next(m for m in res.status.gpus[0].mig if m.start == 0)
    assert host_status.deviceId == host and not host_status.used and host_status.mps == []

    node.nv.stop_process(pid)
    res = node.run(spec(other="2g.20gb"), gen=2)
    assert res.applied, res.status.conditions
    assert (
        sorted(r for d, r in advertised(res.devices).items() if d.startswith(host))
        == ["nvidia.com/gpu-10gb"] * 2
    )
    assert other not in advertised(res.devices)  # replaced by the 2g.20gb
    assert all(host not in advertised(devices) for devices in node.published)


def test_a_host_the_spec_makes_whole_or_a_pod_holds_whole_is_advertised_whole() -> None:
    """What is not a lost host stays advertised: an instance the new spec lists without slices
    (the spec contains it), and one a pod holds as a whole MIG device."""
    node = Node("A100-SXM4-80GB", mig=True)
    node.run(spec())
    host = uuid_at(node, 0)
    node.restart()
    res = node.run(spec(host_slices=0), gen=2)
    assert res.applied and advertised(res.devices).get(host) == "nvidia.com/mig-3g.40gb"

    node.run(spec(), gen=3)  # a host again
    node.restart()
    node.pods.ids = {host}  # held whole (as an earlier agent advertised it, say)
    res = node.run(spec(), gen=3)
    assert res.blocks[0].reason == "InstanceInUse"
    assert advertised(res.devices).get(host) == "nvidia.com/mig-3g.40gb"


def test_a_host_out_of_the_spec_is_told_by_the_previous_status_or_its_daemon() -> None:
    """A hybrid node relabelled to mig (a spec with no GPU) while the agent was down: the host
    is not in the spec.  The previous status says which instance was a host; without it, the
    host's running daemon does."""
    node = Node("A100-SXM4-80GB", mig=True)
    before = node.run(spec(other="2g.20gb"))
    host, plain = uuid_at(node, 0), uuid_at(node, 4)
    relabelled = NodePartitioningSpec.model_validate({"planId": "2", "mode": "mig", "gpus": []})
    previous = NodePartitioningStatus.model_validate(before.status.model_dump())

    node.restart()
    res = asyncio.run(node.agent.reconcile(relabelled, 2, previous=previous, now="t"))
    got = advertised(res.devices)
    assert host not in got and got.get(plain) == "nvidia.com/mig-2g.20gb"
    res = asyncio.run(node.agent.reconcile(relabelled, 2, previous=res.status, now="t"))
    assert host not in advertised(res.devices)  # still: its own status no longer says so

    fresh = Node("A100-SXM4-80GB", mig=True)  # no previous status: the daemon tells
    fresh.run(spec())
    fresh_host = uuid_at(fresh, 0)
    fresh.restart()
    res = fresh.run(relabelled, gen=2)
    assert fresh_host not in advertised(res.devices)


def test_a_host_made_whole_gets_its_instance_memory_as_pinned_limit(tmp_path: Path) -> None:
    node = McNode(tmp_path, "A100-SXM4-80GB", mig=True)
    assert node.run(spec()).applied
    pipe = f"{node.root}/gpu0-mig0"
    assert node.mps.defaults(pipe)["set_default_device_pinned_mem_limit"] == "0 10240M"
    client = node.mps.connect(pipe)  # a slice's pod ran and ended: its server stays, idle
    node.mps.disconnect(client)
    starts = node.mps.starts

    res = node.run(spec(host_slices=0), gen=2)
    assert res.applied
    (whole,) = (d for d in res.devices["nvidia.com/mig-3g.40gb"] if d.id == uuid_at(node, 0))
    assert whole.env["CUDA_MPS_PIPE_DIRECTORY"] == pipe  # the pod is this daemon's client
    limits = node.mps.defaults(pipe)
    assert limits == {
        "set_default_active_thread_percentage": "100",
        "set_default_device_pinned_mem_limit": "0 40192M",
    }
    server = node.mps.daemons[pipe].server_limits
    assert server == {
        "set_active_thread_percentage": "100",
        "set_device_pinned_mem_limit": "0 40192M",
    }
    assert node.mps.starts == starts and not node.mps.quit_with_clients  # same daemon


def test_an_adopted_daemon_of_a_host_made_whole_gets_the_instance_memory(tmp_path: Path) -> None:
    node = McNode(tmp_path, "A100-SXM4-80GB", mig=True)
    node.run(spec())
    pipe = f"{node.root}/gpu0-mig0"
    node.new_agent()  # the spec changes while the agent is replaced
    res = node.run(spec(host_slices=0), gen=2)
    assert res.applied and node.mps.starts == 2  # both daemons adopted, none started
    assert node.mps.defaults(pipe)["set_default_device_pinned_mem_limit"] == "0 40192M"
