"""An in-memory GPU cluster with fake node agents, for the time-replay simulator.

Model
-----
A :class:`FakeCluster` holds nodes (:class:`FakeNode`: name, catalog GPU model, mode, CPU and
memory allocatable, GPUs).  A MIG GPU holds *instances* ``(profile, start)``; an MPS GPU holds
*slices* (memory MiB, active-thread %).  Every instance or slice is one advertised *device* of
the extended resource ``nvidia.com/mig-<profile>`` or ``nvidia.com/gpu-<N>gb``, and is either
free or bound to one pod.

Agents and specs
----------------
The partitioner writes a *spec* to a node: the full desired layout of some of its GPUs
(:class:`planner.snapshot.PlannedGpu`).  The node's agent sees the spec at once and stops
advertising the free devices the spec will remove (they can no longer be bound); after the
agent's apply delay, :meth:`FakeCluster.apply_spec` makes the layout real: devices kept by the
spec stay as they are (bound pods untouched), removed devices disappear, new ones are created
free.  MIG layouts are validated with :func:`planner.geometry.parse_layout`; MPS layouts must fit
the GPU memory.  A node with a spec not yet applied is *in flight* and is left out of snapshots.

Hybrid GPUs
-----------
On a ``hybrid`` node a MIG instance may *host* MPS slices (:attr:`planner.snapshot.PlannedGpu.
mig_mps`), as the node agent does it (:mod:`node_agent.gpu_plan`, :mod:`node_agent.devices`):

* a host is advertised only as its slices (each a device of ``nvidia.com/gpu-<N>gb``); an
  instance with no slices is a whole ``nvidia.com/mig-<profile>`` device.  The host itself is a
  :class:`Device` with an empty ``resource`` (never advertised, never bound);
* the slices of one host must fit the instance's memory (the agent's check);
* a kept instance's slice table is diffed like the agent's :func:`~node_agent.gpu_plan.
  diff_slices`: slices match by (memory, thread %), bound slices claim their twin first, so a
  free twin is the one dropped; new slices take the lowest free positions;
* a bound slice pins its instance: turning a host into a whole device, or a whole bound device
  into a host, removes the bound device (a disruption, as for any removed bound device; the
  real agent refuses such a spec, so the count must stay 0).

Disruptions
-----------
A spec that removes a device bound to a pod *disrupts* that pod: the fake agent (obediently,
like a destroy-and-recreate tool would) removes the device, the pod is evicted and
:meth:`apply_spec` returns it so the simulator can count it and re-queue it.  The real planner
keeps used instances in place, so the count must stay 0; it is non-zero only when a plan moves a
used slice.

Everything here is deterministic: devices are chosen in (GPU index, start / slot) order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from planner.catalog import Catalog, GpuModel, default_catalog
from planner.geometry import InvalidLayout, parse_layout
from planner.snapshot import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PlannedGpu,
    PlannedSlice,
    mps_resource,
)

__all__ = [
    "ApplyResult",
    "Device",
    "FakeCluster",
    "FakeClusterError",
    "FakeGpu",
    "FakeNode",
    "GpuChange",
    "NodeSpec",
    "device_names",
]

MIB_PER_GIB = 1024


class FakeClusterError(ValueError):
    """An operation on the fake cluster is invalid (unknown node, invalid layout, ...)."""


@dataclass(slots=True)
class Device:
    """One advertised unit: a MIG instance or an MPS slice."""

    resource: str
    slot: int
    """MIG: start slot; MPS: position of the slice on its GPU."""
    compute: int
    """MIG compute slices (MPS: 0)."""
    memory_mib: int
    profile: str = ""
    """MIG profile name (empty for MPS)."""
    thread_percentage: int = 100
    pod: str | None = None
    withdrawn: bool = False
    """True while a spec in flight will remove it: not advertised, cannot be bound."""
    host: int = -1
    """Hybrid: the start of the MIG instance hosting this MPS slice (``-1``: not hosted)."""
    share: float = 0.0
    """Hybrid slice: the host's compute slices times the slice's share of the host's memory
    (what the slice counts for in the allocation metric)."""

    @property
    def key(self) -> tuple[str, int]:
        if self.host >= 0:
            return (f"{self.resource}@{self.host}", self.slot)
        return (self.profile or self.resource, self.slot)

    @property
    def is_host(self) -> bool:
        """A hybrid MIG instance hosting slices: not a device of its own."""
        return not self.resource

    @property
    def device_id(self) -> str:
        """The id the fake kubelet allocates by (unique per GPU and resource)."""
        return f"{self.host}.{self.slot}" if self.host >= 0 else str(self.slot)


@dataclass(slots=True)
class FakeGpu:
    index: int
    devices: list[Device] = field(default_factory=list)

    def sort(self) -> None:
        # instances by start; a host's slices right after it, by position
        self.devices.sort(key=lambda d: (d.host, 1, d.slot) if d.host >= 0 else (d.slot, 0, 0))


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A spec in flight: desired layouts of some GPUs, applied at ``apply_at``."""

    layouts: Mapping[int, PlannedGpu]
    apply_at: float


@dataclass(slots=True)
class FakeNode:
    name: str
    model: GpuModel
    mode: Mode
    cpu_milli: int
    memory_mib: int
    gpus: list[FakeGpu]
    label: str = ""
    """Model label matched by pods' ``gpu_spec`` (defaults to the catalog model name)."""
    cpu_used: int = 0
    memory_used: int = 0
    spec: NodeSpec | None = None

    @property
    def in_flight(self) -> bool:
        return self.spec is not None


@dataclass(frozen=True, slots=True)
class GpuChange:
    """One GPU's layout before and after an applied spec, as device names (``<profile>@<start>``
    for MIG instances, ``<resource>@<position>`` for MPS slices, ``<resource>@<host>/<position>``
    for MPS slices inside a hybrid host instance), in the GPU's device order."""

    gpu: int
    before: tuple[str, ...]
    after: tuple[str, ...]


def device_names(g: FakeGpu) -> tuple[str, ...]:
    """:class:`GpuChange`'s names of a GPU's devices (host instances included): each
    device's :attr:`Device.key`, its name and slot joined by ``@`` (``/`` inside a host, whose
    key already names the host as ``<resource>@<host>``)."""
    out: list[str] = []
    for d in g.devices:
        name, slot = d.key
        out.append(f"{name}/{slot}" if d.host >= 0 else f"{name}@{slot}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What applying one spec did."""

    node: str
    gpus_changed: int
    created: int
    destroyed: int
    disrupted: tuple[str, ...]
    """Pods whose bound device the spec removed (evicted)."""
    changes: tuple[GpuChange, ...] = ()
    """The GPUs whose layout changed (``gpus_changed`` of them), in index order."""


@dataclass(frozen=True, slots=True)
class Binding:
    """A pod bound to devices of one node."""

    node: str
    devices: tuple[tuple[int, tuple[str, int]], ...]
    """(GPU index, device key) per bound unit."""
    cpu_milli: int
    memory_mib: int


class FakeCluster:
    """Nodes, their devices, the pods bound to them, and the specs in flight."""

    def __init__(self, nodes: Iterable[FakeNode], mps_reserve_mib: int = 512) -> None:
        self.nodes: dict[str, FakeNode] = {}
        for n in nodes:
            if n.name in self.nodes:
                raise FakeClusterError(f"duplicate node name {n.name!r}")
            if n.mode in (Mode.MIG, Mode.HYBRID) and not n.model.mig_capable:
                raise FakeClusterError(
                    f"node {n.name!r}: mode {n.mode.value} needs a MIG-capable GPU, "
                    f"{n.model.name} is not (use mode mps)"
                )
            self.nodes[n.name] = n
        self.mps_reserve_mib = mps_reserve_mib
        self.bindings: dict[str, Binding] = {}
        self._free: dict[str, Counter[str]] = {}
        """node -> resource -> free advertised devices."""
        self.free_total: Counter[str] = Counter()
        """resource -> free advertised devices, cluster-wide (a quick reject test)."""
        for node in self.nodes.values():
            self._recount(node)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def node(
        name: str,
        model: str | GpuModel,
        gpus: int,
        mode: Mode = Mode.MIG,
        cpu_milli: int = 1 << 30,
        memory_mib: int = 1 << 40,
        catalog: Catalog | None = None,
        label: str = "",
    ) -> FakeNode:
        """A node with ``gpus`` empty GPUs of ``model`` (a catalog name or product label)."""
        m = model if isinstance(model, GpuModel) else (catalog or default_catalog()).model(model)
        return FakeNode(
            name=name,
            model=m,
            mode=mode,
            cpu_milli=cpu_milli,
            memory_mib=memory_mib,
            gpus=[FakeGpu(i) for i in range(gpus)],
            label=label or m.name,
        )

    def set_layout(self, node: str, gpu: int, layout: PlannedGpu) -> None:
        """Set a GPU's layout directly (initial state; the GPU must have nothing bound)."""
        n = self._node(node)
        g = self._gpu(n, gpu)
        if any(d.pod is not None for d in g.devices):
            raise FakeClusterError(f"{node} GPU {gpu}: set_layout on a GPU with bound pods")
        g.devices = self._devices_of(n, layout)
        self._recount(n)

    # ------------------------------------------------------------------ queries

    def _node(self, name: str) -> FakeNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise FakeClusterError(f"unknown node {name!r}") from None

    @staticmethod
    def _gpu(node: FakeNode, index: int) -> FakeGpu:
        if not 0 <= index < len(node.gpus):
            raise FakeClusterError(
                f"node {node.name!r} has GPUs 0..{len(node.gpus) - 1}, not {index}"
            )
        return node.gpus[index]

    def free_on(self, node: str, resource: str) -> int:
        return self._free[node][resource]

    def total_compute(self) -> int:
        """MIG compute slices of all MIG/hybrid GPUs."""
        return sum(
            n.model.compute_slices * len(n.gpus)
            for n in self.nodes.values()
            if n.mode is not Mode.MPS
        )

    def used_compute(self) -> float:
        """Compute slices of bound instances, plus each bound hybrid slice's :attr:`Device.share`."""
        return sum(
            d.compute + d.share
            for n in self.nodes.values()
            for g in n.gpus
            for d in g.devices
            if d.pod is not None
        )

    def gpu_count(self) -> int:
        return sum(len(n.gpus) for n in self.nodes.values())

    def idle_gpus(self) -> int:
        """GPUs none of whose devices (instances, slices) a pod holds."""
        return sum(
            1 for n in self.nodes.values() for g in n.gpus if all(d.pod is None for d in g.devices)
        )

    def uniform(self) -> bool:
        """All nodes share one GPU model and one mode."""
        return len({(n.model.name, n.mode) for n in self.nodes.values()}) <= 1

    def gpu_fraction_used(self) -> float:
        """Mean over all GPUs of the fraction in use: MIG/hybrid GPUs by compute (as
        :meth:`used_compute`), MPS GPUs by memory of the usable memory (mixed clusters)."""
        used = 0.0
        gpus = 0
        for n in self.nodes.values():
            for g in n.gpus:
                gpus += 1
                bound = [d for d in g.devices if d.pod is not None]
                if n.mode is Mode.MPS:
                    usable = n.model.memory_mib - self.mps_reserve_mib
                    used += sum(d.memory_mib for d in bound) / usable if usable > 0 else 0.0
                else:
                    used += sum(d.compute + d.share for d in bound) / n.model.compute_slices
        return used / gpus if gpus else 0.0

    def total_mps_mib(self) -> int:
        return sum(
            (n.model.memory_mib - self.mps_reserve_mib) * len(n.gpus)
            for n in self.nodes.values()
            if n.mode is Mode.MPS
        )

    def used_mps_mib(self) -> int:
        return sum(
            d.memory_mib
            for n in self.nodes.values()
            if n.mode is Mode.MPS
            for g in n.gpus
            for d in g.devices
            if d.pod is not None
        )

    def gpu_state(self, node: FakeNode, gpu: FakeGpu) -> GpuState:
        if node.mode is Mode.MPS:
            return GpuState(
                gpu.index,
                mps=tuple(
                    MpsSlice(d.memory_mib, d.pod is not None, d.thread_percentage)
                    for d in gpu.devices
                ),
            )
        hosted: dict[int, list[MpsSlice]] = {}
        for d in gpu.devices:
            if d.host >= 0:
                hosted.setdefault(d.host, []).append(
                    MpsSlice(d.memory_mib, d.pod is not None, d.thread_percentage)
                )
        return GpuState(
            gpu.index,
            mig=tuple(
                MigInstance(d.profile, d.slot, d.pod is not None, tuple(hosted.get(d.slot, ())))
                for d in gpu.devices
                if d.host < 0
            ),
        )

    def node_states(self) -> tuple[NodeState, ...]:
        """The planner's view of every node not in flight (name order)."""
        return tuple(
            NodeState(
                name=n.name,
                mode=n.mode,
                model=n.model.name,
                gpus=tuple(self.gpu_state(n, g) for g in n.gpus),
                cpu_milli_free=n.cpu_milli - n.cpu_used,
                memory_mib_free=n.memory_mib - n.memory_used,
            )
            for n in sorted(self.nodes.values(), key=lambda n: n.name)
            if not n.in_flight
        )

    # ------------------------------------------------------------------ binding

    def fits(self, node: str, requests: Mapping[str, int], cpu: int, memory: int) -> bool:
        """Whether ``node``'s free advertised devices and CPU/memory hold the pod now."""
        n = self.nodes[node]
        if n.cpu_used + cpu > n.cpu_milli or n.memory_used + memory > n.memory_mib:
            return False
        free = self._free[node]
        return all(free[r] >= k for r, k in requests.items())

    def bind(
        self,
        pod: str,
        node: str,
        requests: Mapping[str, int],
        cpu: int = 0,
        memory: int = 0,
        preferred: Mapping[str, Sequence[int]] | None = None,
    ) -> Binding:
        """Bind ``pod`` to free devices of ``node`` (``preferred`` GPU indices first)."""
        if pod in self.bindings:
            raise FakeClusterError(f"pod {pod!r} is already bound to {self.bindings[pod].node}")
        if not self.fits(node, requests, cpu, memory):
            raise FakeClusterError(f"pod {pod!r} does not fit node {node!r} now")
        chosen: list[tuple[int, Device]] = []
        for resource, count in sorted(requests.items()):
            want = list((preferred or {}).get(resource, ()))
            free = self.free_devices(node, resource)
            # preferred GPUs first (in the order the plan named them), then GPU/slot order
            free.sort(key=lambda gd: (0 if gd[0] in want else 1, gd[0], gd[1].slot))
            chosen.extend(free[:count])
        return self.bind_devices(pod, node, chosen, cpu, memory)

    def advertised(self, node: str) -> Counter[str]:
        """Devices the node's agent advertises per resource (free or bound, not withdrawn)."""
        n = self._node(node)
        return Counter(
            d.resource for g in n.gpus for d in g.devices if not d.withdrawn and d.resource
        )

    def free_devices(self, node: str, resource: str) -> list[tuple[int, Device]]:
        """Free advertised devices of ``resource`` on ``node``: (GPU index, device)."""
        n = self._node(node)
        return [
            (g.index, d)
            for g in n.gpus
            for d in g.devices
            if d.resource == resource and d.pod is None and not d.withdrawn
        ]

    def to_create(self, node: str, resource: str) -> int:
        """Devices of ``resource`` the node's spec in flight will create when applied (0 when
        no spec is in flight); read-only."""
        n = self._node(node)
        if n.spec is None:
            return 0
        return sum(
            1
            for gi, pg in n.spec.layouts.items()
            for d in self._match(n, n.gpus[gi], pg)[1]
            if d.resource == resource
        )

    def bind_devices(
        self, pod: str, node: str, picks: Sequence[tuple[int, Device]], cpu: int, memory: int
    ) -> Binding:
        """Bind ``pod`` to the devices the kubelet chose (free, advertised, of ``node``)."""
        if pod in self.bindings:
            raise FakeClusterError(f"pod {pod!r} is already bound to {self.bindings[pod].node}")
        n = self._node(node)
        for gi, d in picks:
            if d.pod is not None or d.withdrawn or d not in n.gpus[gi].devices:
                raise FakeClusterError(
                    f"pod {pod!r}: device {d.key} of {node} GPU {gi} is not free"
                )
        for _gi, d in picks:
            d.pod = pod
        n.cpu_used += cpu
        n.memory_used += memory
        self._recount(n)
        b = Binding(node, tuple((gi, d.key) for gi, d in picks), cpu, memory)
        self.bindings[pod] = b
        return b

    def release(self, pod: str) -> None:
        """The pod ends: its devices become free (a pod not bound is ignored)."""
        self._unbind(pod)

    def _unbind(self, pod: str) -> None:
        b = self.bindings.pop(pod, None)
        if b is None:
            return
        n = self.nodes[b.node]
        for g in n.gpus:
            for d in g.devices:
                if d.pod == pod:
                    d.pod = None
        n.cpu_used -= b.cpu_milli
        n.memory_used -= b.memory_mib
        self._recount(n)

    # ------------------------------------------------------------------ specs

    def write_spec(self, node: str, layouts: Iterable[PlannedGpu], apply_at: float) -> None:
        """Record a spec; the agent withdraws the free devices it will remove."""
        n = self._node(node)
        if n.spec is not None:
            raise FakeClusterError(f"node {node!r} already has a spec in flight")
        by_gpu: dict[int, PlannedGpu] = {}
        for pg in layouts:
            self._gpu(n, pg.index)
            by_gpu[pg.index] = pg
        for gi, pg in by_gpu.items():
            _kept, _new, removed = self._match(n, n.gpus[gi], pg)
            for d in removed:
                if d.pod is None:
                    d.withdrawn = True
        n.spec = NodeSpec(by_gpu, apply_at)
        self._recount(n)

    def apply_spec(self, node: str) -> ApplyResult:
        """The agent applies the node's spec in flight (see the module docstring)."""
        n = self._node(node)
        if n.spec is None:
            raise FakeClusterError(f"node {node!r} has no spec in flight")
        created = destroyed = 0
        changes: list[GpuChange] = []
        disrupted: list[str] = []
        for gi, pg in sorted(n.spec.layouts.items()):
            g = n.gpus[gi]
            kept, new, removed = self._match(n, g, pg)
            for d in kept:
                d.withdrawn = False
            disrupted.extend(d.pod for d in removed if d.pod is not None)
            created += len(new)
            destroyed += len(removed)
            before = device_names(g) if new or removed else None
            g.devices = kept + new
            g.sort()
            if before is not None:
                changes.append(GpuChange(gi, before, device_names(g)))
        n.spec = None
        pods = tuple(dict.fromkeys(disrupted))
        for pod in pods:
            self._unbind(pod)
        self._recount(n)
        return ApplyResult(n.name, len(changes), created, destroyed, pods, tuple(changes))

    def _match(
        self, n: FakeNode, g: FakeGpu, pg: PlannedGpu
    ) -> tuple[list[Device], list[Device], list[Device]]:
        """Split a GPU's devices against a desired layout: (kept, to create, to remove).

        MIG instances match by (profile, start).  MPS slices match by memory size, bound slices
        first, so a spec that keeps a used slice's size keeps that very slice.  Hybrid: see
        :meth:`_match_hybrid`.
        """
        desired = self._devices_of(n, pg)
        if n.mode is Mode.HYBRID:
            return self._match_hybrid(g, desired)
        kept: list[Device] = []
        new: list[Device] = []
        if n.mode is Mode.MPS:
            pool = sorted(g.devices, key=lambda d: (d.pod is None, d.slot))
            for d in desired:
                match = next((o for o in pool if o.memory_mib == d.memory_mib), None)
                if match is None:
                    new.append(d)
                else:
                    pool.remove(match)
                    kept.append(match)
            removed = pool
            # keep positions unique: new slices go after the kept ones
            top = max((d.slot for d in kept), default=-1)
            for k, d in enumerate(new):
                d.slot = top + 1 + k
            return kept, new, removed
        have = {d.key: d for d in g.devices}
        for d in desired:
            old = have.pop(d.key, None)
            if old is None:
                new.append(d)
            else:
                kept.append(old)
        return kept, new, list(have.values())

    @staticmethod
    def _match_hybrid(
        g: FakeGpu, desired: list[Device]
    ) -> tuple[list[Device], list[Device], list[Device]]:
        """Hybrid GPUs: instances by (profile, start) and whether they host slices; the slice
        table of a kept host diffed as the agent's ``diff_slices`` does (module docstring)."""
        have_inst = {d.key: d for d in g.devices if d.host < 0}
        have_slices: dict[int, list[Device]] = {}
        for d in g.devices:
            if d.host >= 0:
                have_slices.setdefault(d.host, []).append(d)
        want_slices: dict[int, list[Device]] = {}
        for d in desired:
            if d.host >= 0:
                want_slices.setdefault(d.host, []).append(d)
        kept: list[Device] = []
        new: list[Device] = []
        for d in desired:
            if d.host >= 0:
                continue
            old = have_inst.get(d.key)
            if old is None or old.is_host != d.is_host:
                new.append(d)
                new.extend(want_slices.get(d.slot, ()))
                continue
            del have_inst[d.key]
            kept.append(old)
            if not d.is_host:
                continue
            pool = sorted(have_slices.pop(d.slot, []), key=lambda x: (x.pod is None, x.slot))
            fresh: list[Device] = []
            for w in want_slices.get(d.slot, ()):
                match = next(
                    (
                        o
                        for o in pool
                        if (o.memory_mib, o.thread_percentage)
                        == (w.memory_mib, w.thread_percentage)
                    ),
                    None,
                )
                if match is None:
                    fresh.append(w)
                else:
                    pool.remove(match)
                    kept.append(match)
            have_slices[d.slot] = pool  # left over: removed
            taken = {o.slot for o in kept if o.host == d.slot}
            slot = 0
            for w in sorted(fresh, key=lambda x: (x.memory_mib, x.thread_percentage)):
                while slot in taken:
                    slot += 1
                taken.add(slot)
                w.slot = slot
                new.append(w)
        removed = list(have_inst.values()) + [d for ds in have_slices.values() for d in ds]
        return kept, new, removed

    def _devices_of(self, n: FakeNode, pg: PlannedGpu) -> list[Device]:
        """Free devices for a desired layout; raises :class:`FakeClusterError` if invalid."""
        if n.mode is Mode.MPS:
            usable = n.model.memory_mib - self.mps_reserve_mib
            total = sum(s.memory_mib for s in pg.mps)
            if total > usable:
                raise FakeClusterError(
                    f"{n.name} GPU {pg.index}: MPS slices take {total} MiB, more than the "
                    f"{usable} MiB usable"
                )
            return [_mps_device(k, s) for k, s in enumerate(pg.mps)]
        try:
            layout = parse_layout(n.model, pg.mig)
        except InvalidLayout as e:
            raise FakeClusterError(f"{n.name} GPU {pg.index}: {e}") from None
        hosted = dict(pg.mig_mps)
        if hosted and n.mode is not Mode.HYBRID:
            raise FakeClusterError(
                f"{n.name} GPU {pg.index}: MPS slices inside MIG instances need mode hybrid, the "
                f"node is in {n.mode.value} mode"
            )
        starts = {p.start for p in layout}
        if set(hosted) - starts:
            raise FakeClusterError(
                f"{n.name} GPU {pg.index}: slices listed for instance start(s) "
                f"{sorted(set(hosted) - starts)} the layout does not have"
            )
        out: list[Device] = []
        for p in layout:
            slices = hosted.get(p.start, ())
            out.append(
                Device(
                    resource="" if slices else p.profile.resource,
                    slot=p.start,
                    compute=p.profile.compute,
                    memory_mib=p.profile.memory_mib,
                    profile=p.profile.name,
                )
            )
            if not slices:
                continue
            total = sum(s.memory_mib for s in slices)
            if total > p.profile.memory_mib:
                raise FakeClusterError(
                    f"{n.name} GPU {pg.index}: the MPS slices of instance "
                    f"{p.profile.name}@{p.start} take {total} MiB, more than its "
                    f"{p.profile.memory_mib} MiB"
                )
            usable = max(1, p.profile.memory_mib - self.mps_reserve_mib)
            for k, s_ in enumerate(slices):
                d = _mps_device(k, s_)
                d.host = p.start
                d.share = p.profile.compute * s_.memory_mib / usable
                out.append(d)
        return out

    def _recount(self, n: FakeNode) -> None:
        old = self._free.get(n.name)
        if old is not None:
            self.free_total.subtract(old)
        free: Counter[str] = Counter(
            d.resource
            for g in n.gpus
            for d in g.devices
            if d.pod is None and not d.withdrawn and d.resource
        )
        self._free[n.name] = free
        self.free_total.update(free)


def _mps_device(position: int, s: PlannedSlice) -> Device:
    return Device(
        resource=mps_resource(s.memory_mib // MIB_PER_GIB),
        slot=position,
        compute=0,
        memory_mib=s.memory_mib,
        thread_percentage=s.thread_percentage,
    )
