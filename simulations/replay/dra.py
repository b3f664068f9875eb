"""kube-scheduler's DRA allocation over the DRA agents' ResourceSlices, for the time replay.

Model
-----
In DRA mode (``gpuslice agent --dra``, docs/operations.md "DRA mode") each node's agent
publishes every MIG placement of every GPU, and the whole GPU, as devices with shared counters:
the manifests of :func:`node_agent.dra_slices.resource_slices`, the production builder, are
what this model reads.  A pod asks for ``count`` MIG instances of one profile (its mapped
request ``nvidia.com/mig-<profile>: count`` stands for a ResourceClaim of DeviceClass
``mig.gpuslice.io`` with a CEL selector on the profile).

kube-scheduler's structured-parameters allocator (shared/facts/dra.md section 2), per node in
the Filter phase: walk the pool's slices by name and each slice's devices in list order; a
device fits when it is of the requested profile, no claim holds it, and its counters, added to
those of the devices allocated to bound claims and of the devices picked earlier for the same
claim, stay within the GPU's counter set.  The first ``count`` fitting devices are the
allocation (first-fit, no scoring: DRA adds no score, so nodes are ranked by the default
profile's cpu/memory scores alone, :meth:`simulations.replay.kube.Scheduler._choose`).

:class:`DraPools` keeps the allocations of bound claims; :meth:`DraPools.release` frees them
when the pod ends (the claim is deallocated).  The agent creates the instance when the kubelet
prepares the claim and destroys it at unprepare (publish-everything: what the agent does now),
which the replay engine counts as reconfigurations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from node_agent.dra_slices import DraGpu, resource_slices
from planner.catalog import GpuModel
from planner.snapshot import mig_resource
from simulations.replay.fake_cluster import FakeCluster

__all__ = ["DraPools", "PublishedDevice"]


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    name: str
    gpu: int
    profile: str | None
    """MIG profile name; ``None``: the whole GPU."""
    resource: str
    """The extended-resource name the profile has in device-plugin mode (how the replay's
    pods spell their request): ``nvidia.com/mig-<profile>``; ``""`` for the whole GPU."""
    compute: int
    consumes: tuple[tuple[str, int], ...]
    """``(counter, amount)`` of the GPU's counter set."""


@dataclass(slots=True)
class _Pool:
    devices: list[PublishedDevice]
    capacity: dict[tuple[int, str], int]
    used: dict[tuple[int, str], int] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)
    """Device name -> the pod whose claim holds it."""
    fits: dict[tuple[tuple[str, int], ...], list[PublishedDevice] | None] = field(
        default_factory=dict
    )
    """First-fit answers for the pool as it is (cleared when an allocation changes): the
    scheduler's filter asks for every parked pod on every retry, and binding asks again."""


def _published(node: str, models: Mapping[int, GpuModel]) -> _Pool:
    gpus = [DraGpu(i, f"GPU-{node}-{i}", m) for i, m in sorted(models.items())]
    slices = sorted(resource_slices(node, gpus), key=lambda s: s["metadata"]["name"])
    devices: list[PublishedDevice] = []
    capacity: dict[tuple[int, str], int] = {}
    for s in slices:
        spec = s["spec"]
        for cs in spec.get("sharedCounters", ()):
            g = int(cs["name"].removeprefix("gpu"))
            for k, v in cs["counters"].items():
                capacity[(g, k)] = int(v["value"])
        for d in spec.get("devices", ()):
            attrs = d["attributes"]
            g = int(attrs["index"]["int"])
            profile = attrs["profile"]["string"] if "profile" in attrs else None
            model = models[g]
            compute = model.profile(profile).compute if profile else model.compute_slices
            consumes = tuple(
                (k, int(v["value"]))
                for c in d.get("consumesCounters", ())
                for k, v in sorted(c["counters"].items())
            )
            resource = mig_resource(profile) if profile else ""
            devices.append(PublishedDevice(d["name"], g, profile, resource, compute, consumes))
    return _Pool(devices, capacity)


class DraPools:
    """Every node's published devices and the allocations of bound claims (module docstring)."""

    def __init__(self, fake: FakeCluster) -> None:
        self.pools: dict[str, _Pool] = {}
        for name, node in fake.nodes.items():
            models = {g.index: node.model for g in node.gpus}
            self.pools[name] = _published(name, models)
        self.claims: dict[str, tuple[str, list[PublishedDevice]]] = {}
        """Pod -> (node, its allocated devices)."""

    def fit(self, node: str, requests: Mapping[str, int]) -> list[PublishedDevice] | None:
        """The allocator's first-fit allocation of ``requests`` on ``node``, or ``None``."""
        pool = self.pools.get(node)
        if pool is None:
            return None
        key = tuple(sorted(requests.items()))
        if key not in pool.fits:
            pool.fits[key] = self._first_fit(pool, key)
        found = pool.fits[key]
        return None if found is None else list(found)

    @staticmethod
    def _first_fit(
        pool: _Pool, requests: tuple[tuple[str, int], ...]
    ) -> list[PublishedDevice] | None:
        used = dict(pool.used)
        picked: list[PublishedDevice] = []
        taken: set[str] = set()
        for resource, count in requests:
            need = count
            for d in pool.devices:
                if need == 0:
                    break
                if d.resource != resource or d.name in pool.held or d.name in taken:
                    continue
                if any(
                    used.get((d.gpu, k), 0) + v > pool.capacity[(d.gpu, k)] for k, v in d.consumes
                ):
                    continue
                for k, v in d.consumes:
                    used[(d.gpu, k)] = used.get((d.gpu, k), 0) + v
                picked.append(d)
                taken.add(d.name)
                need -= 1
            if need:
                return None
        return picked

    def allocate(self, node: str, pod: str, devices: list[PublishedDevice]) -> None:
        pool = self.pools[node]
        pool.fits.clear()
        for d in devices:
            if d.name in pool.held:
                raise AssertionError(f"device {d.name} of {node} is already allocated")
            pool.held[d.name] = pod
            for k, v in d.consumes:
                pool.used[(d.gpu, k)] = pool.used.get((d.gpu, k), 0) + v
        self.claims[pod] = (node, list(devices))

    def release(self, pod: str) -> tuple[str, list[PublishedDevice]]:
        node, devices = self.claims.pop(pod)
        pool = self.pools[node]
        pool.fits.clear()
        for d in devices:
            del pool.held[d.name]
            for k, v in d.consumes:
                pool.used[(d.gpu, k)] -= v
        return node, devices

    def used_compute(self) -> int:
        return sum(d.compute for _, ds in self.claims.values() for d in ds)
