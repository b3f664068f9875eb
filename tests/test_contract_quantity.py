"""contract.quantity: integers written as kube-apiserver stores them (apimachinery
``Quantity.CanonicalizeBytes``), and quantity strings read to their exact value.

The expected forms are apimachinery's: binary SI of an integer of magnitude 1024 or more takes
the largest exact binary suffix, every other value is decimal SI with an exponent that is a
multiple of 3, zero is ``0``."""

from __future__ import annotations

from decimal import Decimal

import pytest

from contract.quantity import canonical_bytes, canonical_count, quantity_value

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (512, "512"),  # binary below 1024: decimal SI
        (1000, "1k"),
        (1023, "1023"),
        (1024, "1Ki"),
        (1536, "1536"),  # 1.5Ki: no exact binary suffix
        (40960 * MIB, "40Gi"),
        (81920 * MIB, "80Gi"),
        (24576 * MIB, "24Gi"),
        (81559 * MIB, "81559Mi"),
        (5 * 1024 * MIB, "5Gi"),
        (4 * 2**60, "4Ei"),
        (-2048, "-2Ki"),
    ],
)
def test_canonical_bytes(value: int, text: str) -> None:
    assert canonical_bytes(value) == text
    assert quantity_value(text) == value


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1, "1"),
        (7, "7"),
        (10, "10"),
        (100, "100"),
        (1000, "1k"),
        (1500, "1500"),
        (2_000_000, "2M"),
        (123_000, "123k"),
        (-1000, "-1k"),
    ],
)
def test_canonical_count(value: int, text: str) -> None:
    assert canonical_count(value) == text
    assert quantity_value(text) == value


def test_quantity_value() -> None:
    assert quantity_value("40Gi") == quantity_value("40960Mi") == 40 * 1024**3
    assert quantity_value("1e3") == quantity_value("1k") == 1000
    assert quantity_value("500m") == Decimal("0.5")
    assert quantity_value(".5Ki") == 512
    assert quantity_value(3) == 3
    for bad in ("", "Gi", "1x", "abc", True, None, [1]):
        assert quantity_value(bad) is None
