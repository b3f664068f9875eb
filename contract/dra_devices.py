"""How gpuslice's DRA driver names its devices: one rule for the agent that publishes them
and the partitioner that reads which ones kube-scheduler allocated.

A device is a whole GPU, ``gpu<i>``, or a MIG placement, ``gpu<i>-<profile>-s<start>`` with
the profile name lower-cased and ``.`` and ``+`` turned into ``-`` (a DNS label), e.g.
``gpu0-3g-40gb-s4`` or ``gpu1-1g-10gb-me-s6``.
"""

from __future__ import annotations

__all__ = ["dns_label", "placement_device_name"]


def dns_label(text: str) -> str:
    """``text`` as a DNS label part: lower case, ``.`` and ``+`` as ``-``."""
    return text.lower().replace(".", "-").replace("+", "-")


def placement_device_name(gpu: int, profile: str | None = None, start: int = 0) -> str:
    """``gpu0`` (whole GPU, ``profile`` None) or ``gpu0-3g-40gb-s4`` (a placement)."""
    return f"gpu{gpu}" if profile is None else f"gpu{gpu}-{dns_label(profile)}-s{start}"
