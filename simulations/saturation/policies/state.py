"""The GPU-share cluster state every saturation policy reads and the protocol mutates.

Model
-----
Nodes are stored in **rank order** (index 0 = rank 0), so "ties go to the smallest rank" is
simply "the first maximum" (``numpy.argmax``).  Per node: free CPU and memory, the free milli-GPU
of each GPU (``gpu_free[n, g]``, ``-1`` for GPU slots the node does not have), and derived
arrays kept in step on every placement: ``idle`` (Σ free), ``max_free``, ``full`` (# GPUs with
all 1000 milli free), the sorted free tuple ``frees[n]``, the FGD fragmentation ``F[n]`` and a
``version[n]`` counter that policies use to invalidate per-node caches.

Feasibility (fgd.md §3): free CPU >= request and free memory >= request; for a GPU pod also the
node has GPUs of a model its ``gpu_spec`` allows and, for ``num_gpu = 1``, some GPU has
``free >= gpu_milli``; for ``num_gpu > 1``, at least ``num_gpu`` distinct GPUs have
``free >= gpu_milli`` (the traces' multi-GPU pods all take whole GPUs, where this equals FGD's
``Σ floor(free / gpu_milli) >= num_gpu``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import GPU_MILLI, Pod
from simulations.saturation.fragmentation import FragModel

__all__ = ["ShareState"]

IntArray = npt.NDArray[np.int64]


class ShareState:
    """Mutable GPU-share state of a cluster, nodes in rank order (see the module docstring)."""

    def __init__(self, cluster: Cluster, rank: Sequence[int], frag: FragModel) -> None:
        n = len(cluster.nodes)
        if sorted(rank) != list(range(n)):
            raise ValueError(f"rank must be a permutation of 0..{n - 1}")
        order = sorted(range(n), key=lambda i: rank[i])
        self.nodes: tuple[Node, ...] = tuple(cluster.nodes[i] for i in order)
        self.frag_model = frag
        self.total_gpus = cluster.total_gpus
        self.capacity_milli = self.total_gpus * GPU_MILLI
        self.max_node_cpu = cluster.max_node_cpu_milli
        self.max_node_gpu_milli = cluster.max_node_gpus * GPU_MILLI
        width = max(1, cluster.max_node_gpus)
        self.cpu_free: IntArray = np.array([x.cpu_milli for x in self.nodes], dtype=np.int64)
        self.mem_free: IntArray = np.array([x.memory_mib for x in self.nodes], dtype=np.int64)
        self.n_gpus: IntArray = np.array([x.gpus for x in self.nodes], dtype=np.int64)
        self.gpu_free: IntArray = np.full((n, width), -1, dtype=np.int64)
        for i, x in enumerate(self.nodes):
            self.gpu_free[i, : x.gpus] = GPU_MILLI
        self.idle: IntArray = self.n_gpus * GPU_MILLI
        self.max_free: IntArray = np.where(self.n_gpus > 0, GPU_MILLI, -1).astype(np.int64)
        self.full: IntArray = self.n_gpus.copy()
        self.models = sorted({x.model for x in self.nodes if x.gpus})
        model_index = {m: i for i, m in enumerate(self.models)}
        self.model_idx: IntArray = np.array(
            [model_index[x.model] if x.gpus else -1 for x in self.nodes], dtype=np.int64
        )
        self.frag_class = [frag.model_class(x.model) for x in self.nodes]
        self.frees: list[tuple[int, ...]] = [(GPU_MILLI,) * x.gpus for x in self.nodes]
        self.F = np.array(
            [frag.frag(self.frag_class[i], int(self.cpu_free[i]), self.frees[i]) for i in range(n)],
            dtype=np.float64,
        )
        self.version: IntArray = np.zeros(n, dtype=np.int64)
        self.used_milli = 0
        self._spec_masks: dict[tuple[str, ...], npt.NDArray[np.bool_]] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    # ------------------------------------------------------------------ queries

    def spec_mask(self, spec: tuple[str, ...]) -> npt.NDArray[np.bool_]:
        """Nodes with GPUs of a model ``spec`` allows (any model for an empty spec)."""
        m = self._spec_masks.get(spec)
        if m is None:
            allowed = np.array([not spec or model in spec for model in self.models], dtype=bool)
            m = (self.n_gpus > 0) & (allowed[self.model_idx] if self.models else False)
            self._spec_masks[spec] = m
        return m

    def feasible(self, pod: Pod) -> IntArray:
        """Indices (= ranks) of the nodes that can take ``pod`` now, ascending."""
        ok = (self.cpu_free >= pod.cpu_milli) & (self.mem_free >= pod.memory_mib)
        if pod.num_gpu > 0:
            ok &= self.spec_mask(pod.gpu_spec)
            if pod.num_gpu == 1:
                ok &= self.max_free >= pod.gpu_milli
            elif pod.gpu_milli == GPU_MILLI:
                ok &= self.full >= pod.num_gpu
            else:
                ok &= (self.gpu_free >= pod.gpu_milli).sum(axis=1) >= pod.num_gpu
        return np.flatnonzero(ok)

    def whole_gpus(self, n: int, count: int) -> tuple[int, ...]:
        """The ``count`` lowest-indexed fully free GPUs of node ``n``."""
        return tuple(int(g) for g in np.flatnonzero(self.gpu_free[n] == GPU_MILLI)[:count])

    def best_fit_gpu(self, n: int, milli: int) -> int:
        """The GPU with the least free milli that is still >= ``milli`` (ties: lowest index)."""
        row = self.gpu_free[n]
        cand = np.where(row >= milli, row, GPU_MILLI + 1)
        return int(np.argmin(cand))

    def first_gpu_with(self, n: int, values: Sequence[int]) -> int:
        """The lowest-indexed GPU of node ``n`` whose free milli is one of ``values``."""
        for g in range(int(self.n_gpus[n])):
            if int(self.gpu_free[n, g]) in values:
                return g
        raise ValueError(f"node {self.nodes[n].name} has no GPU with free milli in {values}")

    def default_gpus(self, n: int, pod: Pod) -> tuple[int, ...]:
        """GPU choice both baselines share: none, the lowest free whole GPUs, or best fit."""
        if pod.num_gpu == 0:
            return ()
        if pod.gpu_milli == GPU_MILLI:
            return self.whole_gpus(n, pod.num_gpu)
        if pod.num_gpu == 1:
            return (self.best_fit_gpu(n, pod.gpu_milli),)
        row = self.gpu_free[n]
        return tuple(int(g) for g in np.flatnonzero(row >= pod.gpu_milli)[: pod.num_gpu])

    @property
    def cluster_frag(self) -> float:
        return float(self.F.sum())

    # ------------------------------------------------------------------ update

    def place(self, n: int, pod: Pod, gpus: Sequence[int]) -> None:
        """Bind ``pod`` to node ``n`` on ``gpus`` (one index per requested GPU)."""
        if len(gpus) != pod.num_gpu or len(set(gpus)) != len(gpus):
            raise ValueError(f"pod {pod.name}: needs {pod.num_gpu} distinct GPUs, got {gpus}")
        self.cpu_free[n] -= pod.cpu_milli
        self.mem_free[n] -= pod.memory_mib
        row = self.gpu_free[n]
        for g in gpus:
            if not 0 <= g < self.n_gpus[n] or row[g] < pod.gpu_milli:
                raise ValueError(f"pod {pod.name}: GPU {g} of {self.nodes[n].name} cannot take it")
            row[g] -= pod.gpu_milli
        if self.cpu_free[n] < 0 or self.mem_free[n] < 0:
            raise ValueError(f"pod {pod.name}: node {self.nodes[n].name} lacks CPU or memory")
        if gpus:
            k = int(self.n_gpus[n])
            self.idle[n] -= pod.total_gpu_milli
            self.max_free[n] = row[:k].max()
            self.full[n] = int((row[:k] == GPU_MILLI).sum())
            self.frees[n] = tuple(sorted(int(v) for v in row[:k]))
            self.used_milli += pod.total_gpu_milli
        self.F[n] = self.frag_model.frag(self.frag_class[n], int(self.cpu_free[n]), self.frees[n])
        self.version[n] += 1
