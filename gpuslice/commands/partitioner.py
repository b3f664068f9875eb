"""``gpuslice partitioner``: run the partitioner controller (kopf, standalone, cluster-wide).

Every setting is a flag (``--batch-timeout-seconds 30``) and a ``GPUSLICE_*`` environment
variable; flags win.  Peering: the controller runs kopf ``standalone`` — deploy one replica with
the ``Recreate`` strategy (the chart does); spec writes are resourceVersion-guarded, so an
accidental second replica wastes work but cannot corrupt a spec.  The NodePartitioning CRD
must be installed first (the chart's ``crds/``).
"""

from __future__ import annotations

import argparse
import asyncio

from pydantic import ValidationError

from gpuslice.cli import BadInput
from partitioner.settings import PartitionerSettings

HELP = "run the partitioner controller (kopf, standalone: one replica, Recreate strategy)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, info in PartitionerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.get_default(call_default_factory=True)
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            help=f"{info.description} (default: {default!r}; env GPUSLICE_{name.upper()})",
        )


def _describe(loc: tuple[int | str, ...], msg: str) -> str:
    if not loc:
        return msg
    name = str(loc[0])
    return f"{name} (--{name.replace('_', '-')} or GPUSLICE_{name.upper()}): {msg}"


def _settings(args: argparse.Namespace) -> PartitionerSettings:
    given = {
        k: getattr(args, k)
        for k in PartitionerSettings.model_fields
        if getattr(args, k, None) is not None
    }
    try:
        return PartitionerSettings(**given)
    except ValidationError as e:
        problems = "; ".join(_describe(err["loc"], err["msg"]) for err in e.errors())
        raise BadInput(f"invalid partitioner settings: {problems}") from None


def run(args: argparse.Namespace) -> int:
    from partitioner.health import HealthServer
    from partitioner.operator import Controller, configure_logging, run_operator
    from planner.catalog import CatalogError

    settings = _settings(args)
    configure_logging(settings)  # kopf's records too: GPUSLICE_LOG_FORMAT, GPUSLICE_LOG_LEVEL
    try:
        controller = Controller(settings)
    except CatalogError as e:
        raise BadInput(str(e)) from None
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
