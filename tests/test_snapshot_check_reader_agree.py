"""The snapshot file's check and the commands that read a dump agree on what is readable.

:func:`gpuslice.snapshot_file.check_kubectl_list` checks the fields the readers use before they
use them; whatever it lets through, ``gpuslice plan --snapshot`` and ``gpuslice nos-check`` must
read without a traceback (exit 0, or 2 with a message).  The oracle needs no knowledge of the
fields: damage a real dump (the cluster fixtures: nos and GPU Operator clusters) at random
places with values of the wrong kind or ``null``, or by deleting keys, and require one of the
two clean outcomes.  (It found ``spec.containers: null``, which the check reads as absent, as
the API server does, and the reader of slice requests did not.)
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.cli import EXIT_BAD_INPUT, main
from gpuslice.snapshot_file import SnapshotFileError, check_kubectl_list

FIXTURES = Path(__file__).parent / "fixtures" / "clusters"
DUMPS = ("nos-mig", "nos-mps", "gpu-operator-single", "gpu-operator-mixed")
ODD: tuple[Any, ...] = (
    None, 0, -1, 2**40, 1.5, True, "", "x", "-1", "1e9", "500m", [], {}, [1], {"a": 1},
)  # fmt: skip


def _paths(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*at, i))
    return out


_DOCS = {name: json.loads((FIXTURES / f"{name}.json").read_text()) for name in DUMPS}
_PATHS = {name: _paths(doc["items"]) for name, doc in _DOCS.items()}


def _damaged(name: str, hits: list[tuple[int, int, bool]]) -> dict[str, Any]:
    doc = json.loads(json.dumps(_DOCS[name]))
    paths = _PATHS[name]
    for where, value, delete in hits:
        path = paths[where % len(paths)]
        parent: Any = doc["items"]
        try:
            for key in path[:-1]:
                parent = parent[key]
            if delete and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = ODD[value % len(ODD)]
        except (KeyError, IndexError, TypeError):  # an earlier hit changed the way there
            continue
    return doc


def _run(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, err.getvalue()


@pytest.mark.parametrize("name", DUMPS)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    hits=st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 100), st.booleans()),
        min_size=1,
        max_size=3,
    )
)
def test_what_the_check_lets_through_is_read_cleanly(
    tmp_path: Path, name: str, hits: list[tuple[int, int, bool]]
) -> None:
    doc = _damaged(name, hits)
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))
    try:
        check_kubectl_list(doc, str(path))
        passes = True
    except SnapshotFileError:
        passes = False
    for argv in (
        ("plan", "--snapshot", str(path), "-o", "json", "--time-limit", "0.5"),
        ("nos-check", "--snapshot", str(path), "-o", "json"),
    ):
        rc, err = _run(*argv)  # an exception escaping main fails the test with its traceback
        if passes:
            assert rc in (0, EXIT_BAD_INPUT), (argv, rc, err)
            if rc == EXIT_BAD_INPUT:
                assert str(path) in err, err
        else:
            assert rc == EXIT_BAD_INPUT and str(path) in err, (argv, rc, err)


def test_null_containers_read_as_absent(tmp_path: Path) -> None:
    """The case the property found: a pod whose ``containers`` and ``initContainers`` are
    ``null`` asks for nothing; the dump is planned (before: a TypeError escaped from the
    reader of a pending pod's requests)."""
    doc = json.loads(json.dumps(_DOCS["nos-mig"]))
    pod = next(
        i for i in doc["items"] if i["kind"] == "Pod" and i["status"].get("phase") == "Pending"
    )
    pod["spec"]["containers"] = None
    pod["spec"]["initContainers"] = None
    check_kubectl_list(doc, "dump")
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))
    for argv in (
        ("plan", "--snapshot", str(path), "-o", "json", "--time-limit", "1"),
        ("nos-check", "--snapshot", str(path)),
    ):
        rc, err = _run(*argv)
        assert rc == 0, err
