"""Which nodes can still host a unit of a given key: the greedy planner's candidate index.

Model
-----
Nodes are numbered by *position*, their index in the greedy planner's visiting order
(``0 .. n-1``: name order, or the rank it was given).  Every node has a set of *keys* it can
host now: for a MIG node, the profile names of which it has a free instance or could create
one more instance on some GPU beside the instances pinned there
(:meth:`planner.greedy._Greedy.capable`, a necessary condition for a pod asking for that
profile to fit).  The index keeps, per key ``k``, the sorted list ``hosts(k)`` of the
positions of the nodes whose key set holds ``k``.

A pod that needs the key set ``K`` on every node of one GPU model can only fit on a node
whose keys include ``K``, so every such node is in ``hosts(k)`` for each ``k`` in ``K``;
scanning the shortest of those lists in order visits every node the pod could fit on, in
visiting order, and skips the nodes that are full for it.  A pod whose key sets differ between
the nodes it may use (a cluster of several models, whose profile names differ) needs one
such list per key set: :meth:`HostIndex.covering` merges them.

Only the node that changed is updated (:meth:`HostIndex.update`), by bisection in the lists of
the keys it gained or lost, so a plan with ``P`` pods over ``n`` nodes costs
``O(P * changed keys * n)`` list moves (``memmove`` of machine words) instead of the
``O(P * n)`` Python steps of a full scan per pod.

Pure data structure; nothing survives the planner call that builds it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence

__all__ = ["HostIndex"]

_NONE: list[int] = []


class HostIndex:
    """Per key, the positions of the nodes that can host it, in ascending order."""

    def __init__(self, keys_by_position: Sequence[frozenset[str]]) -> None:
        self._hosts: dict[str, list[int]] = {}
        for pos, keys in enumerate(keys_by_position):
            for key in keys:
                self._hosts.setdefault(key, []).append(pos)  # positions ascend: sorted

    def hosts(self, key: str) -> list[int]:
        """Positions of the nodes that can host ``key`` (ascending; do not modify)."""
        return self._hosts.get(key, _NONE)

    def update(self, pos: int, before: frozenset[str], after: frozenset[str]) -> None:
        """Node ``pos`` now hosts ``after`` instead of ``before``."""
        for key in before - after:
            lst = self._hosts[key]
            i = bisect_left(lst, pos)
            if i == len(lst) or lst[i] != pos:
                raise KeyError(f"host index: node position {pos} is not listed under {key!r}")
            del lst[i]
        for key in after - before:
            insort(self._hosts.setdefault(key, []), pos)

    def covering(self, key_sets: Iterable[frozenset[str]]) -> Sequence[int]:
        """Ascending positions including every node whose keys contain one of ``key_sets``.

        Per key set the shortest of its keys' lists (an empty key set would be held by every
        node and cannot be answered from the index: :class:`ValueError`); the union of those
        when there are several key sets.
        """
        chosen: list[list[int]] = []
        for keys in key_sets:
            if not keys:
                raise ValueError("host index: an empty key set is held by every node")
            chosen.append(min((self.hosts(k) for k in keys), key=len))
        if len(chosen) == 1:
            return chosen[0]
        return sorted({pos for lst in chosen for pos in lst})
