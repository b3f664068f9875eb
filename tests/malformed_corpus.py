"""A corpus of malformed inputs for every file-taking gpuslice command, and its runner.

Each :class:`Case` is one command line (``plan --snapshot``, ``plan --catalog``, ``simulate
--trace/--cluster`` with YAML, JSON and CSV files, ``sweep --trace/--cluster``, ``agent --fake
--spec/--catalog``) with the files it reads and the outcome a clean run must have: the
exit code (2 for bad input) and words its error must contain -- the file's path always, and
for most cases the object or field at fault.  The corpus is generated from valid documents:
generic damage (missing, a directory, empty, binary, non-UTF-8, byte-order marks, truncated,
nesting thousands deep, alias bombs, NaN and ``1e400``, 5000-digit numbers, duplicate keys,
oversized files) applied to every kind of file, plus field-level damage specific to each
format (wrong types, quantities like ``true`` or ``1e999999``, counts like ``1e9``, duplicate
names, missing names, indices a node lacks, ...).

:func:`run_corpus` runs the cases in worker processes (each imports gpuslice once) and returns
one :class:`Outcome` per case: exit code, stderr, whether a traceback escaped, the seconds taken.
A case that runs past the hard limit is killed and reported as slow.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HARD_LIMIT_S = 30.0
"""A case still running after this is killed (and counted slow: the limit to report is 10 s)."""

Files = dict[str, Any]
"""File name -> bytes, str (UTF-8), ``DIR`` (a directory), ``("sparse", size)`` or ``None``
(absent)."""
DIR = "<directory>"


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    """Command line; ``{d}`` is replaced by the case's directory."""
    files: Files
    rc: int = 2
    needs: tuple[str, ...] = ()
    """Words the error output must contain besides the file's path (for rc 2)."""
    names_file: str = ""
    """The file the error must name (default: the first of ``files``)."""


@dataclass
class Outcome:
    case: Case
    rc: int | None
    err: str
    traceback: str
    seconds: float
    killed: bool = False

    @property
    def problems(self) -> list[str]:
        """Why this outcome is not clean (empty: clean)."""
        out: list[str] = []
        if self.traceback:
            out.append(f"traceback: {self.traceback[-300:]}")
        if self.killed:
            out.append(f"killed after {self.seconds:.0f} s")
        if self.rc != self.case.rc:
            out.append(f"exit {self.rc}, expected {self.case.rc}: {self.err[-300:]}")
        elif self.rc == 2:
            target = self.case.names_file or next(iter(self.case.files))
            for word in (target, *self.case.needs):
                if word not in self.err:
                    out.append(f"error does not name {word!r}: {self.err[-300:]}")
        return out


# -- valid documents ----------------------------------------------------------------------------


def node(name: str = "gpu-1", count: str = "2", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "gpuslice.io/partitioning": "mig",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.count": count,
            },
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
        "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}},
        **extra,
    }


def pod(name: str = "job", **spec_extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            **spec_extra,
        },
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }


def partitioning(name: str = "gpu-1", index: Any = 0) -> dict[str, Any]:
    return {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": name, "generation": 1},
        "spec": {"planId": "p1", "mode": "mig", "gpus": []},
        "status": {
            "observedGeneration": 1,
            "gpus": [{"index": index, "mig": [{"profile": "1g.10gb", "start": 0, "used": True}]}],
            "conditions": [{"type": "Applied", "status": "True"}],
        },
    }


def kube_list(*items: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}


SNAPSHOT = kube_list(node(), pod(), partitioning())
WORKLOAD_YAML = """\
name: w
pods:
  - {name: a, cpu_milli: 1000, memory_mib: 1024, num_gpu: 1, gpu_milli: 500}
  - {name: b, cpu_milli: 2000, num_gpu: 1, gpu_milli: 1000, gpu_spec: [A100-SXM4-80GB]}
"""
WORKLOAD = {
    "name": "w",
    "pods": [
        {"name": "a", "cpu_milli": 1000, "memory_mib": 1024, "num_gpu": 1, "gpu_milli": 500},
        {"name": "b", "cpu_milli": 2000, "num_gpu": 1, "gpu_milli": 1000},
    ],
}
CLUSTER_YAML = """\
name: c
pools:
  - {name: a100, count: 2, gpu_model: A100-SXM4-80GB, gpus_per_node: 8,
     cpu_milli: 96000, memory_mib: 786432, mode: mps}
"""
CLUSTER = {
    "name": "c",
    "pools": [
        {
            "name": "a100",
            "count": 2,
            "gpu_model": "A100-SXM4-80GB",
            "gpus_per_node": 8,
            "cpu_milli": 96000,
            "memory_mib": 786432,
            "mode": "mps",
        }
    ],
}
PODS_CSV = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,1,500\np2,2000,0,1,1000\n"
NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\nn0,96000,786432,8,T4\nn1,96000,786432,8,T4\n"
SPEC_YAML = """\
mode: mig
planId: p1
gpus:
  - index: 0
    mig: [{profile: 3g.40gb, start: 0}, {profile: 3g.40gb, start: 4}]
"""
SPEC = {
    "mode": "mig",
    "gpus": [{"index": 0, "mig": [{"profile": "3g.40gb", "start": 0}]}],
}
CATALOG_YAML = """\
models:
  - name: A100-TEST
    product_aliases: [A100-TEST]
    geometry: ampere-hopper-8
    memory_mib: 81920
    profiles:
      1g: {name: 1g.10gb, memory_mib: 9984}
      7g: {name: 7g.80gb, memory_mib: 81152}
"""

# -- command lines ------------------------------------------------------------------------------

SIM = ("--repeats", "1", "--quiet", "--policy", "bestfit", "--protocol", "saturation")
PLAN = ("--policy", "greedy", "--time-limit", "0.2")


@dataclass(frozen=True)
class Target:
    """One file-taking option: how to run it with a file named ``fname`` in ``{d}``."""

    key: str
    fname: str
    argv: Callable[[str], tuple[str, ...]]
    valid: bytes
    yaml: bool
    ok_rc: int = 0


def _json(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode()


TARGETS = [
    Target("snapshot", "snap.json", lambda f: ("plan", "--snapshot", f, *PLAN), _json(SNAPSHOT), False),
    Target("plan-catalog", "cat.yaml", lambda f: ("plan", "--demo", "--catalog", f, *PLAN), CATALOG_YAML.encode(), True),
    Target("workload-yaml", "w.yaml", lambda f: ("simulate", "--trace", f, "--cluster", "builtin", *SIM), WORKLOAD_YAML.encode(), True),
    Target("workload-json", "w.json", lambda f: ("simulate", "--trace", f, "--cluster", "builtin", *SIM), _json(WORKLOAD), False),
    Target("cluster-yaml", "c.yaml", lambda f: ("simulate", "--cluster", f, *SIM), CLUSTER_YAML.encode(), True),
    Target("cluster-json", "c.json", lambda f: ("simulate", "--cluster", f, *SIM), _json(CLUSTER), False),
    Target("pods-csv", "pods.csv", lambda f: ("simulate", "--trace", f, "--cluster", "builtin", *SIM), PODS_CSV.encode(), False),
    Target("nodes-csv", "nodes.csv", lambda f: ("simulate", "--cluster", f, *SIM), NODES_CSV.encode(), False),
    Target("sweep-trace", "sw.yaml", lambda f: ("sweep", "--trace", f, "--cluster", "builtin", "--out", "{d}/out"), WORKLOAD_YAML.encode(), True),
    Target("sweep-cluster", "sc.json", lambda f: ("sweep", "--cluster", f, "--out", "{d}/out"), _json(CLUSTER), False),
    Target("agent-spec", "spec.yaml", lambda f: ("agent", "--fake", "--fake-gpus", "A100-SXM4-80GB:1", "--spec", f, "--once"), SPEC_YAML.encode(), True),
    Target("agent-spec-json", "spec.json", lambda f: ("agent", "--fake", "--fake-gpus", "A100-SXM4-80GB:1", "--spec", f, "--once"), _json(SPEC), False),
    Target("agent-catalog", "acat.yaml", lambda f: ("agent", "--fake", "--catalog", f, "--once"), CATALOG_YAML.encode(), True),
]  # fmt: skip


def _case(t: Target, name: str, content: Any, rc: int = 2, *needs: str) -> Case:
    return Case(f"{t.key}: {name}", t.argv("{d}/" + t.fname), {t.fname: content}, rc, needs)


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for k in range(1, levels + 1):
        refs = ", ".join([f"*a{k - 1}"] * 10)
        lines.append(f"a{k}: &a{k} [{refs}]")
    return "\n".join(lines) + "\n"


def generic_cases() -> Iterator[Case]:
    """The same kinds of damage, for every file-taking option."""
    for t in TARGETS:
        second_line = t.valid.index(b"\n") + 2
        opener = min(i for i in (t.valid.find(b"["), t.valid.find(b"{"), len(t.valid)) if i >= 0)
        cut = opener + 1 if t.yaml else len(t.valid) // 2  # YAML: cut inside a bracket
        latin1 = t.valid[:second_line] + b"\xe9" + t.valid[second_line:]
        yield _case(t, "missing file", None, 2)
        yield _case(t, "a directory", DIR, 2, "directory")
        yield _case(t, "binary garbage", bytes(range(256)) * 4)
        yield _case(t, "latin-1 text", latin1, 2, "UTF-8", "offset")
        yield _case(t, "NUL bytes", t.valid[:20] + b"\x00\x00" + t.valid[20:])
        if not t.key.startswith("sweep"):  # a valid sweep runs its whole grid
            yield _case(t, "utf-8 BOM, valid", b"\xef\xbb\xbf" + t.valid, t.ok_rc)
            yield _case(t, "utf-16 BOM, valid", t.valid.decode().encode("utf-16"), t.ok_rc)
        yield _case(t, "truncated", t.valid[:cut])
        deep = "[" * 100_000 if not t.key.endswith("csv") else "x," + '"' * 100_000
        yield _case(t, "nested 100,000 deep", deep, 2)
        yield _case(t, "oversized (sparse)", ("sparse", 600 * 1024 * 1024), 2, "larger than")
        if t.yaml:
            first_key = t.valid.decode().split(":", 1)[0]
            duplicated = f"{t.valid.decode()}{first_key}: again\n"
            yield _case(t, "alias bomb", _alias_bomb(), 2, "alias")
            yield _case(t, "recursive alias", "a: &a [*a]\n", 2, "recursive")
            yield _case(t, "duplicate key", duplicated, 2, "duplicate key", first_key)
            yield _case(t, "tab indentation", "a:\n\t- b\n", 2, "not valid YAML")
            yield _case(t, "a .nan", "x: .nan\n", 2, "finite")
            yield _case(t, "top-level string", "just text\n")
        elif not t.key.endswith("csv"):
            yield _case(t, "NaN", '{"x": NaN}', 2, "NaN")
            yield _case(t, "1e400", '{"x": 1e400}', 2, "1e400")
            yield _case(t, "5000-digit integer", '{"x": ' + "9" * 5000 + "}", 2, "digits")
            yield _case(t, "duplicate key", '{"items": [], "items": []}', 2, "duplicate key")
            yield _case(t, "top-level list", "[1, 2, 3]")


# -- field-level damage --------------------------------------------------------------------------


def _snap(name: str, doc: Any, *needs: str) -> Case:
    return _case(TARGETS[0], name, _json(doc), 2, *needs)


def snapshot_cases() -> Iterator[Case]:
    n, p = node, pod
    yield _snap("items a mapping", {"kind": "List", "items": {}}, "Kubernetes List")
    yield _snap("item a string", kube_list("Node"), "items[0]", "mapping")
    yield _snap("kind a number", kube_list({**n(), "kind": 7}), "items[0]", "kind")
    yield _snap("metadata a string", kube_list({**n(), "metadata": "gpu-1"}), "metadata", "mapping")
    yield _snap("metadata missing", kube_list({"kind": "Node"}), "metadata")
    yield _snap(
        "node without a name", kube_list({**n(), "metadata": {"labels": {}}}), "metadata.name"
    )
    yield _snap("empty node name", kube_list({**n(), "metadata": {"name": ""}}), "metadata.name")
    yield _snap("name a number", kube_list({**n(), "metadata": {"name": 5}}), "metadata.name")
    yield _snap(
        "pod without namespace",
        kube_list(n(), {**p(), "metadata": {"name": "x"}}),
        "Pod",
        "namespace",
    )
    yield _snap(
        "labels a list",
        kube_list({**n(), "metadata": {"name": "a", "labels": ["x"]}}),
        "metadata.labels",
    )
    yield _snap(
        "label value a number",
        kube_list({**n(), "metadata": {"name": "a", "labels": {"x": 1}}}),
        "metadata.labels['x']",
    )
    yield _snap(
        "annotations a list",
        kube_list({**n(), "metadata": {"name": "a", "annotations": [1]}}),
        "annotations",
    )
    yield _snap(
        "ownerReferences a string",
        kube_list(
            n(), {**p(), "metadata": {"name": "x", "namespace": "ml", "ownerReferences": "ds"}}
        ),
        "ownerReferences",
    )
    yield _snap(
        "ownerReference a number",
        kube_list(
            n(), {**p(), "metadata": {"name": "x", "namespace": "ml", "ownerReferences": [3]}}
        ),
        "ownerReferences[0]",
    )
    yield _snap("duplicate node names", kube_list(n(), n()), "items[1]", "Node gpu-1", "items[0]")
    yield _snap("duplicate pods", kube_list(n(), p(), p()), "Pod ml/job", "items[1]")
    yield _snap(
        "duplicate partitionings",
        kube_list(n(), partitioning(), partitioning()),
        "NodePartitioning gpu-1",
    )
    # A huge GPU count is cluster state, not a damaged file: the node is a problem the plan
    # reports (TooManyGpus; tests/test_cluster_fixtures.py), the rest is planned.
    for label, count in [("1e9", "1000000000"), ("30 digits", "9" * 30)]:
        yield _case(TARGETS[0], f"gpu.count {label}", _json(kube_list(n(count=count))), 0)
    big_mem = n()
    big_mem["metadata"]["labels"]["nvidia.com/gpu.memory"] = "999999999999"
    yield _snap("gpu.memory huge", kube_list(big_mem), "nvidia.com/gpu.memory")
    for label, value in [
        ("true", True),
        ("1e999999", "1e999999"),
        ("-5", "-5"),
        ("abc", "abc"),
        ("a list", ["1"]),
        ("70 chars", "9" * 70),
    ]:
        yield _snap(
            f"allocatable cpu {label}",
            kube_list(n(status={"allocatable": {"cpu": value}})),
            "status.allocatable['cpu']",
        )
        bad = p()
        bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-3g.40gb"] = value
        yield _snap(f"pod limit {label}", kube_list(n(), bad), "Pod ml/job", "resources.limits")
    req = p()
    req["spec"]["containers"][0]["resources"] = {"requests": {"memory": "1e999999Gi"}}
    yield _snap("request 1e999999Gi", kube_list(n(), req), "resources.requests['memory']")
    yield _snap(
        "resources a string",
        kube_list(n(), p(containers=[{"name": "c", "resources": "1 gpu"}])),
        "spec.containers[0].resources",
    )
    yield _snap("containers a mapping", kube_list(n(), p(containers={"c": {}})), "spec.containers")
    yield _snap("container a string", kube_list(n(), p(containers=["c"])), "spec.containers[0]")
    yield _snap(
        "initContainers a number", kube_list(n(), p(initContainers=1)), "spec.initContainers"
    )
    yield _snap("overhead true", kube_list(n(), p(overhead={"cpu": True})), "spec.overhead['cpu']")
    yield _snap("nodeSelector a list", kube_list(n(), p(nodeSelector=["a=b"])), "spec.nodeSelector")
    yield _snap(
        "nodeSelector value a number",
        kube_list(n(), p(nodeSelector={"zone": 1})),
        "spec.nodeSelector['zone']",
    )
    yield _snap("affinity a string", kube_list(n(), p(affinity="gpu")), "spec.affinity")
    yield _snap(
        "nodeAffinity a list", kube_list(n(), p(affinity={"nodeAffinity": []})), "nodeAffinity"
    )
    req_at = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "x"}}
    yield _snap(
        "nodeSelectorTerms a string",
        kube_list(n(), p(affinity={"nodeAffinity": req_at})),
        "nodeSelectorTerms",
    )
    term = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": "zone in (a)"}]
        }
    }
    yield _snap(
        "matchExpressions a string",
        kube_list(n(), p(affinity={"nodeAffinity": term})),
        "matchExpressions",
    )
    term2 = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "z", "operator": "In", "values": [1]}]}
            ]
        }
    }
    yield _snap(
        "expression value a number",
        kube_list(n(), p(affinity={"nodeAffinity": term2})),
        "values[0]",
    )
    term3 = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": ["metadata.name"]}]}]
        }
    }
    yield _snap(
        "matchFields key a list",
        kube_list(n(), p(affinity={"nodeAffinity": term3})),
        "matchFields[0].key",
    )
    yield _snap(
        "tolerations a mapping", kube_list(n(), p(tolerations={"key": "x"})), "spec.tolerations"
    )
    yield _snap(
        "toleration key a number",
        kube_list(n(), p(tolerations=[{"key": 5}])),
        "spec.tolerations[0].key",
    )
    yield _snap("toleration a string", kube_list(n(), p(tolerations=["x"])), "spec.tolerations[0]")
    yield _snap("taints a string", kube_list(n(spec={"taints": "gpu"})), "spec.taints")
    yield _snap(
        "taint effect a number",
        kube_list(n(spec={"taints": [{"key": "a", "effect": 1}]})),
        "spec.taints[0].effect",
    )
    yield _snap(
        "unschedulable a string", kube_list(n(spec={"unschedulable": "yes"})), "spec.unschedulable"
    )
    yield _snap("priority a string", kube_list(n(), p(priority="high")), "spec.priority")
    yield _snap("priority 1e12", kube_list(n(), p(priority=10**12)), "spec.priority")
    yield _snap("nodeName a number", kube_list(n(), p(nodeName=1)), "spec.nodeName")
    bad_status = p()
    bad_status["status"] = {"phase": 3}
    yield _snap("phase a number", kube_list(n(), bad_status), "status.phase")
    bad_cond = p()
    bad_cond["status"]["conditions"] = "Unschedulable"
    yield _snap("conditions a string", kube_list(n(), bad_cond), "status.conditions")
    bad_cond2 = p()
    bad_cond2["status"]["conditions"] = [{"type": ["PodScheduled"]}]
    yield _snap("condition type a list", kube_list(n(), bad_cond2), "status.conditions[0].type")
    # the agent's report wins over GFD's count (a node that lost a GPU, Xid 79, is relabelled
    # while the old spec still names it): read as the controller reads it, not refused
    yield _case(
        TARGETS[0],
        "status for GPU 5 of a 2-GPU node, valid",
        _json(kube_list(n(), partitioning(index=5))),
        0,
    )
    single = node(count="14")  # strategy single: 14 counts MIG devices, not GPUs
    single["metadata"]["labels"]["nvidia.com/mig.strategy"] = "single"
    single["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
    yield _case(
        TARGETS[0],
        "GPU 5 under MIG strategy single, valid",
        _json(kube_list(single, partitioning(index=5))),
        0,
    )
    twice = partitioning()
    twice["status"]["gpus"].append(dict(twice["status"]["gpus"][0]))
    yield _snap("status lists GPU 0 twice", kube_list(n(), twice), "listed twice")
    yield _snap(
        "status index a string", kube_list(n(), partitioning(index="0")), "status.gpus[0].index"
    )
    yield _snap(
        "status index true", kube_list(n(), partitioning(index=True)), "status.gpus[0].index"
    )
    spec_bad = partitioning()
    spec_bad["spec"]["gpus"] = [{"index": 3}]
    yield _case(
        TARGETS[0], "spec for GPU 3 of a 2-GPU node, valid", _json(kube_list(n(), spec_bad)), 0
    )
    gpus_map = partitioning()
    gpus_map["status"]["gpus"] = {"0": {}}
    yield _snap("status gpus a mapping", kube_list(n(), gpus_map), "status.gpus")
    yield _snap("300,001 items", kube_list(*([{}] * 300_001)), "300,001 items")


def _doc_cases(t: Target, name: str, doc: Any, *needs: str) -> Case:
    content = _json(doc) if not t.yaml else json.dumps(doc).encode()  # JSON is YAML too
    return _case(t, name, content, 2, *needs)


def workload_cases() -> Iterator[Case]:
    def pods(**change: Any) -> dict[str, Any]:
        return {"pods": [{**WORKLOAD["pods"][0], **change}]}

    for t in (TARGETS[2], TARGETS[3], TARGETS[8]):
        yield _doc_cases(t, "replicas 1e8", pods(replicas=1e8), "pods[0] (a)", "replicas")
        yield _doc_cases(t, "num_gpu 1e9", pods(num_gpu=1_000_000_000), "pods[0] (a)", "num_gpu")
        yield _doc_cases(t, "cpu_milli true", pods(cpu_milli=True), "cpu_milli")
        yield _doc_cases(t, "cpu_milli 1e30", pods(cpu_milli=1e30), "cpu_milli")
        yield _doc_cases(t, "qos a mapping", pods(qos={"class": "LS"}), "qos")
        yield _doc_cases(t, "gpu_spec a number", pods(gpu_spec=7), "gpu_spec")
        yield _doc_cases(t, "gpu_spec of mappings", pods(gpu_spec=[{"m": 1}]), "gpu_spec")
        yield _doc_cases(
            t, "deletion before creation", pods(creation_time=10, deletion_time=5), "deletion_time"
        )
        yield _doc_cases(t, "pod without name", {"pods": [{"cpu_milli": 1}]}, "pods[0]", "name")
        yield _doc_cases(
            t, "duplicate pod names", {"pods": [WORKLOAD["pods"][0]] * 2}, "duplicate pod name 'a'"
        )
        yield _doc_cases(
            t,
            "replica name collides",
            {
                "pods": [
                    {**WORKLOAD["pods"][0], "replicas": 2},
                    {**WORKLOAD["pods"][0], "name": "a-1"},
                ]
            },
            "duplicate pod name 'a-1'",
        )
        yield _doc_cases(t, "pods a mapping", {"pods": {"a": {}}}, "'pods'")
        yield _doc_cases(
            t, "workload name a list", {"name": ["w"], "pods": WORKLOAD["pods"]}, "'name'"
        )
        yield _doc_cases(
            t,
            "replicas 600,000 twice",
            {
                "pods": [
                    {**WORKLOAD["pods"][0], "replicas": 600_000},
                    {**WORKLOAD["pods"][1], "replicas": 600_000},
                ]
            },
            "pods[1] (b)",
            "1,000,000 pods",
        )
        mix = [{"weight": 1, "cpu_milli": 1000}]
        yield _doc_cases(
            t,
            "synthetic count 1e9",
            {"synthetic": {"count": 1_000_000_000, "mix": mix}},
            "synthetic",
            "count",
        )
        yield _doc_cases(
            t,
            "synthetic weight a string",
            {"synthetic": {"mix": [{"weight": "x", "cpu_milli": 1}]}},
            "mix[0]",
            "weight",
        )
        yield _doc_cases(
            t,
            "synthetic mean duration 1e300",
            {"synthetic": {"mix": mix, "mean_duration_s": 1e300}},
            "mean_duration_s",
        )
        yield _doc_cases(
            t, "synthetic unknown field", {"synthetic": {"mix": mix, "cuont": 5}}, "cuont"
        )
        yield _doc_cases(
            t, "synthetic jitter 5", {"synthetic": {"mix": mix, "jitter_cpu": 5}}, "jitter_cpu"
        )
    t = TARGETS[2]
    yield _case(
        t,
        "synthetic weight .nan",
        "synthetic:\n  mix: [{weight: .nan, cpu_milli: 1}]\n",
        2,
        "finite",
    )
    yield _case(
        t,
        "alias bomb in a qos field",
        _alias_bomb() + "pods:\n  - {name: a, cpu_milli: 1, qos: *a9}\n",
        2,
        "alias",
    )


def cluster_cases() -> Iterator[Case]:
    def pools(**change: Any) -> dict[str, Any]:
        return {"pools": [{**CLUSTER["pools"][0], **change}]}

    for t in (TARGETS[4], TARGETS[5], TARGETS[9]):
        yield _doc_cases(t, "count 1e9", pools(count=1_000_000_000), "pools[0] (a100)", "count")
        yield _doc_cases(t, "count 1e9 as float", pools(count=1e9), "pools[0] (a100)", "count")
        yield _doc_cases(t, "gpus_per_node 1e6", pools(gpus_per_node=1_000_000), "gpus_per_node")
        yield _doc_cases(t, "cpu_milli true", pools(cpu_milli=True), "cpu_milli")
        yield _doc_cases(t, "mode bogus", pools(mode="turbo"), "mode")
        yield _doc_cases(
            t, "unknown gpu model", pools(gpu_model="Z9000"), "pools[0] (a100)", "Z9000"
        )
        yield _doc_cases(t, "gpu_model a number", pools(gpu_model=100), "gpu_model")
        yield _doc_cases(t, "pool without name", {"pools": [{"count": 1}]}, "pools[0]", "name")
        yield _doc_cases(
            t, "duplicate pools", {"pools": [CLUSTER["pools"][0]] * 2}, "duplicate node name"
        )
        yield _doc_cases(
            t,
            "60,000 nodes twice",
            {
                "pools": [
                    {**CLUSTER["pools"][0], "count": 60_000},
                    {**CLUSTER["pools"][0], "name": "b", "count": 60_000},
                ]
            },
            "pools[1]",
            "100,000 nodes",
        )
        yield _doc_cases(
            t, "name a mapping", {"name": {"x": 1}, "pools": CLUSTER["pools"]}, "'name'"
        )
        yield _doc_cases(t, "mig mode on a T4", pools(gpu_model="T4", mode="mig"), "MIG-capable")


def csv_cases() -> Iterator[Case]:
    t = TARGETS[6]
    head = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
    rows = {
        "num_gpu 1e9": ("p1,1000,0,1000000000,500\n", "pods.csv:2", "num_gpu"),
        "cpu 1e300": ("p1,1e300,0,1,500\n", "pods.csv:2", "cpu_milli"),
        "memory 5000 digits": ("p1,1," + "9" * 5000 + ",1,500\n", "pods.csv:2", "memory_mib"),
        "cpu nan": ("p1,nan,0,1,500\n", "pods.csv:2", "cpu_milli"),
        "negative cpu": ("p1,-5,0,1,500\n", "pods.csv:2", ">= 0"),
        "duplicate pod": ("p1,1,0,1,500\np1,1,0,1,500\n", "pods.csv:3", "duplicate pod name"),
        "empty name": (",1,0,1,500\n", "pods.csv:2", "'name' is empty"),
        "short row": ("p1,1,0\n", "pods.csv:2", "3 cells"),
        "field over the csv limit": ("p1," + "1" * 200_000 + ",0,1,500\n", "pods.csv:2", "CSV"),
        "unterminated quote": ('p1,"1,0,1,500\n', "pods.csv", "cells"),
    }
    for name, (body, *needs) in rows.items():
        yield _case(t, name, head + body, 2, *needs)
    times = head.strip() + ",creation_time,deletion_time\np1,1,0,1,500,0,10000000000000\n"
    yield _case(t, "deletion 1e13", times, 2, "pods.csv:2", "deletion_time")
    yield _case(t, "header lacks columns", "name,cpu\np1,1\n", 2, "header lacks")
    yield _case(
        t,
        "header names a column twice",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,name\np,1,0,1,5,q\n",
        2,
        "twice",
    )
    yield _case(t, "header only", head, 2, "no pod rows")
    n = TARGETS[7]
    nhead = "sn,cpu_milli,memory_mib,gpu,model\n"
    yield _case(n, "gpu 1e9", nhead + "n0,1,1,1000000000,T4\n", 2, "nodes.csv:2", "gpu")
    yield _case(n, "duplicate node", nhead + "n0,1,1,1,T4\nn0,1,1,1,T4\n", 2, "duplicate node 'n0'")
    yield _case(n, "gpus without model", nhead + "n0,1,1,2,\n", 2, "no model")
    yield _case(
        n, "header lacks gpu", "sn,cpu_milli,memory_mib,model\nn0,1,1,T4\n", 2, "header lacks"
    )
    yield _case(n, "memory 1e300", nhead + "n0,1,1e300,1,T4\n", 2, "memory_mib")


def agent_cases() -> Iterator[Case]:
    spec = SPEC

    def with_gpu(**change: Any) -> dict[str, Any]:
        return {**spec, "gpus": [{**spec["gpus"][0], **change}]}

    for t in (TARGETS[10], TARGETS[11]):
        yield _doc_cases(
            t,
            "metadata a string",
            {"metadata": "node-1", "spec": spec},
            "'metadata' must be a mapping",
        )
        yield _doc_cases(t, "spec a string", {"spec": "mig"}, "spec")
        yield _doc_cases(t, "gpus a string", {**spec, "gpus": "0"}, "gpus")
        yield _doc_cases(t, "index a string", with_gpu(index="zero"), "gpus.0.index")
        yield _doc_cases(t, "index -1", with_gpu(index=-1), "gpus.0.index")
        yield _doc_cases(t, "index 1e9", with_gpu(index=1_000_000_000), "gpus.0.index")
        yield _doc_cases(
            t,
            "mig entry unknown field",
            with_gpu(mig=[{"profile": "1g.10gb", "start": 0, "x": 1}]),
            "gpus.0.mig.0",
        )
        yield _doc_cases(
            t,
            "mps memory 0",
            {
                "mode": "mps",
                "gpus": [{"index": 0, "mps": [{"memoryMiB": 0, "activeThreadPercentage": 50}]}],
            },
            "memoryMiB",
        )
        yield _doc_cases(
            t,
            "mps threads 101",
            {
                "mode": "mps",
                "gpus": [{"index": 0, "mps": [{"memoryMiB": 1024, "activeThreadPercentage": 101}]}],
            },
            "activeThreadPercentage",
        )
        yield _doc_cases(t, "mode bogus", {**spec, "mode": "turbo"}, "mode")
        yield _doc_cases(t, "unknown top field", {**spec, "gpuz": []}, "gpuz")
        yield _doc_cases(
            t, "100 GPUs", {**spec, "gpus": [{"index": i} for i in range(100)]}, "gpus"
        )
        yield _doc_cases(
            t,
            "300 MPS slices",
            {
                "mode": "mps",
                "gpus": [
                    {"index": 0, "mps": [{"memoryMiB": 1024, "activeThreadPercentage": 1}] * 300}
                ],
            },
            "mps",
        )
        yield _doc_cases(t, "top-level number", 7, "mapping")
    t = TARGETS[10]
    yield _case(t, "YAML error", "mode: mig\ngpus: [\n", 2, "not valid YAML")
    yield _case(t, "empty file (no spec)", "", 1)
    yield _case(
        t, "alias bomb in planId", _alias_bomb() + "mode: mig\nplanId: *a9\ngpus: []\n", 2, "alias"
    )


def catalog_cases() -> Iterator[Case]:
    for t in (TARGETS[1], TARGETS[12]):
        yield _case(t, "models a mapping", "models: {a: 1}\n", 2, "catalog")
        yield _case(t, "model a string", "models: [A100]\n", 2, "catalog")
        yield _case(
            t,
            "profiles a list",
            CATALOG_YAML.replace(
                "profiles:\n      1g: {name: 1g.10gb, memory_mib: 9984}\n      7g: {name: 7g.80gb, memory_mib: 81152}",
                "profiles: [1g]",
            ),
            2,
            "catalog",
        )
        yield _case(
            t, "unknown geometry", CATALOG_YAML.replace("ampere-hopper-8", "warp-9"), 2, "warp-9"
        )
        yield _case(
            t,
            "memory 1e400",
            CATALOG_YAML.replace("memory_mib: 81920", "memory_mib: 1.0e+400"),
            2,
            "finite",
        )
        yield _case(
            t,
            "memory a string",
            CATALOG_YAML.replace("memory_mib: 81920", "memory_mib: lots"),
            2,
            "catalog",
        )
        yield _case(t, "top-level list", "- a\n- b\n", 2, "mapping")


def fake_gpus_cases() -> Iterator[Case]:
    for spec, needs in [
        ("A100-SXM4-80GB:1000000000", "COUNT"),
        ("A100-SXM4-80GB:65", "64 GPUs"),
        ("A100-SXM4-80GB:0", "COUNT >= 1"),
        ("Z9000:1", "Z9000"),
    ]:
        yield Case(
            f"agent --fake-gpus {spec}",
            ("agent", "--fake", "--fake-gpus", spec, "--once"),
            {},
            2,
            (needs,),
            names_file="--fake-gpus",
        )


def all_cases() -> list[Case]:
    cases = [
        *generic_cases(),
        *snapshot_cases(),
        *workload_cases(),
        *cluster_cases(),
        *csv_cases(),
        *agent_cases(),
        *catalog_cases(),
        *fake_gpus_cases(),
    ]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), [n for n in names if names.count(n) > 1]
    return cases


# -- the runner -----------------------------------------------------------------------------------


def _materialise(case: Case, d: Path) -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    for name, content in case.files.items():
        path = d / name
        if content is None:
            continue
        if content == DIR:
            path.mkdir()
        elif isinstance(content, tuple):
            with open(path, "wb") as fh:
                fh.truncate(content[1])
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return [a.replace("{d}", str(d)) for a in case.argv]


def run_case(case: Case, d: Path) -> Outcome:
    """One case in this process: the CLI's ``main`` with stdout and stderr captured."""
    from gpuslice.cli import main

    argv = _materialise(case, d)
    out, err = io.StringIO(), io.StringIO()
    tb = ""
    rc: int | None = None
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            tb = traceback.format_exc()
    seconds = time.perf_counter() - t0
    text = err.getvalue()
    if not tb and "Traceback (most recent call last)" in text:
        tb = text
    return Outcome(case, rc, text[-2000:], tb, seconds)


def _worker(conn: multiprocessing.connection.Connection, root: str) -> None:
    import importlib

    # every command's modules once, before any clock runs: the corpus times input handling
    for module in (
        "gpuslice.cli",
        "planner.api",
        "partitioner.snapshot",
        "simulations.replay.engine",
    ):
        importlib.import_module(module)
    for command in ("plan", "simulate", "sweep", "agent"):
        importlib.import_module(f"gpuslice.commands.{command}")

    while True:
        job = conn.recv()
        if job is None:
            return
        k, case = job
        conn.send(run_case(case, Path(root) / f"case{k}"))


@dataclass
class _Slot:
    proc: Any
    conn: multiprocessing.connection.Connection
    job: tuple[int, Case, float] | None = None


def run_corpus(cases: list[Case], root: Path, workers: int = 2) -> list[Outcome]:
    """Run every case in ``workers`` spawned processes; kill one that passes the hard limit."""
    ctx = multiprocessing.get_context("spawn")
    todo = list(enumerate(cases))
    results: dict[int, Outcome] = {}

    def start() -> _Slot:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, str(root)), daemon=True)
        proc.start()
        return _Slot(proc, parent)

    slots = [start() for _ in range(min(workers, len(cases)))]
    try:
        while todo or any(s.job for s in slots):
            for s in slots:
                if s.job is None and todo:
                    k, case = todo.pop(0)
                    s.conn.send((k, case))
                    s.job = (k, case, time.monotonic())
            busy = [s for s in slots if s.job is not None]
            ready = multiprocessing.connection.wait([s.conn for s in busy], timeout=1.0)
            for s in busy:
                assert s.job is not None
                k, case, began = s.job
                if s.conn in ready:
                    try:
                        results[k] = s.conn.recv()
                        s.job = None
                        continue
                    except (EOFError, OSError):  # the worker died (a crash is a traceback too)
                        results[k] = Outcome(
                            case, None, "", "worker process died", time.monotonic() - began
                        )
                elif time.monotonic() - began > HARD_LIMIT_S:
                    results[k] = Outcome(case, None, "", "", time.monotonic() - began, True)
                else:
                    continue
                s.proc.kill()
                s.proc.join()
                fresh = start()
                s.proc, s.conn, s.job = fresh.proc, fresh.conn, None
    finally:
        for s in slots:
            with contextlib.suppress(Exception):
                s.conn.send(None)
            s.proc.join(timeout=5)
            if s.proc.is_alive():
                s.proc.kill()
    return [results[k] for k in range(len(cases))]


if __name__ == "__main__":  # python tests/malformed_corpus.py: the counts, without pytest
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run_corpus(all_cases(), Path(tmp))
    for o in outcomes:
        if o.problems:
            print(o.case.name, o.problems)
    print(
        f"{len(outcomes)} inputs, {sum(bool(o.traceback) for o in outcomes)} tracebacks, "
        f"{sum(o.killed or o.seconds > 10 for o in outcomes)} over 10 s, "
        f"{sum(bool(o.problems) for o in outcomes)} not clean, max "
        f"{max(o.seconds for o in outcomes):.2f} s"
    )
