"""Kubernetes resource quantities as the API server stores them, and compared by value.

Model
-----
The API server parses every ``resource.Quantity`` it is sent and stores and answers it in
*canonical form* (apimachinery ``Quantity.CanonicalizeBytes``), keeping only the value and the
format family of the input:

* zero is ``"0"``;
* *binary SI* input (``Ki Mi Gi Ti Pi Ei``) whose value is an integer of magnitude at least
  1024 is written with the largest binary suffix that divides it exactly: ``40960Mi`` ->
  ``40Gi``, ``81559Mi`` stays, ``1024`` bytes given as ``1Ki`` -> ``1Ki``;
* any other value -- binary input below 1024 in magnitude (``0.5Ki`` -> ``512``), and
  *decimal SI* input (no suffix, ``k M G T P E``, ``m u n``) -- in decimal SI: the mantissa
  stripped of trailing zeros into an exponent that is a multiple of 3 (``1000`` -> ``1k``,
  ``1500`` -> ``1500``, ``2000000`` -> ``2M``, ``7`` -> ``7``).

So a manifest that writes ``"40960Mi"`` reads back ``"40Gi"``: comparing the two as strings
says they differ.  :func:`canonical_bytes` and :func:`canonical_count` write integers in the
canonical form of their family (what the server answers, so a read-back equals what was
sent), and :func:`quantity_value` reads any quantity string to its exact value, for comparing
quantities whatever form either side holds.
"""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["SUFFIX_FACTORS", "ascii_count", "canonical_bytes", "canonical_count", "quantity_value"]

_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL = {0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
SUFFIX_FACTORS = {
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
"""What each quantity suffix multiplies by (the partitioner's request parser shares it)."""
_QUANTITY = re.compile(
    r"(?P<num>[+-]?(?:\d+\.?\d*|\.\d+))(?:(?P<exp>[eE][+-]?\d+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]))?"
)


def canonical_count(value: int) -> str:
    """Integer ``value`` (decimal SI) as the API server stores it: ``1000`` -> ``"1k"``."""
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    n, exponent = abs(value), 0
    while n >= 10 and n % 10 == 0:
        n //= 10
        exponent += 1
    n *= 10 ** (exponent % 3)  # the exponent down to a multiple of 3
    exponent -= exponent % 3
    if exponent not in _DECIMAL:  # beyond int64 (the server stores none): plain digits
        return f"{value}"
    return f"{sign}{n}{_DECIMAL[exponent]}"


def canonical_bytes(value: int) -> str:
    """Integer ``value`` given in binary SI (``<n>Mi``) as the API server stores it: the
    largest exact binary suffix (``40960 * 2**20`` -> ``"40Gi"``), decimal below 1024."""
    if -1024 < value < 1024:
        return canonical_count(value)
    sign = "-" if value < 0 else ""
    n, exponent = abs(value), 0
    while n % 1024 == 0 and exponent < len(_BINARY) - 1:
        n //= 1024
        exponent += 1
    return f"{sign}{n}{_BINARY[exponent]}"


def quantity_value(text: object) -> Decimal | None:
    """The exact value of quantity ``text`` (``"40Gi"`` and ``"40960Mi"`` alike; an int as
    itself); ``None`` when it is not a quantity."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return Decimal(text)
    if not isinstance(text, str):
        return None
    m = _QUANTITY.fullmatch(text.strip())
    if m is None:
        return None
    try:
        number = Decimal(m.group("num"))
        if m.group("exp"):
            return number.scaleb(int(m.group("exp")[1:]))
        return number * SUFFIX_FACTORS[m.group("suffix") or ""]
    except (ArithmeticError, ValueError):  # decimal's InvalidOperation, Overflow
        return None


_ASCII_COUNT = re.compile(r"[0-9]{1,18}")


def ascii_count(text: str) -> int | None:
    """A count written as text (a label, an annotation, a plan id): ASCII digits only, at most
    18 of them, else ``None`` (``str.isdigit`` also takes ``²``, which ``int`` refuses, and
    ``int`` takes other scripts' digits and ``_``)."""
    return int(text) if _ASCII_COUNT.fullmatch(text) else None
