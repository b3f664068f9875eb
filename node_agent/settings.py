"""Node agent settings: pydantic-settings from ``GPUSLICE_*`` environment variables and flags.

``node_name`` comes from ``GPUSLICE_NODE_NAME`` (the DaemonSet sets it from the downward API,
``spec.nodeName``); the agent watches the NodePartitioning of that name.  Lists
(``catalog_files``) are comma-separated in the environment.  One port serves ``/metrics`` and
``/healthz`` (default 8082, so it does not clash with the partitioner's 8080/8081); ``/healthz``
turns unhealthy when reconcile passes have failed (raised, or could not read NVML: errors about
one GPU or PodResources do not count, :mod:`node_agent.agent`), or none has finished, for longer
than ``health_failure_resyncs`` x ``resync_seconds`` (:mod:`node_agent.health`).
``mps_liveness_seconds`` (``GPUSLICE_MPS_LIVENESS_SECONDS``, default 5, 0: off) is how often the
loop checks, between passes, that the MPS control daemons still run: a dead one wakes a pass at
once instead of waiting up to ``resync_seconds`` (:mod:`node_agent.agent`).
``xid_ignore`` (``GPUSLICE_XID_IGNORE``, comma-separated XID codes, default none) adds to the
application errors (13, 31, 43, 45, 68, 109) whose NVML XID events leave the devices Healthy;
any other XID marks the devices it hit Unhealthy until the agent restarts (:mod:`node_agent.xid`).
``xid_watch`` (``GPUSLICE_XID_WATCH``, default true) turns the XID watch off in both agent modes
(no watcher thread, nothing registered with NVML), for a driver whose NVML event sets misbehave,
as NVIDIA's device plugin offers ``DP_DISABLE_HEALTHCHECKS``.
``lease_seconds`` (``GPUSLICE_LEASE_SECONDS``, default 40; 0: none, else at least 10): the
agent renews the heartbeat Lease ``gpuslice-agent-<node>`` in its own namespace
(``pod_namespace``, ``GPUSLICE_POD_NAMESPACE``) every quarter of it, in both modes, and the
partitioner takes a node whose Lease was not renewed for that long as having no agent
(:mod:`node_agent.lease`).
``GPUSLICE_RETRY_SECONDS`` (the partitioner's name too, for its batch retry) is now
``GPUSLICE_RECONCILE_RETRY_SECONDS``; the old name is still read for one release, with a
warning in the log (:mod:`contract.renamed_env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from contract.common_settings import CommonSettings, split_commas

__all__ = ["MIN_LEASE_SECONDS", "AgentSettings"]

MIN_LEASE_SECONDS = 10.0
"""The shortest heartbeat Lease (``lease_seconds``) other than 0 (none)."""


class AgentSettings(CommonSettings):
    RENAMED_ENV: ClassVar[Mapping[str, str]] = {"GPUSLICE_RETRY_SECONDS": "reconcile_retry_seconds"}
    """Old environment variable -> the field now read (:mod:`contract.renamed_env`)."""

    node_name: str = Field(
        "",
        description="This node's name (GPUSLICE_NODE_NAME, from the downward API spec.nodeName).",
    )
    device_plugin_dir: str = Field(
        "/var/lib/kubelet/device-plugins",
        description="Kubelet device-plugin directory (kubelet.sock and the plugins' sockets).",
    )
    pod_resources_socket: str = Field(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        description="Kubelet PodResources API socket (which device ids pods hold).",
    )
    pod_name: str = Field(
        "",
        description="This agent's own pod name (GPUSLICE_POD_NAME, from the downward API "
        "metadata.name); with pod_namespace, a PodResources List that lacks this pod is "
        "incomplete (the kubelet is still loading pods after a restart) and nothing is "
        "destroyed on it. Empty: lists are not checked.",
    )
    pod_namespace: str = Field(
        "",
        description="This agent's own pod namespace (GPUSLICE_POD_NAMESPACE, from the downward "
        "API metadata.namespace); see pod_name. The heartbeat Lease lives here (lease_seconds); "
        "empty: no Lease.",
    )
    mps_pipe_root: str = Field(
        "/run/nvidia/mps", description="Parent of the per-GPU MPS pipe directories."
    )
    mps_log_root: str = Field(
        "/var/log/nvidia-mps", description="Parent of the per-GPU MPS log directories."
    )
    nvidia_smi: str = Field(
        "nvidia-smi",
        min_length=1,
        description="The host driver's nvidia-smi, which resets an Ampere GPU whose MIG-mode "
        "change is pending (the NVIDIA container runtime puts it on PATH with the utility "
        "capability).",
    )
    state_dir: str = Field(
        "/run/gpuslice",
        description="Host directory (tmpfs /run: cleared by a reboot) for the allocation ledger "
        "that survives agent restarts; empty: kept in memory only.",
    )
    allocation_grace_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="A device Allocate handed out counts as in use this long until the "
        "kubelet's PodResources shows it (node_agent.allocations).",
    )
    resync_seconds: float = Field(
        30.0, gt=0, description="Reconcile at least this often, even without a spec change."
    )
    reconcile_retry_seconds: float = Field(
        2.0, gt=0, description="Retry this soon after a pass that did not settle (errors)."
    )
    mps_liveness_seconds: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="Between passes, check this often that the MPS control daemons still run "
        "(get_server_list, one per daemon); a dead one wakes a pass at once, which advertises "
        "its devices Unhealthy until it runs again and restarts it (node_agent.agent). "
        "0: off (a dead daemon waits for the next resync).",
    )
    xid_ignore: Annotated[list[Annotated[int, Field(ge=1)]], NoDecode] = Field(
        default_factory=list,
        description="XID codes that leave the devices they hit Healthy, in addition to the "
        "application errors 13, 31, 43, 45, 68 and 109 (comma-separated in the environment); "
        "any other XID critical error marks them Unhealthy until the agent restarts "
        "(node_agent.xid).",
    )
    xid_watch: bool = Field(
        True,
        description="Watch NVML's XID critical-error events (both agent modes; node_agent.xid). "
        "false: no watcher thread is started and no GPU is registered for events, so a GPU or "
        "MIG instance an XID hits stays in service (for a driver whose NVML event sets "
        "misbehave, as NVIDIA's device plugin offers DP_DISABLE_HEALTHCHECKS).",
    )
    lease_seconds: float = Field(
        40.0,
        ge=0,
        description="Renew the heartbeat Lease gpuslice-agent-<node> in pod_namespace every "
        "quarter of this (both agent modes; node_agent.lease): the partitioner takes a node "
        "whose Lease was not renewed for this long (leaseDurationSeconds) as having no agent. "
        "0: no Lease; else at least 10. Needs pod_namespace (GPUSLICE_POD_NAMESPACE).",
    )
    metrics_port: int = Field(
        8082, ge=0, le=65535, description="Port of /metrics and /healthz (0: disabled)."
    )
    health_failure_resyncs: int = Field(
        3,
        ge=1,
        description="/healthz fails after passes failed (or none ran) this many resyncs long.",
    )
    dra: bool = Field(
        False,
        description="Run as a DRA driver (Kubernetes >= 1.35 with partitionable devices): "
        "publish ResourceSlices and prepare ResourceClaims through the kubelet's DRA plugin "
        "API, instead of device plugins and the NodePartitioning (node_agent.dra_driver).",
    )
    dra_registry_dir: str = Field(
        "/var/lib/kubelet/plugins_registry",
        description="Kubelet plugin-registration directory (DRA mode: <driver>-reg.sock).",
    )
    dra_plugin_dir: str = Field(
        "/var/lib/kubelet/plugins",
        description="Parent of the DRA plugin's socket directory (DRA mode: <driver>/dra.sock).",
    )
    dra_publish: Literal["shaped", "all"] = Field(
        "shaped",
        description="DRA mode: which devices to publish. shaped: the placements of the node's "
        "NodePartitioning spec (the partitioner's plan; the whole GPU where it plans none) "
        "plus the allocated devices; all: every placement of every GPU "
        "(node_agent.dra_shape).",
    )
    dra_spec_poll_seconds: float = Field(
        2.0,
        gt=0,
        description="DRA mode, shaped publishing: read the NodePartitioning this often and "
        "publish again when its spec changed.",
    )
    cdi_dir: str = Field(
        "/var/run/cdi",
        description="Where the container runtime reads generated CDI specs (DRA mode: one "
        "spec per prepared claim).",
    )

    @field_validator("xid_ignore", mode="before")
    @classmethod
    def _split_xids(cls, value: object) -> object:
        return split_commas(value)

    @field_validator("lease_seconds")
    @classmethod
    def _lease_off_or_long_enough(cls, value: float) -> float:
        if 0 < value < MIN_LEASE_SECONDS:
            raise ValueError(
                f"lease_seconds must be 0 (no Lease) or at least {MIN_LEASE_SECONDS:g} "
                f"(renewed every quarter of it), got {value:g}"
            )
        return value
