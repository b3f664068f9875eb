"""The partitioner's shutdown in the chart: a preStop sleep (``partitioner.shutdownDelaySeconds``)
before SIGTERM, so the webhook Service's endpoints drop a terminating pod while its admission
webhook still answers (kopf closes the listener at SIGTERM), and a termination grace period that
covers the sleep plus the shutdown itself.  Rendered and validated like tests/test_chart.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from test_chart import NAMESPACE, NEWEST_KUBE, OLDEST_KUBE, RELEASE, chart, one, render

__all__ = ["chart"]  # the module-scoped fixture, shared

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile"


def pod_spec(chart: helm.Chart, values: dict[str, Any], kube: str | None = None) -> Any:
    deployment = one(render(chart, values, kube_version=kube), "Deployment", "-partitioner")
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("kube", [OLDEST_KUBE, NEWEST_KUBE])
@pytest.mark.parametrize("delay", [None, 0, 12])
def test_a_preStop_sleep_precedes_sigterm_and_the_grace_period_covers_it(
    chart: helm.Chart, kube: str, delay: int | None
) -> None:
    values = {} if delay is None else {"partitioner": {"shutdownDelaySeconds": delay}}
    spec = pod_spec(chart, values, kube)
    (c,) = spec["containers"]
    seconds = 5 if delay is None else delay  # the default: 5 s
    if seconds:
        assert c["lifecycle"] == {"preStop": {"exec": {"command": ["/bin/sleep", str(seconds)]}}}
    else:
        assert "lifecycle" not in c
    assert spec["terminationGracePeriodSeconds"] == seconds + 30
    deployment = one(render(chart, values, kube_version=kube), "Deployment", "-partitioner")
    kubernetes_validate.validate(deployment, kube, strict=True)


def test_the_image_has_the_sleep_the_preStop_hook_runs() -> None:
    """The hook execs /bin/sleep in the partitioner's container: the runtime image must be a
    Debian-based one (coreutils), not distroless or scratch."""
    text = DOCKERFILE.read_text()
    images = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert len(images) == 1 and images[0].startswith("python:3.12") and "-slim-" in images[0]
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages[-1] == "${PYTHON_IMAGE}"  # the runtime stage is that image, with its /bin


@pytest.mark.parametrize("bad", [-1, 2.5, 301, "5"])
def test_schema_refuses_bad_shutdown_delays(chart: helm.Chart, bad: Any) -> None:
    values = {"partitioner": {"shutdownDelaySeconds": bad}}
    with pytest.raises(helm.HelmValuesError, match="/partitioner/shutdownDelaySeconds"):
        chart.validate_schema(chart.merge_values(values))
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
