"""GPU catalog lookups: product labels, PCI ids, exact profile names, user override files."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.catalog_files import load_catalog
from planner.catalog import CatalogError, UnknownGpuModel, UnknownProfile, default_catalog

CAT = default_catalog()


@pytest.mark.parametrize(
    ("label", "model"),
    [
        ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
        ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "A100-SXM4-80GB"),
        ("NVIDIA-A100-SXM4-80GB-SHARED", "A100-SXM4-80GB"),
    ],
)
def test_product_label_lookup(label: str, model: str) -> None:
    assert CAT.model_for_product(label).name == model


@pytest.mark.parametrize("pci", ["0x20B210DE", "20b2", "10de:20b2"])
def test_pci_id_lookup(pci: str) -> None:
    assert CAT.model_for_pci_id(pci).name == "A100-SXM4-80GB"


def test_a30_pci_id() -> None:
    assert CAT.model_for_pci_id("20B7").name == "A30"


@pytest.mark.parametrize(
    ("model", "name", "resolved"),
    [
        ("A100-SXM4-80GB", "nvidia.com/mig-1g.10gb", "1g.10gb"),
        ("A100-SXM4-80GB", "1G.10GB", "1g.10gb"),
        ("A100-SXM4-80GB", "1g.10gb+me", "1g.10gb+me"),
        ("A100-SXM4-80GB", "nvidia.com/mig-1g.10gb.me", "1g.10gb+me"),
        ("RTX-PRO-6000-Blackwell", "2g.48gb.gfx", "2g.48gb+gfx"),
    ],
)
def test_profile_names_resolve_in_both_spellings(model: str, name: str, resolved: str) -> None:
    assert CAT.model(model).profile(name).name == resolved


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("A100-SXM4-80GB", "7g.79gb"),  # a 535.x driver's spelling: needs a catalog override
        ("A100-SXM4-80GB", "3g.39gb"),
        ("GB200", "1g.24gb"),
        ("H100-NVL", "1g.10gb"),  # another model's profile of the same shape
        ("A100-SXM4-40GB", "2g.12gb"),  # A30's 2g: more memory than A100-40GB's 2g.10gb
    ],
)
def test_names_of_other_models_or_drivers_do_not_resolve(model: str, name: str) -> None:
    with pytest.raises(UnknownProfile, match=r"Names must match exactly.*catalog override"):
        CAT.model(model).profile(name)


def test_a_driver_spelling_named_in_an_override_resolves_and_is_advertised(tmp_path: Path) -> None:
    f = tmp_path / "a100-535.yaml"
    f.write_text(
        """
models:
  - name: A100-SXM4-80GB
    geometry: ampere-hopper-8
    memory_mib: 81920
    product_aliases: [NVIDIA-A100-SXM4-80GB]
    profiles:
      1g: {name: 1g.10gb, memory_mib: 9728}
      7g: {name: 7g.79gb, memory_mib: 80896}
"""
    )
    a100 = load_catalog([f]).model("A100-SXM4-80GB")
    assert a100.profile("nvidia.com/mig-7g.79gb").resource == "nvidia.com/mig-7g.79gb"
    with pytest.raises(UnknownProfile):
        a100.profile("7g.80gb")


def test_unknown_model_and_profile_are_clear_errors() -> None:
    with pytest.raises(UnknownGpuModel, match=r"unknown GPU model 'Z9000'.*override file"):
        CAT.model_for_product("Z9000")
    with pytest.raises(UnknownGpuModel, match="PCI device id"):
        CAT.model_for_pci_id("ffff")
    with pytest.raises(UnknownProfile, match=r"does not exist on A100-SXM4-80GB; its profiles"):
        CAT.model("A100-SXM4-80GB").profile("1g.40gb")
    with pytest.raises(UnknownProfile, match="not of the form"):
        CAT.model("A100-SXM4-80GB").profile("banana")


def test_profile_ids_differ_between_families() -> None:
    assert CAT.model("A30").profile("1g.6gb").profile_id == 14
    assert CAT.model("A100-SXM4-80GB").profile("2g.20gb").profile_id == 14


def test_user_override_file_adds_and_replaces_models(tmp_path: Path) -> None:
    f = tmp_path / "extra.yaml"
    f.write_text(
        """
models:
  - name: A100-SXM4-80GB
    geometry: ampere-hopper-8
    memory_mib: 81000
    product_aliases: [NVIDIA-A100-SXM4-80GB]
    profiles:
      1g: {name: 1g.10gb, memory_mib: 9700}
      7g: {name: 7g.79gb, memory_mib: 80000}
  - name: MY-GPU
    memory_mib: 12000
    pci_device_ids: ["ABCD"]
"""
    )
    cat = load_catalog([f])
    a100 = cat.model_for_product("NVIDIA-A100-SXM4-80GB")
    assert a100.memory_mib == 81000
    assert [p.name for p in a100.profiles] == ["1g.10gb", "7g.79gb"]
    assert cat.model_for_pci_id("abcd").name == "MY-GPU"
    assert not cat.model("MY-GPU").mig_capable
    assert cat.model("A30").memory_mib == CAT.model("A30").memory_mib


def test_bad_override_files_name_the_problem(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("models:\n  - name: X\n    geometry: nope\n    memory_mib: 1\n")
    with pytest.raises(CatalogError, match="unknown geometry 'nope'"):
        load_catalog([f])
    with pytest.raises(CatalogError, match="cannot read catalog override file"):
        load_catalog([tmp_path / "missing.yaml"])


def test_max_gpus_per_node_is_16_and_an_override_file_may_change_it(tmp_path: Path) -> None:
    assert CAT.max_gpus_per_node == 16
    f = tmp_path / "big.yaml"
    f.write_text("max_gpus_per_node: 32\nmodels: []\n")
    assert load_catalog([f]).max_gpus_per_node == 32
    assert load_catalog([f]).model("A30").name == "A30"  # the built-in models stay
    f.write_text("max_gpus_per_node: 0\nmodels: []\n")
    with pytest.raises(CatalogError, match="max_gpus_per_node must be an integer from 1"):
        load_catalog([f])
