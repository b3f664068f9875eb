"""GPU Feature Discovery labels by MIG strategy: model, physical GPU count, memory, MIG devices.

Label shapes follow NVIDIA/k8s-device-plugin v0.20.0 (internal/lm/mig-strategy.go,
resource.go; shared/facts/gpu-operator.md section 1): under ``single`` ``gpu.count`` counts MIG
devices and ``gpu.product`` ends in ``-MIG-<profile>``; under ``mixed`` ``mig-<profile>.count``
labels count each profile and ``gpu.count`` counts physical GPUs.
"""

from __future__ import annotations

import pytest

from partitioner.node_labels import (
    GpuLabels,
    LabelProblem,
    MigStrategy,
    read_gpu_labels,
    with_operands_off,
)
from planner.catalog import default_catalog

CAT = default_catalog()
A40 = "NVIDIA-A100-SXM4-40GB"
A80 = "NVIDIA-A100-SXM4-80GB"


def read(labels: dict[str, str], annotations: dict[str, str] | None = None) -> GpuLabels:
    got = read_gpu_labels(labels, annotations or {}, CAT)
    assert isinstance(got, GpuLabels), got
    return got


def problem(labels: dict[str, str], annotations: dict[str, str] | None = None) -> LabelProblem:
    got = read_gpu_labels(labels, annotations or {}, CAT)
    assert isinstance(got, LabelProblem), got
    return got


def single(
    devices: int, profile: str = "1g.5gb", config: str = "", state: str = ""
) -> dict[str, str]:
    labels = {
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": f"{A40}-MIG-{profile}",
        "nvidia.com/gpu.count": str(devices),
        "nvidia.com/gpu.memory": "4864",
    }
    if config:
        labels |= {"nvidia.com/mig.config": config, "nvidia.com/mig.config.state": state}
    return labels


def test_none_strategy_counts_physical_gpus_and_shows_no_mig_devices() -> None:
    got = read({"nvidia.com/gpu.product": A80, "nvidia.com/gpu.count": "8"})
    assert (got.strategy, got.gpu_count, got.mig_devices) == (MigStrategy.NONE, 8, None)
    assert got.count_source == "label nvidia.com/gpu.count"


def test_mixed_strategy_reads_physical_count_and_per_profile_devices() -> None:
    got = read(
        {
            "nvidia.com/mig.strategy": "mixed",
            "nvidia.com/gpu.product": A80,
            "nvidia.com/gpu.count": "2",
            "nvidia.com/gpu.memory": "81920",
            "nvidia.com/mig-1g.10gb.count": "4",
            "nvidia.com/mig-1g.10gb.memory": "9728",
            "nvidia.com/mig-1g.10gb.me.count": "1",
            "nvidia.com/mig-3g.40gb.count": "2",
            "nvidia.com/mig-3g.40gb.slices.gi": "4",
        }
    )
    assert (got.strategy, got.gpu_count, got.gpu_memory_mib) == (MigStrategy.MIXED, 2, 81920)
    assert got.mig_devices == {"1g.10gb": 4, "1g.10gb+me": 1, "3g.40gb": 2}


def test_single_strategy_count_is_devices_and_memory_is_per_device() -> None:
    got = read(single(14))
    assert got.strategy is MigStrategy.SINGLE and got.model.name == "A100-SXM4-40GB"
    assert got.mig_devices == {"1g.5gb": 14}
    assert got.gpu_count is None  # 14 x 1g.5gb may sit on 2 to 14 GPUs
    assert got.gpu_memory_mib is None  # 4864 is one MIG device's memory
    assert "counts 1g.5gb MIG devices, not GPUs" in got.notes[0]


@pytest.mark.parametrize(
    ("labels", "annotations", "count", "source"),
    [
        (single(14), {"gpuslice.io/gpu-count": "2"}, 2, "annotation gpuslice.io/gpu-count"),
        (
            single(14, config="all-1g.5gb", state="success"),
            {},
            2,
            "nvidia.com/mig.config=all-1g.5gb",
        ),
        (
            single(6, "2g.10gb", "all-2g.10gb", "success"),
            {},
            2,
            "3 x 2g.10gb per GPU",
        ),
        (single(3, "7g.40gb"), {}, 3, "at most one per GPU"),
        (single(2, "4g.20gb"), {}, 2, "at most one per GPU"),
    ],
)
def test_single_strategy_physical_count_sources(
    labels: dict[str, str], annotations: dict[str, str], count: int, source: str
) -> None:
    got = read(labels, annotations)
    assert got.gpu_count == count and source in got.count_source


@pytest.mark.parametrize("profile", ["1g.5gb", "1g.5gb+me"])
def test_single_strategy_with_shared_gpus_reads_the_profile_without_the_shared_suffix(
    profile: str,
) -> None:
    # GFD appends -SHARED to <model>-MIG-<profile> when the devices are time-sliced or MPS
    labels = single(14, f"{profile}-SHARED") | {"nvidia.com/gpu.replicas": "4"}
    got = read(labels, {"gpuslice.io/gpu-count": "2"})
    assert got.single_profile is not None and got.single_profile.name == profile
    assert (got.mig_devices, got.gpu_count) == ({profile: 14}, 2)
    invalid = read(single(0, "INVALID-SHARED"))
    assert (invalid.gpu_count, invalid.mig_devices) == (None, None)


def test_single_strategy_ignores_a_mig_config_still_being_applied_or_another_profile() -> None:
    pending = single(14, config="all-1g.5gb", state="pending")
    assert read(pending).gpu_count is None
    other = single(14, config="all-3g.20gb", state="success")
    assert read(other).gpu_count is None


def test_single_strategy_invalid_leaves_count_and_devices_unknown() -> None:
    got = read(
        {
            "nvidia.com/mig.strategy": "single",
            "nvidia.com/gpu.product": f"{A80}-MIG-INVALID",
            "nvidia.com/gpu.count": "0",
            "nvidia.com/gpu.memory": "0",
        }
    )
    assert got.model.name == "A100-SXM4-80GB"
    assert (got.gpu_count, got.mig_devices, got.gpu_memory_mib) == (None, None, None)
    assert "mig.strategy=mixed" in got.notes[0]


def test_single_strategy_without_mig_mode_is_labelled_like_none() -> None:
    got = read(
        {
            "nvidia.com/mig.strategy": "single",
            "nvidia.com/gpu.product": A80,
            "nvidia.com/gpu.count": "4",
        }
    )
    assert (got.gpu_count, got.mig_devices) == (4, {})


@pytest.mark.parametrize(
    ("labels", "annotations", "reason", "fragment"),
    [
        (
            {"nvidia.com/gpu.product": A80, "nvidia.com/gpu.count": "1000000000"},
            {},
            "TooManyGpus",
            "at most 16",
        ),
        (
            {
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/gpu.product": A80,
                "nvidia.com/gpu.count": "3000000",
            },
            {},
            "TooManyGpus",
            "max_gpus_per_node",
        ),
        (single(1000000000), {}, "TooManyGpus", "MIG devices of 1g.5gb"),
        (single(14), {"gpuslice.io/gpu-count": "1000000000"}, "TooManyGpus", "annotation"),
        (single(14), {"gpuslice.io/gpu-count": "two"}, "InvalidGpuLabels", "gpuslice.io/gpu-count"),
        (single(14, "1g.12gb"), {}, "UnknownMigProfile", "1g.12gb"),
        (
            {
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/gpu.product": A80,
                "nvidia.com/gpu.count": "1",
                "nvidia.com/mig-1g.10gb.count": "8",
            },
            {},
            "InvalidGpuLabels",
            "hold at most 7",
        ),
        (
            {
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/gpu.product": A80,
                "nvidia.com/gpu.count": "1",
                "nvidia.com/mig-2g.20gb.count": "x",
            },
            {},
            "InvalidGpuLabels",
            "mig-2g.20gb.count",
        ),
        (
            {
                "nvidia.com/mig.strategy": "weird",
                "nvidia.com/gpu.product": A80,
                "nvidia.com/gpu.count": "1",
            },
            {},
            "InvalidGpuLabels",
            "single, mixed",
        ),
        (
            {"nvidia.com/gpu.product": "Z9000", "nvidia.com/gpu.count": "1"},
            {},
            "UnknownGpuModel",
            "Z9000",
        ),
    ],
)
def test_bad_labels_are_problems_naming_the_label(
    labels: dict[str, str], annotations: dict[str, str], reason: str, fragment: str
) -> None:
    got = problem(labels, annotations)
    assert got.reason == reason and fragment in got.message, got


OFF = {"nvidia.com/gpu.deploy.mig-manager": "false", "nvidia.com/gpu.deploy.device-plugin": "false"}


@pytest.mark.parametrize(
    ("deploy", "reason"),
    [
        ({"nvidia.com/gpu.deploy.mig-manager": "true"}, "MigManagerEnabled"),
        ({"nvidia.com/gpu.deploy.mig-manager": "paused-for-driver-upgrade"}, "MigManagerEnabled"),
        ({"nvidia.com/gpu.deploy.device-plugin": "true"}, "NvidiaDevicePluginEnabled"),
        (
            {
                "nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change",
                "nvidia.com/gpu.deploy.mig-manager": "false",
            },
            "NvidiaDevicePluginEnabled",
        ),
        ({"nvidia.com/gpu.deploy.mig-manager": "false"}, None),
        ({"nvidia.com/gpu.deploy.gpu-feature-discovery": "true", **OFF}, None),  # GFD stays
        ({"nvidia.com/gpu.deploy.dcgm-exporter": "true", **OFF}, None),  # so does dcgm-exporter
    ],
)
def test_gpu_operator_operands_that_must_be_off(deploy: dict[str, str], reason: str | None) -> None:
    labels = {"nvidia.com/gpu.product": A80, "nvidia.com/gpu.count": "1", **deploy}
    got = read_gpu_labels(labels, {}, CAT, "gpu-7")
    if reason is None:
        assert isinstance(got, GpuLabels)
        return
    assert isinstance(got, LabelProblem) and got.reason == reason
    on = [k for k, v in deploy.items() if v != "false"]
    assert (
        f"kubectl label node gpu-7 {' '.join(f'{k}=false' for k in on)} --overwrite" in got.message
    )


def test_with_operands_off_is_what_the_fix_gives() -> None:
    node = {
        "kind": "Node",
        "metadata": {
            "name": "gpu-7",
            "labels": {
                "nvidia.com/gpu.deploy.mig-manager": "true",
                "nvidia.com/gpu.deploy.device-plugin": "false",
                "nvidia.com/gpu.deploy.dcgm-exporter": "true",
            },
        },
    }
    fixed, notes = with_operands_off(node)
    assert fixed["metadata"]["labels"] == {
        "nvidia.com/gpu.deploy.mig-manager": "false",
        "nvidia.com/gpu.deploy.device-plugin": "false",
        "nvidia.com/gpu.deploy.dcgm-exporter": "true",
    }
    assert node["metadata"]["labels"]["nvidia.com/gpu.deploy.mig-manager"] == "true"  # a copy
    assert len(notes) == 1 and "mig-manager=false (it is 'true')" in notes[0]


def test_a_gpu_memory_label_far_above_the_model_is_refused() -> None:
    """The planner sizes an MPS GPU's levels per GiB of its memory label: 80 GiB written in bytes
    (85899345920) planned for minutes while every other node's pods waited.  A label above
    twice the model's memory is a label problem naming it."""
    labels = {"nvidia.com/gpu.product": A80, "nvidia.com/gpu.count": "8"}
    got = problem(labels | {"nvidia.com/gpu.memory": "85899345920"})
    assert got.reason == "InvalidGpuLabels" and "written in bytes" in got.message
    assert read(labels | {"nvidia.com/gpu.memory": "81920"}).gpu_memory_mib == 81920
