"""DRA ResourceSlices for MIG GPUs: every placement a device, shared counters keep them valid.

Model (Kubernetes partitionable devices, ``resource.k8s.io/v1``)
----------------------------------------------------------------
A node's devices form one *pool* (named after the node).  Per MIG-capable GPU ``g`` (index
``i``) the pool has one counter set ``gpu<i>`` and these devices:

* one device per placement ``(P, s)`` of every MIG profile ``P`` of the GPU's model at every
  start ``s`` it allows (shared/facts/mig.md), named ``gpu<i>-<P>-s<s>`` (``.`` and ``+``
  spelled ``-``: device names are DNS labels);
* the whole GPU, ``gpu<i>`` (MIG off).

Counters of ``gpu<i>``, and what each device consumes:

* ``mem<k>`` = 1 for every memory slot ``k``: a placement consumes 1 of each slot it covers,
  the whole GPU every slot -- so no two allocated devices share a slot (facts rule 2) and the
  whole GPU excludes every placement;
* ``compute`` = the GPU's compute slices: a placement consumes its compute slices (rule 5);
* ``max-<P>`` = ``max_count(P)`` for each profile whose maximum count is below the number of
  disjoint placements it has: each instance of ``P`` consumes 1 (rule 3);
* ``media`` = 1 where the model has media-extension profiles: each ``+me``/``+me.all``
  placement consumes 1 (rule 4, at most one);
* ``me-all`` = the slot count where the model has a ``+me.all`` profile: a ``+me.all``
  placement consumes all of it, every other placement except ``-me`` ones 1 (rule 4: ``+me.all``
  allows only ``-me`` profiles beside it).

Allowed starts (rule 1) hold because only allowed placements are devices.  So a set of devices
of one GPU can be allocated together exactly when its placements form a valid layout, which
``tests/test_agent_dra_slices.py`` checks against an oracle written from the facts.

Slices: the counter sets go in their own slices (at most 8 sets per slice), the devices of
each GPU in a slice of their own, ``devices-gpu<i>`` (a GPU has at most 30 placements; more
than 64 devices would be split, the API's limit for devices that consume counters), so that
narrowing what one GPU publishes rewrites one slice and leaves the counters alone
(shared/facts/dra.md, consequence 2).  A GPU that publishes nothing (drained, unreadable, an
XID or a foreign process on it while idle) keeps its device slice, with no devices (the API
accepts an empty ``devices`` list): dropping the slice changed the pool's slice names and
count, so every slice of the node was rewritten at a new generation, one request at a time,
the pool incomplete meanwhile -- and again when the GPU came back.  Every
slice of the pool carries the pool's generation and slice count.  Device attributes (qualified by the driver name):
``type`` (``mig`` or ``gpu``), ``profile``, ``start``, ``index``, ``uuid`` (the parent GPU),
``model``; capacity ``memory``.  Quantities (capacities, counters) are written in the API
server's canonical form (:mod:`contract.quantity`: ``40960Mi`` is ``40Gi``), as it stores
and answers them.  :func:`device_classes` are the DeviceClasses that select MIG
placements and whole GPUs of this driver.

A device published though no new claim can use it (allocated, and an XID hit it, processes
outside any claim use it, or its GPU cannot be read) carries the ``NoSchedule`` device taint
:data:`UNUSABLE_TAINT_KEY`, its value saying why (:data:`TAINT_REASONS`): kube-scheduler
allocates it to no claim that does not tolerate the taint, while its counters stay counted for
the claim that holds it (DRADeviceTaints, beta and on by default from Kubernetes 1.36;
shared/facts/dra.md section 5; why it matters: :mod:`node_agent.dra_driver`, "Lingering
devices").  The API server stamps ``timeAdded`` when it is not sent
(:mod:`node_agent.dra_publish` carries the stored stamp forward).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contract.dra_devices import dns_label, placement_device_name
from contract.quantity import canonical_bytes, canonical_count
from planner.catalog import GpuModel, MigProfile

__all__ = [
    "API_VERSION",
    "DRIVER",
    "MAX_OBJECT_NAME",
    "TAINT_REASONS",
    "UNUSABLE_TAINT_KEY",
    "DraGpu",
    "device_classes",
    "device_name",
    "gpu_counters",
    "placement_counters",
    "reported_layout",
    "resource_slices",
    "slice_name",
    "whole_gpu_profile",
]

DRIVER = "gpu.gpuslice.io"
"""The DRA driver name (a DNS subdomain gpuslice owns)."""
API_VERSION = "resource.k8s.io/v1"
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_DEVICES_PER_SLICE = 64
"""The API's limit for slices whose devices consume counters (or carry taints)."""
UNUSABLE_TAINT_KEY = "gpu.gpuslice.io/unusable"
"""The device taint on a published device no new claim can use (module docstring)."""
TAINT_REASONS = ("unreadable", "xid", "foreign")
"""The taint's values, most serious first: the GPU cannot be read, an XID hit the device (or
shares a memory slot with what it hit), processes outside any claim use it."""


@dataclass(frozen=True, slots=True)
class DraGpu:
    """One GPU of the node as the driver publishes it."""

    index: int
    uuid: str
    model: GpuModel


def device_name(gpu: int, profile: MigProfile | None = None, start: int = 0) -> str:
    """``gpu0`` (whole GPU) or ``gpu0-3g-40gb-s4`` (a placement): a DNS label
    (:mod:`contract.dra_devices`, which the partitioner reads allocations by)."""
    return placement_device_name(gpu, None if profile is None else profile.name, start)


def _disjoint(profile: MigProfile) -> int:
    """The most placements of ``profile`` that share no memory slot."""
    taken = -1
    count = 0
    for s in sorted(profile.starts):
        if s > taken:
            count += 1
            taken = s + profile.memory_slices - 1
    return count


def gpu_counters(model: GpuModel) -> dict[str, int]:
    """The counter set of one GPU of ``model`` (module docstring)."""
    out = {f"mem{k}": 1 for k in range(model.memory_slots)}
    out["compute"] = model.compute_slices
    for p in model.profiles:
        if p.max_count < _disjoint(p):
            out[f"max-{dns_label(p.name)}"] = p.max_count
    if any(p.has_media_extensions for p in model.profiles):
        out["media"] = 1
    if any(p.variant == "+me.all" for p in model.profiles):
        out["me-all"] = model.memory_slots
    return out


def placement_counters(
    model: GpuModel, profile: MigProfile | None, start: int = 0
) -> dict[str, int]:
    """What one device consumes of its GPU's counters (``profile=None``: the whole GPU)."""
    have = gpu_counters(model)
    if profile is None:
        return {k: v for k, v in have.items() if k.startswith("mem")}
    out = {f"mem{k}": 1 for k in profile.span(start)}
    out["compute"] = profile.compute
    name = f"max-{dns_label(profile.name)}"
    if name in have:
        out[name] = 1
    if profile.has_media_extensions:
        out["media"] = 1
    if "me-all" in have:
        if profile.variant == "+me.all":
            out["me-all"] = have["me-all"]
        elif profile.variant != "-me":
            out["me-all"] = 1
    return out


def whole_gpu_profile(model: GpuModel) -> MigProfile | None:
    """The profile that covers every memory slot from start 0 (``7g.80gb`` on an A100-80GB),
    without media variants: how a GPU allocated whole is reported in a MIG layout."""
    full = [p for p in model.profiles if p.memory_slices == model.memory_slots and 0 in p.starts]
    full.sort(key=lambda p: (p.variant != "", -p.compute, p.name))
    return full[0] if full else None


def reported_layout(
    model: GpuModel,
    allocated: Sequence[tuple[MigProfile | None, int]],
    planned: Sequence[tuple[MigProfile, int]],
) -> list[tuple[str, int, bool]]:
    """The MIG layout a DRA agent reports for one GPU, as ``(profile, start, used)`` sorted by
    ``(start, profile)``: every allocated placement, used (``None``: the whole GPU, reported as
    :func:`whole_gpu_profile` at start 0, alone), then each planned placement whose counters
    (:func:`placement_counters`) still fit beside those taken, free; each placement once.

    Allocated placements come first because a spec written before the agent saw an
    allocation may overlap it: that planned placement is not free until the claim goes, and
    the report stays a valid layout (the partitioner's planner refuses any other).  The
    device-plugin-free agent and the time replay's fake DRA agent both report this.
    """
    if any(profile is None for profile, _ in allocated):
        whole = whole_gpu_profile(model)
        return [(whole.name, 0, True)] if whole is not None else []
    capacity = gpu_counters(model)
    taken: dict[str, int] = {}
    out: dict[tuple[int, str], bool] = {}
    rows = [(p, s, True) for p, s in allocated] + [(p, s, False) for p, s in planned]
    for profile, start, used in rows:
        assert profile is not None  # the whole GPU returned above
        if (start, profile.name) in out:
            continue
        need = placement_counters(model, profile, start)
        if not used and any(taken.get(k, 0) + v > capacity[k] for k, v in need.items()):
            continue
        for k, v in need.items():
            taken[k] = taken.get(k, 0) + v
        out[(start, profile.name)] = used
    return [(name, start, used) for (start, name), used in sorted(out.items())]


def _quantity(value: int) -> dict[str, str]:
    """A counter value as the API server stores it
    (:func:`~contract.quantity.canonical_count`: ``1000`` is ``1k``)."""
    return {"value": canonical_count(value)}


def _devices(
    gpu: DraGpu, only: Collection[str] | None, tainted: Mapping[str, str]
) -> list[dict[str, Any]]:
    model = gpu.model
    attrs = {
        "index": {"int": gpu.index},
        "uuid": {"string": gpu.uuid},
        "model": {"string": model.name},
    }
    whole: dict[str, Any] = {
        "name": device_name(gpu.index),
        "attributes": {"type": {"string": "gpu"}, **attrs},
        "capacity": {"memory": _quantity_mib(model.memory_mib)},
    }
    if model.mig_capable:
        whole["consumesCounters"] = [_consumes(gpu.index, placement_counters(model, None))]
    out = [whole]
    for p in sorted(model.profiles, key=lambda x: (x.memory_slices, x.name)):
        for s in p.starts:
            out.append(
                {
                    "name": device_name(gpu.index, p, s),
                    "attributes": {
                        "type": {"string": "mig"},
                        "profile": {"string": p.name},
                        "start": {"int": s},
                        **attrs,
                    },
                    "capacity": {"memory": _quantity_mib(p.memory_mib)},
                    "consumesCounters": [_consumes(gpu.index, placement_counters(model, p, s))],
                }
            )
    if only is not None:
        out = [d for d in out if d["name"] in only]
    for d in out:
        why = tainted.get(d["name"])
        if why is not None:
            d["taints"] = [{"key": UNUSABLE_TAINT_KEY, "value": why, "effect": "NoSchedule"}]
    return out


def _quantity_mib(mib: int) -> dict[str, str]:
    """``mib`` MiB as the API server stores it: ``40960`` -> ``40Gi``, ``81559`` -> ``81559Mi``
    (:func:`~contract.quantity.canonical_bytes`), so a slice reads back as it was sent."""
    return {"value": canonical_bytes(mib * 1024 * 1024)}


def _consumes(gpu: int, counters: dict[str, int]) -> dict[str, Any]:
    return {"counterSet": f"gpu{gpu}", "counters": {k: _quantity(v) for k, v in counters.items()}}


def resource_slices(
    node: str,
    gpus: Sequence[DraGpu],
    generation: int = 1,
    publish: Collection[str] | None = None,
    tainted: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The node's ResourceSlice manifests (module docstring).

    ``publish`` limits the devices to those names (planner-shaped publishing: the placements
    the plan wants used next, plus the allocated ones); ``None`` publishes every placement.
    ``tainted``: device name -> why no new claim can use it (one of :data:`TAINT_REASONS`),
    published with the :data:`UNUSABLE_TAINT_KEY` taint.
    GPUs of a model without MIG are published as whole GPUs only."""
    ordered = sorted(gpus, key=lambda g: g.index)
    mig = [g for g in ordered if g.model.mig_capable]
    counter_chunks = [
        mig[i : i + MAX_COUNTER_SETS_PER_SLICE]
        for i in range(0, len(mig), MAX_COUNTER_SETS_PER_SLICE)
    ]
    device_chunks: list[tuple[str, list[dict[str, Any]]]] = []
    for g in ordered:
        devices = _devices(g, publish, tainted or {})
        # at least one slice per GPU, empty when it publishes nothing (module docstring)
        for n, i in enumerate(range(0, max(len(devices), 1), MAX_DEVICES_PER_SLICE)):
            suffix = f"gpu{g.index}" + (f"-{n}" if n else "")
            device_chunks.append((suffix, devices[i : i + MAX_DEVICES_PER_SLICE]))
    total = len(counter_chunks) + len(device_chunks)
    pool = {"name": node, "generation": generation, "resourceSliceCount": total}
    out: list[dict[str, Any]] = []
    for n, gpu_chunk in enumerate(counter_chunks):
        sets = [
            {
                "name": f"gpu{g.index}",
                "counters": {k: _quantity(v) for k, v in gpu_counters(g.model).items()},
            }
            for g in gpu_chunk
        ]
        out.append(_slice(node, f"counters-{n}", pool, {"sharedCounters": sets}))
    for suffix, device_chunk in device_chunks:
        out.append(_slice(node, f"devices-{suffix}", pool, {"devices": device_chunk}))
    return out


MAX_OBJECT_NAME = 253
"""An object name is a DNS subdomain of at most 253 characters."""


def slice_name(node: str, suffix: str) -> str:
    """``<node>-<driver>-<suffix>``; a node name too long for that (node names may have 253
    characters themselves) is cut and given a hash of the whole name, so the name stays unique
    and valid (slices are found by ``spec.nodeName``, never by name)."""
    name = f"{node}-{DRIVER}-{suffix}"
    if len(name) <= MAX_OBJECT_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    tail = f"-{digest}-{DRIVER}-{suffix}"
    head = node[: MAX_OBJECT_NAME - len(tail)].rstrip(".-")
    return f"{head}{tail}"


def _slice(node: str, suffix: str, pool: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, suffix)},
        "spec": {"driver": DRIVER, "nodeName": node, "pool": dict(pool), **body},
    }


def device_classes() -> list[dict[str, Any]]:
    """DeviceClasses: ``mig.gpuslice.io`` (any MIG placement; a claim narrows it with a CEL
    selector on ``profile``) and ``gpu.gpuslice.io`` (whole GPUs)."""

    def cls(name: str, kind: str) -> dict[str, Any]:
        expr = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{kind}"'
        return {
            "apiVersion": API_VERSION,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expr}}]},
        }

    return [cls("mig.gpuslice.io", "mig"), cls("gpu.gpuslice.io", "gpu")]
