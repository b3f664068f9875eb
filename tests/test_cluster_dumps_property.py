"""Random kubectl dumps over every MIG model, judged by an oracle written from facts/mig.md.

Each example is a cluster gpuslice has not yet reported on: 1-2 opted-in nodes of random
catalog models with 1-3 GPUs each, a random valid layout per GPU (built with
``tests/mig_facts.py``'s rules, not the planner's), a random subset of instances in use by
running pods, the node described the way a real cluster may show it (GPU Operator mixed
labels, single labels, nos's status annotations beside mixed labels, or only the device
plugin's ``nvidia.com/mig-*`` capacity), and pending pods asking for MIG profile names of ANY
model.  One controller cycle runs on it (:func:`partitioner.decide.decide`, with the empty
NodePartitionings it creates and no agent report yet: the reading, adoption, plan and spec
writes of production); then:

* every node is read with its physical GPU count, or is a problem only where no source can
  give that count (single strategy without annotation or MIG-manager config);
* no pod is planned onto a resource name other than its request, nor onto a name its node's
  model does not have (facts sheet names, ``+`` spelled ``.``);
* every instance in use (the generator's truth, by GPU index and start) is in the layout of
  every GPU a written spec lists (changed by the plan, or rewritten with its adopted layout);
* every layout written is valid per the facts sheet's placement rules;
* on each node, the units placed of each resource fit the free instances of exactly that name
  once the agents applied the specs (unlisted GPUs keep what they hold).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kube_objects import pod_object
from mig_facts import MODELS, layout_ok, names_of, resource_name

from partitioner.actions import WriteSpec
from partitioner.batching import BatchPolicy
from partitioner.decide import ControllerState, DecideConfig, decide
from partitioner.snapshot import view_from_items
from planner.catalog import default_catalog
from planner.settings import PlannerSettings, Policy

CAT = default_catalog()
ALL_RESOURCES = sorted({resource_name(n) for m in MODELS for n in names_of(m)})
COUNTED: Counter[str] = Counter()


@dataclass
class TrueNode:
    name: str
    model: str
    gpus: list[list[tuple[str, int, bool]]]
    """Per GPU: (profile, start, used)."""
    shown_as: str
    count_known: bool


@st.composite
def gpu_layout(draw: st.DrawFn, model: str) -> list[tuple[str, int, bool]]:
    shapes = names_of(model)
    names = sorted(shapes)
    tries = draw(
        st.lists(st.tuples(st.sampled_from(names), st.integers(0, 11), st.booleans()), max_size=7)
    )
    layout: list[tuple[str, int, bool]] = []
    for name, start, used in tries:
        starts = shapes[name].starts
        start = starts[start % len(starts)]
        if layout_ok(model, [(n, s) for n, s, _ in layout] + [(name, start)]):
            layout.append((name, start, used))
    return sorted(layout, key=lambda x: x[1])


@st.composite
def true_node(draw: st.DrawFn, index: int) -> TrueNode:
    model = draw(st.sampled_from(sorted(MODELS)))
    gpus = [draw(gpu_layout(model)) for _ in range(draw(st.integers(1, 3)))]
    shown_as = draw(st.sampled_from(["mixed", "single", "nos", "capacity"]))
    profiles = {n for g in gpus for n, _, _ in g}
    if shown_as == "single" and (len(profiles) != 1 or not all(gpus)):
        shown_as = "mixed"  # GFD would write -MIG-INVALID: covered by the unit tests
    count_known = True
    if shown_as == "single":
        count_known = draw(st.booleans())
    return TrueNode(f"gpu-{index}", model, gpus, shown_as, count_known)


def node_object(t: TrueNode) -> dict[str, Any]:
    totals = Counter(n for g in t.gpus for n, _, _ in g)
    product = f"NVIDIA-{t.model}"
    labels = {
        "gpuslice.io/partitioning": "mig",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(len(t.gpus)),
        "nvidia.com/mig.capable": "true",
    }
    annotations: dict[str, str] = {}
    capacity: dict[str, str] = {"cpu": "64", "memory": "512Gi"}
    if t.shown_as in ("mixed", "nos"):
        labels["nvidia.com/mig.strategy"] = "mixed"
        for name, n in totals.items():
            key = resource_name(name)
            labels[f"{key}.count"] = str(n)
            labels[f"{key}.product"] = f"{product}-MIG-{name.replace('+', '.')}"
            capacity[key] = str(n)
    if t.shown_as == "nos":
        for i, g in enumerate(t.gpus):
            state = Counter((n, "used" if u else "free") for n, _, u in g)
            for (name, s), n in state.items():
                annotations[f"nos.nebuly.com/status-gpu-{i}-{name}-{s}"] = str(n)
    if t.shown_as == "capacity":
        capacity |= {resource_name(name): str(n) for name, n in totals.items()}
    if t.shown_as == "single":
        (name,) = totals
        labels |= {
            "nvidia.com/mig.strategy": "single",
            "nvidia.com/gpu.product": f"{product}-MIG-{name.replace('+', '.')}",
            "nvidia.com/gpu.count": str(totals[name]),
        }
        capacity["nvidia.com/gpu"] = str(totals[name])
        if t.count_known:
            annotations["gpuslice.io/gpu-count"] = str(len(t.gpus))
    return {
        "kind": "Node",
        "metadata": {"name": t.name, "uid": t.name, "labels": labels, "annotations": annotations},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


@st.composite
def dumps(draw: st.DrawFn) -> tuple[dict[str, Any], list[TrueNode]]:
    nodes = [draw(true_node(i)) for i in range(draw(st.integers(1, 2)))]
    items = [node_object(t) for t in nodes]
    for t in nodes:
        k = 0
        for g in t.gpus:
            for name, _, used in g:
                if used:
                    resource = "nvidia.com/gpu" if t.shown_as == "single" else resource_name(name)
                    items.append(pod_object(f"run-{t.name}-{k}", {resource: 1}, t.name))
                    k += 1
    # Half the requests name a profile of a node's model, half any model's (cross-model names).
    own = sorted({resource_name(n) for t in nodes for n in names_of(t.model)})
    names = st.one_of(st.sampled_from(own), st.sampled_from(ALL_RESOURCES))
    pending = draw(
        st.lists(st.dictionaries(names, st.integers(1, 2), min_size=1, max_size=2), max_size=6)
    )
    items += [pod_object(f"want-{i}", req) for i, req in enumerate(pending)]
    return {"apiVersion": "v1", "kind": "List", "items": items}, nodes


def partitioning(name: str) -> dict[str, Any]:
    """The NodePartitioning the controller creates for a node: empty spec, no agent status."""
    return {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": name, "uid": f"np-{name}", "generation": 1, "resourceVersion": "1"},
        "spec": {"mode": "mig", "gpus": []},
    }


def check(doc: dict[str, Any], truth: list[TrueNode], policy: Policy) -> None:
    by_name = {t.name: t for t in truth}
    view = view_from_items([*doc["items"], *(partitioning(t.name) for t in truth)])
    config = DecideConfig(
        CAT, BatchPolicy(timeout=1, idle=1), PlannerSettings(policy=policy, time_limit_s=0.5)
    )
    opened = decide(ControllerState(), view, 0.0, config)
    got = decide(opened.state, view, 5.0, config)  # the batch window is due: plan and write
    for name, problem in got.problems.items():
        t = by_name[name]
        assert (t.shown_as, t.count_known, problem.reason) == (
            "single",
            False,
            "GpuCountUnknown",
        ), problem
    assert got.error == "", got.error
    result = got.plan
    if result is None or got.snapshot is None:  # nothing to plan...
        # ...because no pod waits, or every node is left out for a problem (the pods wait)
        assert not got.counts.get("candidates") or set(got.problems) == set(by_name)
        return
    for state in got.snapshot.nodes:
        assert len(state.gpus) == len(by_name[state.name].gpus)  # the physical count
    COUNTED["nodes read"] += len(got.snapshot.nodes)
    COUNTED["locked GPUs"] += sum(g.locked for n in got.snapshot.nodes for g in n.gpus)
    COUNTED["pods placed"] += len(result.assignments)
    # What the agents would hold after applying the written specs: a listed GPU gets its
    # spec entry, an unlisted one keeps what it has (the truth).
    after = {t.name: {i: [(n, s) for n, s, _ in g] for i, g in enumerate(t.gpus)} for t in truth}
    for write in (a for a in got.actions if isinstance(a, WriteSpec)):
        t = by_name[write.node]
        for entry in write.spec.gpus:
            COUNTED["GPUs written"] += 1
            layout = [(m.profile, m.start) for m in entry.mig]
            used = {(n, s) for n, s, u in t.gpus[entry.index] if u}
            assert used <= set(layout), f"{t.name} GPU {entry.index}: in-use {used} not in {layout}"
            assert layout_ok(t.model, layout), f"{t.name} GPU {entry.index}: {layout}"
            after[t.name][entry.index] = layout
    pods = {p.name: p for p in got.snapshot.pods}
    placed: dict[str, Counter[str]] = {}
    for pod, a in result.assignments.items():
        own = {resource_name(n) for n in names_of(by_name[a.node].model)}
        for resource, units in a.gpus.items():
            assert resource in pods[pod].requests, (pod, resource)
            assert resource in own, f"{pod}: {resource} planned on a {by_name[a.node].model}"
            placed.setdefault(a.node, Counter())[resource] += len(units)
    for name, want in placed.items():
        t = by_name[name]
        free: Counter[str] = Counter()
        for index, gpu in enumerate(t.gpus):
            used = {(n, s) for n, s, u in gpu if u}
            free.update(resource_name(n) for n, s in after[name][index] if (n, s) not in used)
        assert all(n <= free[r] for r, n in want.items()), (name, want, free)


def test_a_pod_whose_only_node_has_an_unknown_gpu_count_waits_unplanned() -> None:
    """Found by the property below: GFD's single strategy without a known GPU count leaves the
    node out (GpuCountUnknown); the pod stays a candidate, nothing is planned or written."""
    t = TrueNode("gpu-0", "A100-SXM4-40GB", [[("1g.10gb", 0, False)]], "single", False)
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [node_object(t), pod_object("want-0", {"nvidia.com/mig-1g.10gb": 1})],
    }
    check(doc, [t], Policy.GREEDY)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dumps())
def test_random_dumps_greedy(case: tuple[dict[str, Any], list[TrueNode]]) -> None:
    check(*case, Policy.GREEDY)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dumps())
def test_random_dumps_cpsat(case: tuple[dict[str, Any], list[TrueNode]]) -> None:
    check(*case, Policy.CPSAT)


def test_print_what_the_random_dumps_covered() -> None:
    # Runs after the two property tests in file order; the counts show they exercised
    # locking, reshaping and placement rather than trivially empty plans.
    print(f"random dumps covered: {dict(COUNTED)}")
    assert COUNTED["pods placed"] > 0 and COUNTED["GPUs written"] > 0 and COUNTED["locked GPUs"] > 0
