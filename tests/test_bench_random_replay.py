"""The random-workload replay benchmark: its generator keeps its documented ranges, a case
replays both policies and is judged by issue 9's rule, and bad arguments exit 2."""

from __future__ import annotations

import json

import pytest

from simulations.bench_random_replay import (
    DURATIONS,
    LOADS,
    SHARES,
    aggregate,
    build,
    main,
    random_case,
    run_case,
)


@pytest.mark.parametrize("case", range(40))
def test_cases_stay_in_their_documented_ranges_and_are_reproducible(case: int) -> None:
    spec = random_case(case)
    assert spec == random_case(case)
    assert 2 <= spec.nodes <= 4 and spec.gpus_per_node in (2, 4, 8)
    assert spec.mean_duration_s in DURATIONS and spec.load in LOADS
    assert 2 <= len(spec.mix) <= 5
    for weight, gpus, milli in spec.mix:
        assert weight > 0
        if gpus == 1:
            assert milli in SHARES
        else:  # a multi-GPU pod always fits a node
            assert milli == 1000 and gpus in (2, 4) and gpus <= spec.gpus_per_node
    # the offered load, in GPU shares, is the case's load
    total = sum(w for w, _, _ in spec.mix)
    mean_gpu = sum(w * n * m / 1000 for w, n, m in spec.mix) / total
    offered = spec.arrival_rate_per_s() * spec.mean_duration_s * mean_gpu / spec.gpus
    assert offered == pytest.approx(spec.load)


def test_the_workload_and_cluster_are_what_the_case_says() -> None:
    spec = random_case(5, pods=50)
    workload, cluster = build(spec)
    assert len(workload.pods) == 50
    assert len(cluster.nodes) == spec.nodes
    assert all(n.gpus == spec.gpus_per_node for n in cluster.nodes)
    shapes = {(p.num_gpu, p.gpu_milli) for p in workload.pods}
    assert shapes <= {(n, m) for _, n, m in spec.mix}


def test_a_case_replays_both_policies_and_is_judged() -> None:
    out = run_case((3, 40))
    assert set(out["policies"]) == {"cpsat", "greedy"}
    for summary in out["policies"].values():
        assert summary["pods"] == 40
    assert out["verdict"]["pass"] == all(out["verdict"]["checks"].values())
    agg = aggregate([out, out])
    assert agg["cases"] == 2 and agg["pass"] == 2 * out["verdict"]["pass"]
    assert agg["totals"]["cpsat"]["theft"] == 2 * out["policies"]["cpsat"]["theft"]


def test_the_aggregate_counts_what_failed() -> None:
    def summary(
        p95: float, p99: float, reconf: int, theft: int = 0, mean: float = 0.0
    ) -> dict[str, float]:
        return {
            "pending_p50_s": 0.0,
            "pending_mean_s": mean,
            "pending_p95_s": p95,
            "pending_p99_s": p99,
            "gpus_reconfigured": reconf,
            "theft": theft,
            "pods_disrupted": 0,
            "never_scheduled": 0,
            "overtakes": theft,
        }

    from simulations.bench_replay import verdict

    good = {"cpsat": summary(10, 20, 5, mean=3), "greedy": summary(30, 40, 6, theft=2, mean=7)}
    bad = {"cpsat": summary(500, 900, 9, mean=99), "greedy": summary(600, 800, 6, mean=24)}
    cases = [{"policies": p, "verdict": verdict(p["cpsat"], p["greedy"])} for p in (good, bad)]
    agg = aggregate(cases)
    assert agg["pass"] == 1
    assert agg["failed_checks"] == {
        "p99 <= greedy": 1,
        "reconfigured <= greedy": 1,
        "p95 <= 0.5 x greedy": 1,
    }
    assert agg["cpsat_at_most_greedy"] == {"p95": 1.0, "p99": 0.5, "gpus_reconfigured": 0.5}
    assert agg["totals"]["greedy"]["theft"] == 2
    assert agg["totals"]["greedy"]["overtakes"] == 2
    # geometric mean of (a + 1) / (b + 1): (4 / 8 * 100 / 25) ** 0.5 = 2 ** 0.5
    assert agg["geomean_ratio_cpsat_to_greedy"]["mean"] == pytest.approx(2**0.5, abs=1e-3)


@pytest.mark.parametrize("argv", [["--cases", "5-2"], ["--cases", "x"], ["--pods", "0"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "bench_random_replay" in capsys.readouterr().err


def test_the_cli_prints_one_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cases", "1", "--pods", "30"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["aggregate"]["cases"] == 1 and len(doc["cases"]) == 1
    assert doc["cases"][0]["case"] == 1


def test_an_agent_outage_applies_to_every_case_and_bad_ones_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = run_case((14, 120, (500.0, 3000.0)))
    calm = run_case((14, 120))
    hit, nos = out["policies"]["cpsat"], out["policies"]["greedy"]
    assert hit["pending_mean_s"] > calm["policies"]["cpsat"]["pending_mean_s"]
    assert hit["never_scheduled"] == 0 and hit["theft"] == 0
    assert hit["admission_rejections"] <= nos["admission_rejections"]
    assert main(["--cases", "1", "--agent-outage", "50:10"]) == 2
    assert "expected START:END" in capsys.readouterr().err
    assert main(["--cases", "1", "--plugin-lag", "-1"]) == 2
    assert "--plugin-lag, --agent-lease and --recreate-stranded must be >= 0" in (
        capsys.readouterr().err
    )
    assert main(["--cases", "1", "--recreate-stranded", "-5"]) == 2
    capsys.readouterr()
    argv = ["--cases", "1", "--pods", "20", "--plugin-lag", "30", "--recreate-stranded", "0"]
    assert main(argv) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["plugin_lag_s"], settings["recreate_stranded_s"]) == (30, 0)
