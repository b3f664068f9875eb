"""Kubernetes resource quantities and pod resource requests, read from plain API objects.

A quantity is a decimal number with an optional suffix: binary (``Ki Mi Gi Ti Pi Ei``),
decimal (``k M G T P E``), milli (``m``) or an exponent (``1e3``).  The scheduler's rule for a
pod's effective request of one resource is ``max(sum over containers, max over init
containers)``, where sidecars (init containers with ``restartPolicy: Always``) count with the
containers and with every init container after them; extended resources (``nvidia.com/...``)
may be given as limits only, in which case the limit is the request.

The API server stores no quantity above ``2^63 - 1`` in magnitude; a larger one (``1e999999``),
or a value that is neither a string nor a number (``true``, a list), is a :class:`QuantityError`,
never a :mod:`decimal` exception.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, DecimalException
from typing import Any

from contract.quantity import SUFFIX_FACTORS
from planner.snapshot import mig_profile_of

__all__ = [
    "QuantityError",
    "container_slice_conflicts",
    "cpu_milli",
    "memory_mib",
    "parse_quantity",
    "pod_requests",
]

_SUFFIX = SUFFIX_FACTORS
MAX_QUANTITY = Decimal(2**63 - 1)
"""The largest magnitude the API server stores (``int64``)."""
_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)(?P<suffix>[KMGTPE]i|[numkMGTPE])?$"
)


class QuantityError(ValueError):
    """A resource quantity is malformed, not a string or number, or beyond ``2^63 - 1``."""


def _shown(value: object) -> str:
    """``value`` for a message, at most 40 characters (a huge integer by its size)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"(a {value.bit_length():,}-bit integer)"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


def parse_quantity(value: object) -> Decimal:
    """``"100m"`` -> 0.1, ``"1Gi"`` -> 1073741824, ``2`` -> 2."""
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise QuantityError(
            f"resource quantity {_shown(value)} is not a string or a number (e.g. '500m', '2', "
            "'1Gi')"
        )
    if isinstance(value, Decimal):  # parsed already (a sum of :func:`pod_requests`)
        if not value.is_finite():
            raise QuantityError(f"resource quantity {value} is not a number")
        return value
    try:
        if isinstance(value, int):
            number = Decimal(value)
        elif isinstance(value, float):
            number = Decimal(str(value))
        else:
            m = _QUANTITY.match(value.strip())
            if m is None:
                raise QuantityError(
                    f"malformed resource quantity {_shown(value)} (e.g. '500m', '2', '1Gi')"
                )
            number = Decimal(m.group("num")) * _SUFFIX[m.group("suffix") or ""]
        if not number.is_finite():
            raise QuantityError(f"resource quantity {_shown(value)} is not a number")
        if abs(number) > MAX_QUANTITY:
            raise QuantityError(
                f"resource quantity {_shown(value)} is beyond 2^63-1, the largest the API "
                "server stores"
            )
    except DecimalException:  # an exponent past Decimal's range (1e999999Ei)
        raise QuantityError(
            f"resource quantity {_shown(value)} is beyond 2^63-1, the largest the API server stores"
        ) from None
    return number


def cpu_milli(value: object) -> int:
    return int((parse_quantity(value) * 1000).to_integral_value(rounding="ROUND_CEILING"))


def memory_mib(value: object) -> int:
    return int((parse_quantity(value) / (1024 * 1024)).to_integral_value(rounding="ROUND_CEILING"))


def _container_requests(container: Mapping[str, Any]) -> dict[str, Decimal]:
    res = container.get("resources") or {}
    out = {k: parse_quantity(v) for k, v in (res.get("limits") or {}).items()}
    out.update({k: parse_quantity(v) for k, v in (res.get("requests") or {}).items()})
    return out


_POD_LEVEL = ("cpu", "memory")
"""Resources a pod may request for itself (``spec.resources``), besides ``hugepages-*``."""


def container_slice_conflicts(pod: Mapping[str, Any]) -> list[str]:
    """Per container that asks for MIG instances of more than one resource name: the kubelet merges
    the environments its device plugins' ``Allocate`` answers give one container, first one
    wins (``NVIDIA_VISIBLE_DEVICES`` of only one resource, in Go map order), so such a
    container would see one of its slices and hold the other idle.  Words naming each."""
    spec = pod.get("spec") or {}
    out: list[str] = []
    for c in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        if not isinstance(c, Mapping):
            continue
        try:
            asked = _container_requests(c)
        except QuantityError:
            continue  # the pod's requests are refused as malformed elsewhere
        # MIG instances only: a pod's MPS slices are one per pod (planner.demand.one_mps_slice,
        # whose message names the one slice to ask for instead)
        names = sorted(k for k, v in asked.items() if v > 0 and mig_profile_of(k) is not None)
        if len(names) > 1:
            out.append(f"container {c.get('name', '?')!r} asks for {' and '.join(names)}")
    return out


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """The pod's effective request per resource name (the scheduler's rule, overhead added)."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or ():
        for k, v in _container_requests(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    # Sidecars (init containers with ``restartPolicy: Always``) run beside the app containers
    # and the init containers after them: their requests add up (KEP-753).
    sidecars: dict[str, Decimal] = {}
    init: dict[str, Decimal] = {}
    for c in spec.get("initContainers") or ():
        requests = _container_requests(c)
        if c.get("restartPolicy") == "Always":
            for k, v in requests.items():
                total[k] = total.get(k, Decimal(0)) + v
                sidecars[k] = sidecars.get(k, Decimal(0)) + v
            during = dict(sidecars)
        else:
            during = dict(sidecars)
            for k, v in requests.items():
                during[k] = during.get(k, Decimal(0)) + v
        for k, v in during.items():
            init[k] = max(init.get(k, Decimal(0)), v)
    for k, v in init.items():
        total[k] = max(total.get(k, Decimal(0)), v)
    # Pod-level resources (KEP-2837, on by default since Kubernetes 1.34): where the pod sets
    # CPU, memory or hugepages for itself, kube-scheduler counts that instead of its
    # containers' sum (the API server defaults a pod-level request from its limit).
    for k, v in _container_requests(spec).items():
        if k in _POD_LEVEL or k.startswith("hugepages-"):
            total[k] = v
    for k, v in (spec.get("overhead") or {}).items():
        total[k] = total.get(k, Decimal(0)) + parse_quantity(v)
    return total
