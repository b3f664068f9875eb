"""``gpuslice partitioner``: run the partitioner controller (kopf, standalone, cluster-wide).

Every setting is a flag (``--batch-timeout-seconds 30``) and a ``GPUSLICE_*`` environment
variable; flags win.  The catalog override files are ``--catalog FILE`` (repeatable or
comma-separated, as in every command; ``--catalog-files`` is its deprecated spelling).
``--help`` shows each default as it is written (``cpsat``, ``true``).  kopf runs
``standalone`` (no peering); with leader election on (``--leader-election-enabled``, the
chart's default with 2 replicas) only the replica holding the Lease plans and writes
(:mod:`partitioner.leader`); with it off, deploy one replica with the ``Recreate`` strategy.
Spec writes are resourceVersion-guarded either way.  The NodePartitioning CRD
must be installed first (the chart's ``crds/``).

Outside a pod (no service-account token) it logs in with the kubeconfig (``$KUBECONFIG``, else
``~/.kube/config``); that file is checked once before kopf starts (:func:`check_kubeconfig`), so
an unusable one is exit 2 naming it, as in ``gpuslice status``, not kopf's retried login.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import os
import typing
from typing import Any

from pydantic import ValidationError

from gpuslice.cli import BadInput
from gpuslice.options import (
    add_catalog_argument,
    catalog_files,
    deprecated_alias,
    settings_problems,
)
from partitioner.settings import PartitionerSettings

HELP = "run the partitioner controller (kopf; leader election over a Lease when enabled)"


FLAG_NAMES = {"catalog_files": "--catalog"}
"""Settings whose flag is not ``--<field-name>``: the CLI's one name for the concept
(:mod:`gpuslice.options`); the field-named flag stays as a hidden deprecated spelling."""
OLD_FLAGS = {"batch_retry_seconds": "--retry-seconds"}
"""Flags of settings that were renamed, kept hidden and deprecated for one release."""


def plain(value: Any) -> str:
    """A default as the user writes it: ``cpsat``, not ``<Policy.CPSAT: 'cpsat'>``."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(plain(v) for v in value) or "none"
    if isinstance(value, str):
        return value or '""'
    return f"{value:g}" if isinstance(value, float) else str(value)


def _choices(annotation: Any) -> list[str] | None:
    """The values an enum or ``Literal`` field accepts, for the flag's metavar."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(m.value) for m in annotation]
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    if annotation is bool:
        return ["true", "false"]
    return None


def _metavar(name: str) -> str:
    for suffix in ("seconds", "port", "mib", "name", "dir"):
        if name.endswith("_" + suffix):
            return suffix.upper()
    return "VALUE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, info in PartitionerSettings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        env = f"GPUSLICE_{name.upper()}"
        if name == "catalog_files":
            add_catalog_argument(parser, env=f"replaces {env}")
            deprecated_alias(parser, "--catalog-files", "--catalog", "catalog", append=True)
            continue
        flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        choices = _choices(info.annotation)
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            metavar="{" + ",".join(choices) + "}" if choices else _metavar(name),
            help=f"{info.description} (default: {plain(default)}; env {env})",
        )
        if name in OLD_FLAGS:
            deprecated_alias(parser, OLD_FLAGS[name], flag, name)


def _settings(args: argparse.Namespace) -> PartitionerSettings:
    given: dict[str, Any] = {
        k: getattr(args, k)
        for k in PartitionerSettings.model_fields
        if getattr(args, k, None) is not None
    }
    if args.catalog:
        given["catalog_files"] = catalog_files(args.catalog)
    try:
        return PartitionerSettings(**given)
    except ValidationError as e:
        problems = settings_problems(
            e.errors(),
            PartitionerSettings.RENAMED_ENV,
            lambda name: FLAG_NAMES.get(name, "--" + name.replace("_", "-")),
        )
        raise BadInput(f"invalid partitioner settings: {problems}") from None


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
"""kopf's in-cluster login reads this file; where it exists the kubeconfig is not used."""


def _unusable(where: str, why: str) -> BadInput:
    """The text ``gpuslice status`` gives for the same file (:mod:`gpuslice.cluster_client`)."""
    why = " ".join(why.split())
    return BadInput(
        f"cannot connect: kubeconfig {where} is not usable ({why}); check it with "
        "`kubectl config view`"
    )


def _not_a_url(url: Any) -> bool:
    import yarl

    try:
        parsed = yarl.URL(str(url))
    except (ValueError, TypeError):
        return True
    return parsed.scheme not in ("http", "https") or not parsed.host


def check_kubeconfig() -> None:
    """Refuse (exit 2) the kubeconfig the partitioner would log in with, if it is unusable.

    The partitioner logs in as kopf does (``partitioner.operator``'s ``on.login``): the
    service account where its token file exists, else the kubeconfig.  In a pod with a
    service account nothing is checked.  Otherwise the file the user gave (``$KUBECONFIG``,
    else an existing ``~/.kube/config``) is loaded once, as the other commands load it
    (:class:`gpuslice.cluster_client.Cluster`) and as kopf's login reads it, and its API server
    must be an http(s) URL.  Without this a missing file was a login retried every minute
    forever, and a missing CA file or a server that is not a URL was kopf tracebacks and exit
    1.  With neither a service account nor a kubeconfig nothing is checked either (kopf
    reports it has no credentials)."""
    if os.path.exists(SERVICE_ACCOUNT_TOKEN):
        return
    where = os.environ.get("KUBECONFIG") or ""
    if not where.strip(os.pathsep):
        where = os.path.expanduser("~/.kube/config")
        if not os.path.exists(where):
            return
    from gpuslice.cluster_client import Cluster

    async def load() -> tuple[Any, Any]:
        api = await Cluster._connect(where, None)  # BadInput naming the file
        try:
            configuration = api.configuration
            return configuration.host, getattr(configuration, "proxy", None)
        finally:
            await api.close()

    host, proxy = asyncio.run(load())
    if _not_a_url(host):
        raise _unusable(where, f"its API server {str(host)!r} is not an http or https URL")
    if proxy and _not_a_url(proxy):
        raise _unusable(where, f"its proxy-url {str(proxy)!r} is not an http or https URL")

    # kopf reads the file itself, more simply; what it would fail on fails here, once
    import ssl

    import kopf
    import yaml

    try:
        info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
        if info is not None and str(info.server or "").startswith("https://"):
            info.as_ssl_context()  # the CA and client certificate files, as the writer loads them
    except (
        kopf.LoginError,
        OSError,
        ssl.SSLError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        yaml.YAMLError,
    ) as e:
        raise _unusable(where, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    if info is not None and _not_a_url(info.server):
        raise _unusable(where, f"its API server {str(info.server)!r} is not an http or https URL")


def run(args: argparse.Namespace) -> int:
    from partitioner.health import HealthServer
    from partitioner.operator import Controller, configure_logging, run_operator
    from planner.catalog import CatalogError

    settings = _settings(args)
    configure_logging(settings)  # kopf's records too: GPUSLICE_LOG_FORMAT, GPUSLICE_LOG_LEVEL
    for note in [*settings.renamed_env_notes(), *settings.unknown_env_notes()]:
        logging.getLogger("gpuslice.partitioner").warning(note)
    try:
        controller = Controller(settings)
    except CatalogError as e:
        raise BadInput(str(e)) from None
    check_kubeconfig()
    if settings.metrics_port:
        controller.metrics.serve(settings.metrics_port)
    health = None
    if settings.health_port:
        try:
            health = HealthServer(controller.health, settings.health_port)
        except OSError as e:
            raise BadInput(
                f"cannot serve /healthz and /readyz on port {settings.health_port}: {e}; "
                f"choose another GPUSLICE_HEALTH_PORT (0: do not serve them)"
            ) from None
        health.start()
    try:
        asyncio.run(run_operator(controller))
    finally:
        if health is not None:
            health.stop()
    return 0
