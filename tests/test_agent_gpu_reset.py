"""GPU reset through the host driver's ``nvidia-smi`` (node_agent.gpu_reset, node_agent.runner)."""

from __future__ import annotations

import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from node_agent.gpu_reset import NvidiaSmi, reset_gpu
from node_agent.nvml import NvmlError, NvmlErrorCode
from node_agent.runner import NOT_RUN, TIMED_OUT, subprocess_runner

BUS = "00000000:3B:00.0"


class Script:
    """A scripted nvidia-smi: answers ``(rc, output)`` per call, records the argv."""

    def __init__(self, *answers: tuple[int, str]) -> None:
        self.answers = list(answers)
        self.calls: list[str] = []

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], stdin: str | None
    ) -> tuple[int, str]:
        self.calls.append(" ".join(argv))
        return self.answers.pop(0) if self.answers else (0, "All done.")


IN_USE_TEXT = (
    f"The following GPUs could not be reset:\n  GPU {BUS}: In use by another client\n\n"
    "1 device is currently being used by one or more other processes (e.g., Fabric Manager, "
    "CUDA application ...). Please first kill all processes using this device."
)


@pytest.mark.parametrize(
    ("rc", "out", "code"),
    [
        (255, IN_USE_TEXT, NvmlErrorCode.IN_USE),
        (255, f"GPU {BUS} is currently in use by another process.", NvmlErrorCode.IN_USE),
        (
            3,
            "The requested operation is not available on target device",
            NvmlErrorCode.NOT_SUPPORTED,
        ),
        (4, "Insufficient Permissions", NvmlErrorCode.NO_PERMISSION),
        (6, "No devices were found", NvmlErrorCode.NOT_FOUND),
        (9, "NVIDIA driver is not loaded", NvmlErrorCode.DRIVER_NOT_LOADED),
        (12, "NVML Shared Library Not Found", NvmlErrorCode.LIBRARY_NOT_FOUND),
        (15, "GPU has fallen off the bus", NvmlErrorCode.GPU_IS_LOST),
        (TIMED_OUT, "nvidia-smi did not finish within 60 s", NvmlErrorCode.TIMEOUT),
        (255, "Unknown Error", NvmlErrorCode.UNKNOWN),
        (NOT_RUN, "cannot run nvidia-smi: [Errno 2] No such file", NvmlErrorCode.NOT_SUPPORTED),
    ],
)
def test_exit_codes_and_messages_map_to_nvml_codes(rc: int, out: str, code: NvmlErrorCode) -> None:
    smi = NvidiaSmi(Script((rc, out)))
    with pytest.raises(NvmlError) as e:
        smi.reset(BUS)
    assert e.value.code == code and e.value.op == "reset_gpu"
    assert " ".join(out.split())[:60] in str(e.value)  # the tool's own words, on one line


def test_reset_calls_the_tool_with_the_bus_id_and_succeeds_on_exit_0() -> None:
    script = Script((0, f"GPU {BUS} was successfully reset.\nAll done."))
    NvidiaSmi(script, binary="/host/usr/bin/nvidia-smi").reset(BUS)
    assert script.calls == [f"/host/usr/bin/nvidia-smi -r -i {BUS}"]


@pytest.mark.parametrize("bus", ["", "0", "-r", "00000000:3B:00.0 -q", "../../x"])
def test_a_bus_id_that_is_not_one_is_refused_before_running_anything(bus: str) -> None:
    script = Script()
    with pytest.raises(NvmlError) as e:
        NvidiaSmi(script).reset(bus)
    assert e.value.code == NvmlErrorCode.INVALID_ARGUMENT and script.calls == []


def test_persistence_mode_is_restored_even_when_the_reset_fails() -> None:
    script = Script((0, "Persistence mode disabled"), (255, IN_USE_TEXT), (0, "enabled"))
    with pytest.raises(NvmlError) as e:
        reset_gpu(NvidiaSmi(script), BUS, persistence_mode=True)
    assert e.value.code == NvmlErrorCode.IN_USE
    assert [c.split(" ", 1)[1] for c in script.calls] == [
        f"-pm 0 -i {BUS}",
        f"-r -i {BUS}",
        f"-pm 1 -i {BUS}",
    ]


def test_without_persistence_mode_only_the_reset_runs() -> None:
    script = Script()
    reset_gpu(NvidiaSmi(script), BUS, persistence_mode=False)
    assert script.calls == [f"nvidia-smi -r -i {BUS}"]


def test_a_long_output_is_cut_in_the_error() -> None:
    with pytest.raises(NvmlError) as e:
        NvidiaSmi(Script((255, "x" * 100_000))).reset(BUS)
    assert len(str(e.value)) < 700


# -- the real subprocess path --------------------------------------------------------------


def tool(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_subprocess_runner_runs_the_program_and_reports_its_exit(tmp_path: Path) -> None:
    ok = tool(tmp_path, 'echo "GPU $3 was successfully reset."; echo "All done."')
    NvidiaSmi(subprocess_runner, ok).reset(BUS)
    busy = tool(tmp_path, f"printf '{IN_USE_TEXT.splitlines()[1]}\\n' >&2; exit 255")
    with pytest.raises(NvmlError) as e:
        NvidiaSmi(subprocess_runner, busy).reset(BUS)
    assert e.value.code == NvmlErrorCode.IN_USE


def test_subprocess_runner_missing_program_and_time_limit(tmp_path: Path) -> None:
    rc, out = subprocess_runner([str(tmp_path / "absent")], {}, None)
    assert rc == NOT_RUN and "absent" in out
    with pytest.raises(NvmlError) as e:
        NvidiaSmi(subprocess_runner, str(tmp_path / "absent")).reset(BUS)
    assert e.value.code == NvmlErrorCode.NOT_SUPPORTED
    slow = tool(tmp_path, "sleep 5")
    rc, out = subprocess_runner([slow], {}, None, timeout_s=0.2)
    assert rc == TIMED_OUT and "0.2 s" in out
    garbage = tool(tmp_path, r"printf '\377\376 bad bytes'; exit 1")
    rc, out = subprocess_runner([garbage], {}, None)  # undecodable output never raises
    assert rc == 1 and "bad bytes" in out
