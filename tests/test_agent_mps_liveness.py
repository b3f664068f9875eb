"""An MPS control daemon that dies between passes is noticed within seconds, not at the resync.

The node is the fake one of ``tests/test_agent_rollout.py``: the production
:class:`~node_agent.mps.MpsControlSupervisor` drives :class:`~node_agent.mps_fake.FakeMpsControl`,
whose :meth:`~node_agent.mps_fake.FakeMpsControl.kill` is one daemon's crash (its server ends,
its clients are broken).  The agent loop runs with a resync far beyond the test
(``RESYNC``), so whatever happens within it was woken by the liveness check
(``mps_liveness_seconds``, a few hundredths of a second here).

Before the check existed, a daemon killed between passes stayed dead and its slices stayed
advertised Healthy until the next resync (measured: no pass, no restart, no publish a second
after the kill; ``test_with_the_check_off_a_dead_daemon_waits_for_the_resync`` keeps that
behaviour for the switch that turns the check off).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from node_agent.agent import Agent, InMemorySpecSource
from node_agent.devices import AdvertisedDevice
from node_agent.metrics import AgentMetrics
from node_agent.mps import FakeSupervisor, MpsControlSupervisor, MpsDaemonSpec
from node_agent.mps_fake import FakeMpsControl
from node_agent.nvml import ComputeMode
from node_agent.reconciler import Reconciler
from node_agent.settings import AgentSettings
from tests.fake_kubelet import eventually
from tests.test_agent_rollout import CAT, Node, mps_spec

SPEC = mps_spec([(40960, 50), (40960, 50)], [(20480, 25)] * 4)
RESYNC = 60.0
"""Far beyond any test here: a pass within a test was woken by something else."""
TICK = 0.02
"""The liveness interval of the tests."""
DEATHS = "gpuslice_agent_mps_daemon_deaths_total"


def gpu_devices(node: Node, gpu: int) -> list[AdvertisedDevice]:
    """The devices of GPU ``gpu`` in the last publish (by their daemon's pipe directory)."""
    pipe = f"{node.root}/gpu{gpu}"
    return [
        d
        for ds in node.published[-1].values()
        for d in ds
        if d.env.get("CUDA_MPS_PIPE_DIRECTORY") == pipe
    ]


def deaths(metrics: AgentMetrics, daemon: str) -> float:
    return metrics.registry.get_sample_value(DEATHS, {"daemon": daemon}) or 0.0


@asynccontextmanager
async def agent_running(agent: Agent) -> AsyncIterator[None]:
    """The agent's loop, in the test's own event loop; stopped and awaited on the way out."""
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 2.0)


async def settled(agent: Agent) -> None:
    """The loop has made its passes for the spec set at construction (two: that spec also
    wakes the first wait) and waits."""
    await eventually(lambda: agent.passes >= 2, timeout=2.0, what="the first passes")
    await asyncio.sleep(5 * TICK)


def two_mps_gpus(tmp_path: Path) -> tuple[Node, AgentMetrics, Agent]:
    """Two MPS GPUs and their agent's loop (not started), checking the daemons every TICK."""
    node = Node(tmp_path, "A100-SXM4-80GB", "A100-SXM4-80GB")
    metrics = AgentMetrics(CollectorRegistry())
    agent = Agent(
        node.agent,
        InMemorySpecSource("gpu-node-1", SPEC),
        resync_seconds=RESYNC,
        retry_seconds=TICK,
        metrics=metrics,
        mps_liveness_seconds=TICK,
    )
    return node, metrics, agent


def with_client(node: Node) -> int:
    """A pod holds a slice of GPU 0 and its CUDA process is a client of GPU 0's daemon."""
    held = gpu_devices(node, 0)[0]
    node.pods.ids = {held.id}
    return node.mps.connect(held.env["CUDA_MPS_PIPE_DIRECTORY"])


async def test_a_dead_daemon_is_restarted_with_its_limits_at_once_although_its_slice_is_held(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node, metrics, agent = two_mps_gpus(tmp_path)
    caplog.set_level(logging.INFO, logger="gpuslice.agent")
    async with agent_running(agent):
        await settled(agent)
        client = with_client(node)
        gpu0, gpu1 = f"{node.root}/gpu0", f"{node.root}/gpu1"
        limits = node.mps.defaults(gpu0)
        assert limits == {
            "set_default_active_thread_percentage": "50",
            "set_default_device_pinned_mem_limit": "0 40960M",
        }
        passes, starts = agent.passes, node.mps.starts

        t0 = time.monotonic()
        node.mps.kill(gpu0)  # a crash: its client goes with it, the pod still holds the slice
        await eventually(lambda: node.mps.served(gpu0), timeout=2.0, what="the restart")
        took = time.monotonic() - t0

        assert took < 1.0 < RESYNC  # woken by the check, not by the resync
        assert agent.passes > passes
        assert node.mps.starts == starts + 1  # GPU 0's daemon only: GPU 1's ran on
        assert node.mps.defaults(gpu0) == limits  # started again with its limits
        assert client in node.mps.broken and node.pods.ids  # in use, and restarted anyway
        assert not node.mps.quit_with_clients and "quit" not in node.mps.commands
        await eventually(
            lambda: len(gpu_devices(node, 0)) == 2 and all(d.healthy for d in gpu_devices(node, 0)),
            timeout=1.0,
            what="GPU 0's slices published Healthy again",
        )
        assert node.mps.served(gpu1) and len(gpu_devices(node, 1)) == 4
        assert deaths(metrics, "gpu0") == 1 and deaths(metrics, "gpu1") == 0
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1
        assert "MPS control daemon gpu0 died (1 time(s)" in warned[0].getMessage()

        # it dies again: a crash loop shows in the count
        node.mps.kill(gpu0)
        await eventually(lambda: node.mps.served(gpu0), timeout=2.0, what="the second restart")
        await eventually(lambda: deaths(metrics, "gpu0") == 2, timeout=1.0, what="2 deaths")
        assert agent.daemon_deaths == {"gpu0": 2}
        assert any("gpu0 died (2 time(s)" in r.getMessage() for r in caplog.records)


async def test_a_daemon_that_cannot_be_restarted_is_advertised_unhealthy_until_it_runs(
    tmp_path: Path,
) -> None:
    node, metrics, agent = two_mps_gpus(tmp_path)
    async with agent_running(agent):
        await settled(agent)
        with_client(node)
        gpu0 = f"{node.root}/gpu0"
        published = len(node.published)
        node.mps.refuse_starts = 10**6  # the daemon cannot come back for now

        node.mps.kill(gpu0)
        await eventually(
            lambda: (
                len(node.published) > published and not any(d.healthy for d in gpu_devices(node, 0))
            ),
            timeout=1.0,
            what="GPU 0's slices published Unhealthy",
        )
        assert len(gpu_devices(node, 0)) == 2  # still advertised: the pod keeps its slice
        assert all(d.healthy for d in gpu_devices(node, 1))
        refused = node.mps.refuse_starts
        await eventually(
            lambda: node.mps.refuse_starts < refused - 2, timeout=1.0, what="retried starts"
        )
        assert not node.mps.served(gpu0)
        assert not any(d.healthy for d in gpu_devices(node, 0))
        assert deaths(metrics, "gpu0") == 1  # one death, however many starts failed

        node.mps.refuse_starts = 0  # it can start again
        await eventually(lambda: node.mps.served(gpu0), timeout=1.0, what="the restart")
        await eventually(
            lambda: all(d.healthy for d in gpu_devices(node, 0)),
            timeout=1.0,
            what="GPU 0's slices Healthy again",
        )
        assert node.mps.defaults(gpu0)["set_default_device_pinned_mem_limit"] == "0 40960M"
        assert deaths(metrics, "gpu0") == 1


async def test_with_the_check_off_a_dead_daemon_waits_for_the_resync(tmp_path: Path) -> None:
    """The gap as it was (and as ``mps_liveness_seconds=0`` keeps it)."""
    node = Node(tmp_path, "A100-SXM4-80GB")
    resync = 0.6
    agent = Agent(
        node.agent, InMemorySpecSource("n1", SPEC), resync_seconds=resync, mps_liveness_seconds=0
    )
    async with agent_running(agent):
        await settled(agent)
        gpu0 = f"{node.root}/gpu0"
        passes, published = agent.passes, len(node.published)
        node.mps.kill(gpu0)
        t0 = time.monotonic()
        await asyncio.sleep(resync / 3)
        assert not node.mps.served(gpu0) and agent.passes == passes
        assert len(node.published) == published and all(d.healthy for d in gpu_devices(node, 0))
        await eventually(lambda: node.mps.served(gpu0), timeout=2.0, what="the resync's restart")
        assert time.monotonic() - t0 >= resync / 2


class Recording:
    """A runner around the fake control binary that records which thread each probe ran in
    and how many calls overlapped; ``slow`` makes every probe from a worker thread last that
    long."""

    def __init__(self, control: FakeMpsControl, slow: float = 0.0) -> None:
        self.control = control
        self.slow = slow
        self.threads: list[bool] = []
        """Per ``get_server_list``: True when it ran outside the event loop's thread."""
        self.busy = 0
        self.most = 0
        self._lock = threading.Lock()
        self._main = threading.get_ident()

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], stdin: str | None
    ) -> tuple[int, str]:
        with self._lock:
            self.busy += 1
            self.most = max(self.most, self.busy)
        try:
            worker = threading.get_ident() != self._main
            if stdin == "get_server_list\n":
                self.threads.append(worker)
                if worker and self.slow:
                    time.sleep(self.slow)
            return self.control(argv, env, stdin)
        finally:
            with self._lock:
                self.busy -= 1


def recorded_agent(node: Node, runner: Recording, source: InMemorySpecSource) -> Agent:
    node.agent = Reconciler(
        node.nv,
        node.pods,
        MpsControlSupervisor(runner),
        CAT,
        mps_pipe_root=node.root,
        mps_log_root=node.logs,
        publish=node.publish,
    )
    return Agent(
        node.agent, source, resync_seconds=RESYNC, retry_seconds=TICK, mps_liveness_seconds=TICK
    )


async def test_the_check_runs_off_the_event_loop_and_never_beside_a_pass(tmp_path: Path) -> None:
    node = Node(tmp_path, "A100-SXM4-80GB")
    runner = Recording(node.mps, slow=0.1)
    source = InMemorySpecSource("n1", SPEC)
    agent = recorded_agent(node, runner, source)
    async with agent_running(agent):
        await settled(agent)
        idle_from = len(runner.threads)
        await asyncio.sleep(0.3)
        between_passes = runner.threads[idle_from:]
        assert between_passes and all(between_passes)  # every probe from a worker thread
        # a spec change while a probe is in flight: the pass waits for it
        await eventually(lambda: runner.busy == 1, timeout=1.0, what="a probe in flight")
        passes = agent.passes
        source.set_spec(mps_spec([(20480, 25)] * 4))
        await eventually(lambda: agent.passes > passes, timeout=2.0, what="the pass")
        await asyncio.sleep(0.15)
    assert runner.most == 1  # the pass's probes never overlapped the check's


def test_the_supervisor_reports_each_death_once_and_no_stop_or_failed_start(
    tmp_path: Path,
) -> None:
    control = FakeMpsControl(Node(tmp_path, "A100-SXM4-80GB", "A100-SXM4-80GB").nv)
    for gpu in (0, 1):
        control.nvml.set_compute_mode(gpu, ComputeMode.EXCLUSIVE_PROCESS)
    sup = MpsControlSupervisor(control)

    def spec(gpu: int) -> MpsDaemonSpec:
        return MpsDaemonSpec(
            f"gpu{gpu}", control.nvml.gpus()[gpu].uuid, f"{tmp_path}/p{gpu}", f"{tmp_path}/l{gpu}"
        )

    sup.ensure(spec(0))
    sup.ensure(spec(1))
    assert sup.check() == []
    control.kill(f"{tmp_path}/p0")
    assert sup.check() == ["gpu0"] and sup.check() == []  # reported once
    control.refuse_starts = 1
    with pytest.raises(Exception, match="failed"):
        sup.ensure(spec(0))
    assert sup.check() == []  # never up again: not another death
    sup.ensure(spec(0))
    control.kill(f"{tmp_path}/p0")
    assert sup.running() == {"gpu1"}  # a pass's probe sees it first ...
    assert sup.check() == ["gpu0"]  # ... and the next check reports it
    sup.stop("gpu1")
    assert sup.check() == []  # a stop is not a death

    fake = FakeSupervisor()
    fake.ensure(spec(0))
    fake.kill("gpu0")
    fake.kill("gpu0")  # already dead: one death
    assert fake.check() == ["gpu0"] and fake.check() == []


def test_the_agents_default_interval_is_the_settings_default() -> None:
    default = AgentSettings.model_fields["mps_liveness_seconds"].default
    assert default == 5.0
    assert inspect.signature(Agent).parameters["mps_liveness_seconds"].default == default
