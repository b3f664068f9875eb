"""Check the GPU catalog against the driver: a read-only NVML probe of this machine's GPUs.

Model
-----
The planner takes every MIG fact from the catalog (``planner/data/gpu_catalog.json`` plus
override files): profile ids and names, compute slices, memory slots, the most instances of a
profile, memory, and the start slots a profile may occupy.  Where the catalog says
``placements_captured: false`` those starts were inferred from a sibling model with identical
profile ids, and only the hardware can confirm them.  A wrong fact is not harmless: the agent
would ask NVML for a placement the driver refuses, or the planner would leave slots idle.

This module asks the driver, read-only -- nothing is created, destroyed, reset or switched,
so it is safe on a GPU that runs work, MIG mode on or off:

* per GPU: ``nvmlDeviceGetName`` / ``GetPciInfo`` (device id ``pciDeviceId >> 16``) /
  ``GetMemoryInfo`` / ``GetMigMode`` (``NOT_SUPPORTED``: not MIG-capable);
* per GPU-instance profile index ``0 ..`` the binding's ``NVML_GPU_INSTANCE_PROFILE_COUNT - 1``
  or the highest index the catalog knows, whichever is larger:
  ``nvmlDeviceGetGpuInstanceProfileInfoV`` (v2 struct: ``id``, ``sliceCount``,
  ``instanceCount``, ``memorySizeMB``, ``name`` such as ``MIG 1g.18gb``); ``NOT_SUPPORTED`` or
  ``INVALID_ARGUMENT`` means the GPU lacks that profile, any other error is recorded as the
  answer for that index (some drivers refuse profile queries while MIG mode is off). nvml.h
  also answers ``NOT_SUPPORTED`` for every profile while MIG mode is off, so a GPU with MIG off
  whose driver answers no profile query at all is reported unverified (enable MIG mode and run
  again), not as lacking every catalog profile;
* per profile the GPU has: ``nvmlDeviceGetGpuInstancePossiblePlacements_v2`` -> the
  ``(start, size)`` pairs a GPU instance of it may take.

:func:`compare` then lists every difference from the catalog model the agent would pick for
the GPU (by PCI device id, else by product name, as :mod:`node_agent.reconciler` does): a
profile on one side only; a different id, name, compute slice count, most-instances count,
memory slot count (placement size) or start list; memory that differs from the catalog's
figure by more than ``MEMORY_TOLERANCE_MIB``.  ``python -m node_agent.catalog_probe`` (and
``gpuslice agent --check-catalog``) prints the report as JSON and exits 0 when nothing differs,
1 when something does, 2 when NVML itself cannot be used.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from planner.catalog import Catalog, CatalogError, GpuModel, default_catalog

__all__ = [
    "MEMORY_TOLERANCE_MIB",
    "ProbedGpu",
    "ProbedProfile",
    "check",
    "compare",
    "main",
    "match_model",
    "probe",
    "report",
]

MEMORY_TOLERANCE_MIB = 512
"""A profile's memory may differ this much from the catalog's figure before it counts.

Drivers round a profile's memory differently between releases (tens of MiB); the planner uses
the figure only to size MPS-free memory and to print, never to place, so only a gross error
(a wrong GB class) is a finding."""

_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_INVALID_ARGUMENT = 2
_MIG_PREFIX = "MIG "


@dataclass
class ProbedProfile:
    """What the driver says about one GPU-instance profile index."""

    nvml_index: int
    profile_id: int | None = None
    name: str = ""
    compute: int | None = None
    max_count: int | None = None
    memory_mib: int | None = None
    placements: list[tuple[int, int]] = field(default_factory=list)
    """``(start, size)`` pairs from PossiblePlacements; empty when that call failed."""
    error: str = ""
    """The NVML error for this index (profile info or placements), ``""`` when none."""


@dataclass
class ProbedGpu:
    """One GPU as the driver reports it, with every profile index it answered for."""

    index: int
    name: str
    pci_device_id: str
    memory_mib: int
    mig_capable: bool
    mig_current: bool = False
    mig_pending: bool = False
    profiles: list[ProbedProfile] = field(default_factory=list)
    error: str = ""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _code(e: Exception) -> int:
    return int(getattr(e, "value", -1))


def _probe_profile(m: ModuleType, h: Any, idx: int) -> ProbedProfile | None:
    out = ProbedProfile(nvml_index=idx)
    try:
        info = m.nvmlDeviceGetGpuInstanceProfileInfo(h, idx, 2)
    except m.NVMLError as e:
        if _code(e) in (_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_INVALID_ARGUMENT):
            return None
        out.error = f"profile info: {e}"
        return out
    out.profile_id = int(info.id)
    out.name = _text(getattr(info, "name", b"")).removeprefix(_MIG_PREFIX).strip()
    out.compute = int(info.sliceCount)
    out.max_count = int(info.instanceCount)
    out.memory_mib = int(info.memorySizeMB)
    n = max(out.max_count, 1) * 8  # every start of the profile; 8 covers the widest grid
    arr = (m.c_nvmlGpuInstancePlacement_t * n)()
    count = ctypes.c_uint(n)
    try:
        m.nvmlDeviceGetGpuInstancePossiblePlacements(h, out.profile_id, arr, ctypes.byref(count))
    except m.NVMLError as e:
        out.error = f"possible placements: {e}"
        return out
    out.placements = [(int(arr[k].start), int(arr[k].size)) for k in range(count.value)]
    return out


def probe(m: ModuleType, profile_indices: int = 0) -> list[ProbedGpu]:
    """Read every GPU and its MIG profiles through the pynvml module ``m`` (read-only): the
    GPU-instance profile indices below the binding's count or ``profile_indices``, whichever is
    larger (an older binding counts none of the RTX PRO ``+gfx`` profiles, 0xA and 0xB)."""
    count = max(int(getattr(m, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)), profile_indices)
    m.nvmlInit()
    try:
        gpus: list[ProbedGpu] = []
        for i in range(int(m.nvmlDeviceGetCount())):
            h = m.nvmlDeviceGetHandleByIndex(i)
            pci = m.nvmlDeviceGetPciInfo(h)
            gpu = ProbedGpu(
                index=i,
                name=_text(m.nvmlDeviceGetName(h)),
                pci_device_id=f"{(int(pci.pciDeviceId) >> 16) & 0xFFFF:04X}",
                memory_mib=int(m.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024),
                mig_capable=True,
            )
            try:
                current, pending = m.nvmlDeviceGetMigMode(h)
                gpu.mig_current = current == m.NVML_DEVICE_MIG_ENABLE
                gpu.mig_pending = pending == m.NVML_DEVICE_MIG_ENABLE
            except m.NVMLError as e:
                if _code(e) != _NVML_ERROR_NOT_SUPPORTED:
                    gpu.error = f"MIG mode: {e}"
                gpu.mig_capable = False
            if gpu.mig_capable:
                for idx in range(count):
                    found = _probe_profile(m, h, idx)
                    if found is not None:
                        gpu.profiles.append(found)
            gpus.append(gpu)
        return gpus
    finally:
        m.nvmlShutdown()


def match_model(catalog: Catalog, gpu: ProbedGpu) -> GpuModel | None:
    """The catalog model the agent would use for this GPU (PCI id first, then the name)."""
    return catalog.model_for_device(gpu.pci_device_id, gpu.name)


def compare(model: GpuModel | None, gpu: ProbedGpu) -> list[str]:
    """Every difference between the driver's answers and the catalog model (empty: agree).

    Profile indexes whose info the driver refused (``error`` set, no id) are reported as
    unverified, not as differences: the probe could not tell.
    """
    where = f"GPU {gpu.index} ({gpu.name}, PCI {gpu.pci_device_id})"
    if model is None:
        return [f"{where}: no catalog model matches; add it with a catalog override file"]
    diffs: list[str] = []
    if not gpu.mig_capable:
        if model.mig_capable:
            diffs.append(f"{where}: the driver says MIG is not supported; {model.name} lists MIG")
        return diffs
    if not model.mig_capable:
        diffs.append(f"{where}: the driver supports MIG; catalog model {model.name} lists none")
        return diffs
    if _mig_off_and_silent(gpu):
        return diffs  # nothing the driver said can be compared: see report()'s "unverified"
    answered = [p for p in gpu.profiles if p.profile_id is not None]
    by_index = {p.nvml_index: p for p in answered}
    for prof in model.profiles:
        seen = by_index.get(prof.nvml_index)
        if seen is None:
            if not any(p.nvml_index == prof.nvml_index and p.error for p in gpu.profiles):
                diffs.append(
                    f"{where}: catalog profile {prof.name} (index {prof.nvml_index}) "
                    f"is not supported by the driver"
                )
            continue
        label = f"{where} profile {prof.name}"
        if seen.profile_id != prof.profile_id:
            diffs.append(f"{label}: id {seen.profile_id} (catalog {prof.profile_id})")
        if seen.name and seen.name.lower() != prof.name.lower():
            diffs.append(f"{label}: driver name {seen.name!r} (catalog {prof.name!r})")
        if seen.compute != prof.compute:
            diffs.append(f"{label}: {seen.compute} compute slices (catalog {prof.compute})")
        if seen.max_count != prof.max_count:
            diffs.append(f"{label}: at most {seen.max_count} instances (catalog {prof.max_count})")
        if seen.memory_mib is not None and abs(seen.memory_mib - prof.memory_mib) > (
            MEMORY_TOLERANCE_MIB
        ):
            diffs.append(f"{label}: {seen.memory_mib} MiB (catalog {prof.memory_mib})")
        if seen.placements:
            starts = tuple(sorted(s for s, _ in seen.placements))
            sizes = {size for _, size in seen.placements}
            if starts != tuple(sorted(prof.starts)):
                diffs.append(f"{label}: starts {list(starts)} (catalog {list(prof.starts)})")
            if sizes != {prof.memory_slices}:
                diffs.append(
                    f"{label}: {sorted(sizes)} memory slots (catalog {prof.memory_slices})"
                )
    known = {p.nvml_index for p in model.profiles}
    for seen in answered:
        if seen.nvml_index not in known:
            diffs.append(
                f"{where}: the driver offers profile {seen.name or seen.profile_id} "
                f"(index {seen.nvml_index}, id {seen.profile_id}) that {model.name} lacks"
            )
    return diffs


def _mig_off_and_silent(gpu: ProbedGpu) -> bool:
    """MIG mode off and no profile query answered: the driver's "not supported" then means
    "not while MIG mode is off" (nvml.h), which tells nothing about the GPU's profiles."""
    return gpu.mig_capable and not gpu.mig_current and not gpu.profiles


def _unverified(gpu: ProbedGpu) -> list[str]:
    if _mig_off_and_silent(gpu):
        return [
            "every profile: MIG mode is off and the driver answered no profile query "
            "(NVML answers NOT_SUPPORTED until MIG mode is enabled); enable MIG mode "
            "(gpuslice's agent does on an opted-in node) and run the check again"
        ]
    return [f"index {p.nvml_index}: {p.error}" for p in gpu.profiles if p.error]


def report(catalog: Catalog, gpus: Sequence[ProbedGpu]) -> dict[str, Any]:
    """The JSON document: each GPU, the model matched, its differences and unverified indexes."""
    out: list[dict[str, Any]] = []
    for gpu in gpus:
        model = match_model(catalog, gpu)
        out.append(
            {
                "gpu": asdict(gpu),
                "catalogModel": model.name if model else None,
                "placementsCaptured": model.placements_captured if model else None,
                "differences": compare(model, gpu),
                "unverified": _unverified(gpu),
            }
        )
    return {"gpus": out, "agree": all(not g["differences"] for g in out)}


def check(catalog: Catalog, nvml: ModuleType | None = None) -> int:
    """Probe, compare, print the report as JSON on stdout; the exit code of the module doc."""
    try:
        m = nvml if nvml is not None else importlib.import_module("pynvml")
        gpus = probe(m, catalog.gi_profile_count())
    except Exception as e:  # no driver, no library: nothing to compare
        print(f"NVML unavailable: {e}", file=sys.stderr)
        return 2
    doc = report(catalog, gpus)
    print(json.dumps(doc, indent=2))
    return 0 if doc["agree"] else 1


def main(argv: Sequence[str] | None = None, nvml: ModuleType | None = None) -> int:
    """``python -m node_agent.catalog_probe [--catalog FILE ...]``: print the report as JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m node_agent.catalog_probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--catalog", action="append", default=[], help="catalog override file")
    args = parser.parse_args(argv)
    try:
        if args.catalog:
            from contract.catalog_files import load_catalog  # needs PyYAML: only with files

            catalog = load_catalog(args.catalog)
        else:
            catalog = default_catalog()
    except (OSError, CatalogError) as e:
        print(f"catalog: {e}", file=sys.stderr)
        return 2
    return check(catalog, nvml)


if __name__ == "__main__":
    raise SystemExit(main())
