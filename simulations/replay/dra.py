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
prepares the claim and destroys it at unprepare (publish-everything), which the replay engine
counts as reconfigurations.

Planner-shaped publishing (``shaped``; policy ``dra-shaped``)
-------------------------------------------------------------
The agent (``gpuslice agent --dra``, publish mode ``shaped``) publishes, per GPU, the
placements of its node's NodePartitioning spec (the whole GPU where the spec lists none) and
every allocated device (:meth:`DraPools.publish`, run when the agent's round reads a new spec):
it destroys the idle instances the new spec no longer lists and creates the spec's placements
as idle instances (except where an allocated device still overlaps one), as the device-plugin
agent applies a spec.  First-fit then only chooses among planned placements.  Prepare adopts
the idle instance at the allocated placement (no reconfiguration, no wait) or creates one;
unprepare keeps an instance the spec lists and destroys the others (:meth:`DraPools.prepare`,
:meth:`DraPools.unprepare`).  Reconfigurations are counted per GPU and event (a spec applied,
a prepare that created, an unprepare that destroyed).  The status the
agent reports (:meth:`DraPools.status_gpus`) is what the partitioner's ledger reads: allocated
placements (used), then the spec's placements the counters still allow beside them, so it is
always a valid layout even when a spec was planned before an allocation it now overlaps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contract.quantity import quantity_value
from node_agent.dra_slices import DraGpu, reported_layout, resource_slices
from planner.catalog import GpuModel, MigProfile
from planner.snapshot import mig_resource
from simulations.replay.fake_cluster import FakeCluster


def _count(value: object) -> int:
    """A counter's value as the agent writes it (a canonical quantity: ``8``, ``1k``)."""
    exact = quantity_value(value)
    if exact is None or exact != exact.to_integral_value():
        raise ValueError(f"counter value {value!r} is not a whole quantity")
    return int(exact)

__all__ = ["DRA_SLICE_WIPE_S", "DraPools", "PublishedDevice"]

DRA_SLICE_WIPE_S = 30.0
"""The kubelet deletes the ResourceSlices of a DRA driver that has had no connected endpoint
for this long (shared/facts/dra.md, section 3)."""


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
    start: int = 0
    """The placement's first memory slot (0 for the whole GPU)."""


@dataclass(slots=True)
class _Pool:
    devices: list[PublishedDevice]
    capacity: dict[tuple[int, str], int]
    models: dict[int, GpuModel]
    used: dict[tuple[int, str], int] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)
    """Device name -> the pod whose claim holds it."""
    published: set[str] | None = None
    wiped: set[str] | None = None
    """While the kubelet has deleted the pool's slices (the agent's plugin gone for
    :data:`DRA_SLICE_WIPE_S`): what the agent published before, published again when it is
    back (:meth:`DraPools.restore`); ``None``: not wiped."""
    """Planner-shaped publishing: the device names the agent publishes (``None``: every one)."""
    spec: set[str] = field(default_factory=set)
    """Planner-shaped: the placements of the node's spec, as device names."""
    kept: set[str] = field(default_factory=set)
    """Planner-shaped: idle MIG instances the agent keeps (spec placements a claim used)."""
    fits: dict[tuple[tuple[str, int], ...], list[PublishedDevice] | None] = field(
        default_factory=dict
    )
    """First-fit answers for the pool as it is (cleared when an allocation changes): the
    scheduler's filter asks for every parked pod on every retry, and binding asks again."""


Used = dict[tuple[int, str], int]
"""``(GPU, counter) -> amount`` consumed."""


def _fits(used: Used, capacity: Mapping[tuple[int, str], int], d: PublishedDevice) -> bool:
    """``d``'s counters, added to ``used``, stay within its GPU's counter set."""
    return all(used.get((d.gpu, k), 0) + v <= capacity[(d.gpu, k)] for k, v in d.consumes)


def _consume(used: Used, d: PublishedDevice, sign: int = 1) -> None:
    for k, v in d.consumes:
        used[(d.gpu, k)] = used.get((d.gpu, k), 0) + sign * v


def _profile(model: GpuModel, d: PublishedDevice) -> MigProfile | None:
    return model.profile(d.profile) if d.profile is not None else None


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
                capacity[(g, k)] = _count(v["value"])
        for d in spec.get("devices", ()):
            attrs = d["attributes"]
            g = int(attrs["index"]["int"])
            profile = attrs["profile"]["string"] if "profile" in attrs else None
            model = models[g]
            compute = model.profile(profile).compute if profile else model.compute_slices
            consumes = tuple(
                (k, _count(v["value"]))
                for c in d.get("consumesCounters", ())
                for k, v in sorted(c["counters"].items())
            )
            resource = mig_resource(profile) if profile else ""
            start = int(attrs["start"]["int"]) if "start" in attrs else 0
            devices.append(
                PublishedDevice(d["name"], g, profile, resource, compute, consumes, start)
            )
    return _Pool(devices, capacity, dict(models))


class DraPools:
    """Every node's published devices and the allocations of bound claims (module docstring)."""

    def __init__(
        self,
        fake: FakeCluster,
        shaped: bool = False,
        draining: Callable[[str], frozenset[int]] | None = None,
    ) -> None:
        self.shaped = shaped
        self.draining = draining
        self.pools: dict[str, _Pool] = {}
        for name, node in fake.nodes.items():
            models = {g.index: node.model for g in node.gpus}
            self.pools[name] = pool = _published(name, models)
            if shaped:  # no spec yet: whole GPUs only
                pool.published = {d.name for d in pool.devices if d.profile is None}
        self.claims: dict[str, tuple[str, list[PublishedDevice]]] = {}
        """Pod -> (node, its allocated devices)."""

    def fit(self, node: str, requests: Mapping[str, int]) -> list[PublishedDevice] | None:
        """The allocator's first-fit allocation of ``requests`` on ``node``, or ``None``."""
        pool = self.pools.get(node)
        if pool is None:
            return None
        key = tuple(sorted(requests.items()))
        if key not in pool.fits:
            pool.fits[key] = self._first_fit(pool, key, self.withheld(node))
        found = pool.fits[key]
        return None if found is None else list(found)

    def withheld(self, node: str) -> frozenset[int]:
        """Planner-shaped: GPUs whose free placements the agent does not publish (the ones the
        partitioner drains, read from its NodePartitioning's ``status.reservations``)."""
        if not self.shaped or self.draining is None:
            return frozenset()
        return self.draining(node)

    @staticmethod
    def _first_fit(
        pool: _Pool, requests: tuple[tuple[str, int], ...], withheld: frozenset[int] = frozenset()
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
                if pool.published is not None and d.name not in pool.published:
                    continue
                if d.gpu in withheld:
                    continue
                if not _fits(used, pool.capacity, d):
                    continue
                _consume(used, d)
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
            _consume(pool.used, d)
        self.claims[pod] = (node, list(devices))

    def release(self, pod: str) -> tuple[str, list[PublishedDevice]]:
        node, devices = self.claims.pop(pod)
        pool = self.pools[node]
        pool.fits.clear()
        for d in devices:
            del pool.held[d.name]
            _consume(pool.used, d, -1)
        return node, devices

    def wipe(self, node: str) -> None:
        """The kubelet deleted ``node``'s ResourceSlices (its DRA plugin has been gone for
        :data:`DRA_SLICE_WIPE_S`): nothing more is allocated there until the agent publishes
        again (:meth:`restore`); the devices bound claims hold stay theirs."""
        pool = self.pools[node]
        if pool.wiped is None:
            everything = {d.name for d in pool.devices}
            pool.wiped = everything if pool.published is None else pool.published
            pool.published = set()
            pool.fits.clear()

    def restore(self, node: str) -> set[str]:
        """The agent is back and publishes its pool again: what it published before the wipe,
        and every allocated device (a spec written meanwhile is published by the agent's round
        that applies it).  Returns the resources published again."""
        pool = self.pools[node]
        if pool.wiped is None:
            return set()
        pool.published, pool.wiped = pool.wiped | set(pool.held), None
        pool.fits.clear()
        return {d.resource for d in pool.devices if d.name in pool.published}

    # ------------------------------------------------------------------ planner-shaped agent

    def publish(self, node: str, spec: Mapping[int, list[tuple[str, int]]]) -> tuple[int, set[str]]:
        """The agent's round after a spec (module docstring, "Planner-shaped publishing"):
        destroy kept instances the spec no longer lists, create the spec's placements that are
        free (not overlapping an allocated device), publish the spec's placements (the whole
        GPU where it lists none) and every allocated device.  Returns the GPUs reconfigured
        and the resources newly published."""
        pool = self.pools[node]
        by_slot = {(d.gpu, d.profile, d.start): d for d in pool.devices}
        wanted = [
            d
            for gpu, placements in spec.items()
            for profile, start in placements
            if (d := by_slot.get((gpu, profile, start))) is not None
        ]
        pool.spec = {d.name for d in wanted}
        whole = {d.name for d in pool.devices if d.profile is None and not spec.get(d.gpu)}
        before = pool.published or set()
        pool.published = pool.spec | whole | set(pool.held)
        changed = {d.gpu for d in pool.devices if d.name in pool.kept - pool.spec}
        pool.kept &= pool.spec
        used: Used = {}
        for d in pool.devices:
            if d.name in pool.held or d.name in pool.kept:
                _consume(used, d)
        for d in wanted:
            if d.name in pool.held or d.name in pool.kept:
                continue
            if not _fits(used, pool.capacity, d):
                continue  # overlaps an allocated device: made once that claim is gone
            _consume(used, d)
            pool.kept.add(d.name)
            changed.add(d.gpu)
        pool.fits.clear()
        grown = {d.resource for d in pool.devices if d.name in pool.published - before}
        return len(changed), grown

    def prepare(self, node: str, devices: list[PublishedDevice]) -> int:
        """Prepare: adopt a kept instance at the placement, else create one; returns the GPUs
        on which an instance was created."""
        pool = self.pools[node]
        created = set()
        for d in devices:
            if d.name in pool.kept:
                pool.kept.discard(d.name)
            elif d.profile is not None:
                created.add(d.gpu)
        return len(created)

    def unprepare(self, node: str, devices: list[PublishedDevice]) -> int:
        """Unprepare: keep an instance the spec lists, destroy the others; returns the GPUs
        on which an instance was destroyed.  A device no longer in the spec stops being
        published once free."""
        pool = self.pools[node]
        destroyed = set()
        for d in devices:
            if d.name in pool.spec:
                pool.kept.add(d.name)
            else:
                if d.profile is not None:
                    destroyed.add(d.gpu)
                if pool.published is not None:
                    pool.published.discard(d.name)
        pool.fits.clear()
        return len(destroyed)

    def status_gpus(self, node: str, gpu_count: int) -> list[dict[str, Any]]:
        """The NodePartitioning status the agent reports: per GPU the allocated placements
        (``used``) and the spec's placements the counters still allow beside them (free), in
        that order, so the report is always a valid layout (a spec written before the agent saw
        an allocation may overlap it; that placement is not free until the claim goes)."""
        pool = self.pools[node]
        out: list[dict[str, Any]] = []
        for g in range(gpu_count):
            model = pool.models[g]
            mine = [d for d in pool.devices if d.gpu == g]
            layout = reported_layout(
                model,
                [(_profile(model, d), d.start) for d in mine if d.name in pool.held],
                [(p, d.start) for d in mine if d.name in pool.spec and (p := _profile(model, d))],
            )
            mig = [{"profile": p, "start": s, "used": u} for p, s, u in layout]
            out.append({"index": g, "migEnabled": True, "mig": mig})
        return out

    def busy_gpus(self) -> int:
        """GPUs some bound claim holds a device of."""
        return len({(node, d.gpu) for node, ds in self.claims.values() for d in ds})

    def used_compute(self) -> int:
        return sum(d.compute for _, ds in self.claims.values() for d in ds)
