"""Catalog override files that would make one name mean two things are refused, naming the
model and the fix; GFD's ``Tesla-`` product strings resolve like ``NVIDIA-`` ones.

Each case loaded silently before: a model with MIG profiles and no geometry became MPS-only;
two shapes of one model with one name resolved differently in the planner and the rejection
path; an override claiming a built-in model's product label made the partitioner (by label)
and the agent (by PCI id) name one GPU two ways."""

from __future__ import annotations

import json

import pytest

from planner.catalog import CatalogError, default_catalog, parse_catalog

BASE = default_catalog()


def override(**model: object) -> str:
    body = {"name": "MY-GPU", "memory_mib": 81920, **model}
    return json.dumps({"models": [body]})


def test_profiles_without_a_geometry_are_refused() -> None:
    text = override(profiles={"1g": {"name": "1g.10gb", "memory_mib": 9984}})
    with pytest.raises(CatalogError, match=r"MY-GPU.*lists MIG profiles but no 'geometry'"):
        parse_catalog(text, "o.json", BASE)


def test_two_shapes_with_one_name_are_refused() -> None:
    text = override(
        geometry="ampere-hopper-8",
        profiles={
            "1g": {"name": "1g.10gb", "memory_mib": 9984},
            "1g.2m": {"name": "1g.10gb", "memory_mib": 19968},
        },
    )
    with pytest.raises(CatalogError, match=r"shapes 1g and 1g.2m are both named '1g.10gb'"):
        parse_catalog(text, "o.json", BASE)


def test_a_label_or_pci_id_of_another_model_is_refused_and_a_same_name_override_is_not() -> None:
    with pytest.raises(CatalogError, match=r"MY-GPU: A100-SXM4-80GB already name"):
        parse_catalog(override(product_aliases=["A100-SXM4-80GB"]), "o.json", BASE)
    with pytest.raises(CatalogError, match=r"MY-GPU: 20B2 already name"):
        parse_catalog(override(pci_device_ids=["20B2"]), "o.json", BASE)
    same = json.dumps(
        {"models": [{"name": "A100-SXM4-80GB", "memory_mib": 81920,
                     "product_aliases": ["A100-SXM4-80GB"], "pci_device_ids": ["20B2"]}]}
    )  # fmt: skip
    assert parse_catalog(same, "o.json", BASE).model("A100-SXM4-80GB").profiles == ()


@pytest.mark.parametrize(
    ("label", "model"),
    [
        ("Tesla-V100S-PCIE-32GB", "V100-32GB"),
        ("Tesla-V100-SXM3-32GB", "V100-32GB"),
        ("Tesla-V100-SXM2-16GB", "V100-16GB"),
        ("Tesla-T4", "T4"),
        ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB"),
    ],
)
def test_tesla_product_strings_resolve(label: str, model: str) -> None:
    assert BASE.model_for_product(label).name == model
    assert BASE.model_for_pci_id("1DB8").name == "V100-32GB"
