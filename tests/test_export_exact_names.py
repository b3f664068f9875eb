"""``gpuslice export`` refuses slice names gpuslice's nodes never advertise, naming the fix.

A slice name that is a near miss of a canonical one (``nvidia.com/gpu-010gb``,
``nvidia.com/mig-1G.10GB``, NVIDIA's time-slicing ``nvidia.com/mig-1g.10gb.shared``, and
kube-state-metrics' ``nvidia_com_gpu_010gb``) is refused with exit 2, naming the pod, the
canonical name and the ``--map-resource`` that renames it, as the partitioner refuses such pods
(``tests/test_partitioner_exact_names.py``); with that map entry the pod exports under the
canonical name, and a map entry whose ``TO`` is a near miss is refused the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_export import (
    BASE,
    STEPS,
    at,
    bad_pod,
    ksm_answer,
    ksm_pod,
    kube_list,
    llm,
    write,
)

from gpuslice.cli import main


def _export(tmp_path: Path, doc: object, *extra: str) -> int:
    path = write(tmp_path / "dump.json", doc) + f"@{at('10:30:00')}"
    return main(["export", path, *extra])


@pytest.mark.parametrize(
    ("asked", "meant"),
    [
        ("nvidia.com/gpu-010gb", "nvidia.com/gpu-10gb"),
        ("nvidia.com/mig-1G.10GB", "nvidia.com/mig-1g.10gb"),
        ("nvidia.com/mig-1g.10gb.shared", "nvidia.com/mig-1g.10gb"),
        ("nvidia.com/mig-1g.10gb.me.shared", "nvidia.com/mig-1g.10gb.me"),
    ],
)
def test_a_near_miss_slice_name_exits_2_naming_the_pod_the_name_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], asked: str, meant: str
) -> None:
    doc = kube_list(llm(), bad_pod({asked: "1"}))
    assert _export(tmp_path, doc) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("gpuslice export: error: 1 problem(s): pod ml/odd")
    assert f"requests {asked}, a slice name gpuslice's nodes never advertise" in err
    assert f"did you mean {meant}?" in err
    assert f"--map-resource {asked}={meant}" in err

    # the fix it names works: the pod is exported under the canonical name
    assert _export(tmp_path, doc, "--map-resource", f"{asked}={meant}") == 0
    workload = yaml.safe_load(capsys.readouterr().out)
    (odd,) = [p for p in workload["pods"] if p["name"] == "ml/odd"]
    assert odd["requests"] == {meant: 1}


def test_a_map_entry_renaming_to_a_near_miss_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = kube_list(llm(), bad_pod({"nvidia.com/gpu.shared": "1"}))
    entry = "nvidia.com/gpu.shared=nvidia.com/mig-1g.10gb.shared"
    assert _export(tmp_path, doc, "--map-resource", entry) == 2
    err = capsys.readouterr().err
    assert "pod ml/odd" in err and "renames to nvidia.com/mig-1g.10gb.shared" in err
    assert "--map-resource nvidia.com/gpu.shared=nvidia.com/mig-1g.10gb" in err


def test_a_ksm_label_with_a_leading_zero_is_refused_not_read_as_the_canonical_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = ksm_answer(ksm_pod("ml", "a", BASE, {"nvidia_com_gpu_010gb": (1, "integer")}, STEPS))
    path = write(tmp_path / "ksm.json", doc)
    assert main(["export", path, "--from", "ksm"]) == 2
    err = capsys.readouterr().err
    assert "pod ml/a" in err and "requests nvidia_com_gpu_010gb" in err
    assert "did you mean nvidia.com/gpu-10gb?" in err
    assert "--map-resource nvidia_com_gpu_010gb=nvidia.com/gpu-10gb" in err
    entry = "nvidia_com_gpu_010gb=nvidia.com/gpu-10gb"
    assert main(["export", path, "--from", "ksm", "--map-resource", entry]) == 0
    workload = yaml.safe_load(capsys.readouterr().out)
    assert [p["requests"] for p in workload["pods"]] == [{"nvidia.com/gpu-10gb": 1}]
