"""``gpuslice partitioner`` with an unusable kubeconfig: exit 2 naming the file, as ``status``.

Before, a missing CA file or a server that is not a URL gave kopf tracebacks and exit 1, and
``KUBECONFIG=/nonexistent`` a login retried every 60 s forever (review 4, badinput4 item 4).
``run_operator`` is replaced here: the check runs before kopf starts, so a refused file never
reaches it, and a usable one (or an in-cluster run) does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslice.cli import main
from gpuslice.commands import partitioner as partitioner_cmd

GOOD = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""
BAD = {
    "ca_file": GOOD.replace(
        "insecure-skip-tls-verify: true", "certificate-authority: /nonexistent/ca.crt"
    ),
    "server_not_a_url": GOOD.replace('"https://127.0.0.1:1"', '"not a url"'),
    "no_current_context": GOOD.replace("current-context: x", "current-context: y"),
    "token_file": GOOD.replace("token: abc", "tokenFile: /nonexistent/token"),
    "not_yaml": "clusters: [\n",
}


@pytest.fixture
def operator_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Replaces kopf (``run_operator``) and leaves the process outside a pod."""
    import partitioner.operator as operator_module

    calls: list[Any] = []

    async def fake_operator(controller: Any, **_: Any) -> None:
        calls.append(controller)

    monkeypatch.setattr(operator_module, "run_operator", fake_operator)
    monkeypatch.setattr(partitioner_cmd, "SERVICE_ACCOUNT_TOKEN", str(tmp_path / "no-token"))
    for key, value in {
        "GPUSLICE_METRICS_PORT": "0",
        "GPUSLICE_HEALTH_PORT": "0",
        "GPUSLICE_WEBHOOK_ENABLED": "false",
        "HOME": str(tmp_path / "home"),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return calls


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_unusable_kubeconfig_is_exit_2_naming_it(
    case: str,
    operator_calls: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kubeconfig = tmp_path / f"{case}.yaml"
    kubeconfig.write_text(BAD[case])
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert main(["partitioner"]) == 2
    err = _error(capsys)
    assert f"cannot connect: kubeconfig {kubeconfig} is not usable (" in err
    assert "check it with `kubectl config view`" in err
    assert operator_calls == []


def test_a_missing_kubeconfig_is_exit_2_not_a_login_retried_forever(
    operator_calls: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    assert main(["partitioner"]) == 2
    assert "kubeconfig /nonexistent is not usable" in _error(capsys)
    assert operator_calls == []


def test_the_text_is_the_one_status_gives_for_the_same_file(
    operator_calls: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text(BAD["ca_file"])
    assert main(["status", "--kubeconfig", str(kubeconfig)]) == 2
    status = _error(capsys).split("error: ", 1)[1]
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert main(["partitioner"]) == 2
    assert _error(capsys).split("error: ", 1)[1] == status


def test_a_usable_kubeconfig_starts_the_operator(
    operator_calls: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text(GOOD)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert main(["partitioner"]) == 0
    assert len(operator_calls) == 1


def test_in_a_pod_the_service_account_is_used_and_the_kubeconfig_not_checked(
    operator_calls: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    monkeypatch.setattr(partitioner_cmd, "SERVICE_ACCOUNT_TOKEN", str(token))
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")  # kopf's login never reads it here
    assert main(["partitioner"]) == 0
    assert len(operator_calls) == 1


def test_without_any_kubeconfig_nothing_is_checked(
    operator_calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)  # and HOME has no .kube/config
    assert main(["partitioner"]) == 0
    assert len(operator_calls) == 1


def test_a_home_kubeconfig_is_checked_when_kubeconfig_is_unset(
    operator_calls: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    home_config = tmp_path / "home" / ".kube" / "config"
    home_config.parent.mkdir(parents=True)
    home_config.write_text(BAD["server_not_a_url"])
    assert main(["partitioner"]) == 2
    assert f"kubeconfig {home_config} is not usable" in _error(capsys)
