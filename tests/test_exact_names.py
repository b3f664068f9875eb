"""Exact resource names: every catalog model x every profile name of every model.

A pod is planned only onto an instance whose advertised resource name equals its request.  For
each model of the catalog and each MIG profile name any GPU has (the catalog's and the facts
sheet's, in NVML's ``+`` spelling and the resource's ``.`` spelling), the name resolves on the
model iff the facts sheet (``tests/mig_facts.py``) lists it for that model; the resolved
profile's resource name is the request; and the node agent advertises an instance of that
profile under exactly that name.
"""

from __future__ import annotations

import pytest
from mig_facts import MODELS, names_of, resource_name

from contract.nodepartitioning import ActualGpu, ActualMigInstance
from node_agent.devices import advertised_devices
from planner.catalog import UnknownProfile, default_catalog

CAT = default_catalog()
ALL_NAMES = sorted(
    {p.name for m in CAT.models for p in m.profiles}
    | {name for model in MODELS for name in names_of(model)}
)
SPELLINGS = sorted({n for name in ALL_NAMES for n in (name, name.replace("+", "."))})


def test_the_oracle_knows_every_mig_model_of_the_catalog() -> None:
    mig_models = {m.name for m in CAT.models if m.mig_capable}
    assert mig_models == set(MODELS), "update tests/mig_facts.py from shared/facts/mig.md"
    assert len(SPELLINGS) > 60  # the loop below covers every name of every model


@pytest.mark.parametrize("model_name", [m.name for m in CAT.models])
def test_a_name_resolves_only_on_its_own_model_and_is_advertised_as_asked(model_name: str) -> None:
    model = CAT.model(model_name)
    own = names_of(model_name)
    spelled = {n.replace("+", "."): n for n in own} | {n: n for n in own}
    resolved = 0
    for spelling in SPELLINGS:
        request = "nvidia.com/mig-" + spelling
        canonical = spelled.get(spelling)
        if canonical is None:
            with pytest.raises(UnknownProfile):
                model.profile(request)
            continue
        profile = model.profile(request)
        resolved += 1
        assert profile.name == canonical
        assert profile.compute == own[canonical].compute
        assert profile.memory_slices == own[canonical].memory_slices
        assert profile.resource == resource_name(canonical) == request.replace("+", ".")
        gpu = ActualGpu(
            index=0,
            uuid="GPU-0",
            model=model.name,
            migEnabled=True,
            mig=[ActualMigInstance(profile=profile.name, start=0, deviceId="MIG-0", used=False)],
        )
        advertised = advertised_devices([gpu], mps_pipe_root="/run/nvidia/mps")
        assert list(advertised) == [resource_name(canonical)]
    assert resolved == len(spelled)  # every spelling of every own name, nothing else
