"""The operator docs (README, docs/operations.md, the chart's README and NOTES.txt) against the
code: every statement this issue added about GPU Operator coexistence, MIG mode, the nos
migration and the pre-install what-if is tied to the code that makes it true."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import pytest

from contract.nodepartitioning import DesiredGpu, DesiredMigInstance
from gpuslice.cli import COMMANDS
from node_agent.gpu_plan import ObservedGpu, plan_gpu
from node_agent.nvml import GpuInfo
from partitioner.node_labels import COUNT_ANNOTATION, OPERANDS_OFF
from planner.catalog import default_catalog

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
CHART_README = (ROOT / "charts" / "gpuslice" / "README.md").read_text()


@pytest.fixture(scope="module")
def notes() -> str:
    with helm.Chart.load(ROOT / "charts" / "gpuslice") as chart:
        text: str = chart.render({}, name="gs", namespace="gpu-system")[
            "gpuslice/templates/NOTES.txt"
        ]
    return text


def problem_reasons() -> set[str]:
    """Every node-problem reason the label reading and adoption code can produce."""
    found: set[str] = set()
    for module in ("node_labels.py", "adoption.py"):
        text = (ROOT / "partitioner" / module).read_text()
        found |= set(re.findall(r'LabelProblem\(\s*"([A-Za-z]+)"', text))
    found |= {reason for reason, _ in OPERANDS_OFF.values()}
    return found


def test_every_node_problem_reason_is_documented() -> None:
    reasons = problem_reasons()
    assert len(reasons) >= 10
    missing = sorted(r for r in reasons if f"`{r}`" not in OPERATIONS)
    assert not missing, f"docs/operations.md does not name {missing}"


def agent_block_reasons() -> set[str]:
    """Every reason a node agent gives for a GPU it does not change (``Block``, ``_blocked``)."""
    found: set[str] = set()
    for path in (ROOT / "node_agent").glob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'Block\(\s*"([A-Z][A-Za-z]+)"', text))
        found |= set(re.findall(r'_blocked\(\s*\w+,\s*"([A-Z][A-Za-z]+)"', text))
        found |= set(re.findall(r'^\s*"([A-Z][A-Za-z]+InUse)",\s*$', text, re.MULTILINE))
    return found


def test_every_agent_reason_and_partitioner_event_is_documented() -> None:
    """What an operator reads in ``kubectl describe np`` or ``kubectl get events`` is in
    docs/operations.md: every agent block reason, every Event reason the partitioner posts."""
    reasons = agent_block_reasons()
    assert {"InstanceInUse", "InUseUnknown", "InvalidSpec", "MIGModePending"} <= reasons
    events: set[str] = set()
    for path in (ROOT / "partitioner").glob("*.py"):
        events |= set(
            re.findall(r'EmitEvent\(\s*[^,]+,\s*"(?:Normal|Warning)",\s*"([A-Za-z]+)"', path.read_text())
        )
    assert {"SpecConflict", "PatchRefused"} <= events
    missing = sorted(r for r in reasons | events if f"`{r}`" not in OPERATIONS)
    assert not missing, f"docs/operations.md does not name {missing}"


def test_gpu_operator_labels_are_the_ones_the_code_checks(notes: str) -> None:
    for label, (reason, _) in OPERANDS_OFF.items():
        for name, text in [
            ("README.md", README),
            ("docs/operations.md", OPERATIONS),
            ("chart README", CHART_README),
            ("NOTES.txt", notes),
        ]:
            assert f"{label}=false" in text, f"{name} does not say {label}=false"
        assert reason in OPERATIONS and reason in notes
    for kept in ("GPU Feature Discovery", "dcgm-exporter"):
        assert kept in OPERATIONS and kept in notes and kept in CHART_README
    # the old, false advice: the GPU Operator's ClusterPolicy has no devicePlugin affinity
    for text in (README, OPERATIONS, CHART_README, notes):
        assert "devicePlugin.affinity" not in text and "Operator's devicePlugin)" not in text


def test_the_agent_switches_mig_mode_and_the_docs_say_so(notes: str) -> None:
    a100 = default_catalog().model("A100-SXM4-80GB")
    info = GpuInfo(0, "GPU-0", "NVIDIA A100-SXM4-80GB", "20B2", 81920, mig_enabled=False)
    idle = ObservedGpu(info, a100, (), 0, (), frozenset(), True)
    desired = DesiredGpu(index=0, mig=[DesiredMigInstance(profile="7g.80gb", start=0)])
    assert plan_gpu(idle, desired, "mig").mig_mode is True  # the agent turns MIG mode on
    busy = ObservedGpu(info, a100, (), 1, (), frozenset(), True)
    assert plan_gpu(busy, desired, "mig").block is not None  # only while the GPU is idle
    for text in (OPERATIONS, notes):
        flat = " ".join(text.split())
        assert "does not toggle MIG mode" not in flat
        assert "switches MIG mode itself" in flat and "MIGModePending" in flat
        assert "nvidia-smi -r -i" in flat
    assert "switches MIG mode itself" in " ".join(README.split())
    reconciler = (ROOT / "node_agent" / "reconciler.py").read_text()
    assert '"MIGModePending"' in reconciler


def test_the_what_if_and_nos_check_commands_exist_as_documented(notes: str) -> None:
    assert "nos-check" in COMMANDS
    for text in (README, OPERATIONS):
        assert "kubectl get nodes,pods -A -o json" in text
        assert "gpuslice plan --snapshot" in text and "gpuslice nos-check --snapshot" in text
    assert "gpuslice nos-check --snapshot" in notes
    assert COUNT_ANNOTATION in OPERATIONS and COUNT_ANNOTATION in README
