"""Seeded planner instances: benchmark clusters and the built-in demo cluster.

Benchmark model (:func:`mig_benchmark_snapshot`)
------------------------------------------------
``nodes`` nodes named ``node-0000``... each with ``gpus_per_node`` GPUs of one MIG model
(default A100-SXM4-80GB, 7 compute slices per GPU).  Every GPU first gets a *realistic* full
layout, drawn from the layouts operators actually configure (mig-parted style: ``7g``,
``4g+3g``, ``3g+3g``, "balanced" ``2g+1g+1g+3g``, ``3x2g+1g``, ``7x1g``, ...).  Then the
instances of the whole cluster are visited in a seeded random order and marked USED while the
used compute stays within ``occupancy`` x (7 x GPU count): ``occupancy`` is the fraction of
compute slices held by used instances.  Of the instances left over, about half stay as FREE
instances and the rest are removed (empty memory slots), as a cluster that has been
repartitioned a few times looks.

The pending batch has ``round(pending_fraction x GPU count)`` pods with a realistic profile
mix (mostly ``1g.10gb`` and ``2g.20gb``, fewer ``3g.40gb``/``4g.40gb``, some ``7g.80gb`` and
``1g.20gb``; a tenth of the small ones ask for two units), priorities mostly 0 with some 10 and
a few 100, CPU/memory requests, and about 15 % of them restricted to one of four "zones"
(node index modulo 4), as a nodeSelector would.  Profile names are those of the chosen model.

Demo (:func:`demo_snapshot`)
----------------------------
A small fixed cluster for ``gpuslice plan --demo``: two A100-80GB MIG nodes, one H100 MIG node
and one V100-32GB MPS node with some used and free instances/slices, and ten pending pods, one
of which cannot be placed anywhere (a 40 GB MPS slice on a 32 GB GPU).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from planner.catalog import Catalog, GpuModel, default_catalog
from planner.geometry import parse_layout
from planner.snapshot import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    Snapshot,
    mps_resource,
)

__all__ = ["REALISTIC_LAYOUTS", "demo_snapshot", "mig_benchmark_snapshot"]

# Layouts by shape (so they apply to every 8-slot model), with a relative frequency.
REALISTIC_LAYOUTS: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = (
    (3, (("7g", 0),)),
    (4, (("4g", 0), ("3g", 4))),
    (2, (("3g", 0), ("3g", 4))),
    (4, (("2g", 0), ("1g", 2), ("1g", 3), ("3g", 4))),
    (3, (("2g", 0), ("2g", 2), ("2g", 4), ("1g", 6))),
    (3, tuple(("1g", s) for s in range(7))),
    (2, (("1g", 0), ("1g", 1), ("1g", 2), ("1g", 3), ("3g", 4))),
    (2, (("4g", 0), ("2g", 4), ("1g", 6))),
    (1, (("1g.2m", 0), ("1g.2m", 2), ("1g.2m", 4), ("1g", 6))),
)

# Pending pod mix by shape: (weight, shape).
POD_SHAPES: tuple[tuple[int, str], ...] = (
    (35, "1g"),
    (5, "1g.2m"),
    (25, "2g"),
    (15, "3g"),
    (12, "4g"),
    (8, "7g"),
)

ZONES = 4


def _model(catalog: Catalog | None, name: str) -> GpuModel:
    model = (catalog or default_catalog()).model(name)
    if model.memory_slots != 8:
        raise ValueError(
            f"benchmark model {name!r} has a {model.memory_slots}-slot grid; "
            "choose an 8-slot MIG model such as A100-SXM4-80GB or H100-80GB"
        )
    return model


def _gpu_layouts(model: GpuModel, rng: random.Random, count: int) -> list[list[tuple[str, int]]]:
    weights = [w for w, _ in REALISTIC_LAYOUTS]
    shapes = [layout for _, layout in REALISTIC_LAYOUTS]
    out: list[list[tuple[str, int]]] = []
    for shape_layout in rng.choices(shapes, weights=weights, k=count):
        named = [(model.profile_by_shape(shape).name, start) for shape, start in shape_layout]
        parse_layout(model, named)  # every layout we emit is valid
        out.append(named)
    return out


def mig_benchmark_snapshot(
    nodes: int,
    *,
    gpus_per_node: int = 8,
    occupancy: float = 0.85,
    pending_fraction: float = 0.30,
    seed: int = 0,
    model_name: str = "A100-SXM4-80GB",
    catalog: Catalog | None = None,
) -> Snapshot:
    """A seeded MIG cluster at ``occupancy`` with a pending batch (see the module docstring)."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("need at least one node and one GPU per node")
    if not 0.0 <= occupancy <= 1.0 or pending_fraction < 0.0:
        raise ValueError("occupancy must be in [0, 1] and pending_fraction >= 0")
    model = _model(catalog, model_name)
    rng = random.Random(seed)
    n_gpus = nodes * gpus_per_node
    layouts = _gpu_layouts(model, rng, n_gpus)

    # Mark instances used in a random order while used compute stays within the target.
    slots = [(g, i) for g, layout in enumerate(layouts) for i in range(len(layout))]
    rng.shuffle(slots)
    target = occupancy * model.compute_slices * n_gpus
    used: set[tuple[int, int]] = set()
    used_compute = 0
    for g, i in slots:
        c = model.profile(layouts[g][i][0]).compute
        if used_compute + c <= target:
            used.add((g, i))
            used_compute += c

    node_states: list[NodeState] = []
    for n in range(nodes):
        gpus: list[GpuState] = []
        for k in range(gpus_per_node):
            g = n * gpus_per_node + k
            instances = []
            for i, (name, start) in enumerate(layouts[g]):
                if (g, i) in used:
                    instances.append(MigInstance(name, start, used=True))
                elif rng.random() < 0.5:
                    instances.append(MigInstance(name, start, used=False))
            gpus.append(GpuState(index=k, mig=tuple(instances)))
        node_states.append(
            NodeState(
                name=f"node-{n:04d}",
                mode=Mode.MIG,
                model=model.name,
                gpus=tuple(gpus),
                cpu_milli_free=rng.randrange(16, 65) * 1000,
                memory_mib_free=rng.randrange(64, 513) * 1024,
            )
        )

    zones = [
        frozenset(ns.name for i, ns in enumerate(node_states) if i % ZONES == z)
        for z in range(ZONES)
    ]
    pods: list[PendingPod] = []
    shape_weights = [w for w, _ in POD_SHAPES]
    shape_names = [s for _, s in POD_SHAPES]
    for j in range(round(pending_fraction * n_gpus)):
        shape = rng.choices(shape_names, weights=shape_weights)[0]
        profile = model.profile_by_shape(shape)
        count = 2 if profile.compute <= 2 and rng.random() < 0.1 else 1
        r = rng.random()
        priority = 100 if r < 0.05 else 10 if r < 0.20 else 0
        eligible = zones[rng.randrange(ZONES)] if rng.random() < 0.15 else None
        pods.append(
            PendingPod(
                name=f"team-{j % 7}/job-{j:05d}",
                requests={profile.resource: count},
                cpu_milli=rng.choice((500, 1000, 2000, 4000, 8000)),
                memory_mib=rng.choice((2, 4, 8, 16, 32, 64)) * 1024,
                priority=priority,
                eligible_nodes=eligible,
            )
        )
    return Snapshot(nodes=tuple(node_states), pods=tuple(pods))


def _mig_gpu(index: int, instances: Sequence[tuple[str, int, bool]]) -> GpuState:
    return GpuState(index=index, mig=tuple(MigInstance(p, s, used=u) for p, s, u in instances))


def demo_snapshot() -> Snapshot:
    """The built-in demo cluster and pending batch (see the module docstring)."""
    gib = 1024
    nodes = (
        NodeState(
            name="node-a",
            mode=Mode.MIG,
            model="A100-SXM4-80GB",
            gpus=(
                _mig_gpu(0, [("3g.40gb", 0, True), ("3g.40gb", 4, False)]),
                _mig_gpu(1, [("1g.10gb", 0, True), ("1g.10gb", 1, False), ("2g.20gb", 4, True)]),
            ),
            cpu_milli_free=32_000,
            memory_mib_free=256 * gib,
        ),
        NodeState(
            name="node-b",
            mode=Mode.MIG,
            model="A100-SXM4-80GB",
            gpus=(
                _mig_gpu(0, [("7g.80gb", 0, True)]),
                _mig_gpu(1, []),
            ),
            cpu_milli_free=16_000,
            memory_mib_free=128 * gib,
        ),
        NodeState(
            name="node-c",
            mode=Mode.MIG,
            model="H100-80GB",
            gpus=(_mig_gpu(0, [("4g.40gb", 0, True), ("1g.10gb", 4, False)]),),
            cpu_milli_free=24_000,
            memory_mib_free=192 * gib,
        ),
        NodeState(
            name="node-d",
            mode=Mode.MPS,
            model="V100-32GB",
            gpus=(
                GpuState(0, mps=(MpsSlice(8 * gib, used=True, thread_percentage=25),)),
                GpuState(1, mps=()),
            ),
            cpu_milli_free=16_000,
            memory_mib_free=64 * gib,
        ),
    )

    def mig(name: str, profile: str, count: int = 1, priority: int = 0) -> PendingPod:
        return PendingPod(
            name=name,
            requests={f"nvidia.com/mig-{profile}": count},
            cpu_milli=2000,
            memory_mib=8 * gib,
            priority=priority,
        )

    def mps(name: str, gb: int) -> PendingPod:  # one slice: a container reaches one daemon
        return PendingPod(
            name=name,
            requests={mps_resource(gb): 1},
            cpu_milli=1000,
            memory_mib=4 * gib,
        )

    pods = (
        mig("ml/train-large", "4g.40gb", priority=10),
        mig("ml/train-medium", "3g.40gb"),
        mig("ml/notebook-1", "1g.10gb"),
        mig("ml/notebook-2", "1g.10gb"),
        mig("ml/notebook-pair", "1g.10gb", count=2),
        mig("ml/eval", "2g.20gb"),
        PendingPod(
            name="ml/h100-only",
            requests={"nvidia.com/mig-2g.20gb": 1},
            cpu_milli=4000,
            memory_mib=16 * gib,
            eligible_nodes=frozenset({"node-c"}),
        ),
        mps("infer/small-1", 8),
        mps("infer/small-2", 8),
        mps("infer/medium", 16),
        mps("infer/too-big", 40),
    )
    return Snapshot(nodes=nodes, pods=pods)
