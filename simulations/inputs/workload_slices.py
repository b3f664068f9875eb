"""Replaying pods that ask for slices by name: their requests checked against the cluster.

Model
-----
A pod exported from a real cluster asks for MIG profiles or MPS sizes by resource name
(:attr:`simulations.inputs.workload.Pod.slices`).  The time replay passes those requests to the
simulated cluster *as they are*: no gpu_milli mapping is involved.  They must be requests the
replayed cluster's GPUs can serve, so :func:`direct_requests` checks every such pod against the
cluster's GPU model and partitioning mode when all its GPU nodes share one of each (on hybrid
and mixed-model clusters the replay checks each request against every node kind itself,
:mod:`simulations.replay.engine`):

* ``nvidia.com/mig-<profile>`` needs nodes in ``mig`` mode and
  a profile of *that* model, spelled as the catalog names it (:meth:`planner.catalog.GpuModel.
  profile`: ``1g.10gb`` is an A100-80GB/H100-80GB profile, ``1g.5gb`` an A100-40GB one).  The
  name comes back in the exact spelling the simulated agent advertises.
* ``nvidia.com/gpu-<N>gb`` needs nodes in ``mps`` mode and at most the GiB one GPU offers to MPS
  slices (its memory minus the MPS server reserve).

Every pod that fails is listed (up to :data:`MAX_LISTED`, then a count) in one
:class:`SliceRequestError` naming the pod, the resource and the fix: change the cluster file's
``gpu_model``/``mode``, or rename the resource when exporting (``gpuslice export
--map-resource FROM=TO``).  Nothing is dropped silently.

Pods that ask for GPU *shares* (``num_gpu``/``gpu_milli``, whole GPUs included) are not this
module's: the replay maps them with :mod:`simulations.inputs.mapping` as before.  The saturation
protocol places shares only; :func:`require_shares` refuses a workload with slice pods there.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.catalog import CatalogError, GpuModel
from planner.snapshot import Mode, mig_profile_of, mps_gb_of
from simulations.inputs.workload import Pod, Workload, WorkloadError

__all__ = ["MAX_LISTED", "SliceRequestError", "direct_requests", "require_shares"]

MAX_LISTED = 10
"""Problems listed in one error; the rest are counted."""


class SliceRequestError(WorkloadError):
    """Pods whose slice requests the replayed cluster cannot serve (each named, with the fix)."""


def _profiles(model: GpuModel) -> str:
    return ", ".join(p.name for p in model.profiles if not p.variant)


def _resolve(
    pod: Pod, resource: str, model: GpuModel, mode: Mode, mps_gpu_gb: int
) -> tuple[str, str]:
    """(the advertised spelling of ``resource``, problem or ``""``)."""
    profile = mig_profile_of(resource)
    if profile is not None:
        if mode is Mode.MPS:
            return resource, (
                f"asks for {resource}, a MIG instance, but the cluster's {model.name} nodes are "
                "in mps mode: replay it on a cluster file whose pool has mode: mig"
            )
        try:
            return model.profile(profile).resource, ""
        except CatalogError:
            return resource, (
                f"asks for {resource}, which is not a MIG profile of {model.name} (its profiles: "
                f"{_profiles(model)}): set the cluster file's gpu_model to the GPU that has it, "
                f"or export again with --map-resource {resource}=nvidia.com/mig-<profile>"
            )
    gb = mps_gb_of(resource)
    if gb is not None:
        if mode is not Mode.MPS:
            return resource, (
                f"asks for {resource}, an MPS slice, but the cluster's {model.name} nodes are in "
                f"{mode.value} mode: replay it on a cluster file whose pool has mode: mps"
            )
        if gb > mps_gpu_gb:
            return resource, (
                f"asks for {resource}, more than the {mps_gpu_gb} GiB one {model.name} offers to "
                "MPS slices: use a GPU model with more memory in the cluster file"
            )
        return resource, ""
    return resource, f"asks for {resource}, which is neither a MIG nor an MPS resource"


def direct_requests(
    pods: Iterable[Pod], model: GpuModel, mode: Mode, mps_reserve_mib: int
) -> dict[str, dict[str, int]]:
    """Pod name -> its slice requests in the advertised spelling, for the pods with slices.

    Raises :class:`SliceRequestError` listing every pod the cluster (``model`` in ``mode``)
    cannot serve (module docstring).
    """
    mps_gpu_gb = max(0, model.memory_mib - mps_reserve_mib) // 1024
    out: dict[str, dict[str, int]] = {}
    problems: list[str] = []
    for pod in pods:
        if not pod.slices:
            continue
        requests: dict[str, int] = {}
        for resource, count in pod.slices:
            name, problem = _resolve(pod, resource, model, mode, mps_gpu_gb)
            if problem:
                problems.append(f"pod {pod.name!r} {problem}")
            requests[name] = requests.get(name, 0) + count
        out[pod.name] = requests
    if problems:
        more = len(problems) - MAX_LISTED
        listed = "; ".join(problems[:MAX_LISTED])
        raise SliceRequestError(
            f"{len(problems)} slice request(s) the cluster cannot serve: {listed}"
            + (f"; and {more} more" if more > 0 else "")
        )
    return out


def require_shares(workload: Workload, protocol: str) -> None:
    """Refuse a workload with slice pods in a protocol that places GPU shares only."""
    pods = workload.slice_pods
    if pods:
        first = pods[0]
        raise SliceRequestError(
            f"workload {workload.name!r}: {len(pods)} pod(s) ask for slices by name (e.g. "
            f"{first.name!r}: {', '.join(r for r, _ in first.slices)}); the {protocol} protocol "
            "places GPU shares (gpu_milli) only: use --protocol time-replay"
        )
