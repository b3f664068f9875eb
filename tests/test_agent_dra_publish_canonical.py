"""The ResourceSlice publisher against an API server that stores quantities in canonical form.

Model: kube-apiserver parses every ``resource.Quantity`` and answers it canonicalised
(apimachinery ``CanonicalizeBytes``): binary SI input of an integer value of magnitude 1024 or
more takes the largest exact binary suffix (``40960Mi`` -> ``40Gi``), every other value is
decimal SI with an exponent that is a multiple of 3 (``1000`` -> ``1k``, ``0`` -> ``0``); and it
omits empty fields.  :class:`CanonicalApi` does that (written here from the Go rules, apart from
the agent's :mod:`contract.quantity`).

Checked, over every MIG model of the catalog: after the first publication, later rounds of the
same devices (all of them, or a narrowed and tainted set) write nothing and the pool keeps its
generation; what the agent sends reads back string for string; slices stored in another
spelling of the same values (an older agent's ``40960Mi``, plain bytes) count as unchanged.
"""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any

import pytest

from node_agent.dra_publish import SlicePublisher
from node_agent.dra_slices import DraGpu, device_name
from planner.catalog import GpuModel, default_catalog

CAT = default_catalog()
MIG_MODELS = [m for m in CAT.models if m.mig_capable]

_BIN = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BIN_SUFFIX = {0: "", **{shift: suffix for suffix, shift in _BIN.items()}}
_DEC_SUFFIX = {exp: suffix for suffix, exp in _DEC.items()}


def go_canonical(text: str) -> str:
    """apimachinery's canonical form of quantity ``text`` (integers and SI suffixes)."""
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)([KMGTPE]i|[numkMGTPE]?)", text)
    assert m is not None, text
    number, suffix = Decimal(m.group(1)), m.group(2)
    binary = suffix in _BIN
    value = number * 2 ** _BIN[suffix] if binary else number.scaleb(_DEC[suffix])
    if value == 0:
        return "0"
    if binary and abs(value) >= 1024 and value == value.to_integral_value():
        n, shift = int(value), 0
        while n % 1024 == 0 and shift < 60:
            n //= 1024
            shift += 10
        return f"{n}{_BIN_SUFFIX[shift]}"
    sign, digits, exp = value.normalize().as_tuple()
    assert isinstance(exp, int)
    mantissa = int("".join(map(str, digits))) * (-1 if sign else 1)
    down = exp % 3  # Go: exponent lowered to a multiple of 3, the mantissa scaled up
    mantissa, exp = mantissa * 10**down, exp - down
    return f"{mantissa}{_DEC_SUFFIX[exp]}"


def _check_the_oracle() -> None:
    """The fake's canonical forms are apimachinery's (its documented examples)."""
    cases = {
        "40960Mi": "40Gi",
        "81559Mi": "81559Mi",
        "0Mi": "0",
        "0": "0",
        "1024": "1024",
        "1Ki": "1Ki",
        "0.5Ki": "512",
        "1000": "1k",
        "1500": "1500",
        "7": "7",
        "1048576Ki": "1Gi",
    }
    assert {k: go_canonical(k) for k in cases} == cases


def _canon(obj: Any, quantities: bool = False) -> Any:
    """``obj`` as the server stores it: quantities canonical, empty fields omitted."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            c = _canon(v, quantities or k in ("capacity", "counters"))
            if c is not None and c != [] and c != {}:
                out[k] = c
        return out
    if isinstance(obj, list):
        return [_canon(v, quantities) for v in obj]
    if quantities and isinstance(obj, str):
        return go_canonical(obj)
    return obj


def _merge(a: Any, b: Any) -> Any:
    if not isinstance(b, dict):
        return copy.deepcopy(b)
    out = dict(a) if isinstance(a, dict) else {}
    for k, v in b.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


class CanonicalApi:
    """ResourceSlices stored as kube-apiserver stores them (module docstring)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.writes = 0
        self.rv = 0

    def _store(self, name: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        self.writes += 1
        stored = _canon(obj)
        stored["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[name] = stored

    async def list_cluster_custom_object(self, *a: Any, **k: Any) -> dict[str, Any]:
        return {"items": copy.deepcopy(list(self.objects.values()))}

    async def patch_cluster_custom_object(
        self, g: str, v: str, p: str, name: str, body: Any, **k: Any
    ) -> None:
        self._store(name, _merge(self.objects[name], body))

    async def create_cluster_custom_object(
        self, g: str, v: str, p: str, body: Any, **k: Any
    ) -> None:
        self._store(body["metadata"]["name"], copy.deepcopy(body))

    async def delete_cluster_custom_object(
        self, g: str, v: str, p: str, name: str, **k: Any
    ) -> None:
        self.writes += 1
        self.objects.pop(name, None)


def _gpus(model: GpuModel) -> list[DraGpu]:
    return [DraGpu(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", model) for i in range(2)]


def _generations(api: CanonicalApi) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in api.objects.values()}


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
async def test_an_unchanged_node_writes_nothing_on_every_model(model: GpuModel) -> None:
    api = CanonicalApi()
    pub = SlicePublisher(api, "node-a", _gpus(model), node_uid="uid-node-a")
    assert await pub.publish()
    first = api.writes
    for _ in range(3):
        assert not await pub.publish()
    assert api.writes == first
    assert _generations(api) == {1}
    # narrowed and tainted (shaped publishing): one rewrite, then nothing again
    small = min(model.profiles, key=lambda p: (p.memory_slices, p.name))
    narrowed = {device_name(0), device_name(1, small, small.starts[0])}
    tainted = {device_name(0): "xid"}
    assert await pub.publish(narrowed, tainted)
    second = api.writes
    for _ in range(3):
        assert not await pub.publish(narrowed, tainted)
    assert api.writes == second
    assert _generations(api) == {2}


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
async def test_what_is_sent_reads_back_as_sent(model: GpuModel) -> None:
    api = CanonicalApi()
    pub = SlicePublisher(api, "node-a", _gpus(model))
    sent = pub._wanted(1, None)
    for s in sent:
        await api.create_cluster_custom_object("", "", "", s)
    for s in sent:
        assert api.objects[s["metadata"]["name"]]["spec"] == s["spec"]


@pytest.mark.parametrize(
    "spell", [lambda mib: f"{mib}Mi", lambda mib: str(mib * 1024 * 1024)], ids=["Mi", "bytes"]
)
async def test_stored_quantities_compare_by_value(spell: Any) -> None:
    """A pool stored in another spelling of the same values (an older agent's ``40960Mi``
    under a server that kept it, plain bytes) is the same pool: nothing is rewritten."""
    _check_the_oracle()
    model = CAT.model("A100-SXM4-40GB")
    api = CanonicalApi()
    pub = SlicePublisher(api, "node-a", _gpus(model))
    for s in pub._wanted(1, None):
        obj = copy.deepcopy(s)
        for d in obj["spec"].get("devices") or ():
            name = d["name"]
            gpu, _, rest = name.partition("-")
            mib = (
                model.memory_mib
                if not rest
                else next(
                    p.memory_mib
                    for p in model.profiles
                    for st in p.starts
                    if device_name(int(gpu[3:]), p, st) == name
                )
            )
            d["capacity"]["memory"]["value"] = spell(mib)
        for cs in obj["spec"].get("sharedCounters") or ():
            for c in cs["counters"].values():
                c["value"] = f"{int(c['value'])}.0"
        obj["metadata"]["resourceVersion"] = "1"
        api.objects[obj["metadata"]["name"]] = obj
    assert not await pub.publish()
    assert api.writes == 0
    assert _generations(api) == {1}
