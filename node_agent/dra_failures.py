"""The claims whose prepare failed on this node, as the DRA agent reports them.

Model
-----
The kubelet prepares a pod's ResourceClaims (``NodePrepareResources``) before it starts the
pod's containers and retries a failed prepare with its pod-sync backoff (about every 10 s,
longer while it keeps failing); meanwhile the pod shows ``ContainerCreating`` and Events
``FailedPrepareDynamicResources`` that expire after an hour.  Nothing else in the cluster learns
that the claim cannot be prepared (an XID hit its device between allocation and prepare, a
process outside any claim holds the placement, MIG mode cannot be switched, the GPU is
unreadable), so a pod gpuslice promised a slice would wait there for ever.

:class:`PrepareFailures` keeps, per claim uid, the newest failure: the claim
(``namespace/name``), the devices allocated to it on this node (empty when they could not be
read), the error as the kubelet got it, when it first failed (wall clock, RFC 3339) and when
it was last asked (monotonic).  A record is dropped when

* a prepare of the claim succeeds (:meth:`PrepareFailures.succeeded`);
* the claim is unprepared (:meth:`PrepareFailures.forget`: its pod is gone or done);
* its devices are no longer all allocated in this node's pool (the claim was deallocated: its
  pod was deleted without an unprepare, which the kubelet skips for a claim it never
  prepared), checked at each report;
* no prepare of it came for :data:`STALE_AFTER_S` (the kubelet stopped asking: its pod is gone).

:meth:`PrepareFailures.report` gives the survivors, oldest first, at most
:data:`~contract.nodepartitioning.MAX_PREPARE_FAILURES`, each message cut to
:data:`~contract.nodepartitioning.MAX_FAILURE_MESSAGE` characters: the status's
``prepareFailures`` (shaped publishing writes it; the partitioner strands those claims' pods,
:mod:`partitioner.decide`).  Not thread-safe: the plugin's event loop owns it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from contract.nodepartitioning import MAX_FAILURE_MESSAGE, MAX_PREPARE_FAILURES, PrepareFailure
from node_agent.dra_claims import ClaimRef

__all__ = ["STALE_AFTER_S", "PrepareFailures"]

STALE_AFTER_S = 300.0
"""A failure no prepare has repeated for this long is dropped: the kubelet retries a pod it
still runs well within it (its pod-sync backoff tops out at a few minutes)."""


@dataclass(slots=True)
class _Failure:
    ref: ClaimRef
    devices: frozenset[str]
    message: str
    since: str
    last: float


def _cut(message: str) -> str:
    if len(message) <= MAX_FAILURE_MESSAGE:
        return message
    return message[: MAX_FAILURE_MESSAGE - 3] + "..."


class PrepareFailures:
    """The newest prepare failure per claim on this node (module docstring)."""

    def __init__(self) -> None:
        self._by_uid: dict[str, _Failure] = {}

    def __len__(self) -> int:
        return len(self._by_uid)

    def failed(
        self, ref: ClaimRef, devices: Iterable[str], message: str, *, now: float, wall: str
    ) -> None:
        """A prepare of ``ref`` failed with ``message`` at monotonic time ``now`` (``wall``:
        RFC 3339); ``devices``: its devices on this node, empty if they could not be read."""
        old = self._by_uid.get(ref.uid)
        self._by_uid[ref.uid] = _Failure(
            ref, frozenset(devices), message, old.since if old is not None else wall, now
        )

    def succeeded(self, uid: str) -> None:
        """A prepare of claim ``uid`` succeeded."""
        self._by_uid.pop(uid, None)

    def forget(self, uid: str) -> None:
        """Claim ``uid`` was unprepared."""
        self._by_uid.pop(uid, None)

    def report(self, allocated: Collection[str] | None, *, now: float) -> list[PrepareFailure]:
        """Drop the records whose claim is no longer allocated here (``allocated``: this pool's
        allocated devices; ``None``: not known, publishing every placement lists no claims) or
        that no prepare repeated for :data:`STALE_AFTER_S`; the rest, oldest first (then by
        claim), as the status lists them."""
        held = None if allocated is None else set(allocated)
        for uid, f in list(self._by_uid.items()):
            if now - f.last > STALE_AFTER_S or (held is not None and not f.devices <= held):
                del self._by_uid[uid]
        kept = sorted(self._by_uid.values(), key=lambda f: (f.since, f.ref.namespace, f.ref.name))
        return [
            PrepareFailure(
                claim=f"{f.ref.namespace}/{f.ref.name}",
                uid=f.ref.uid,
                message=_cut(f.message),
                since=f.since,
            )
            for f in kept[:MAX_PREPARE_FAILURES]
        ]
