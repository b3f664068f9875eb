"""The node agent in DRA mode: the kubelet plugin, the ResourceSlice publisher and one loop.

Model
-----
:class:`DraDriver` runs, in this order:

1. :meth:`~node_agent.dra_prepare.DraPreparer.clean_unknown`: claims whose prepare the last
   agent did not finish are rolled back, idle MIG instances no claim owns are destroyed (used
   ones are kept and logged);
2. the kubelet plugin (:class:`~node_agent.draplugin.DraKubeletPlugin`): registration and
   DRA servers;
3. a publish loop: :meth:`~node_agent.dra_publish.SlicePublisher.publish` now, again whenever
   the kubelet (re)registers the plugin (a starting kubelet deletes its node's slices) and at
   least every ``resync_s`` (repairing slices someone changed or deleted); a failed round is
   retried after ``retry_s``.  Each round's outcome goes to the health check
   (:class:`~node_agent.health.AgentHealth`), so an API server that keeps refusing the slices
   (e.g. with DRAPartitionableDevices off) turns ``/healthz`` unhealthy with that reason.

:meth:`DraDriver.run` returns when ``stop`` is set; the plugin's sockets are removed on the
way out (the kubelet then deregisters the driver) and nothing on the GPUs is touched: prepared
instances keep serving their pods, and the next agent finds them in the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from node_agent.dra_publish import SlicePublisher
from node_agent.draplugin import DraKubeletPlugin
from node_agent.health import AgentHealth

__all__ = ["DraDriver"]

log = logging.getLogger(__name__)


class DraDriver:
    def __init__(
        self,
        plugin: DraKubeletPlugin,
        publisher: SlicePublisher,
        *,
        resync_s: float = 30.0,
        retry_s: float = 2.0,
        health: AgentHealth | None = None,
    ) -> None:
        """``plugin``'s registrations wake the publish loop (its ``on_registered`` is set
        here); its preparer is the one the start-up clean-up runs on."""
        self.plugin = plugin
        self.preparer = plugin.preparer
        self.publisher = publisher
        self.resync_s = resync_s
        self.retry_s = retry_s
        self.health = health
        self._wake = asyncio.Event()
        plugin.on_registered = self._wake.set
        self.rounds = 0
        self.failures = 0

    async def publish_once(self) -> bool:
        """One publish round; return whether it succeeded (:attr:`rounds` counts finished
        rounds)."""
        try:
            await self.publisher.publish()
        except Exception as e:  # PublishError, a connection or a timeout: the loop goes on
            self.rounds += 1
            self.failures += 1
            log.warning("publishing ResourceSlices failed (will retry): %s", e)
            if self.health is not None:
                self.health.record(False, str(e))
            return False
        self.rounds += 1
        if self.health is not None:
            self.health.record(True, "")
        return True

    async def run(self, stop: asyncio.Event) -> None:
        kept = await asyncio.to_thread(self.preparer.clean_unknown)
        for line in kept:
            log.warning("kept a MIG instance no claim owns, because it is in use: %s", line)
        await self.plugin.start()
        try:
            while not stop.is_set():
                self._wake.clear()
                ok = await self.publish_once()
                waits = [
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(self._wake.wait()),
                ]
                try:
                    await asyncio.wait(
                        waits,
                        timeout=self.resync_s if ok else self.retry_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    for w in waits:
                        w.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await w
        finally:
            await self.plugin.stop()
