"""How gpuslice's DRA driver names its devices: one rule for the agent that publishes them
and the partitioner that reads which ones kube-scheduler allocated.

A device is a whole GPU, ``gpu<i>``, or a MIG placement, ``gpu<i>-<profile>-s<start>`` with
the profile name lower-cased, ``-`` turned into ``--`` and then ``.`` and ``+`` into ``-`` (a
DNS label), e.g. ``gpu0-3g-40gb-s4``, ``gpu1-1g-10gb-me-s6`` (``1g.10gb+me``) or
``gpu0-1g-24gb--me-s3`` (RTX PRO's ``1g.24gb-me``, which must not be named like
``1g.24gb+me``); the catalog refuses a model two of whose profiles would get one name
(:func:`planner.catalog.profile_label`, the rule itself).
"""

from __future__ import annotations

from planner.catalog import profile_label

__all__ = ["dns_label", "placement_device_name"]


def dns_label(text: str) -> str:
    """``text`` (a MIG profile name) as a DNS label part (:func:`planner.catalog.profile_label`:
    lower case, ``-`` as ``--``, ``.`` and ``+`` as ``-``)."""
    return profile_label(text)


def placement_device_name(gpu: int, profile: str | None = None, start: int = 0) -> str:
    """``gpu0`` (whole GPU, ``profile`` None) or ``gpu0-3g-40gb-s4`` (a placement)."""
    return f"gpu{gpu}" if profile is None else f"gpu{gpu}-{dns_label(profile)}-s{start}"
