"""A reservation annotation belongs to the pod it was written for.

``kubectl debug --copy-to`` and a manifest saved with ``kubectl get -o yaml`` and applied again
under another name copy a pod's annotations (and its gate) onto a new pod.  The annotation names
the pod's uid; on a pod of another uid it holds nothing, so the copy never takes the slice
promised to the original.
"""

from __future__ import annotations

import copy
import json

from test_partitioner_promises import (
    MIG,
    ONE_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from partitioner.reservations import parse_reservation


def test_a_copy_of_a_reserved_pod_does_not_take_its_slice() -> None:
    c = Cluster(
        node("n1", MIG),  # the kubelet does not list the new slice yet
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("web", ONE_G, created=T0),
    )
    c.step(T0 + 5)
    r = reservation(c, "web")
    assert r is not None and r.pod == c.pod("web")["metadata"]["uid"]
    dup = copy.deepcopy(c.pod("web"))  # a name that sorts first: the old tie-break chose it
    dup["metadata"].update(name="a-debug", uid="uid-a-debug", resourceVersion="1")
    c.put(dup)
    c.put(with_alloc(node("n1", MIG), **{"1g_10gb": 1}))  # the one slice is listed now
    d = c.step(T0 + 6)
    (why,) = events(d, "InvalidReservation")
    assert "written for another pod" in why and "a-debug" not in why
    (released,) = events(d, "Released")
    assert "n1" in released
    assert "schedulingGates" not in c.pod("web")["spec"]  # the original got its slice
    assert "schedulingGates" in c.pod("a-debug")["spec"]
    assert not events(d, "ReservationDropped")


def test_the_uid_round_trips_and_an_old_annotation_without_it_still_reads() -> None:
    doc = {"node": "n1", "state": "planned", "gpus": {ONE_G: [0]}, "since": 1.0}
    assert parse_reservation(json.dumps(doc)).pod == ""
    r = parse_reservation(json.dumps({**doc, "pod": "u1"}))
    assert r.pod == "u1" and parse_reservation(r.to_json()) == r
