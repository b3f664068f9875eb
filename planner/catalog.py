"""GPU catalog: models, MIG profiles, placement grids and the lookups that resolve them.

Model
-----
A *geometry* is the placement grid one family of GPUs shares: ``memory_slots`` memory slices,
``compute_slices`` compute slices, and a list of profile *shapes* (``1g``, ``1g+me``,
``1g.2m`` = one compute slice with double memory, ``2g``, ``3g``, ``4g``, ``7g``, ...), each with
its NVML profile id, compute slices, memory slices, maximum count and allowed start slots.

A *GPU model* names one geometry (or none: MPS-only GPUs such as V100 or T4), its total memory,
its PCI device ids, the ``nvidia.com/gpu.product`` spellings it is known by, and per shape the
driver's profile name (``1g.10gb``) and memory in MiB.  A :class:`MigProfile` is the join of
the two, which is what the planner and the fake NVML work with.

Lookups
-------
* :meth:`Catalog.model_for_product` takes the GPU Feature Discovery label in any of its
  sanitised spellings (``NVIDIA-A100-SXM4-80GB``, ``A100-SXM4-80GB``, ``NVIDIA A100 80GB PCIe``,
  with ``-SHARED`` or a ``-MIG-<profile>`` suffix).
* :meth:`Catalog.model_for_pci_id` takes ``0x20B210DE``, ``20b2`` or ``10de:20b2``.
* :meth:`GpuModel.profile` resolves a profile name as people and labels write it: the model's
  own profile name (``1g.10gb+me``, as NVML spells it) or its Kubernetes resource spelling
  (``1g.10gb.me``: resource names cannot hold ``+``, so NVIDIA's device plugin and gpuslice's
  agent advertise ``nvidia.com/mig-1g.10gb.me``), with or without the ``nvidia.com/mig-``
  prefix, in any case (CLI flags, GFD labels, catalog files, NVML's names).  Nothing else: a
  name of another model (``1g.12gb`` on an A100) or another driver's spelling (``7g.79gb``
  where the catalog says ``7g.80gb``) does not resolve, because the agent advertises exactly the
  catalog's name and a pod asking for another name would never bind.  A driver that names a
  profile differently needs a catalog override naming it that way (then the planner and the
  agent both use that name).
* :meth:`GpuModel.requested_profile` resolves a *pod's request*, which must be exactly the
  resource name the agent advertises (:attr:`MigProfile.resource`, e.g.
  ``nvidia.com/mig-1g.10gb.me``): kube-scheduler and the kubelet match extended resource names
  exactly, case included, so ``nvidia.com/mig-1G.10GB``, ``nvidia.com/mig-1g.10gb+me`` or
  ``nvidia.com/mig-1g.10gb.shared`` never bind to an instance gpuslice creates.  Such a near
  miss raises :class:`UnknownProfile` naming the name it most likely meant
  (:meth:`GpuModel.near_miss`: same name up to case, ``+``/``.``, leading zeros and unknown
  ``.<word>`` suffixes).
* :attr:`Catalog.max_gpus_per_node` bounds a node's GPU count (the largest server the catalog
  knows of: 16 GPUs, e.g. NVIDIA HGX-2 / DGX-2 with 16 V100s); a count above it is a label
  error, not a node to plan.

Users add or override models with their own JSON or YAML file in the same format
(:func:`parse_catalog` with ``base=``; the edges read the files, see ``contract.catalog_files``);
a model of the same name replaces the built-in one.  The built-in catalog is package data read
once, like a constant; the planner itself does no other I/O.
Unknown models and profiles raise :class:`UnknownGpuModel` / :class:`UnknownProfile` naming the
input and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from planner.snapshot import mig_resource

__all__ = [
    "DEFAULT_MAX_GPUS_PER_NODE",
    "Catalog",
    "CatalogError",
    "GpuModel",
    "MigProfile",
    "UnknownGpuModel",
    "UnknownProfile",
    "default_catalog",
    "parse_catalog",
    "sanitize_product",
]


class CatalogError(ValueError):
    """A catalog file or lookup is invalid."""


class UnknownGpuModel(CatalogError):
    """No model in the catalog matches a product label or PCI id."""


class UnknownProfile(CatalogError):
    """A MIG profile name does not resolve on a GPU model."""


DEFAULT_MAX_GPUS_PER_NODE = 16
"""GPUs in the largest single server (HGX-2 / DGX-2: 16 V100; HGX A100 16-GPU)."""

_PROFILE_NAME = re.compile(r"^(?P<compute>\d+)g\.(?P<mem>\d+)gb(?P<suffix>(\+[a-z.]+)*)$")
_NAME_FORM = re.compile(r"^(\d+c\.)?\d+g\.\d+gb([.+][a-z]+)*$")
"""A MIG device name in either spelling, including NVIDIA's ``<c>c.<g>g.<m>gb`` compute-instance form."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One MIG GPU-instance profile on one GPU model."""

    name: str
    """Driver name, e.g. ``1g.10gb`` or ``1g.10gb+me``; also the resource suffix."""
    shape: str
    """Family-independent shape key: ``1g``, ``1g+me``, ``1g.2m``, ``2g``, ``3g``, ``4g``, ``7g``..."""
    profile_id: int
    """NVML GPU-instance profile id (``nvmlGpuInstanceProfileInfo_t.id``)."""
    nvml_index: int
    """The ``NVML_GPU_INSTANCE_PROFILE_*`` index constant."""
    compute: int
    memory_slices: int
    memory_mib: int
    max_count: int
    starts: tuple[int, ...]
    variant: str = ""
    """Suffix after the base name: ``""``, ``+me``, ``+me.all``, ``+gfx``..."""

    def __hash__(self) -> int:
        # Equal profiles have equal names and shapes, so this agrees with ``__eq__``; hashing
        # two strings instead of every field keeps the planner's layout sets fast.
        return hash((self.name, self.memory_slices))

    @property
    def resource(self) -> str:
        """Kubernetes extended resource name for this profile (``+`` spelled ``.``)."""
        return mig_resource(self.name)

    @property
    def has_media_extensions(self) -> bool:
        return self.variant.startswith("+me")

    @property
    def memory_gb(self) -> int:
        """The GB figure in the profile name (``10`` for ``1g.10gb``)."""
        m = _PROFILE_NAME.match(self.name)
        return int(m.group("mem")) if m else round(self.memory_mib / 1024)

    def span(self, start: int) -> range:
        """Memory slots an instance of this profile occupies when placed at ``start``."""
        return range(start, start + self.memory_slices)


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One GPU model: memory, ids, and (if MIG-capable) its placement grid and profiles."""

    name: str
    memory_mib: int
    pci_device_ids: tuple[str, ...]
    product_aliases: tuple[str, ...]
    memory_slots: int = 0
    compute_slices: int = 0
    profiles: tuple[MigProfile, ...] = ()
    placements_captured: bool = True
    """False where placements were inferred from identical profile ids, not captured."""
    note: str = ""
    _by_name: Mapping[str, MigProfile] = field(default_factory=dict, repr=False, compare=False)

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)

    def profile(self, name: str) -> MigProfile:
        """Resolve a profile name as people and labels write it: the catalog name or its
        resource spelling, in any case.

        ``1g.10gb+me``, ``1g.10gb.me``, ``1G.10GB+ME`` and ``nvidia.com/mig-1g.10gb.me`` all name
        the same profile; ``1g.12gb`` on an A100 or ``7g.79gb`` where the catalog says
        ``7g.80gb`` do not (module docstring).  A pod's request must match exactly:
        :meth:`requested_profile`.
        """
        key = name.strip().lower()
        if key.startswith("nvidia.com/mig-"):
            key = key[len("nvidia.com/mig-") :]
        found = self._by_name.get(key)
        if found is not None:
            return found
        if not self.profiles:
            raise UnknownProfile(
                f"MIG profile {name!r} does not exist on {self.name}: it is not MIG-capable"
            )
        valid = ", ".join(p.name for p in self.profiles)
        if _NAME_FORM.match(key) is None:
            raise UnknownProfile(
                f"MIG profile {name!r} is not of the form '<compute>g.<memory>gb[+variant]' "
                f"(e.g. {self.profiles[0].name}); profiles of {self.name}: {valid}"
            )
        raise UnknownProfile(
            f"MIG profile {name!r} does not exist on {self.name}; its profiles: {valid}. "
            f"Names must match exactly (a pod asking for another name never binds); if this "
            f"GPU's driver spells a profile differently, name it so in a catalog override file"
        )

    def requested_profile(self, resource: str) -> MigProfile:
        """The profile a pod asking for ``resource`` gets: the one whose advertised resource name
        (:attr:`MigProfile.resource`) is exactly ``resource`` (module docstring).

        Raises :class:`UnknownProfile` otherwise, naming the fix: the canonical name of a near
        miss (``nvidia.com/mig-1G.10GB`` -> ``nvidia.com/mig-1g.10gb``), else this model's names.
        """
        for p in self.profiles:
            if p.resource == resource:
                return p
        if not self.profiles:
            raise UnknownProfile(f"{resource} does not exist on {self.name}: it is not MIG-capable")
        near = self.near_miss(resource)
        if near is not None:
            raise UnknownProfile(
                f"{resource} is not a name any {self.name} node advertises: Kubernetes matches "
                f"extended resource names exactly, case included; did you mean {near.resource}?"
            )
        raise UnknownProfile(
            f"{resource} does not exist on {self.name}; its MIG resources: "
            f"{', '.join(p.resource for p in self.profiles)}"
        )

    def near_miss(self, name: str) -> MigProfile | None:
        """The profile ``name`` most likely means, if it is not its exact resource name: equal
        up to case, ``+`` for ``.``, leading zeros of numbers, surrounding blanks, the
        ``nvidia.com/mig-`` prefix, and trailing ``.<word>`` suffixes that are no profile
        variant (``1g.10gb.shared`` -> ``1g.10gb``; ``1g.24gb.me`` on a model without media
        extensions is another profile, not a misspelling); ``None`` if nothing is that close."""
        keys = {_loose(p.resource): p for p in self.profiles}
        key = _loose(name)
        while True:
            found = keys.get(key)
            if found is not None:
                return found
            head, dot, tail = key.rpartition(".")
            if not dot or not head or not tail.isalpha() or tail in _VARIANT_WORDS:
                return None
            key = head

    def profile_by_id(self, profile_id: int) -> MigProfile:
        for p in self.profiles:
            if p.profile_id == profile_id:
                return p
        raise UnknownProfile(f"NVML profile id {profile_id} does not exist on {self.name}")

    def profile_by_shape(self, shape: str) -> MigProfile:
        for p in self.profiles:
            if p.shape == shape:
                return p
        raise UnknownProfile(f"MIG shape {shape!r} does not exist on {self.name}")


_LEADING_ZEROS = re.compile(r"(?<![0-9])0+(?=[0-9])")
_VARIANT_WORDS = frozenset({"me", "all", "gfx"})
"""The words of NVIDIA's profile variants (``+me``, ``+me.all``, ``+gfx``): a request naming a
variant a model lacks asks for another profile, so :meth:`GpuModel.near_miss` never drops one."""


def _loose(name: str) -> str:
    """``name`` folded for :meth:`GpuModel.near_miss`: ``NVIDIA.com/MIG-01G.10GB+ME`` ->
    ``1g.10gb.me``."""
    key = name.strip().lower().replace("+", ".")
    key = key.removeprefix("nvidia.com/mig-")
    return _LEADING_ZEROS.sub("", key)


def sanitize_product(label: str) -> str:
    """Normalise an ``nvidia.com/gpu.product`` value for matching.

    Upper-case, spaces and underscores to ``-``, the ``NVIDIA-`` and ``TESLA-`` vendor
    prefixes removed (GFD reports ``Tesla-V100S-PCIE-32GB``; aliases are normalised the same
    way), GFD's ``-SHARED`` and ``-MIG-<profile>`` suffixes removed.
    """
    s = re.sub(r"[\s_]+", "-", label.strip()).upper()
    s = re.sub(r"-MIG-.*$", "", s)
    s = re.sub(r"-SHARED$", "", s)
    for vendor in ("NVIDIA-", "TESLA-"):
        if s.startswith(vendor):
            s = s[len(vendor) :]
    return s


def _norm_pci(pci: str) -> str:
    s = pci.strip().lower()
    if s.startswith("0x"):
        s = s[2:]
    if ":" in s:  # "10de:20b2"
        s = s.split(":")[-1]
    if len(s) == 8 and s.endswith("10de"):  # NVML pciDeviceId 0x20B210DE
        s = s[:4]
    return s.upper()


@dataclass(frozen=True, slots=True)
class Catalog:
    """All known GPU models, with lookups by name, product label and PCI id."""

    models: tuple[GpuModel, ...]
    _by_name: Mapping[str, GpuModel] = field(repr=False, compare=False)
    _by_alias: Mapping[str, GpuModel] = field(repr=False, compare=False)
    _by_pci: Mapping[str, GpuModel] = field(repr=False, compare=False)
    max_gpus_per_node: int = DEFAULT_MAX_GPUS_PER_NODE
    """The most GPUs one node can have; a label or report above it is an error to show."""

    @classmethod
    def of(
        cls, models: Iterable[GpuModel], max_gpus_per_node: int = DEFAULT_MAX_GPUS_PER_NODE
    ) -> Catalog:
        ms = tuple(models)
        by_name = {m.name.upper(): m for m in ms}
        by_alias: dict[str, GpuModel] = {}
        by_pci: dict[str, GpuModel] = {}
        for m in ms:
            for alias in (m.name, *m.product_aliases):
                by_alias[sanitize_product(alias)] = m
            for pci in m.pci_device_ids:
                by_pci[_norm_pci(pci)] = m
        return cls(ms, by_name, by_alias, by_pci, max_gpus_per_node)

    def gi_profile_count(self) -> int:
        """One past the highest ``NVML_GPU_INSTANCE_PROFILE_*`` index any model's profile has:
        the indices an NVML reader must ask about, whatever its binding counts (an older
        nvidia-ml-py counts none of the RTX PRO ``+gfx`` ones)."""
        return 1 + max((p.nvml_index for m in self.models for p in m.profiles), default=-1)

    def model(self, name: str) -> GpuModel:
        """Look a model up by its catalog name, falling back to product-label matching."""
        found = self._by_name.get(name.upper())
        return found if found is not None else self.model_for_product(name)

    def model_for_product(self, label: str) -> GpuModel:
        found = self._by_alias.get(sanitize_product(label))
        if found is None:
            raise UnknownGpuModel(
                f"unknown GPU model {label!r} (nvidia.com/gpu.product); known: "
                f"{', '.join(m.name for m in self.models)}. Add it with a catalog override file "
                f"(see README, 'GPU catalog')"
            )
        return found

    def near_miss(self, resource: str) -> MigProfile | None:
        """The canonical profile a MIG request most likely means when no model of the catalog
        advertises ``resource`` exactly (:meth:`GpuModel.near_miss`, models in catalog order);
        ``None`` when one does, or when nothing is that close."""
        if any(p.resource == resource for m in self.models for p in m.profiles):
            return None
        for m in self.models:
            near = m.near_miss(resource)
            if near is not None:
                return near
        return None

    def model_for_pci_id(self, pci_id: str) -> GpuModel:
        found = self._by_pci.get(_norm_pci(pci_id))
        if found is None:
            raise UnknownGpuModel(
                f"unknown GPU PCI device id {pci_id!r}; add the model with a catalog override file"
            )
        return found

    def model_for_device(self, pci_id: str, name: str) -> GpuModel | None:
        """The model of a GPU as the driver reports it: by PCI device id, else by product
        name; ``None`` if the catalog knows neither (how the node agent identifies GPUs)."""
        try:
            return self.model_for_pci_id(pci_id)
        except CatalogError:
            try:
                return self.model_for_product(name)
            except CatalogError:
                return None

    def merged(self, other: Sequence[GpuModel]) -> Catalog:
        """This catalog with ``other``'s models added; same-named models are replaced.  A
        product label or PCI id of a kept model may not be claimed by another model: the
        partitioner (by label) and the agent (by PCI id) would then name one GPU two ways."""
        names = {m.name.upper() for m in other}
        kept = [m for m in self.models if m.name.upper() not in names]
        for m in other:
            for old in kept:
                aliases = {sanitize_product(a) for a in (old.name, *old.product_aliases)}
                taken = sorted(
                    a for a in m.product_aliases if sanitize_product(a) in aliases
                ) + sorted(
                    p
                    for p in m.pci_device_ids
                    if _norm_pci(p) in {_norm_pci(q) for q in old.pci_device_ids}
                )
                if taken:
                    raise CatalogError(
                        f"model {m.name}: {', '.join(taken)} already name(s) the built-in or "
                        f"earlier model {old.name}; to change that model, give the override "
                        f"its name ({old.name}), else drop the label or PCI id"
                    )
        return Catalog.of([*kept, *other], self.max_gpus_per_node)


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise CatalogError(f"{where}: missing field {key!r}")
    return d[key]


def profile_label(name: str) -> str:
    """A MIG profile name as a DNS label part, as the DRA driver's device names spell it
    (:mod:`contract.dra_devices`): lower case, ``-`` as ``--`` (first), then ``.`` and ``+``
    as ``-`` -- ``1g.24gb+me`` is ``1g-24gb-me``, ``1g.24gb-me`` is ``1g-24gb--me``.  The
    catalog refuses a model two of whose profiles get one label (:func:`_parse_models`)."""
    return name.lower().replace("-", "--").replace(".", "-").replace("+", "-")


def _parse_models(
    doc: Mapping[str, Any], base_geometries: Mapping[str, Any], where: str
) -> list[GpuModel]:
    geometries = {**base_geometries, **doc.get("geometries", {})}
    out: list[GpuModel] = []
    for i, md in enumerate(_req(doc, "models", where)):
        mwhere = f"{where}: models[{i}] ({md.get('name', '?')})"
        name = str(_req(md, "name", mwhere))
        geo_name = md.get("geometry")
        profiles: list[MigProfile] = []
        slots = compute = 0
        if geo_name is None and md.get("profiles"):
            raise CatalogError(
                f"{mwhere}: lists MIG profiles but no 'geometry': name the geometry its "
                f"placements follow (one of {sorted(geometries)}), or remove 'profiles' for a "
                "GPU without MIG"
            )
        if geo_name is not None:
            if geo_name not in geometries:
                raise CatalogError(
                    f"{mwhere}: unknown geometry {geo_name!r}; known: {sorted(geometries)}"
                )
            geo = geometries[geo_name]
            slots, compute = int(geo["memory_slots"]), int(geo["compute_slices"])
            names = md.get("profiles", {})
            for pd in geo["profiles"]:
                shape = str(pd["shape"])
                if shape not in names:
                    continue  # a model may lack a shape (e.g. B200 4g on old drivers)
                pn = names[shape]
                pname = str(_req(pn, "name", f"{mwhere} profile {shape}")).lower()
                starts = tuple(int(s) for s in pd["starts"])
                size = int(pd["memory_slices"])
                if any(s < 0 or s + size > slots for s in starts):
                    raise CatalogError(
                        f"{mwhere}: profile {pname} has a start outside the {slots}-slot grid"
                    )
                # ``+me``, ``+gfx``...; and ``-me`` (RTX PRO: no media extensions, the only
                # profiles a ``+me.all`` instance allows beside it, shared/facts/mig.md)
                cut = min((shape.index(c) for c in "+-" if c in shape), default=len(shape))
                variant = shape[cut:]
                profiles.append(
                    MigProfile(
                        name=pname,
                        shape=shape,
                        profile_id=int(pd["profile_id"]),
                        nvml_index=int(pd.get("nvml_index", -1)),
                        compute=int(pd["compute"]),
                        memory_slices=size,
                        memory_mib=int(_req(pn, "memory_mib", f"{mwhere} profile {shape}")),
                        max_count=int(pd["max_count"]),
                        starts=starts,
                        variant=variant,
                    )
                )
            spellings: dict[str, str] = {}
            for p in profiles:
                for key in {p.name, mig_resource(p.name).removeprefix("nvidia.com/mig-")}:
                    if key in spellings and spellings[key] != p.shape:
                        raise CatalogError(
                            f"{mwhere}: shapes {spellings[key]} and {p.shape} are both named "
                            f"{key!r}; a pod's request would mean either: give each its own name"
                        )
                    spellings[key] = p.shape
            labels: dict[str, str] = {}
            for p in profiles:
                label = profile_label(p.name)
                if label in labels:
                    raise CatalogError(
                        f"{mwhere}: profiles {labels[label]} and {p.name} get the same DRA "
                        f"device name part {label!r}; device names must be unique in a "
                        "node's pool: rename one"
                    )
                labels[label] = p.name
            unknown = set(names) - {str(p["shape"]) for p in geo["profiles"]}
            if unknown:
                raise CatalogError(
                    f"{mwhere}: profiles for shapes not in geometry {geo_name}: {sorted(unknown)}"
                )
        out.append(
            GpuModel(
                name=name,
                memory_mib=int(_req(md, "memory_mib", mwhere)),
                pci_device_ids=tuple(str(p).upper() for p in md.get("pci_device_ids", ())),
                product_aliases=tuple(str(a) for a in md.get("product_aliases", ())),
                memory_slots=slots,
                compute_slices=compute,
                profiles=tuple(profiles),
                placements_captured=bool(md.get("placements_captured", True)),
                note=str(md.get("note", "")),
                _by_name=_profile_keys(profiles),
            )
        )
    return out


def _profile_keys(profiles: Sequence[MigProfile]) -> dict[str, MigProfile]:
    """Every exact spelling of each profile: its name and its resource spelling (``+`` -> ``.``)."""
    keys = {mig_resource(p.name).removeprefix("nvidia.com/mig-"): p for p in profiles}
    keys.update({p.name: p for p in profiles})
    return keys


def _read_doc(text: str, where: str) -> Mapping[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        import yaml  # YAML only for user files; the built-in catalog is JSON

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise CatalogError(f"{where}: neither valid JSON nor YAML: {e}") from e
    if not isinstance(doc, dict):
        raise CatalogError(f"{where}: expected a mapping with a 'models' list")
    return doc


def parse_catalog(text: str, where: str = "<catalog>", base: Catalog | None = None) -> Catalog:
    """Parse catalog text (JSON or YAML). With ``base``, models are merged over it."""
    doc = _read_doc(text, where)
    geos = _builtin_doc()["geometries"]
    models = _parse_models(doc, geos, where)
    limit = _max_gpus(doc, where)
    if base is not None:
        merged = base.merged(models)
        return merged if limit is None else Catalog.of(merged.models, limit)
    return Catalog.of(models, limit or DEFAULT_MAX_GPUS_PER_NODE)


def _max_gpus(doc: Mapping[str, Any], where: str) -> int | None:
    raw = doc.get("max_gpus_per_node")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 1024:
        raise CatalogError(
            f"{where}: max_gpus_per_node must be an integer from 1 to 1024, got {raw!r}"
        )
    return raw


@cache
def _builtin_doc() -> Mapping[str, Any]:
    text = resources.files("planner").joinpath("data/gpu_catalog.json").read_text()
    doc: Mapping[str, Any] = json.loads(text)
    return doc


@cache
def default_catalog() -> Catalog:
    """The catalog shipped with gpuslice (``planner/data/gpu_catalog.json``)."""
    doc = _builtin_doc()
    models = _parse_models(doc, doc["geometries"], "built-in catalog")
    return Catalog.of(models, _max_gpus(doc, "built-in catalog") or DEFAULT_MAX_GPUS_PER_NODE)
