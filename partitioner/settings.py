"""Partitioner settings: pydantic-settings, from ``GPUSLICE_*`` environment variables and flags.

Every field has a documented default; ``gpuslice partitioner --help`` lists them as flags
(``--batch-timeout-seconds``) and the environment spells them ``GPUSLICE_BATCH_TIMEOUT_SECONDS``.
Lists (``catalog_files``) are comma-separated in the environment.  ``GPUSLICE_RETRY_SECONDS``
(the node agent's name too, for another retry) is now ``GPUSLICE_BATCH_RETRY_SECONDS``; the old
name is still read for one release, with a warning in the log (:mod:`contract.renamed_env`).  The settings do not depend
on a namespace: the partitioner watches Nodes, Pods and NodePartitionings cluster-wide.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from contract.common_settings import CommonSettings
from partitioner.batching import BatchPolicy
from planner.settings import (
    MAX_SEED,
    MAX_TIME_LIMIT_S,
    PlacementWeight,
    PlannerSettings,
    Policy,
    ThreadPolicy,
)
from planner.snapshot import MIG_RESOURCE_PREFIX, mig_resource

if TYPE_CHECKING:
    from partitioner.decide import DecideConfig, PlanFn
    from planner.catalog import Catalog

__all__ = ["PartitionerSettings", "parse_mig_profiles", "parse_mps_sizes"]


def _weighted_parts(text: str) -> list[tuple[str, str, float]]:
    """``'a:3, b'`` -> ``[('a:3', 'a', 3.0), ('b', 'b', 1.0)]``: each comma-separated part, its
    key and its weight (1 when absent; 0.0 when it is not a finite number > 0, which the callers
    refuse with their setting's message)."""
    out: list[tuple[str, str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, weight = part.partition(":")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            w = 0.0
        out.append((part, key, w if 0 < w < float("inf") else 0.0))
    return out


def parse_mps_sizes(text: str | None) -> tuple[tuple[int, float], ...] | None:
    """``'10:3,20:1'`` (GiB:weight) -> ``((10240, 3.0), (20480, 1.0))``; ``None`` stays
    ``None`` (learned), ``''`` is ``()`` (only empty GPUs count).  A malformed value raises
    :class:`ValueError` naming the setting and the expected form."""
    if text is None:
        return None
    out: list[tuple[int, float]] = []
    for part, gib, w in _weighted_parts(text):
        try:
            size = int(gib)
        except ValueError:
            size = 0
        if size <= 0 or not w:
            raise ValueError(
                f"free_capacity_mps_sizes (GPUSLICE_FREE_CAPACITY_MPS_SIZES): {part!r} is not "
                "GiB:weight with a whole number of GiB > 0 and a weight > 0, e.g. '10:3,20:1'"
            )
        out.append((size * 1024, w))
    return tuple(out)


def _mig_resource_name(name: str) -> str:
    """``name`` (a profile or its resource name) as its resource name."""
    return name if name.startswith(MIG_RESOURCE_PREFIX) else mig_resource(name)


def _check_mig_targets(targets: tuple[tuple[str, float], ...] | None, catalog: Catalog) -> None:
    """Refuse target profiles (``freeCapacity.migProfiles``) no GPU model of the catalog has:
    a typo (``9g.99gb``) was accepted without a word and made every free MIG instance worth
    nothing to the planner.  :class:`~planner.catalog.CatalogError` (the CLI's exit 2) naming
    the closest known names."""
    if not targets:
        return
    from planner.catalog import CatalogError

    profiles = {mig_resource(p.name): p.name for m in catalog.models for p in m.profiles}
    unknown = sorted({name for name, _ in targets if _mig_resource_name(name) not in profiles})
    if not unknown:
        return
    hints = []
    for name in unknown:
        shown = name.removeprefix(MIG_RESOURCE_PREFIX)
        close = difflib.get_close_matches(shown, sorted(set(profiles.values())), n=3, cutoff=0.5)
        hints.append(f"{shown!r} (closest: {', '.join(close)})" if close else repr(shown))
    raise CatalogError(
        f"free_capacity_mig_profiles (partitioner.planner.freeCapacity.migProfiles) names "
        f"{'; '.join(hints)}, which no GPU model of the catalog has: name profiles of your "
        f"GPUs (gpuslice catalog lists them), or add the model with a catalog override file"
    )


def parse_mig_profiles(text: str | None) -> tuple[tuple[str, float], ...] | None:
    """``'7g.80gb:3,4g.40gb'`` (profile:weight, weight 1 by default) -> ``(("nvidia.com/mig-7g.80gb",
    3.0), ("nvidia.com/mig-4g.40gb", 1.0))``; a full resource name (``nvidia.com/mig-7g.80gb``)
    works too.  ``None`` stays ``None`` (learned), ``''`` is ``()`` (free instances count
    nothing).  A malformed value raises :class:`ValueError` naming the setting and the form."""
    if text is None:
        return None
    out: list[tuple[str, float]] = []
    for part, key, w in _weighted_parts(text):
        name = key.strip().removeprefix(MIG_RESOURCE_PREFIX)
        if not _MIG_PROFILE.fullmatch(name) or not w:
            raise ValueError(
                f"free_capacity_mig_profiles (GPUSLICE_FREE_CAPACITY_MIG_PROFILES): {part!r} is "
                "not profile:weight with a MIG profile name and a weight > 0, e.g. "
                "'7g.80gb:3,4g.40gb:1'"
            )
        out.append((mig_resource(name), w))
    return tuple(out)


_MIG_PROFILE = re.compile(r"\d+g\.\d+gb([+.][a-z][a-z0-9.]*)?")
"""A MIG profile name as the driver spells it (``1g.10gb``, ``1g.10gb+me``, ``1g.10gb.me``)."""


MAX_WEIGHT = 1_000_000
"""The largest objective weight: the planner's levels multiply weights by counts of GPUs,
instances and slots, which CP-SAT keeps in int64 (a weight of 2^63 failed every plan)."""


class PartitionerSettings(CommonSettings):
    RENAMED_ENV: ClassVar[Mapping[str, str]] = {"GPUSLICE_RETRY_SECONDS": "batch_retry_seconds"}
    """Old environment variable -> the field now read (:mod:`contract.renamed_env`)."""

    batch_timeout_seconds: float = Field(
        60.0, gt=0, description="Plan a batch at the latest this long after its first pod."
    )
    batch_idle_seconds: float = Field(
        10.0, gt=0, description="Plan a batch when no new pod arrived for this long."
    )
    batch_retry_seconds: float = Field(
        60.0,
        ge=0,
        description=(
            "A pod planned but still pending opens a new batch again after this long, once the "
            "cluster changed since its plan (an unchanged cluster would get the same plan)."
        ),
    )
    cycle_seconds: float = Field(
        1.0, gt=0, description="How often the controller re-evaluates the cluster state."
    )
    react_seconds: float = Field(
        0.1,
        ge=0,
        description="After a watch event that changes what the controller reads, the next "
        "cycle starts this long after the previous one ended instead of waiting out "
        "cycle_seconds (a pod is released as soon as its node reports its slice); also the "
        "least gap between cycles.  Equal to cycle_seconds: poll only.",
    )
    relist_seconds: float = Field(
        600.0,
        ge=0,
        description="List NodePartitionings (and ResourceClaims in DRA mode) this often, "
        "dropping those deleted while kopf's watch had a gap: a kind with no object left "
        "shows no gap to notice.  0: never (a ghost then stays until a restart).",
    )
    lease_poll_seconds: float = Field(
        10.0,
        ge=0,
        description="List the node agents' heartbeat Leases this often; a node whose agent has "
        "not renewed its Lease for the Lease's duration gets no promise and its planned pods "
        "are planned elsewhere (AgentSilent).  0: never (a stopped agent is then found by the "
        "apply deadline and the kubelet's listing only).",
    )
    agent_lease_namespace: str = Field(
        "",
        description="The namespace of the agents' heartbeat Leases (the release namespace); "
        "empty: list them in every namespace.",
    )
    planner_policy: Policy = Field(Policy.CPSAT, description="cpsat or greedy.")
    planner_time_limit_seconds: float = Field(
        1.0,
        gt=0,
        le=MAX_TIME_LIMIT_S,
        allow_inf_nan=False,
        description="CP-SAT wall-clock limit per plan.",
    )
    planner_seed: int = Field(
        0, ge=0, le=MAX_SEED, description="CP-SAT random seed (a 32-bit integer)."
    )
    weight_destroy: int = Field(
        4, ge=0, le=MAX_WEIGHT, description="Churn cost per free instance destroyed."
    )
    weight_create: int = Field(
        2, ge=0, le=MAX_WEIGHT, description="Churn cost per instance created."
    )
    weight_gpu_touched: int = Field(
        8, ge=0, le=MAX_WEIGHT, description="Churn cost per GPU reconfigured."
    )
    weight_free_gpu: int = Field(
        4, ge=0, le=MAX_WEIGHT, description="Value of a GPU left entirely free."
    )
    weight_free_block: int = Field(
        1, ge=0, le=MAX_WEIGHT, description="Value per slot of the largest free block."
    )
    free_capacity_cpu_milli: int | None = Field(
        None,
        ge=0,
        description="CPU (milli) a pod of the target workload needs: a node's free GPUs count "
        "as useful for at most as many pods of that size as its CPU could still hold; unset: "
        "the lower quartile of the waiting pods' requests; 0: CPU-blind.",
    )
    free_capacity_memory_mib: int | None = Field(
        None,
        ge=0,
        description="Memory (MiB) a pod of the target workload needs, as above; unset: the "
        "lower quartile of the waiting pods' requests; 0: memory-blind.",
    )
    free_capacity_mps_sizes: str | None = Field(
        None,
        description="The target workload's MPS slice sizes as GiB:weight pairs, comma-separated "
        "(e.g. '10:3,20:1'): an MPS GPU's free memory is valued by the share of such slices it "
        "could still hold (FGD's fragmentation); unset: learned from the slices in use and the "
        "waiting pods' requests; empty: only empty GPUs count.",
    )
    free_capacity_mig_profiles: str | None = Field(
        None,
        description="The target workload's MIG profiles as profile:weight pairs, "
        "comma-separated (e.g. '7g.80gb:3,4g.40gb:1'): a free MIG instance is valued by its "
        "memory slots times its profile's share, so plans keep free the instances the next pods "
        "ask for; unset: learned from the instances in use and the waiting pods' requests; "
        "empty: free instances count nothing.",
    )
    mps_polish: bool = Field(
        True,
        description="Polish the planner's MPS placements with its node-level packing measure "
        "(CPU-aware fragmentation plus expected waste, against the shapes of the pods bound to "
        "MPS nodes and waiting): the same pods placed, no more churn; false: the solve's "
        "placements as they are.",
    )
    mps_reserve_mib: int = Field(512, ge=0, description="GPU memory kept for the MPS server.")
    mps_thread_policy: ThreadPolicy = Field(
        ThreadPolicy.PROPORTIONAL,
        description="Each MPS slice's active-thread percentage: proportional to its share of "
        "the GPU's usable memory (default), or full (100: no compute limit).",
    )
    placement_weight: PlacementWeight = Field(
        PlacementWeight.PODS,
        description="What the objective's placement level counts: pods (default) or compute "
        "(GPU compute placed).",
    )
    reservation: bool = Field(
        True,
        description="Gate, reserve and release pods (plans are promises); false: nos's "
        "behaviour, pods are never gated and kube-scheduler binds whichever pod comes first.",
    )
    apply_deadline_seconds: float = Field(
        300.0,
        ge=0,
        description="A node must apply a spec within this long, else its "
        "planned pods are planned elsewhere and the node cools down.",
    )
    bind_deadline_seconds: float = Field(
        120.0,
        ge=0,
        description="A released pod should be bound within this long; then "
        "gpuslice reports why not (slice taken, node gone) and re-plans or reports it stranded.",
    )
    recreate_stranded_seconds: float = Field(
        600.0,
        ge=0,
        description="A released pod stranded this long (its node is gone, no longer accepts "
        "it, or has lost its agent or device plugin since) is evicted if a controller owns it, "
        "so the controller creates it again and the new pod is planned afresh. 0: never (the "
        "Stranded Event asks a person to delete it).",
    )
    cooldown_seconds: float = Field(
        300.0,
        ge=0,
        description="A node that missed an apply deadline is left out of plans this long.",
    )
    plugin_lag_seconds: float = Field(
        60.0,
        ge=0,
        description="A node whose kubelet lists none of the slices its agent reports for this "
        "long has lost its device plugin: nothing is promised there and its planned pods are "
        "planned elsewhere. Keep it above the kubelet's node status update period (10 s).",
    )
    drain_after_seconds: float = Field(
        900.0,
        ge=0,
        description="A gated pod no plan can place gets a drain (the GPUs "
        "closest to free are emptied for it) after waiting this long.",
    )
    drain_fraction: float = Field(
        0.1, ge=0, le=1, description="At most this fraction of the GPUs may be drained at once."
    )
    drain_queue_limit: float = Field(
        0.1,
        gt=0,
        description="Drains start only while the slice units waiting, or the GPUs they would "
        "fill (a MIG unit its compute slices of seven, an MPS unit its memory of 80 GiB), are at "
        "most this many per GPU of the cluster (a deeper queue is overload: a drain would idle GPUs younger pods "
        "could use, and free slices go to the smallest pods first, those past the last waiting "
        "tier first).",
    )
    warm_slice_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Warm slices: while no slice pod waits, keep one free slice of each request "
        "that at least this share of the bound one-slice pods hold, on the busiest node with "
        "room, so the next such pod starts at once; 0 turns them off (the default: they delay "
        "whole-node pods, docs/operations.md).",
    )
    preemption: bool = Field(
        True,
        description="A gated pod no free slice or plan can serve, for which lower-priority pods "
        "hold the slices it asks for on a node it may use, loses its gate so kube-scheduler "
        "preempts them (as without gpuslice); false: it waits for them to end.",
    )
    scale_up_after_seconds: float = Field(
        0.0,
        ge=0,
        description="A gated pod the cluster has no room for loses its gate after waiting this "
        "long, so kube-scheduler marks it unschedulable and the cluster autoscaler can add a "
        "node for it (it is still planned, without a reservation); 0 (the default): never.",
    )
    drain_overtaken: int = Field(
        0,
        ge=0,
        description="Drain only for a pod that at least this many younger slice pods have "
        "overtaken (bound now, created after it); 0: any pod past the drain wait.",
    )
    metrics_port: int = Field(8080, ge=0, le=65535, description="Prometheus /metrics port.")
    health_port: int = Field(
        8081, ge=0, le=65535, description="Port of /healthz (liveness) and /readyz (readiness)."
    )
    liveness_stale_seconds: float = Field(
        120.0,
        ge=0,
        description="Not live when no decision step completed for this long (since start "
        "before the first one); 0: never stale.  A step takes one cycle plus the planner's "
        "time limit plus its API writes (30 s timeout each).",
    )
    liveness_failed_steps: int = Field(
        10,
        ge=0,
        description="Not live when this many decision steps in a row raised; 0: never.",
    )
    heap_reclaim_seconds: float = Field(
        3600.0,
        gt=0,
        description="Seconds between two full garbage collections of the whole heap (about "
        "0.5 s at 50,000 pods); between them the cache stays out of the collector's reach "
        "(partitioner/heap.py).",
    )

    # -- leader election (partitioner/leader.py); the chart sets these ---------------------------
    leader_election_enabled: bool = Field(
        False,
        description=(
            "Elect a leader through a coordination.k8s.io Lease: only the leader plans and "
            "writes, the other replicas keep their caches warm and take over when its lease "
            "expires (the chart turns it on and runs 2 replicas)."
        ),
    )
    leader_election_namespace: str = Field(
        "", description="Namespace of the Lease (the partitioner's own)."
    )
    leader_election_lease_name: str = Field(
        "gpuslice-partitioner", description="Name of the Lease."
    )
    leader_election_identity: str = Field(
        "",
        description="This replica's holderIdentity in the Lease (the pod's name); empty: "
        "the host name.",
    )
    leader_election_lease_duration_seconds: int = Field(
        15,
        ge=1,
        description="A follower takes the Lease over when its holder did not renew it for this "
        "long.",
    )
    leader_election_renew_deadline_seconds: float = Field(
        10.0,
        gt=0,
        description="The leader stops planning and writing when it could not renew the Lease "
        "for this long; must be below the lease duration.",
    )
    leader_election_retry_period_seconds: float = Field(
        2.0,
        gt=0,
        description="How often the leader renews and followers try to acquire the Lease; "
        "must be below the renew deadline.",
    )

    @model_validator(mode="after")
    def _mps_sizes(self) -> PartitionerSettings:
        parse_mps_sizes(self.free_capacity_mps_sizes)  # raises with the fix in the message
        parse_mig_profiles(self.free_capacity_mig_profiles)
        return self

    @model_validator(mode="after")
    def _leader_election_settings(self) -> PartitionerSettings:
        if not self.leader_election_enabled:
            return self
        if not self.leader_election_namespace:
            raise ValueError(
                "leader election needs leader_election_namespace (the namespace of its Lease; "
                "the chart sets it), or turn it off with leader_election_enabled=false"
            )
        retry = self.leader_election_retry_period_seconds
        renew = self.leader_election_renew_deadline_seconds
        lease = self.leader_election_lease_duration_seconds
        if not retry < renew < lease:
            raise ValueError(
                f"leader election needs leader_election_retry_period_seconds ({retry:g}) < "
                f"leader_election_renew_deadline_seconds ({renew:g}) < "
                f"leader_election_lease_duration_seconds ({lease}): a leader must stop writing "
                f"before its lease can expire for the others"
            )
        return self

    @model_validator(mode="after")
    def _react_within_a_cycle(self) -> PartitionerSettings:
        if self.react_seconds > self.cycle_seconds:
            raise ValueError(
                f"react_seconds ({self.react_seconds:g}) must be at most cycle_seconds "
                f"({self.cycle_seconds:g}): a change is acted on within one cycle anyway"
            )
        return self

    @model_validator(mode="after")
    def _stale_after_a_step(self) -> PartitionerSettings:
        least = self.cycle_seconds + self.planner_time_limit_seconds
        if self.liveness_stale_seconds and self.liveness_stale_seconds <= least:
            raise ValueError(
                f"liveness_stale_seconds ({self.liveness_stale_seconds:g}) must exceed "
                f"cycle_seconds + planner_time_limit_seconds ({least:g}), the least time "
                f"between two completed decision steps (or be 0: never stale)"
            )
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> PartitionerSettings:
        if self.metrics_port and self.metrics_port == self.health_port:
            raise ValueError(
                f"metrics_port and health_port are both {self.metrics_port}; give them "
                f"different ports (defaults 8080 and 8081)"
            )
        return self

    def decide_config(self, catalog: Catalog, planner: PlanFn | None = None) -> DecideConfig:
        """The decision step's configuration from these settings (the controller's, and the
        controller benchmark's); ``planner`` defaults to the production planner."""
        from partitioner.decide import DecideConfig, default_planner

        _check_mig_targets(self.planner_settings().free_capacity_mig_profiles, catalog)
        return DecideConfig(
            catalog=catalog,
            policy=self.batch_policy(),
            planner_settings=self.planner_settings(),
            planner=planner if planner is not None else default_planner(),
            reservation=self.reservation,
            apply_deadline_s=self.apply_deadline_seconds,
            bind_deadline_s=self.bind_deadline_seconds,
            cooldown_s=self.cooldown_seconds,
            plugin_lag_s=self.plugin_lag_seconds,
            recreate_stranded_s=self.recreate_stranded_seconds,
            drain_after_s=self.drain_after_seconds,
            drain_fraction=self.drain_fraction,
            drain_queue_limit=self.drain_queue_limit,
            drain_overtaken=self.drain_overtaken,
            preemption=self.preemption,
            scale_up_after_s=self.scale_up_after_seconds,
            warm_share=self.warm_slice_share,
            node_lifecycle=True,
            claims_watched=self.dra_enabled,
        )

    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(
            timeout=self.batch_timeout_seconds,
            idle=self.batch_idle_seconds,
            retry=self.batch_retry_seconds,
        )

    def planner_settings(self) -> PlannerSettings:
        return PlannerSettings(
            policy=self.planner_policy,
            time_limit_s=self.planner_time_limit_seconds,
            seed=self.planner_seed,
            weight_destroy=self.weight_destroy,
            weight_create=self.weight_create,
            weight_gpu_touched=self.weight_gpu_touched,
            weight_free_gpu=self.weight_free_gpu,
            weight_free_block=self.weight_free_block,
            free_capacity_cpu_milli=self.free_capacity_cpu_milli,
            free_capacity_memory_mib=self.free_capacity_memory_mib,
            free_capacity_mps_sizes=parse_mps_sizes(self.free_capacity_mps_sizes),
            free_capacity_mig_profiles=parse_mig_profiles(self.free_capacity_mig_profiles),
            mps_reserve_mib=self.mps_reserve_mib,
            mps_thread_policy=self.mps_thread_policy,
            mps_polish=self.mps_polish,
            placement_weight=self.placement_weight,
        )

    dra_enabled: bool = Field(
        False,
        description=(
            "Plan nodes labelled gpuslice.io/partitioning=dra for pods that ask through "
            "ResourceClaims of gpuslice's DRA driver: watch ResourceClaims (resource.k8s.io/v1, "
            "Kubernetes >= 1.35) and write those nodes' NodePartitioning specs, which their "
            "agents publish (the chart sets it with dra.enabled)."
        ),
    )

    # -- admission webhook (partitioner/webhook.py); the chart sets these -----------------------
    webhook_enabled: bool = Field(
        False,
        description=(
            "Serve the mutating admission webhook that gates pods asking for a slice (the chart "
            "turns it on and renders its MutatingWebhookConfiguration and Service)."
        ),
    )
    webhook_port: int = Field(
        9443, ge=0, le=65535, description="HTTPS port of the webhook (0: any free port)."
    )
    webhook_cert_mode: Literal["self-managed", "files"] = Field(
        "self-managed",
        description=(
            "self-managed: the partitioner keeps a CA and serving certificate in the Secret "
            "webhook_secret_name and patches the caBundle; files: read tls.crt, tls.key and ca.crt "
            "from webhook_cert_dir, kept current by someone else (cert-manager)."
        ),
    )
    webhook_cert_dir: str = Field(
        "/tmp/gpuslice-webhook",
        description="Where the webhook's certificate files are written (self-managed) or read.",
    )
    webhook_service_name: str = Field(
        "", description="The webhook Service; its DNS names go into the serving certificate."
    )
    webhook_namespace: str = Field(
        "", description="Namespace of the webhook Service and Secret (the partitioner's own)."
    )
    webhook_configuration_name: str = Field(
        "", description="The MutatingWebhookConfiguration whose caBundle is kept current."
    )
    webhook_secret_name: str = Field(
        "", description="The Secret holding the self-managed CA and serving certificate."
    )
    webhook_cert_check_seconds: float = Field(
        3600.0, gt=0, description="How often the self-managed certificate is checked for renewal."
    )
    webhook_ca_bundle_check_seconds: float = Field(
        20.0,
        gt=0,
        description=(
            "How often (at most webhook_cert_check_seconds) the self-managed mode reads the "
            "MutatingWebhookConfiguration to check that its caBundle still trusts this replica's "
            "certificate; one replaced or re-created without it is restored at once."
        ),
    )

    @model_validator(mode="after")
    def _webhook_settings(self) -> PartitionerSettings:
        if not self.webhook_enabled:
            return self
        taken = {self.metrics_port: "metrics_port", self.health_port: "health_port"}
        if self.webhook_port and self.webhook_port in taken:
            raise ValueError(
                f"webhook_port and {taken[self.webhook_port]} are both {self.webhook_port}; "
                f"give them different ports (default webhook_port 9443)"
            )
        if self.webhook_cert_mode == "self-managed":
            needed = (
                "webhook_service_name",
                "webhook_namespace",
                "webhook_configuration_name",
                "webhook_secret_name",
            )
            missing = [n for n in needed if not getattr(self, n)]
            if missing:
                raise ValueError(
                    f"the self-managed webhook certificate needs {', '.join(missing)} (the "
                    f"chart sets them; or use webhook_cert_mode=files)"
                )
        return self
