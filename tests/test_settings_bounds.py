"""Every numeric setting of the partitioner and the node agent is finite and bounded.

Before, most numbers had only a lower bound: ``inf``, ``1e400`` and integers past int64 started
the process, and then a weight of 2^63 failed every CP-SAT plan, an apply deadline of 1e13 s made
the partitioner write reservations it refused to read back, and an infinite agent Lease length
raised after the agent had started.  Now every numeric field refuses a non-finite value and
anything above :data:`contract.common_settings.MAX_SETTING` (weights: ``MAX_WEIGHT``), naming the
field.
"""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("text", ["2147483647", "2.147483647e+09", "1.5e+09"])
def test_the_seed_takes_its_own_32_bit_range_over_the_generic_cap(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A field's own upper bound decides, wider than :data:`MAX_SETTING` too: the seed is a
    32-bit integer (as ``plan --seed`` and the chart's schema say), also in the float notation
    Helm's ``quote`` prints (before: "must be at most 1e+09" or "unable to parse string as an
    integer", and the partitioner exited 2 at every start)."""
    monkeypatch.setenv("GPUSLICE_PLANNER_SEED", text)
    assert PartitionerSettings().planner_settings().seed == int(float(text))
    monkeypatch.setenv("GPUSLICE_PLANNER_SEED", "2.147483648e+09")
    with pytest.raises(ValidationError, match="less than or equal to 2147483647"):
        PartitionerSettings()


@pytest.mark.parametrize(
    ("env", "text", "message"),
    [
        ("GPUSLICE_WEIGHT_FREE_BLOCK", "2e+06", "less than or equal to 1000000"),
        ("GPUSLICE_MPS_RESERVE_MIB", "2e+09", "must be at most 1e+09"),
        ("GPUSLICE_FREE_CAPACITY_CPU_MILLI", "1e+12", "must be at most 1e+09"),
    ],
)
def test_a_whole_float_over_the_bound_is_refused_naming_the_bound(
    env: str, text: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole number in float notation past the field's bound is read as the number, so the
    refusal names the bound, not "unable to parse string as an integer"."""
    monkeypatch.setenv(env, text)
    with pytest.raises(ValidationError, match=re.escape(message)) as err:
        PartitionerSettings()
    assert "unable to parse" not in str(err.value)
