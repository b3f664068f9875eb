"""``freeCapacity.migProfiles`` naming a profile no GPU model has is refused at start-up (a
review's finding: a typo was accepted without a word and made every free MIG instance worth
nothing to the planner)."""

from __future__ import annotations

import pytest

from partitioner.settings import PartitionerSettings
from planner.catalog import CatalogError, default_catalog

CAT = default_catalog()


@pytest.mark.parametrize("value", ["9g.99gb:1", "7g.80gb:2,1g.11gb:1"])
def test_an_unknown_target_profile_is_refused_naming_the_closest(value: str) -> None:
    settings = PartitionerSettings(free_capacity_mig_profiles=value)
    with pytest.raises(CatalogError, match="no GPU model of the catalog has") as e:
        settings.decide_config(CAT)
    assert "closest" in str(e.value) and "7g.80gb'" not in str(e.value)


@pytest.mark.parametrize("value", ["7g.80gb:1", "1g.10gb+me:1,3g.40gb:2", None])
def test_known_target_profiles_start(value: str | None) -> None:
    config = PartitionerSettings(free_capacity_mig_profiles=value).decide_config(CAT)
    assert config.catalog is CAT
