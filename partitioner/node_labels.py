"""What GPU Feature Discovery's node labels say about a node's GPUs, read by MIG strategy. Pure.

Model
-----
GPU Feature Discovery (GFD, run by NVIDIA's GPU Operator or on its own) labels a GPU node
differently under each ``nvidia.com/mig.strategy`` (label absent = ``none``); sources:
NVIDIA/k8s-device-plugin v0.20.0 ``internal/lm/mig-strategy.go`` and ``resource.go``, summed up
in ``shared/facts/gpu-operator.md`` section 1:

========================  ==========================  ================================  ==========================
label                     none                        single                            mixed
========================  ==========================  ================================  ==========================
``gpu.product``           model                       ``<model>-MIG-<profile>``         model
``gpu.count``             physical GPUs               number of MIG devices             physical GPUs
``gpu.memory``            one GPU, MiB                one MIG device, MiB               one GPU, MiB
``mig-<profile>.count``   absent                      absent                            MIG devices of that profile
========================  ==========================  ================================  ==========================

So :func:`read_gpu_labels` takes

* the **model** from ``gpu.product`` with any ``-SHARED``/``-MIG-...`` suffix stripped;
* the **physical GPU count** from a source that means GPUs: ``gpu.count`` under ``none`` and
  ``mixed``, and under ``single`` (where no label holds it) in this order: the annotation
  ``gpuslice.io/gpu-count`` (set by an admin, e.g. before installing gpuslice; read under
  ``-MIG-INVALID`` too), the GPU Operator's MIG manager config
  ``nvidia.com/mig.config=all-<profile>`` with ``nvidia.com/mig.config.state=success``
  (NVIDIA's default configs put the profile's maximum count on every GPU: MIG devices / that
  maximum), or a profile of which one GPU holds at most one (7g, 4g: count = MIG devices).
  Otherwise the count is left unknown here.  Under ``single`` every one of these is a guess
  for the time before the node agent reports: once its NodePartitioning status (it counts GPUs
  through NVML) is there, its count wins and a label or annotation that disagrees is named in
  a note (:mod:`partitioner.adoption`);
* the **full-GPU memory** from ``gpu.memory`` except under ``single`` (one MIG device's memory
  there: the catalog's figure is used);
* every count (labels and the annotation) as ASCII digits only, at most 18 of them (anything
  else is no count: ``²`` is a digit to ``str.isdigit`` but not to ``int``);
* the **MIG devices per profile** the labels show: ``mig-<profile>.count`` under ``mixed``
  (profile names in the resource spelling, ``1g.10gb.me``), ``gpu.count`` devices of the
  product's profile under ``single``, nothing under ``none``.

Before any of that, two GPU Operator operands must be off on a gpuslice node
(:data:`OPERANDS_OFF`; facts sheet section 3): the MIG manager (it re-applies its own config at
every start and on every ``nvidia.com/mig.config`` change, clearing every MIG GPU) and NVIDIA's
device plugin (it would advertise the GPUs gpuslice's agent serves a second time).  The
operator deploys each where its ``nvidia.com/gpu.deploy.<operand>`` label is anything but
``false`` and never overwrites a ``false``; a node with such a label not ``false`` is a
:class:`LabelProblem` naming the ``kubectl label`` that fixes it.  Absent labels (no GPU
Operator) are fine -- unless other ``nvidia.com/gpu.deploy.*`` labels show the operator manages
the node: it then writes a missing one back as ``true`` (the MIG manager's only where the node
is MIG-capable: ``nvidia.com/mig.capable=true``, or without that label a product naming
A100/H100/A30; none of them after ``nvidia.com/gpu.deploy.operands=false``), so a deleted label
is read as on and the problem says to write ``false``.  :func:`with_operands_off` gives the node as it will look once fixed (the
pre-install what-if assumes the fix and says so).

Under single with sharing the product is ``<model>-MIG-<profile>-SHARED``: the profile is read
without the ``-SHARED``.  ``<model>-MIG-INVALID`` (single's preconditions failed: profiles
differ, a MIG GPU is empty, or MIG is off on some GPU) leaves the devices unknown, and the
count unknown unless the annotation gives it.  Every single-strategy node gets a note that GFD
rewrites ``gpu.product``, ``gpu.count`` and ``gpu.memory`` as gpuslice repartitions (a pod
selecting on the product stops matching: use ``mixed``).  A
count above the catalog's ``max_gpus_per_node`` (or more MIG devices of a profile than that
many GPUs can hold) is a :class:`LabelProblem` naming the label: a node's labels never make the
controller loop over a billion GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from contract.quantity import ascii_count
from planner.catalog import Catalog, CatalogError, GpuModel, MigProfile

__all__ = [
    "COUNT_ANNOTATION",
    "COUNT_LABEL",
    "MEMORY_LABEL",
    "MIG_CONFIG_LABEL",
    "MIG_CONFIG_STATE_LABEL",
    "OPERANDS_OFF",
    "PRODUCT_LABEL",
    "SINGLE_RELABELS",
    "STRATEGY_LABEL",
    "GpuLabels",
    "LabelProblem",
    "MigStrategy",
    "operands_on",
    "read_gpu_labels",
    "with_operands_off",
]

PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"
STRATEGY_LABEL = "nvidia.com/mig.strategy"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
OPERANDS_OFF = {
    "nvidia.com/gpu.deploy.mig-manager": (
        "MigManagerEnabled",
        "the GPU Operator's MIG manager re-applies its MIG config at every start, clearing "
        "every MIG GPU (gpuslice's instances too)",
    ),
    "nvidia.com/gpu.deploy.device-plugin": (
        "NvidiaDevicePluginEnabled",
        "NVIDIA's device plugin would advertise the GPUs the gpuslice agent serves a second time",
    ),
}
"""GPU Operator deploy labels that must be ``false`` on a gpuslice node -> (reason, why)."""
COUNT_ANNOTATION = "gpuslice.io/gpu-count"
"""Physical GPUs of a node whose labels cannot say (GFD's ``single`` strategy); set by you."""

_MIXED_COUNT = re.compile(r"^nvidia\.com/mig-(?P<name>.+)\.count$")
_COMPUTE_SPLIT = re.compile(r"^\d+c\.(?P<gi>\d+g\..+)$")
"""GFD's name of a MIG device whose compute instance is smaller than its GPU instance
(``1c.3g.40gb``: one compute slice of a ``3g.40gb`` instance; facts/gpu-operator.md)."""
_INVALID = "-MIG-INVALID"
_SHARED = "-SHARED"
"""GFD's suffix on ``gpu.product`` when the GPUs are shared (time-slicing, MPS) under any
strategy, after ``-MIG-<profile>`` under single (facts/gpu-operator.md section 1)."""


class MigStrategy(StrEnum):
    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class LabelProblem:
    reason: str
    """CamelCase, for Events and the node condition."""
    message: str


@dataclass(frozen=True, slots=True)
class GpuLabels:
    """A node's GPUs as its labels describe them (module docstring)."""

    strategy: MigStrategy
    model: GpuModel
    gpu_count: int | None
    """Physical GPUs; ``None`` when no label or annotation says (single strategy)."""
    count_source: str
    """Where ``gpu_count`` came from, in words."""
    gpu_memory_mib: int | None
    """Full-GPU memory (MiB) from ``gpu.memory``; ``None`` = use the catalog's."""
    mig_devices: Mapping[str, int] | None
    """Catalog profile name -> MIG devices the labels show on the node; ``None`` = the labels
    say nothing about MIG devices (strategy none, or single's ``-MIG-INVALID``)."""
    single_profile: MigProfile | None = None
    """Under a valid single strategy: the one profile of every MIG device."""
    mig_config: str = ""
    """``nvidia.com/mig.config`` when the MIG manager applied it (state ``success``), else ``""``."""
    notes: tuple[str, ...] = ()
    """What was assumed, one sentence each (``gpuslice plan --snapshot`` prints them)."""
    split_devices: tuple[str, ...] = ()
    """Labels counting MIG devices of compute instances smaller than their GPU instance
    (``mig-1c.3g.40gb.count``): how many GPU instances hold them is unknown from labels, so
    only the agent's report can say what the node holds (:func:`partitioner.adoption.adopt`)."""


def _int(text: str | None) -> int | None:
    """The count ``text`` holds (surrounding whitespace allowed, :func:`ascii_count`), or
    ``None``."""
    return ascii_count((text or "").strip())


def _too_many(what: str, value: int, limit: int) -> LabelProblem:
    return LabelProblem(
        "TooManyGpus",
        f"{what}={value} is more than any server holds (at most {limit} GPUs per node, the "
        f"catalog's max_gpus_per_node); fix the label, or raise max_gpus_per_node in a catalog "
        f"override file if your servers really are that large",
    )


def _physical_count(labels: Mapping[str, str], limit: int) -> int | LabelProblem:
    raw = labels.get(COUNT_LABEL)
    count = _int(raw)
    if count is None or count == 0:
        return LabelProblem(
            "InvalidGpuLabels",
            f"label {COUNT_LABEL}={raw!r} is missing or not a positive integer; run GPU "
            f"Feature Discovery or set it to the number of GPUs",
        )
    return _too_many(f"label {COUNT_LABEL}", count, limit) if count > limit else count


def _memory(labels: Mapping[str, str]) -> int | LabelProblem | None:
    raw = labels.get(MEMORY_LABEL)
    if raw is None:
        return None
    memory = _int(raw)
    if not memory:
        return LabelProblem(
            "InvalidGpuLabels", f"label {MEMORY_LABEL}={raw!r} is not a positive integer (MiB)"
        )
    return memory


def _applied_config(labels: Mapping[str, str]) -> str:
    state = labels.get(MIG_CONFIG_STATE_LABEL, "")
    return labels.get(MIG_CONFIG_LABEL, "") if state == "success" else ""


def _profile(model: GpuModel, name: str, where: str) -> MigProfile | LabelProblem:
    try:
        return model.profile(name)
    except CatalogError as e:
        return LabelProblem(
            "UnknownMigProfile",
            f"{where} names MIG device {name!r}, which is not a profile of {model.name} in the "
            f"catalog ({e}); gpuslice manages whole GPU instances of catalog profiles: remove "
            f"that instance, or add its name to the model with a catalog override file",
        )


SINGLE_RELABELS = (
    f"mig.strategy=single: GPU Feature Discovery rewrites {PRODUCT_LABEL}, {COUNT_LABEL} and "
    f"{MEMORY_LABEL} whenever gpuslice repartitions the GPUs (<model>-MIG-<profile>, or "
    f"<model>{_INVALID} while profiles differ), so a pod selecting on {PRODUCT_LABEL} stops "
    f"matching this node; set the GPU Operator's ClusterPolicy mig.strategy=mixed"
)
"""The note every single-strategy node gets (facts/gpu-operator.md section 1)."""


def _annotated_count(annotations: Mapping[str, str], limit: int) -> int | LabelProblem | None:
    """The :data:`COUNT_ANNOTATION`'s count, ``None`` without it."""
    annotated = annotations.get(COUNT_ANNOTATION)
    if annotated is None:
        return None
    value = _int(annotated)
    if not value:
        return LabelProblem(
            "InvalidGpuLabels",
            f"annotation {COUNT_ANNOTATION}={annotated!r} is not a positive integer",
        )
    if value > limit:
        return _too_many(f"annotation {COUNT_ANNOTATION}", value, limit)
    return value


def _single(
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    model: GpuModel,
    suffix: str,
    limit: int,
) -> GpuLabels | LabelProblem:
    """Strategy single with every GPU in MIG mode: count and memory are per MIG device."""
    config = _applied_config(labels)
    annotated = _annotated_count(annotations, limit)
    if isinstance(annotated, LabelProblem):
        return annotated
    if suffix == "INVALID":
        return GpuLabels(
            MigStrategy.SINGLE,
            model,
            annotated,
            "unknown: GFD reports the single strategy invalid (-MIG-INVALID)"
            if annotated is None
            else f"annotation {COUNT_ANNOTATION}",
            None,
            None,
            mig_config=config,
            notes=(
                f"{PRODUCT_LABEL} ends in {_INVALID}: the GPUs mix MIG profiles, hold an empty "
                f"MIG GPU or mix MIG on and off, so the labels tell neither GPU count nor "
                f"instances (set the GPU Operator's mig.strategy=mixed)",
                SINGLE_RELABELS,
            ),
        )
    profile = _profile(model, suffix, f"label {PRODUCT_LABEL}")
    if isinstance(profile, LabelProblem):
        return profile
    devices = _int(labels.get(COUNT_LABEL))
    if devices is None:
        return LabelProblem(
            "InvalidGpuLabels",
            f"label {COUNT_LABEL}={labels.get(COUNT_LABEL)!r} is missing or not an integer; "
            f"under mig.strategy=single it counts MIG devices",
        )
    if devices > limit * profile.max_count:
        return _too_many(f"label {COUNT_LABEL} (MIG devices of {profile.name})", devices, limit)
    notes = [
        f"mig.strategy=single: {COUNT_LABEL}={devices} counts {profile.name} MIG devices, not "
        f"GPUs, and {MEMORY_LABEL} is one device's memory (the catalog's GPU memory is used)",
        SINGLE_RELABELS,
    ]
    count: int | None = None
    source = "unknown: no label holds it under mig.strategy=single"
    if annotated is not None:
        count, source = annotated, f"annotation {COUNT_ANNOTATION}"
    elif config and config.startswith("all-"):
        try:
            same = model.profile(config.removeprefix("all-")) == profile
        except CatalogError:
            same = False
        if same and devices % profile.max_count == 0:
            count = devices // profile.max_count
            source = (
                f"{MIG_CONFIG_LABEL}={config} (state success): {profile.max_count} x "
                f"{profile.name} per GPU, {devices} devices"
            )
    elif profile.max_count == 1:
        count, source = devices, f"{devices} {profile.name} devices, at most one per GPU"
    return GpuLabels(
        MigStrategy.SINGLE,
        model,
        count,
        source,
        None,
        {profile.name: devices},
        single_profile=profile,
        mig_config=config,
        notes=tuple(notes),
    )


def _mixed_devices(
    labels: Mapping[str, str], model: GpuModel, gpus: int, split: list[str]
) -> dict[str, int] | LabelProblem:
    """MIG devices per profile from GFD's ``mig-<profile>.count`` labels; the keys of those
    counting compute instances smaller than their GPU instance go to ``split`` instead."""
    devices: dict[str, int] = {}
    for key in sorted(labels):
        m = _MIXED_COUNT.match(key)
        if m is None:
            continue
        n = _int(labels[key])
        if n is None:
            return LabelProblem(
                "InvalidGpuLabels", f"label {key}={labels[key]!r} is not a non-negative integer"
            )
        part = _COMPUTE_SPLIT.match(m.group("name"))
        if part is not None:
            instance = _profile(model, part.group("gi"), f"label {key}")
            if isinstance(instance, LabelProblem):
                return instance
            if n:
                split.append(key)
            continue
        profile = _profile(model, m.group("name"), f"label {key}")
        if isinstance(profile, LabelProblem):
            return profile
        if n > gpus * profile.max_count:
            return LabelProblem(
                "InvalidGpuLabels",
                f"label {key}={n}: {gpus} {model.name} GPU(s) hold at most "
                f"{gpus * profile.max_count} {profile.name} instances",
            )
        if n:
            devices[profile.name] = devices.get(profile.name, 0) + n
    return devices


_DEPLOY_PREFIX = "nvidia.com/gpu.deploy."
_OPERANDS_ALL = "nvidia.com/gpu.deploy.operands"
_MIG_MANAGER = "nvidia.com/gpu.deploy.mig-manager"
_MIG_CAPABLE = "nvidia.com/mig.capable"
_MIG_PRODUCTS = ("a100", "h100", "a30")
"""Products the GPU Operator takes as MIG-capable without ``mig.capable`` (hasMIGCapableGPU)."""


def _operator_restores(labels: Mapping[str, str], key: str) -> bool:
    """Would the GPU Operator write the missing deploy label ``key`` back as ``true``?  Only on
    a node it manages (another ``nvidia.com/gpu.deploy.*`` label present, operands not all
    off); the MIG manager's only on a MIG-capable node (facts/gpu-operator.md section 3)."""
    if labels.get(_OPERANDS_ALL) == "false":
        return False
    if not any(k.startswith(_DEPLOY_PREFIX) and k not in OPERANDS_OFF for k in labels):
        return False
    if key != _MIG_MANAGER:
        return True
    capable = labels.get(_MIG_CAPABLE)
    if capable is not None:
        return capable == "true"
    product = labels.get(PRODUCT_LABEL, "").lower()
    return any(p in product for p in _MIG_PRODUCTS)


def operands_on(labels: Mapping[str, str]) -> list[str]:
    """The :data:`OPERANDS_OFF` labels the node carries with a value other than ``false``, and
    those missing where the GPU Operator would put them back as ``true``."""
    return [
        k
        for k in OPERANDS_OFF
        if (labels[k] != "false" if k in labels else _operator_restores(labels, k))
    ]


def _shown(labels: Mapping[str, str], key: str) -> str:
    """``key=<value>``, or what its absence means on a GPU Operator node."""
    if key in labels:
        return f"{key}={labels[key]!r}"
    return (
        f"{key} is missing (deleted?) while other {_DEPLOY_PREFIX}* labels show the GPU "
        f"Operator manages the node: the operator puts it back as true"
    )


def with_operands_off(node: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of the node object with every :data:`OPERANDS_OFF` label ``false``, and one
    sentence per label changed (what the pre-install what-if assumes)."""
    meta = dict(node.get("metadata") or {})
    labels = dict(meta.get("labels") or {})
    changed = operands_on(labels)
    notes = [
        f"assumed {k}=false ("
        + (
            f"it is {labels[k]!r}"
            if k in labels
            else "it is missing; the GPU Operator would add it as true"
        )
        + f"): set it before installing gpuslice, or the partitioner leaves the node out "
        f"({OPERANDS_OFF[k][1]})"
        for k in changed
    ]
    labels.update({k: "false" for k in changed})
    meta["labels"] = labels
    return {**node, "metadata": meta}, notes


def read_gpu_labels(
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    catalog: Catalog,
    node: str = "<node>",
) -> GpuLabels | LabelProblem:
    """Model, physical GPU count, memory and MIG devices per the node's labels (module docstring).

    ``nvidia.com/gpu.product`` must be present (the caller says so in its own words).
    """
    on = operands_on(labels)
    if on:
        fixes = " ".join(f"{k}=false" for k in on)
        return LabelProblem(
            OPERANDS_OFF[on[0]][0],
            "; ".join(f"{_shown(labels, k)}: {OPERANDS_OFF[k][1]}" for k in on)
            + f". Run: kubectl label node {node} {fixes} --overwrite (write false, do not "
            f"delete the label: the GPU Operator puts a missing one back as true; harmless where "
            f"the operand is disabled cluster-wide)",
        )
    raw_strategy = labels.get(STRATEGY_LABEL, MigStrategy.NONE.value)
    try:
        strategy = MigStrategy(raw_strategy)
    except ValueError:
        return LabelProblem(
            "InvalidGpuLabels",
            f"label {STRATEGY_LABEL}={raw_strategy!r} is not one of single, mixed (GFD writes "
            f"no label for none)",
        )
    product = labels[PRODUCT_LABEL]
    try:
        model = catalog.model_for_product(product)
    except CatalogError as e:
        return LabelProblem("UnknownGpuModel", str(e))
    limit = catalog.max_gpus_per_node
    _, sep, suffix = product.partition("-MIG-")
    if sep:  # GFD writes <model>-MIG-<profile>[-SHARED] only under single
        return _single(labels, annotations, model, suffix.removesuffix(_SHARED), limit)
    count = _physical_count(labels, limit)
    if isinstance(count, LabelProblem):
        return count
    memory = _memory(labels)
    if isinstance(memory, LabelProblem):
        return memory
    if memory is not None and memory > 2 * model.memory_mib:
        # the planner sizes MPS levels per GiB of it: 80 GiB written in bytes planned for
        # minutes while every other node's pods waited
        return LabelProblem(
            "InvalidGpuLabels",
            f"label {MEMORY_LABEL}={labels[MEMORY_LABEL]} MiB is more than twice the "
            f"{model.memory_mib} MiB a {model.name} has (written in bytes?); GPU Feature "
            "Discovery writes MiB: fix the label, or the catalog entry with an override",
        )
    source = f"label {COUNT_LABEL}"
    notes: list[str] = []
    devices: dict[str, int] | None = None
    split: list[str] = []
    if strategy is MigStrategy.MIXED:
        got = _mixed_devices(labels, model, count, split)
        if isinstance(got, LabelProblem):
            return got
        devices = got
        source += " (mig.strategy=mixed: physical GPUs, MIG on and off)"
    elif strategy is MigStrategy.SINGLE:
        source += " (mig.strategy=single with no GPU in MIG mode: physical GPUs)"
        devices = {}
        notes.append(SINGLE_RELABELS)
    else:
        notes.append("no nvidia.com/mig.strategy label (none): the labels show no MIG devices")
    return GpuLabels(
        strategy,
        model,
        count,
        source,
        memory,
        devices,
        mig_config=_applied_config(labels),
        notes=tuple(notes),
        split_devices=tuple(split),
    )
