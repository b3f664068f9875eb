"""bench_replay's acceptance rule (issue 9) per cell and its merged Markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openb_data import OPENB, needs_openb

from simulations.bench_replay import (
    WHOLE_NODE,
    _cell,
    render_modes_table,
    render_shaped_table,
    render_table,
    verdict,
)


def summary(
    p95: float, p99: float, reconf: int = 10, theft: int = 0, disrupted: int = 0
) -> dict[str, Any]:
    return {
        "pending_p95_s": p95,
        "pending_p99_s": p99,
        "gpus_reconfigured": reconf,
        "theft": theft,
        "pods_disrupted": disrupted,
    }


@pytest.mark.parametrize(
    ("greedy", "cpsat", "regime", "ok"),
    [
        (summary(30, 100), summary(25, 100), "light", True),
        (summary(30, 100), summary(25, 101), "light", False),  # p99 above greedy's
        (summary(600, 2000), summary(300, 1500), "overload", True),
        (summary(600, 2000), summary(301, 1500), "overload", False),  # p95 over half
        (summary(7200, 20000), summary(6480, 18000), "deep overload", True),
        (summary(7200, 20000), summary(6480, 18001), "deep overload", False),  # p99 > 0.9x
        (summary(7200, 20000), summary(6481, 18000), "deep overload", False),  # p95 > 0.9x
        (summary(30, 100), summary(25, 90, reconf=11), "light", False),
        (summary(30, 100), summary(25, 90, theft=1), "light", False),
        (summary(30, 100), summary(25, 90, disrupted=1), "light", False),
    ],
)
def test_verdict_applies_the_rule_of_the_regime(
    greedy: dict[str, Any], cpsat: dict[str, Any], regime: str, ok: bool
) -> None:
    v = verdict(cpsat, greedy)
    assert v["regime"].startswith(regime + " (") and v["pass"] is ok


def test_render_merges_files_and_names_the_failed_checks(tmp_path: Path) -> None:
    def doc(trace: str, nodes: int, c: dict[str, Any], g: dict[str, Any]) -> dict[str, Any]:
        cell = {"trace": trace, "nodes": nodes, "gpus": 8 * nodes}
        return {"cells": [{**cell, "policies": {"cpsat": c, "greedy": g}}]}

    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    whole = {"pending_by_size": {WHOLE_NODE: {"pods": 3, "p50": 12345.0}}}
    a.write_text(json.dumps(doc("gpushare40", 4, summary(10, 20), {**summary(30, 40), **whole})))
    b.write_text(json.dumps(doc("default", 5, summary(1, 1), summary(1000, 4000))))
    rerun = doc("default", 5, summary(900, 5000), summary(0, 0))
    del rerun["cells"][0]["policies"]["greedy"]  # a later run of CP-SAT alone replaces b's
    c.write_text(json.dumps(rerun))
    lines = render_table([str(a), str(b), str(c)]).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| default | 5 (40) | overload | 900 / 5,000 | 1,000 / 4,000 |")
    assert lines[2].endswith("| FAIL: p99 <= greedy, p95 <= 0.5 x greedy |")
    assert lines[3].startswith("| gpushare40 | 4 (32) | light |") and lines[3].endswith("| pass |")
    # the whole-node pods' median wait, CP-SAT vs greedy ("-": the run had none)
    assert "| - vs 12,345 | 10 vs 10 |" in lines[3]
    assert "| - vs - | 10 vs 10 |" in lines[2]


def test_render_modes_puts_dra_beside_the_planners(tmp_path: Path) -> None:
    def pol(p50: float, p95: float, p99: float, reconf: int, whole: float | None) -> dict[str, Any]:
        by_size = {} if whole is None else {WHOLE_NODE: {"pods": 2, "p50": whole}}
        return {
            "pending_p50_s": p50,
            "pending_p95_s": p95,
            "pending_p99_s": p99,
            "gpus_reconfigured": reconf,
            "pending_by_size": by_size,
        }

    cell = {"trace": "default", "nodes": 4, "gpus": 32}
    run = tmp_path / "run.json"
    run.write_text(
        json.dumps(
            {
                "cells": [
                    {
                        **cell,
                        "policies": {
                            "dra": pol(5, 300, 9000, 900, 2_000_000),
                            "cpsat": pol(10, 1500, 20000, 50, 600_000),
                            "greedy": pol(12, 1600, 21000, 60, None),
                        },
                    },
                    {
                        "trace": "gpushare40",
                        "nodes": 4,
                        "gpus": 32,
                        "policies": {"dra": pol(1, 1, 1, 1, None)},
                    },
                ]
            }
        )
    )
    lines = render_modes_table([str(run)]).splitlines()
    assert len(lines) == 3  # a cell without the planners' runs is left out
    assert lines[2] == (
        "| default | 4 (32) | 5 / 300 / 9,000 | 10 / 1,500 / 20,000 | 12 / 1,600 / 21,000 "
        "| 2,000,000 / 600,000 / - | 900 / 50 / 60 |"
    )


def test_render_shaped_puts_planner_shaped_beside_publish_everything(tmp_path: Path) -> None:
    def pol(p95: float, reconf: int) -> dict[str, Any]:
        return {
            "pending_p50_s": 1,
            "pending_p95_s": p95,
            "pending_p99_s": 2 * p95,
            "gpus_reconfigured": reconf,
            "pending_by_size": {WHOLE_NODE: {"pods": 1, "p50": 7}},
        }

    cells = [
        {
            "trace": "default",
            "nodes": 4,
            "gpus": 32,
            "policies": {"dra": pol(100, 900), "dra-shaped": pol(50, 90)},
        },
        {
            "trace": "default",
            "nodes": 5,
            "gpus": 40,
            "policies": {"dra": pol(100, 900), "dra-shaped": pol(150, 90)},
        },
        {
            "trace": "default",
            "nodes": 8,
            "gpus": 64,
            "policies": {"dra": pol(100, 900), "dra-shaped": pol(100, 900)},
        },
        {"trace": "gpushare40", "nodes": 4, "gpus": 32, "policies": {"dra": pol(1, 1)}},
    ]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"cells": cells}))
    lines = render_shaped_table([str(run)]).splitlines()
    assert len(lines) == 5  # a cell without both policies is left out
    assert (
        lines[2]
        == "| default | 4 (32) | 1 / 50 / 100 | 1 / 100 / 200 | 0.50 | 7 / 7 | 90 / 900 | pass |"
    )
    assert lines[3].endswith("| 1.50 | 7 / 7 | 90 / 900 | FAIL: p95 <= publish-everything |")
    assert lines[4].endswith("| FAIL: reconfigured < publish-everything |")


@needs_openb
def test_max_pod_slices_leaves_the_whole_node_pods_out_of_the_replay() -> None:
    # The first 130 GPU pods of openb default hold two eight-GPU pods (the 16th and 123rd).
    opts: dict[str, Any] = {
        "openb_dir": str(OPENB),
        "times_from": "default",
        "seed": 0,
        "limit": 1.0,
        "limit_pods": 130,
        "mode": "mig",
        "models": [],
        "settings": {},
    }
    _, _, _, everything = _cell(("default", 2, "greedy", {**opts, "max_pod_slices": 0}))
    _, _, _, pooled = _cell(("default", 2, "greedy", {**opts, "max_pod_slices": 7}))
    assert everything["gpu_pods"] == 130 and pooled["gpu_pods"] == 128
    assert everything["pending_by_size"][WHOLE_NODE]["pods"] == 2
    assert WHOLE_NODE not in pooled["pending_by_size"]


def test_a_negative_max_pod_slices_is_refused_with_exit_code_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from simulations.bench_replay import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--max-pod-slices", "-1"])
    assert exit_info.value.code == 2
    assert "--max-pod-slices must be 0 (keep all) or more, not -1" in capsys.readouterr().err


@pytest.mark.parametrize("share", ["-0.5", "1.5"])
def test_a_warm_share_outside_zero_to_one_is_refused_with_exit_code_2(
    share: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from simulations.bench_replay import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--warm-share", share])
    assert exit_info.value.code == 2
    assert f"--warm-share must be in [0, 1] (0: off), not {float(share)}" in capsys.readouterr().err
