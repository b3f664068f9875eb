"""``gpuslice agent``: run the node agent (``--fake``: against the fake NVML, no GPU needed).

With ``--fake`` the agent drives an in-memory NVML of catalog GPUs (``--fake-gpus
A100-SXM4-80GB:2,A30:1``), reads its spec from a local file (``--spec``, JSON or YAML: a
NodePartitioning or a bare spec; the status goes to ``<file>.status.json``) and prints the
devices it would advertise.  ``--once`` runs a single pass and prints the status: a table of
devices and conditions, or the NodePartitioning status document with ``-o json|yaml``.
Without ``--fake`` it uses pynvml, the kubelet's PodResources API and device-plugin sockets, and
the NodePartitioning named after ``GPUSLICE_NODE_NAME`` in the cluster.  Unless ``--once``, both
serve ``/healthz`` and ``/metrics`` (``gpuslice_agent_*``, see :mod:`node_agent.metrics`) on
``GPUSLICE_METRICS_PORT`` (default 8082; 0 disables it).  The real agent, in both modes and
unless ``--once``, also renews its heartbeat Lease ``gpuslice-agent-<node>`` in
``GPUSLICE_POD_NAMESPACE`` every quarter of ``GPUSLICE_LEASE_SECONDS`` (default 40; 0: none),
as a task on the same event loop (:mod:`node_agent.lease`).

SIGTERM (the kubelet deleting the pod: a rollout, an opt-out, an uninstall) and SIGINT stop the
loop cleanly: a drain in progress gets its last pass (:meth:`node_agent.agent.Agent.run`), the
device-plugin sockets are removed, and nothing on the GPUs is touched on the way out -- MIG
instances, compute modes and the MPS daemons' state stay as they are.

One agent per node: the real agent holds an exclusive ``flock`` on ``agent.lock`` in
``GPUSLICE_STATE_DIR`` (the DRA agent on ``dra-agent.lock``) while it runs; a second one on the
same node (a surging rollout, a hand-started copy) exits 2 naming the file instead of registering
the same device plugin and changing the same GPUs (:func:`one_agent_per_node`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.options import add_catalog_argument, catalog_files, settings_problems
from gpuslice.output import Column, add_output_argument, emit, render_table

HELP = "run the node agent (use --fake without a GPU)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fake", action="store_true", help="use the fake NVML (no GPU needed)")
    parser.add_argument(
        "--fake-gpus",
        default="A100-SXM4-80GB:1",
        help="fake GPUs as MODEL:COUNT[,MODEL:COUNT] (catalog model names; default %(default)s)",
    )
    parser.add_argument(
        "--fake-mig-enabled", action="store_true", help="fake GPUs start with MIG mode on"
    )
    parser.add_argument(
        "--spec",
        help="(--fake) spec file, JSON or YAML; re-read when it changes. The agent writes its "
        "status beside it, to SPEC.status.json (where the real agent writes the "
        "NodePartitioning's status)",
    )
    parser.add_argument("--once", action="store_true", help="one reconcile pass, print the status")
    parser.add_argument(
        "--dra",
        action="store_true",
        help="run as a DRA driver (also GPUSLICE_DRA=true): publish ResourceSlices and prepare "
        "ResourceClaims through the kubelet's DRA plugin API instead of device plugins and the "
        "NodePartitioning (Kubernetes >= 1.35 with partitionable devices)",
    )
    parser.add_argument(
        "--dra-publish",
        metavar="{shaped,all}",
        default=None,
        help="(--dra) which devices to publish (also GPUSLICE_DRA_PUBLISH; default shaped): "
        "shaped, the placements the partitioner planned in the node's NodePartitioning (the "
        "whole GPU where it planned none) plus the allocated devices; all, every placement "
        "(immediate first-fit allocation, but claims fragment GPUs)",
    )
    parser.add_argument(
        "--check-catalog",
        action="store_true",
        help="read-only: ask NVML for this machine's MIG profiles and placements, compare them "
        "with the catalog, print the report; exit 0 agree, 1 differ, 2 NVML unusable",
    )
    add_catalog_argument(
        parser, old=("--catalog-file",), env="after the files of GPUSLICE_CATALOG_FILES"
    )
    add_output_argument(parser, what="the status (--once) or the report (--check-catalog)")


def _gib(mib: int) -> str:
    return f"{mib // 1024}gb" if mib % 1024 == 0 else f"{mib}MiB"


DEVICE_COLUMNS = (
    Column("gpu", "gpu", align="right"),
    Column("model", "model"),
    Column("MIG", "mig"),
    Column("slice", "slice"),
    Column("device id", "device", wide=True),
    Column("uuid", "uuid", wide=True),
    Column("used", "used"),
)
CONDITION_COLUMNS = (
    Column("condition", "type"),
    Column("status", "status"),
    Column("reason", "reason"),
    Column("message", "message"),
    Column("since", "lastTransitionTime", wide=True),
)


def _device_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for g in status["gpus"]:
        gpu = {"gpu": g["index"], "model": g["model"], "mig": g["migEnabled"], "uuid": g["uuid"]}
        slices = [
            {"slice": f"{m['profile']}@{m['start']}", "device": m["deviceId"], "used": m["used"]}
            for m in g["mig"]
        ] + [
            {
                "slice": f"{_gib(m['memoryMiB'])}/{m['activeThreadPercentage']}%",
                "device": m["deviceId"],
                "used": m["used"],
            }
            for m in g["mps"]
        ]
        rows += [gpu | s for s in slices] or [gpu | {"slice": None, "used": None}]
    return rows


def render_status(status: dict[str, Any], wide: bool = False, width: int | None = None) -> str:
    """The table form of a NodePartitioning status (``gpuslice agent --once``)."""
    lines = [
        f"plan {status['planId'] or '-'}, spec generation {status['observedGeneration']}",
        render_table(DEVICE_COLUMNS, _device_rows(status), wide=wide, width=width),
        "",
        render_table(CONDITION_COLUMNS, status["conditions"], wide=wide, width=width),
    ]
    if status.get("lastError"):
        lines += ["", f"last error: {status['lastError']}"]
    return "\n".join(lines)


CHECK_COLUMNS = (
    Column("gpu", "index", align="right"),
    Column("name", "name"),
    Column("pci id", "pci", wide=True),
    Column("catalog model", "model"),
    Column("MIG", "mig", wide=True),
    Column("profiles", "profiles", align="right"),
    Column("differences", "differences", align="right"),
    Column("unverified", "unverified", align="right"),
)
DIFFERENCE_COLUMNS = (Column("gpu", "index", align="right"), Column("difference", "text"))


def render_check(doc: Mapping[str, Any], wide: bool = False, width: int | None = None) -> str:
    """The table form of the catalog check (``gpuslice agent --check-catalog``): one row per
    GPU, then every difference (``-o wide``: the unverified profile indexes too)."""
    rows = []
    listed: list[dict[str, Any]] = []
    for g in doc["gpus"]:
        gpu = g["gpu"]
        mig = "on" if gpu["mig_current"] else ("pending" if gpu["mig_pending"] else "off")
        rows.append(
            {
                "index": gpu["index"],
                "name": gpu["name"],
                "pci": gpu["pci_device_id"],
                "model": g["catalogModel"],
                "mig": mig if gpu["mig_capable"] else "not capable",
                "profiles": len(gpu["profiles"]),
                "differences": len(g["differences"]),
                "unverified": len(g["unverified"]),
            }
        )
        listed += [{"index": gpu["index"], "text": d} for d in g["differences"]]
        if wide:
            listed += [{"index": gpu["index"], "text": f"unverified {u}"} for u in g["unverified"]]
    verdict = "the catalog agrees with the driver" if doc["agree"] else "the catalog differs"
    lines = [verdict, render_table(CHECK_COLUMNS, rows, wide=wide, width=width)]
    if listed:
        lines += ["", render_table(DIFFERENCE_COLUMNS, listed, wide=wide, width=width)]
    return "\n".join(lines)


def check_catalog(catalog: Any, output: str, nvml: Any = None) -> int:
    """``--check-catalog``: probe the driver read-only (:mod:`node_agent.catalog_probe`), print
    the report in the ``-o`` format; 0 agree, 1 differ, 2 NVML unusable."""
    import importlib

    from node_agent.catalog_probe import probe, report

    try:
        gpus = probe(
            nvml if nvml is not None else importlib.import_module("pynvml"),
            catalog.gi_profile_count(),
        )
    except Exception as e:  # no driver, no library: nothing to compare
        print(f"gpuslice agent: NVML unavailable: {e}", file=sys.stderr)
        return 2
    doc = report(catalog, gpus)
    emit(doc, output, lambda wide, width: render_check(doc, wide, width))
    return 0 if doc["agree"] else 1


def _print_status(status: Any, output: str) -> None:
    doc = status.model_dump(mode="json")
    emit(doc, output, lambda wide, width: render_status(doc, wide, width))


def parse_fake_gpus(text: str) -> list[tuple[str, int]]:
    """``MODEL:COUNT[,MODEL:COUNT]`` -> ``[(model, count)]``, at most MAX_GPUS_PER_NODE GPUs."""
    from contract.input_files import MAX_GPUS_PER_NODE

    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, count = part.rpartition(":")
        if not name:
            name, count = count, "1"
        try:
            n = int(count) if len(count) <= 6 else -1
        except ValueError:
            n = -1
        if n < 1:
            raise BadInput(
                f"--fake-gpus entry {part[:60]!r}: expected MODEL:COUNT with COUNT >= 1, "
                "e.g. A100-SXM4-80GB:2"
            )
        out.append((name, n))
        if sum(c for _, c in out) > MAX_GPUS_PER_NODE:
            raise BadInput(
                f"--fake-gpus {text[:60]!r}: more than {MAX_GPUS_PER_NODE} GPUs on one node; "
                "give fewer"
            )
    if not out:
        raise BadInput("--fake-gpus is empty; e.g. --fake-gpus A100-SXM4-80GB:2")
    return out


class _NoPods:
    """In-use source of a node without a kubelet: no device is held by a pod."""

    async def in_use_device_ids(self) -> set[str]:
        return set()


def _print_devices(devices: Mapping[str, Sequence[Any]]) -> None:
    summary = {r: [d.id for d in ds] for r, ds in devices.items()}
    logging.getLogger("gpuslice.agent").info("advertised devices: %s", summary)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from contract.catalog_files import load_catalog
    from node_agent.settings import AgentSettings
    from planner.catalog import CatalogError

    try:
        settings = AgentSettings()  # type: ignore[call-arg]  # fields come from GPUSLICE_* env
    except ValidationError as e:
        problems = settings_problems(e.errors(), AgentSettings.RENAMED_ENV)
        raise BadInput(f"invalid agent settings: {problems}") from None
    from contract.logs import configure as configure_logging

    # GPUSLICE_LOG_FORMAT (text or json) and GPUSLICE_LOG_LEVEL; every record names the node.
    configure_logging(
        settings.log_format,
        settings.log_level,
        constant={"node": settings.node_name} if settings.node_name else None,
    )
    for note in [*settings.renamed_env_notes(), *settings.unknown_env_notes()]:
        logging.getLogger("gpuslice.agent").warning(note)
    try:
        catalog = load_catalog([*settings.catalog_files, *catalog_files(args.catalog)])
    except CatalogError as e:
        raise BadInput(str(e)) from e
    if args.check_catalog:
        if args.fake:
            raise BadInput("--check-catalog reads the real driver; run it without --fake")
        return check_catalog(catalog, args.output)
    dra = args.dra or settings.dra
    if dra and (args.fake or args.once or args.spec):
        raise BadInput(
            "DRA mode serves the kubelet and the cluster's ResourceClaims: it runs without "
            "--fake, --once and --spec"
        )
    if args.dra_publish is not None and args.dra_publish not in ("shaped", "all"):
        raise BadInput(f"--dra-publish {args.dra_publish[:40]!r}: expected shaped or all")
    if dra:
        return asyncio.run(_run_dra(settings, catalog, args.dra_publish or settings.dra_publish))
    if args.dra_publish is not None:
        raise BadInput("--dra-publish is for DRA mode (--dra or GPUSLICE_DRA=true)")
    if args.fake:
        return asyncio.run(_run_fake(args, settings, catalog))
    if args.spec:
        raise BadInput("--spec is for --fake; the real agent reads its NodePartitioning")
    return asyncio.run(_run_real(args, settings, catalog))


async def _run_fake(args: argparse.Namespace, settings: Any, catalog: Any) -> int:
    from node_agent.agent import Agent, FileSpecSource, InMemorySpecSource, SpecSource
    from node_agent.metrics import MeteredNvml
    from node_agent.mps import FakeSupervisor
    from node_agent.nvml_fake import FakeNvml
    from node_agent.reconciler import Reconciler
    from node_agent.xid import XidLedger, XidWatcher
    from planner.catalog import CatalogError

    try:
        models = [catalog.model(n) for n, c in parse_fake_gpus(args.fake_gpus) for _ in range(c)]
    except CatalogError as e:
        raise BadInput(f"--fake-gpus: {e}") from e
    nvml = FakeNvml(models, mig_enabled=args.fake_mig_enabled)
    metrics, health = _observability(settings)
    xid_ledger = XidLedger()
    reconciler = Reconciler(
        MeteredNvml(nvml, metrics),
        _NoPods(),
        FakeSupervisor(nvml=nvml),
        catalog,
        mps_pipe_root=settings.mps_pipe_root,
        mps_log_root=settings.mps_log_root,
        publish=_print_devices,
        xids=xid_ledger,
    )
    name = settings.node_name or "fake-node"
    source: SpecSource = FileSpecSource(args.spec, name) if args.spec else InMemorySpecSource(name)
    try:
        await source.get()  # a bad spec file is bad input (later edits are retried and logged)
    except ValueError as e:
        raise BadInput(str(e)) from e
    agent = Agent(
        reconciler,
        source,
        resync_seconds=settings.resync_seconds,
        mps_liveness_seconds=settings.mps_liveness_seconds,
        retry_seconds=settings.reconcile_retry_seconds,
        metrics=metrics,
        health=health,
        xids=XidWatcher(nvml, xid_ledger, ignore=settings.xid_ignore, enabled=settings.xid_watch),
    )
    if args.once:
        try:
            result = await agent.run_once()
        except ValueError as e:
            raise BadInput(str(e)) from e
        _print_status(result.status, args.output)
        return 0 if result.applied or args.spec is None else 1
    with _serving(settings, metrics, health):
        await agent.run(_stop_on_signals())
    return 0


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the loop then ends after its current pass)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    return stop


def _observability(settings: Any) -> tuple[Any, Any]:
    """The agent's metrics and health state."""
    from node_agent.health import AgentHealth
    from node_agent.metrics import AgentMetrics

    metrics = AgentMetrics()
    health = AgentHealth(settings.resync_seconds, settings.health_failure_resyncs)
    return metrics, health


@contextlib.contextmanager
def _serving(settings: Any, metrics: Any, health: Any) -> Iterator[None]:
    """Serve /healthz and /metrics on ``metrics_port`` (0: not at all) while the agent runs."""
    if not settings.metrics_port:
        yield
        return
    from node_agent.health import MonitoringServer

    try:
        server = MonitoringServer(health, metrics.registry, settings.metrics_port)
    except OSError as e:
        raise BadInput(
            f"cannot serve /healthz and /metrics on port {settings.metrics_port}: {e}; "
            "set GPUSLICE_METRICS_PORT to a free port (0 disables it)"
        ) from e
    server.start()
    try:
        yield
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def _heartbeat(settings: Any, api: Any) -> AsyncIterator[asyncio.Task[None] | None]:
    """Renew the agent's heartbeat Lease (:mod:`node_agent.lease`) through ``api`` (a
    ``CustomObjectsApi``) in a task on this event loop while the body runs, and stop it after;
    the task, or ``None`` when there is no Lease (``lease_seconds`` 0, no ``pod_namespace``)."""
    from node_agent.lease import from_settings

    lease = from_settings(settings, api)
    if lease is None:
        yield None
        return
    stop = asyncio.Event()
    task = asyncio.create_task(lease.run(stop), name=f"heartbeat Lease {lease.where}")
    try:
        yield task
    finally:
        stop.set()
        # a renewal in flight ends within its request timeout; past that it is cancelled
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, lease.request_timeout_s + 1)


@contextlib.contextmanager
def one_agent_per_node(state_dir: str, name: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<state_dir>/<name>`` while the agent runs.

    The state dir is a host directory, so a second agent on the node (another pod of the
    DaemonSet during a surging rollout, or one started by hand) finds the lock taken and exits
    2 naming the file, before it registers a device plugin or touches a GPU.  The kernel drops
    the lock when the process ends, however it ends (the file itself stays).  An empty
    ``state_dir`` (state in memory only) takes no lock; a state dir where the file cannot be
    opened or locked (read-only, no flock support) is a warning, and the agent runs without it.
    """
    if not state_dir:
        yield
        return
    import fcntl

    log = logging.getLogger("gpuslice.agent")
    path = os.path.join(state_dir, name)
    try:
        os.makedirs(state_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    except OSError as e:
        log.warning("cannot open %s (%s): running without the one-agent-per-node lock", path, e)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(
                f"another gpuslice agent holds {path}: one agent runs per node (two would both "
                "register the device plugin and change the same GPUs through NVML); stop the "
                "other one, or wait until it has exited (a rollout must not surge: maxSurge 0)"
            ) from None
        except OSError as e:
            log.warning("cannot lock %s (%s): running without the one-agent-per-node lock", path, e)
        yield
    finally:
        os.close(fd)  # releases the lock


async def _run_real(args: argparse.Namespace, settings: Any, catalog: Any) -> int:
    if not settings.node_name:
        raise BadInput("GPUSLICE_NODE_NAME is not set (DaemonSet: downward API spec.nodeName)")
    with one_agent_per_node(settings.state_dir, "agent.lock"):
        return await _run_real_locked(args, settings, catalog)


async def _run_real_locked(args: argparse.Namespace, settings: Any, catalog: Any) -> int:
    from node_agent.agent import Agent, KubeSpecSource
    from node_agent.allocations import AllocationLedger, LedgerInUse
    from node_agent.deviceplugin import DevicePluginManager
    from node_agent.gpu_reset import NvidiaSmi
    from node_agent.kubelet_checkpoint import KubeletCheckpoint
    from node_agent.metrics import MeteredNvml
    from node_agent.mps import MpsControlSupervisor
    from node_agent.nvml_pynvml import PynvmlAdapter
    from node_agent.podresources import PodResourcesClient
    from node_agent.reconciler import Reconciler
    from node_agent.xid import XidLedger, XidWatcher

    if not settings.node_name:
        raise BadInput("GPUSLICE_NODE_NAME is not set (DaemonSet: downward API spec.nodeName)")
    metrics, health = _observability(settings)
    ledger = AllocationLedger(
        settings.allocation_grace_seconds,
        path=f"{settings.state_dir.rstrip('/')}/allocations.json" if settings.state_dir else None,
    )
    source = KubeSpecSource(settings.node_name)
    plugins = DevicePluginManager(settings.device_plugin_dir, on_allocate=ledger.record)
    await plugins.start()
    try:
        # in-cluster service account, else kubeconfig: fails at start
        custom = await source.connect()
        nvml = MeteredNvml(
            PynvmlAdapter(smi=NvidiaSmi(binary=settings.nvidia_smi), catalog=catalog), metrics
        )
        xid_ledger = XidLedger()
        reconciler = Reconciler(
            nvml,
            LedgerInUse(
                PodResourcesClient(
                    settings.pod_resources_socket,
                    own_pod=(
                        (settings.pod_namespace, settings.pod_name)
                        if settings.pod_name and settings.pod_namespace
                        else None
                    ),
                ),
                ledger,
                # ordinary init containers' devices, which PodResources List leaves out
                KubeletCheckpoint.in_dir(settings.device_plugin_dir),
            ),
            MpsControlSupervisor(),
            catalog,
            mps_pipe_root=settings.mps_pipe_root,
            mps_log_root=settings.mps_log_root,
            publish=plugins.set_devices,
            xids=xid_ledger,
        )
        agent = Agent(
            reconciler,
            source,
            resync_seconds=settings.resync_seconds,
            mps_liveness_seconds=settings.mps_liveness_seconds,
            retry_seconds=settings.reconcile_retry_seconds,
            metrics=metrics,
            health=health,
            on_draining=plugins.set_avoided,
            xids=XidWatcher(
                nvml, xid_ledger, ignore=settings.xid_ignore, enabled=settings.xid_watch
            ),
        )
        if args.once:
            result = await agent.run_once()
            _print_status(result.status, args.output)
            return 0
        async with _heartbeat(settings, custom):
            with _serving(settings, metrics, health):
                await agent.run(_stop_on_signals())
    finally:
        await plugins.stop()
        await source.close()
    return 0


async def _run_dra(settings: Any, catalog: Any, publish: str) -> int:
    if not settings.node_name:
        raise BadInput("GPUSLICE_NODE_NAME is not set (DaemonSet: downward API spec.nodeName)")
    with one_agent_per_node(settings.state_dir, "dra-agent.lock"):
        return await _run_dra_locked(settings, catalog, publish)


async def _run_dra_locked(settings: Any, catalog: Any, publish: str) -> int:
    from kubernetes_asyncio import client, config

    from node_agent.agent import KubeSpecSource
    from node_agent.dra_checkpoint import Checkpoint
    from node_agent.dra_driver import DraDriver
    from node_agent.dra_prepare import DraPreparer
    from node_agent.dra_publish import SlicePublisher
    from node_agent.dra_shape import ShapeApi
    from node_agent.dra_slices import DraGpu
    from node_agent.draplugin import DraKubeletPlugin, KubeClaimReader
    from node_agent.gpu_reset import NvidiaSmi
    from node_agent.metrics import MeteredNvml
    from node_agent.nvml_pynvml import PynvmlAdapter
    from node_agent.xid import XidLedger, XidWatcher

    if not settings.node_name:
        raise BadInput("GPUSLICE_NODE_NAME is not set (DaemonSet: downward API spec.nodeName)")
    from node_agent.nvml import NvmlError

    metrics, health = _observability(settings)
    state = settings.state_dir.rstrip("/")
    try:
        nvml = MeteredNvml(
            PynvmlAdapter(smi=NvidiaSmi(binary=settings.nvidia_smi), catalog=catalog), metrics
        )
        preparer = DraPreparer(
            nvml,
            catalog,
            node=settings.node_name,
            checkpoint=Checkpoint(f"{state}/dra-claims.json" if state else None),
            cdi_dir=settings.cdi_dir,
        )
        # a GPU NVML cannot read now is left out (gpu_models): each round tries it again and
        # the driver publishes it once it reads (DraPreparer.read_pending)
        uuids = {g.index: g.uuid for g in nvml.gpus(isolate=True) if g.read_error is None}
    except NvmlError as e:
        raise BadInput(
            f"NVML is not usable ({e}): the DRA agent runs on a GPU node with the NVIDIA driver "
            "and the NVIDIA container runtime (the chart's DaemonSet)"
        ) from None
    gpus = [DraGpu(i, uuids[i], m) for i, m in sorted(preparer.models.items()) if i in uuids]
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as not_in_pod:
        try:
            await config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError) as e:
            raise BadInput(
                f"cannot connect to the Kubernetes API: not in a pod ({not_in_pod}) and no "
                f"usable kubeconfig ({e}); run the DRA agent in its DaemonSet, or set KUBECONFIG"
            ) from None
    async with client.ApiClient(configuration) as api_client:
        core = client.CoreV1Api(api_client)
        node = await core.read_node(settings.node_name)
        custom = client.CustomObjectsApi(api_client)

        async def node_uid() -> str | None:
            uid: str | None = (await core.read_node(settings.node_name)).metadata.uid
            return uid

        publisher = SlicePublisher(
            custom,
            settings.node_name,
            gpus,
            node_uid=node.metadata.uid,
            node_uid_reader=node_uid,
        )

        plugin = DraKubeletPlugin(
            preparer,
            KubeClaimReader(custom),
            registry_dir=settings.dra_registry_dir,
            plugin_dir=settings.dra_plugin_dir,
            metrics=metrics,
        )
        shaped = publish == "shaped"
        driver = DraDriver(
            plugin,
            publisher,
            resync_s=settings.resync_seconds,
            retry_s=settings.reconcile_retry_seconds,
            health=health,
            spec_source=KubeSpecSource(settings.node_name, custom) if shaped else None,
            claims=ShapeApi(custom, settings.node_name) if shaped else None,
            spec_poll_s=settings.dra_spec_poll_seconds,
            xids=XidWatcher(
                nvml, XidLedger(), ignore=settings.xid_ignore, enabled=settings.xid_watch
            ),
            metrics=metrics,
        )
        async with _heartbeat(settings, custom):
            with _serving(settings, metrics, health):
                await driver.run(_stop_on_signals())
    return 0
