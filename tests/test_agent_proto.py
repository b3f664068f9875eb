"""The kubelet .proto files and their committed generated code.

Two independent checks:

* the wire format: every package, service, method, message, field number, type and label of the
  generated descriptors equals the tables of shared/facts/kubelet-grpc.md, written out below a
  second time (so a typo in the .proto fails here);
* freshness: the committed ``*_pb2*`` code describes exactly the current .proto files
  (descriptor comparison, independent of the grpcio-tools version), and is byte-identical to a
  fresh ``python -m node_agent.proto.generate`` when the installed grpcio-tools is the version
  that generated it.
"""

from __future__ import annotations

import importlib.metadata
import tempfile
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from node_agent.proto import deviceplugin_v1beta1_pb2 as dp
from node_agent.proto import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from node_agent.proto import dra_v1_pb2 as dra
from node_agent.proto import dra_v1_pb2_grpc as dra_grpc
from node_agent.proto import generate
from node_agent.proto import pluginregistration_v1_pb2 as reg
from node_agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from node_agent.proto import podresources_v1_pb2 as pr

UPSTREAM = {
    # vendored verbatim from kubernetes/kubelet @63b3249724f7 (2026-07-23)
    "dra_v1.proto": "b3066ad7f6abcfd0003c47b06ceb801d76997d78d6be505597478d3905b9cc57",
    "pluginregistration_v1.proto": (
        "7a67a0000a1a167c155286834bc9ccb489f8bcdb394e006daba270189c272afa"
    ),
}

# message -> field name -> (number, type); "[]" = repeated, ".pkg.Msg" = message type
DEVICEPLUGIN_MESSAGES: dict[str, dict[str, tuple[int, str]]] = {
    "Empty": {},
    "PreStartContainerResponse": {},
    "DevicePluginOptions": {
        "pre_start_required": (1, "bool"),
        "get_preferred_allocation_available": (2, "bool"),
    },
    "RegisterRequest": {
        "version": (1, "string"),
        "endpoint": (2, "string"),
        "resource_name": (3, "string"),
        "options": (4, ".v1beta1.DevicePluginOptions"),
    },
    "ListAndWatchResponse": {"devices": (1, "[].v1beta1.Device")},
    "Device": {
        "ID": (1, "string"),
        "health": (2, "string"),
        "topology": (3, ".v1beta1.TopologyInfo"),
    },
    "TopologyInfo": {"nodes": (1, "[].v1beta1.NUMANode")},
    "NUMANode": {"ID": (1, "int64")},
    "PreferredAllocationRequest": {
        "container_requests": (1, "[].v1beta1.ContainerPreferredAllocationRequest")
    },
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": (1, "[]string"),
        "must_include_deviceIDs": (2, "[]string"),
        "allocation_size": (3, "int32"),
    },
    "PreferredAllocationResponse": {
        "container_responses": (1, "[].v1beta1.ContainerPreferredAllocationResponse")
    },
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, "[]string")},
    "AllocateRequest": {"container_requests": (1, "[].v1beta1.ContainerAllocateRequest")},
    "ContainerAllocateRequest": {"devices_ids": (1, "[]string")},
    "AllocateResponse": {"container_responses": (1, "[].v1beta1.ContainerAllocateResponse")},
    "ContainerAllocateResponse": {
        "envs": (1, "map<string,string>"),
        "mounts": (2, "[].v1beta1.Mount"),
        "devices": (3, "[].v1beta1.DeviceSpec"),
        "annotations": (4, "map<string,string>"),
        "cdi_devices": (5, "[].v1beta1.CDIDevice"),
    },
    "Mount": {
        "container_path": (1, "string"),
        "host_path": (2, "string"),
        "read_only": (3, "bool"),
    },
    "DeviceSpec": {
        "container_path": (1, "string"),
        "host_path": (2, "string"),
        "permissions": (3, "string"),
    },
    "CDIDevice": {"name": (1, "string")},
    "PreStartContainerRequest": {"devices_ids": (1, "[]string")},
}

DEVICEPLUGIN_SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "Registration": {"Register": ("RegisterRequest", "Empty", False)},
    "DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": (
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            False,
        ),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}

PODRESOURCES_MESSAGES: dict[str, dict[str, tuple[int, str]]] = {
    "ListPodResourcesRequest": {},
    "AllocatableResourcesRequest": {},
    "ListPodResourcesResponse": {"pod_resources": (1, "[].v1.PodResources")},
    "PodResources": {
        "name": (1, "string"),
        "namespace": (2, "string"),
        "containers": (3, "[].v1.ContainerResources"),
        "cpu_ids": (4, "[]int64"),
        "memory": (5, "[].v1.ContainerMemory"),
    },
    "ContainerResources": {
        "name": (1, "string"),
        "devices": (2, "[].v1.ContainerDevices"),
        "cpu_ids": (3, "[]int64"),
        "memory": (4, "[].v1.ContainerMemory"),
        "dynamic_resources": (5, "[].v1.DynamicResource"),
    },
    "ContainerDevices": {
        "resource_name": (1, "string"),
        "device_ids": (2, "[]string"),
        "topology": (3, ".v1.TopologyInfo"),
    },
    "ContainerMemory": {
        "memory_type": (1, "string"),
        "size": (2, "uint64"),
        "topology": (3, ".v1.TopologyInfo"),
    },
    "TopologyInfo": {"nodes": (1, "[].v1.NUMANode")},
    "NUMANode": {"ID": (1, "int64")},
    "DynamicResource": {
        "claim_name": (2, "string"),
        "claim_namespace": (3, "string"),
        "claim_resources": (4, "[].v1.ClaimResource"),
    },
    "ClaimResource": {
        "cdi_devices": (1, "[].v1.CDIDevice"),
        "driver_name": (2, "string"),
        "pool_name": (3, "string"),
        "device_name": (4, "string"),
        "share_id": (5, "optional string"),
    },
    "CDIDevice": {"name": (1, "string")},
    "GetPodResourcesRequest": {"pod_name": (1, "string"), "pod_namespace": (2, "string")},
    "GetPodResourcesResponse": {"pod_resources": (1, ".v1.PodResources")},
    "AllocatableResourcesResponse": {
        "devices": (1, "[].v1.ContainerDevices"),
        "cpu_ids": (2, "[]int64"),
        "memory": (3, "[].v1.ContainerMemory"),
    },
}

PODRESOURCES_SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "PodResourcesLister": {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse", False),
        "GetAllocatableResources": (
            "AllocatableResourcesRequest",
            "AllocatableResourcesResponse",
            False,
        ),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse", False),
    }
}

_SCALARS = {3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string"}


def _field_type(field: Any) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (f for f in field.message_type.fields)
        return f"map<{_SCALARS[key.type]},{_SCALARS[value.type]}>"
    base = "." + field.message_type.full_name if field.message_type else _SCALARS[field.type]
    if field.is_repeated:
        return "[]" + base
    if field.has_presence and field.message_type is None:
        return "optional " + base
    return base


def _wire(file: Any) -> tuple[str, dict[str, dict[str, tuple[int, str]]], dict[str, Any]]:
    messages = {
        name: {f.name: (f.number, _field_type(f)) for f in msg.fields}
        for name, msg in file.message_types_by_name.items()
    }
    services = {
        name: {
            m.name: (
                m.input_type.name,
                m.output_type.name,
                m.server_streaming or m.client_streaming,
            )
            for m in svc.methods
        }
        for name, svc in file.services_by_name.items()
    }
    return file.package, messages, services


@pytest.mark.parametrize(
    ("module", "package", "messages", "services"),
    [
        (dp, "v1beta1", DEVICEPLUGIN_MESSAGES, DEVICEPLUGIN_SERVICES),
        (pr, "v1", PODRESOURCES_MESSAGES, PODRESOURCES_SERVICES),
    ],
    ids=["deviceplugin", "podresources"],
)
def test_wire_format_matches_the_kubelet(
    module: Any, package: str, messages: dict[str, Any], services: dict[str, Any]
) -> None:
    assert _wire(module.DESCRIPTOR) == (package, messages, services)
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    assert proto.syntax == "proto3"
    assert not module.DESCRIPTOR.enum_types_by_name


def test_listandwatch_is_server_streaming_only_and_paths_are_the_kubelets() -> None:
    method = dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"]
    assert method.server_streaming and not method.client_streaming
    assert "/v1beta1.DevicePlugin/ListAndWatch" in Path(dp_grpc.__file__).read_text()


def test_removed_dynamic_resource_field_1_stays_reserved() -> None:
    proto = descriptor_pb2.FileDescriptorProto()
    pr.DESCRIPTOR.CopyToProto(proto)
    (msg,) = [m for m in proto.message_type if m.name == "DynamicResource"]
    assert [(r.start, r.end) for r in msg.reserved_range] == [(1, 2)]


def _clear_json_names(messages: Any) -> None:
    for msg in messages:
        for field in msg.field:
            field.ClearField("json_name")
        _clear_json_names(msg.nested_type)


def test_committed_code_describes_the_current_protos(tmp_path: Path) -> None:
    fresh = descriptor_pb2.FileDescriptorSet()
    fresh.ParseFromString(generate.compile_descriptor_set(tmp_path / "set.bin").read_bytes())
    committed = []
    for module in (dp, pr, reg, dra):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        committed.append(proto)
    for proto in fresh.file:  # neither source info nor json names are embedded in gencode
        proto.ClearField("source_code_info")
        _clear_json_names(proto.message_type)
    assert list(fresh.file) == committed, "run: python -m node_agent.proto.generate"


def test_regeneration_is_byte_identical_with_the_same_grpcio_tools() -> None:
    committed_grpc = (generate.PROTO_DIR / "deviceplugin_v1beta1_pb2_grpc.py").read_text()
    installed = importlib.metadata.version("grpcio-tools")
    if f"GRPC_GENERATED_VERSION = '{installed}'" not in committed_grpc:
        pytest.skip(f"committed code was generated by another grpcio-tools than {installed}")
    with tempfile.TemporaryDirectory(prefix="gsproto-") as tmp:
        fresh = generate.generate(Path(tmp))
        for new, old in zip(fresh, generate.generated_files(), strict=True):
            assert new.read_bytes() == old.read_bytes(), (
                f"{old.name} is stale: run python -m node_agent.proto.generate"
            )


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_dra_protos_are_the_kubelets_own_files(name: str) -> None:
    """pkg/apis/dra/v1/api.proto and pkg/apis/pluginregistration/v1/api.proto, byte for byte."""
    import hashlib

    data = (generate.PROTO_DIR / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == UPSTREAM[name]


def test_dra_wire_names_match_the_kubelet() -> None:
    """Method paths and the fields the plugin fills (shared/facts/dra.md section 3)."""
    text = Path(dra_grpc.__file__).read_text() + Path(reg_grpc.__file__).read_text()
    for path in (
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ):
        assert path in text
    fields = {
        f.name: (f.number, f.type) for f in dra.DESCRIPTOR.message_types_by_name["Device"].fields
    }
    assert fields == {
        "request_names": (1, 9),
        "pool_name": (2, 9),
        "device_name": (3, 9),
        "cdi_device_ids": (4, 9),
        "share_id": (5, 9),
    }
    assert dra.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    info = reg.PluginInfo.DESCRIPTOR.fields_by_name
    assert [info[n].number for n in ("type", "name", "endpoint", "supported_versions")] == [
        1,
        2,
        3,
        4,
    ]
