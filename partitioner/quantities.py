"""Kubernetes resource quantities and pod resource requests, read from plain API objects.

A quantity is a decimal number with an optional suffix: binary (``Ki Mi Gi Ti Pi Ei``),
decimal (``k M G T P E``), milli (``m``) or an exponent (``1e3``).  The scheduler's rule for a
pod's effective request of one resource is ``max(sum over containers, max over init
containers)``, where sidecars (init containers with ``restartPolicy: Always``) count with the
containers and with every init container after them; extended resources (``nvidia.com/...``)
may be given as limits only, in which case the limit is the request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["QuantityError", "cpu_milli", "memory_mib", "parse_quantity", "pod_requests"]

_SUFFIX = {
    "Ki": Decimal(1024),
    "Mi": Decimal(1024) ** 2,
    "Gi": Decimal(1024) ** 3,
    "Ti": Decimal(1024) ** 4,
    "Pi": Decimal(1024) ** 5,
    "Ei": Decimal(1024) ** 6,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)(?P<suffix>[KMGTPE]i|[numkMGTPE])?$"
)


class QuantityError(ValueError):
    """A resource quantity string is malformed."""


def parse_quantity(value: object) -> Decimal:
    """``"100m"`` -> 0.1, ``"1Gi"`` -> 1073741824, ``2`` -> 2."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if m is None:
        raise QuantityError(f"malformed resource quantity {value!r} (e.g. '500m', '2', '1Gi')")
    try:
        return Decimal(m.group("num")) * _SUFFIX[m.group("suffix") or ""]
    except InvalidOperation as e:  # pragma: no cover - the regex admits only valid decimals
        raise QuantityError(f"malformed resource quantity {value!r}") from e


def cpu_milli(value: object) -> int:
    return int((parse_quantity(value) * 1000).to_integral_value(rounding="ROUND_CEILING"))


def memory_mib(value: object) -> int:
    return int((parse_quantity(value) / (1024 * 1024)).to_integral_value(rounding="ROUND_CEILING"))


def _container_requests(container: Mapping[str, Any]) -> dict[str, Decimal]:
    res = container.get("resources") or {}
    out = {k: parse_quantity(v) for k, v in (res.get("limits") or {}).items()}
    out.update({k: parse_quantity(v) for k, v in (res.get("requests") or {}).items()})
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
    for k, v in (spec.get("overhead") or {}).items():
        total[k] = total.get(k, Decimal(0)) + parse_quantity(v)
    return total
