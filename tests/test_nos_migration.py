"""Migrating from nos: the check that lists every pod whose meaning changes, with the fix.

nos sizes ``nvidia.com/gpu-<N>gb`` as N x 1000 MiB and packs a GPU up to ceil(MiB / 1000)
"GB" with no MPS server reserve (shared/facts/gpu-operator.md section 5); gpuslice as N GiB
with a 512 MiB reserve.  Expected numbers below are worked out by hand from those rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from partitioner.nos_migration import fits

FIXTURES = Path(__file__).parent / "fixtures" / "clusters"


@pytest.mark.parametrize(
    ("gb", "memory", "nos", "ours", "keep"),
    [
        (10, 40960, 4, 3, 9),  # ceil(40.96) = 41 // 10 = 4; (40960 - 512) // 10240 = 3
        (20, 40960, 2, 1, 19),  # 40448 // 40960 = 0 -> 19: 40448 // 19456 = 2
        (16, 32768, 2, 1, 15),  # nos #39: 2 x 16 GB on a 32 GB V100 (33 // 16 = 2)
        (10, 81920, 8, 7, 9),  # 82 // 10 = 8; 81408 // 10240 = 7
        (40, 81920, 2, 1, 39),
        (5, 16384, 3, 3, None),  # 17 // 5 = 3; 15872 // 5120 = 3: nothing changes
        (1, 15360, 16, 14, None),  # T4: 16 x 1 GB under nos; no GiB size fits 16 beside the reserve
    ],
)
def test_slices_per_gpu_under_nos_and_gpuslice(
    gb: int, memory: int, nos: int, ours: int, keep: int | None
) -> None:
    got = fits(gb, memory, 512)
    assert (got.nos, got.gpuslice, got.keep_with) == (nos, ours, keep)
    if keep is not None:  # the fix keeps nos's packing, and one GiB more would not
        assert (memory - 512) // (keep * 1024) >= nos > (memory - 512) // ((keep + 1) * 1024)


def test_check_lists_every_mps_pod_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nos-check", "--snapshot", str(FIXTURES / "nos-mps.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pods = {(p["pod"], p["resource"]): p for p in doc["pods"]}
    assert len(pods) == 7  # 5 running + 2 pending, each with one MPS resource
    tiny = pods["serving/tiny-3b1c2-0", "nvidia.com/gpu-10gb"]
    assert (tiny["node"], tiny["nos_mib"], tiny["gpuslice_mib"]) == ("gpu-mps-0", 10000, 10240)
    assert tiny["fits"] == [{"model": "A100-SXM4-40GB", "nos": 4, "gpuslice": 3, "keep_with": 9}]
    pending = pods["research/small-5a7f1-0", "nvidia.com/gpu-5gb"]
    assert pending["node"] == "" and pending["fits"][0]["keep_with"] == 4  # 8 per GPU
    assert all(p["fewer_fit"] for p in doc["pods"])
    messages = {n["message"].split(":")[0] for n in doc["nodes"]}
    assert any("nos annotation" in m for m in messages)
    assert any("nvidia.com/device-plugin.config" in m for m in messages)


def test_check_text_names_the_request_to_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nos-check", "--snapshot", str(FIXTURES / "nos-mps.json")]) == 0
    out = capsys.readouterr().out
    assert "7 MPS request(s) change meaning" in out and "for 7 of them fewer fit" in out
    assert (
        "to keep 4 per GPU request nvidia.com/gpu-9gb (9216 MiB, 7.8 % less than nos gave)" in out
    )
    assert "drain them before the switch" in out


def test_a_mig_only_cluster_has_no_pod_to_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nos-check", "--snapshot", str(FIXTURES / "nos-mig.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pods"] == [] and [n["node"] for n in doc["nodes"]] == ["gpu-nos-0"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--snapshot", "/nonexistent/dump.json"], "cannot read snapshot file"),
        (["--snapshot", str(FIXTURES / "nos-mps.json"), "--mps-reserve-mib", "-1"], "must be >= 0"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    assert main(["nos-check", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_the_mps_node_with_nos_pods_running_is_left_out_of_plans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--snapshot", str(FIXTURES / "nos-mps.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes_read"]["gpu-mps-0"]["problem"].startswith("GpuInUseBeforeAgent")


def test_check_tells_refused_pods_left_out_nodes_and_nos_scheduler_pods(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pod gpuslice refuses as it asks (nos summed ``gpu-10gb: 2`` into one slice) gets the
    reason, not a size fix; a request that fits no GPU under either says so; every node left
    out of plans is listed with its reason; pending pods naming nos's scheduler, which leaves
    with nos, are named (nothing would bind them)."""
    dump = json.loads((FIXTURES / "nos-mps.json").read_text())
    template = next(
        i for i in dump["items"] if i["kind"] == "Pod" and not i["spec"].get("nodeName")
    )

    def pending(name: str, limits: dict[str, str], **spec: str) -> dict[str, object]:
        p = json.loads(json.dumps(template))
        p["metadata"] |= {"name": name, "namespace": "research", "uid": f"uid-{name}"}
        for c in p["spec"]["containers"]:
            c["resources"] = {"limits": limits, "requests": limits}
        p["spec"] |= spec
        return p

    dump["items"] += [
        pending("two", {"nvidia.com/gpu-10gb": "2"}),
        pending("huge", {"nvidia.com/gpu-50gb": "1"}),
        pending("quota", {"nvidia.com/gpu-5gb": "1"}, schedulerName="nos-scheduler"),
    ]
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump))
    assert main(["nos-check", "--snapshot", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pods = {p["pod"]: p for p in doc["pods"]}
    assert "more than one MPS slice" in pods["research/two"]["refused"]
    assert pods["research/huge"]["fits"][0]["nos"] == 0
    notes = [n["message"] for n in doc["nodes"]]
    assert any(m.startswith("left out of plans: GpuInUseBeforeAgent") for m in notes)
    assert any("nos-scheduler (research/quota)" in m for m in notes)
    assert main(["nos-check", "--snapshot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gpuslice refuses the pod as it asks" in out
    assert "fits no GPU of this model under either" in out


def test_check_finds_a_packing_of_mixed_sizes_that_no_longer_fits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """nos packed 5 x gpu-7gb + 1 x gpu-6gb on each A100-40GB (41 "GB" <= ceil(40960 / 1000)):
    each size alone fits both ways, so every pod read "nothing to do", but together they are
    41 GiB against the 39.5 GiB gpuslice gives a GPU beside the MPS server (2 GiB over)."""
    dump = json.loads((FIXTURES / "nos-mps.json").read_text())
    node = next(i for i in dump["items"] if i["metadata"]["name"] == "gpu-mps-0")
    ann = node["metadata"]["annotations"]
    for k in [k for k in ann if k.startswith("nos.nebuly.com/status-gpu-")]:
        del ann[k]
    ann |= {
        "nos.nebuly.com/status-gpu-0-7gb-used": "5",
        "nos.nebuly.com/status-gpu-0-6gb-used": "1",
        "nos.nebuly.com/status-gpu-1-10gb-used": "3",
    }
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump))
    assert main(["nos-check", "--snapshot", str(path), "--json"]) == 0
    notes = [n["message"] for n in json.loads(capsys.readouterr().out)["nodes"]]
    (over,) = [m for m in notes if "add up to" in m]
    assert over.startswith("GPU 0: nos's slices there add up to 41984 MiB")
    assert "more than the 40448 MiB" in over and "ask 2 GiB less" in over
