"""Every numeric setting of the partitioner and the node agent is finite and bounded.

Before, most numbers had only a lower bound: ``inf``, ``1e400`` and integers past int64 started
the process, and then a weight of 2^63 failed every CP-SAT plan, an apply deadline of 1e13 s made
the partitioner write reservations it refused to read back, and an infinite agent Lease length
raised after the agent had started.  Now every numeric field refuses a non-finite value and
anything above :data:`contract.common_settings.MAX_SETTING` (weights: ``MAX_WEIGHT``), naming the
field.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from contract.common_settings import MAX_SETTING
from node_agent.settings import AgentSettings
from partitioner.settings import MAX_WEIGHT, PartitionerSettings


def _numeric_fields(cls: type) -> list[str]:
    out = []
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]
        text = str(info.annotation)
        if ("int" in text or "float" in text) and "bool" not in text and "list" not in text:
            out.append(name)
    return out


CASES = [(PartitionerSettings, f) for f in _numeric_fields(PartitionerSettings)] + [
    (AgentSettings, f) for f in _numeric_fields(AgentSettings)
]


def test_the_field_lists_are_the_numeric_settings() -> None:
    names = {f for _, f in CASES}
    assert {"apply_deadline_seconds", "weight_destroy", "lease_poll_seconds"} <= names
    assert "lease_seconds" in names and "resync_seconds" in names


@pytest.mark.parametrize(("cls", "field"), CASES, ids=[f"{c.__name__}.{f}" for c, f in CASES])
@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "9223372036854775808"])
def test_a_non_finite_or_vast_number_is_refused_naming_the_field(
    cls: type, field: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"GPUSLICE_{field.upper()}", value)
    with pytest.raises(ValidationError) as err:
        cls()
    assert field in str(err.value)


def test_the_defaults_and_the_bounds_themselves_are_valid() -> None:
    PartitionerSettings()
    AgentSettings()  # type: ignore[call-arg]
    edge = PartitionerSettings(apply_deadline_seconds=MAX_SETTING, weight_destroy=MAX_WEIGHT)
    assert edge.apply_deadline_seconds == MAX_SETTING and edge.weight_destroy == MAX_WEIGHT
    with pytest.raises(ValidationError, match="weight_destroy"):
        PartitionerSettings(weight_destroy=MAX_WEIGHT + 1)
