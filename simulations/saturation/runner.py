"""Every row of the GPU-share saturation table by name, in the protocol it belongs to.

Two protocols answer two questions on the same arrivals (fgd.md §2 sampling, seeds, 130 %):

* **scheduler** (:mod:`simulations.saturation.protocol`, the FGD paper's): the policy places every
  pod, CPU-only pods too, on GPU shares in milli -- what a GPU-share *scheduler* packs.  Rows
  ``bestfit``, ``fgd`` (the paper's baselines, re-implemented) and ``fgd-waste`` (a what-if
  rule, :mod:`simulations.saturation.policies.fgd_waste`).
* **partitioner** (:mod:`simulations.saturation.mps_rules`): kube-scheduler places the CPU-only pods
  (a stand-in chosen by ``cpu_scheduler``: FGD's BestFit by default, or kube-scheduler's
  default or bin-packing profile), GPU pods get MPS slices, and a rule or the planner places them -- what gpuslice,
  which places only GPU pods, packs in production.  Rows ``gpuslice`` (:func:`planner.plan` on
  each arrival batch, :func:`simulations.saturation.partitioned.run_planned`, the production
  decision), and the baselines ``mps:bestfit``, ``mps:fgd``, ``mps:fgd-waste`` (the same rules
  scoring every node, for the comparison under the same condition).

:func:`run_policy` runs one row by name; :data:`ROWS` lists them in table order.
"""

from __future__ import annotations

from planner.snapshot import Mode
from simulations.inputs.cluster import Cluster
from simulations.inputs.workload import Workload
from simulations.saturation.mps_rules import RULES, run_rule
from simulations.saturation.partitioned import CpuScheduler, run_planned
from simulations.saturation.policies import POLICIES
from simulations.saturation.protocol import Progress, SaturationResult, run_saturation

__all__ = ["GPUSLICE", "ROWS", "cpu_scheduler_of", "protocol_of", "run_policy"]

GPUSLICE = "gpuslice"
"""The production row: :func:`planner.plan` on MPS slices."""
_MPS_PREFIX = "mps:"
ROWS: tuple[str, ...] = (
    *POLICIES,
    *(f"{_MPS_PREFIX}{r}" for r in RULES),
    GPUSLICE,
)
"""Every row, scheduler protocol first (module docstring)."""


def protocol_of(name: str) -> str:
    """``scheduler`` or ``partitioner`` (module docstring); ``ValueError`` for an unknown row."""
    key = name.lower()
    if key in POLICIES:
        return "scheduler"
    if key == GPUSLICE or (key.startswith(_MPS_PREFIX) and key[len(_MPS_PREFIX) :] in RULES):
        return "partitioner"
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(ROWS)}")


def cpu_scheduler_of(name: str) -> CpuScheduler:
    """The :class:`~simulations.saturation.partitioned.CpuScheduler` called ``name``;
    ``ValueError`` naming the choices otherwise."""
    try:
        return CpuScheduler(name.lower())
    except ValueError:
        choices = ", ".join(c.value for c in CpuScheduler)
        raise ValueError(f"unknown CPU scheduler {name!r}; choose one of {choices}") from None


def run_policy(
    cluster: Cluster,
    workload: Workload,
    name: str,
    seed: int,
    *,
    batch: int = 1,
    progress: Progress | None = None,
    cpu_scheduler: str = CpuScheduler.BESTFIT,
) -> SaturationResult:
    """One seed of row ``name`` (module docstring), batches of ``batch`` arrivals;
    ``cpu_scheduler`` (:class:`~simulations.saturation.partitioned.CpuScheduler`) places the
    CPU-only pods of a partitioner-protocol row (``ValueError`` for another value, or for
    anything but ``bestfit`` on a scheduler-protocol row, whose policy places every pod)."""
    key = name.lower()
    protocol = protocol_of(key)
    cpu = cpu_scheduler_of(cpu_scheduler)
    if protocol == "scheduler" and cpu is not CpuScheduler.BESTFIT:
        raise ValueError(
            f"row {name!r} places every pod itself (the FGD paper's protocol); "
            f"--cpu-scheduler {cpu.value} applies to the partitioner protocol's rows only"
        )
    if protocol == "scheduler":
        result = run_saturation(cluster, workload, key, seed, batch=batch, progress=progress)
    elif cluster.total_gpus == 0:
        raise ValueError(
            f"cluster {cluster.name!r} has no GPUs: the saturation protocol needs some"
        )
    elif key == GPUSLICE:
        result = run_planned(
            cluster,
            workload,
            Mode.MPS,
            "mps-memory",
            seed,
            batch=batch,
            label=GPUSLICE,
            progress=progress,
            cpu_scheduler=cpu,
        )
    else:
        rule = key[len(_MPS_PREFIX) :]
        result = run_rule(
            cluster, workload, rule, seed, batch=batch, progress=progress, cpu_scheduler=cpu
        )
    result.extra["protocol"] = protocol
    return result
