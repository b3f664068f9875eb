"""Creation and deletion times for a trace that has none, borrowed from a sibling trace.

openb's ``multigpu20`` lists the ``default`` trace's pods (same names, same requests) plus extra
multi-GPU pods, with no time columns; the time replay needs a timeline.  :func:`borrow_times`
gives each pod without times:

* the times of the pod of the same name in the reference trace when it has them (for
  ``multigpu20``: every pod the two traces share);
* else the creation time and lifetime of a reference pod drawn at random (``random.Random(seed)``,
  uniformly among the reference's GPU pods with times, one draw per pod in file order), so the
  extra pods arrive like the reference's pods do and live as long.

Pods that already have times keep them.  The rule is deterministic for a seed, and documented
where it is used (``python -m simulations.bench_replay`` prints ``times_from`` in its JSON).
"""

from __future__ import annotations

import random
from dataclasses import replace

from simulations.inputs.workload import Pod, Workload

__all__ = ["TimelineError", "borrow_times", "has_times"]


class TimelineError(ValueError):
    """The reference trace cannot lend times (it has none either)."""


def has_times(workload: Workload) -> bool:
    """Every GPU pod carries a creation time."""
    return all(p.creation_time is not None for p in workload.pods if not p.is_cpu_only)


def borrow_times(workload: Workload, reference: Workload, seed: int = 0) -> Workload:
    """``workload`` with times for its pods that lack them (module docstring)."""
    timed = {p.name: p for p in reference.pods if p.creation_time is not None}
    donors = [p for p in reference.pods if p.creation_time is not None and not p.is_cpu_only]
    if not donors:
        raise TimelineError(
            f"reference trace {reference.name!r} has no GPU pod with a creation time to borrow"
        )
    rng = random.Random(seed)
    pods: list[Pod] = []
    for pod in workload.pods:
        if pod.creation_time is not None:
            pods.append(pod)
            continue
        same = timed.get(pod.name)
        donor = same if same is not None else donors[rng.randrange(len(donors))]
        pods.append(
            replace(
                pod,
                creation_time=donor.creation_time,
                deletion_time=donor.deletion_time,
                scheduled_time=donor.scheduled_time,
            )
        )
    return replace(
        workload, pods=tuple(pods), source=f"{workload.source}; times from {reference.name}"
    )
