"""The generated NodePartitioning CRD against the API server's own schema type, and the contract
read across one release of skew.

* Every node of ``openAPIV3Schema`` uses only JSONSchemaProps fields, each of its Go type
  (apiextensions.k8s.io/v1): the API server refuses a CRD whose ``exclusiveMaximum`` is a
  number (JSON Schema's form) where JSONSchemaProps has a boolean -- kubernetes_validate does
  not look below ``items``, so the chart's CRD test passed while ``helm install`` would fail.
* No ``default``: the API server fills defaults in on every write and read, so a flag the
  agent writes only when true reached every reader, older ones included, after a CRD upgrade.
* Status parts are read with unknown fields ignored (a newer partitioner's reservation field
  must not fail an older agent's every pass); a spec with an unknown field is still refused.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from contract.nodepartitioning import NodePartitioning, crd_manifest

# JSONSchemaProps (k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1/types_jsonschema.go):
# field -> the Python types its Go type decodes from
PROPS: dict[str, tuple[type, ...]] = {
    "type": (str,),
    "format": (str,),
    "description": (str,),
    "title": (str,),
    "pattern": (str,),
    "maximum": (int, float),
    "minimum": (int, float),
    "exclusiveMaximum": (bool,),
    "exclusiveMinimum": (bool,),
    "maxLength": (int,),
    "minLength": (int,),
    "maxItems": (int,),
    "minItems": (int,),
    "maxProperties": (int,),
    "minProperties": (int,),
    "multipleOf": (int, float),
    "uniqueItems": (bool,),
    "required": (list,),
    "enum": (list,),
    "nullable": (bool,),
    "properties": (dict,),
    "items": (dict,),
    "additionalProperties": (dict, bool),
    "allOf": (list,),
    "oneOf": (list,),
    "anyOf": (list,),
    "not": (dict,),
    "x-kubernetes-preserve-unknown-fields": (bool,),
    "x-kubernetes-int-or-string": (bool,),
    "x-kubernetes-list-type": (str,),
    "x-kubernetes-list-map-keys": (list,),
    "x-kubernetes-map-type": (str,),
    "x-kubernetes-embedded-resource": (bool,),
    "x-kubernetes-validations": (list,),
    "default": (object,),
}


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path or ".", schema)]
    for name, sub in (schema.get("properties") or {}).items():
        out += _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _nodes(schema["items"], f"{path}[]")
    return out


def test_every_schema_node_is_a_jsonschemaprops_of_the_right_types() -> None:
    (version,) = crd_manifest()["spec"]["versions"]
    nodes = _nodes(version["schema"]["openAPIV3Schema"])
    assert len(nodes) > 40
    for path, node in nodes:
        for key, value in node.items():
            assert key in PROPS, f"{path}: {key} is no JSONSchemaProps field"
            assert isinstance(value, PROPS[key]), f"{path}: {key}: {value!r} is no {PROPS[key]}"
            if key in ("maximum", "minimum"):
                assert not isinstance(value, bool)
        assert "default" not in node, f"{path}: the API server would default it for every reader"
    index = dict(nodes)[".spec.gpus[].index"]
    assert (index["maximum"], index["exclusiveMaximum"], index["minimum"]) == (64, True, 0)


def _np(status: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": "n1", "generation": 2},
        "spec": spec or {"planId": "3", "mode": "mig", "gpus": [{"index": 0}]},
        "status": status,
    }


def test_status_fields_of_a_newer_release_are_read_and_spec_typos_refused() -> None:
    status = {
        "observedGeneration": 2,
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-0",
                "futureFlag": True,
                "mig": [{"profile": "1g.10gb", "start": 0, "used": True, "sealed": True}],
            }
        ],
        "reservations": [
            {
                "pod": "ns/p",
                "state": "planned",
                "gpus": {"nvidia.com/mig-1g.10gb": [0]},
                "priority": 7,
            }
        ],
        "conditions": [{"type": "Applied", "status": "True", "observedAt": "now"}],
        "somethingNew": {"a": 1},
    }
    obj = NodePartitioning.model_validate(_np(status))
    assert obj.status is not None and obj.status.gpus[0].mig[0].used
    assert [r.pod for r in obj.status.reservations] == ["ns/p"]
    with pytest.raises(ValidationError, match="gpuz"):
        NodePartitioning.model_validate(_np(status, {"mode": "mig", "gpuz": []}))
