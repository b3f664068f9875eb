"""The chart refuses a surging agent rollout (review 4, badinput4 item 5).

``agent.updateStrategy.rollingUpdate.maxSurge`` above 0 would run a second agent on each GPU
node beside the old one during a rollout: both register the device plugin for the same
resources and change the same GPUs through NVML.  The schema admits only 0 (or no maxSurge);
the chart's validation template refuses it too, with the reason, where the schema is skipped
(``helm install --skip-schema-validation``).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpuslice"
RELEASE, NAMESPACE = "gs", "gpu-system"
WHERE = "/agent/updateStrategy/rollingUpdate/maxSurge"
KUBE = kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())


def strategy(**rolling: Any) -> dict[str, Any]:
    return {"agent": {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": rolling}}}


def daemonset(files: dict[str, str]) -> dict[str, Any]:
    texts = [text for path, text in files.items() if path.endswith(".yaml")]
    docs = [d for text in texts for d in yaml.safe_load_all(text) if d]
    (ds,) = [
        d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-agent")
    ]
    return ds


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def chart_without_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helm.Chart]:
    """The chart as ``--skip-schema-validation`` sees it: only the templates' checks apply."""
    copy = tmp_path_factory.mktemp("chart") / "gpuslice"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    with helm.Chart.load(copy) as loaded:
        yield loaded


SURGES = [1, 2, "1%", "100%", "25%"]


@pytest.mark.parametrize("surge", SURGES, ids=str)
def test_the_schema_refuses_a_surge(chart: helm.Chart, surge: Any) -> None:
    values = strategy(maxUnavailable=0, maxSurge=surge)
    with pytest.raises(helm.HelmValuesError, match=re.escape(WHERE)):
        chart.validate_schema(chart.merge_values(values))
    with pytest.raises(helm.HelmValuesError, match=re.escape(WHERE)):  # install and template too
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("surge", SURGES, ids=str)
def test_the_template_refuses_a_surge_and_says_why(
    chart_without_schema: helm.Chart, surge: Any
) -> None:
    with pytest.raises(helm.HelmRenderError) as refused:
        chart_without_schema.render(
            strategy(maxUnavailable=0, maxSurge=surge), name=RELEASE, namespace=NAMESPACE
        )
    message = str(refused.value)
    assert f"agent.updateStrategy.rollingUpdate.maxSurge ({surge}) must be 0 or unset" in message
    assert "second agent" in message and "maxUnavailable" in message


@pytest.mark.parametrize(
    "values",
    [
        strategy(maxUnavailable=1),
        strategy(maxUnavailable=1, maxSurge=0),
        strategy(maxUnavailable="10%", maxSurge="0%"),
        {},  # OnDelete, the default
    ],
    ids=["no-maxSurge", "maxSurge-0", "maxSurge-0%", "defaults"],
)
def test_no_surge_renders_a_valid_daemonset(
    chart: helm.Chart, chart_without_schema: helm.Chart, values: dict[str, Any]
) -> None:
    chart.validate_schema(chart.merge_values(values))
    for c in (chart, chart_without_schema):
        ds = daemonset(c.render(values, name=RELEASE, namespace=NAMESPACE))
        kubernetes_validate.validate(ds, KUBE, strict=True)
        expected = values.get("agent", {}).get("updateStrategy", {"type": "OnDelete"})
        assert ds["spec"]["updateStrategy"] == expected
