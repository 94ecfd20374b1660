"""The checkpoint interval from the failure rate (Young/Daly), the expected goodput, the failure simulator
against them, save_interval=auto's config errors, and the planner's goodput table and simulation."""

from __future__ import annotations

import math

import pytest

from pipeline.cli.plan import compose_config, main
from pipeline.schema.build import build_config
from pipeline.schema.errors import ConfigError
from pipeline.schema.failsim import RunModel, simulate
from pipeline.schema.goodput import (
    auto_save_interval,
    daly_interval_s,
    expected_goodput,
    interval_table,
    lost_per_failure_s,
    system_mtbf_s,
    young_interval_s,
)
from tests.schema.test_plan import PLAN_70B
from tests.support.env import REPO


def test_daly_interval_by_hand() -> None:
    # C = 20 s, 1,024 nodes of 6,300 h: M = 6300 * 3600 / 1024 = 22,148.4 s; sqrt(2 C M) = 941.24 s
    m = system_mtbf_s(6300, 1024)
    assert m == pytest.approx(22148.4375)
    assert young_interval_s(20, m) == pytest.approx(941.2425, rel=1e-6)
    r = 20 / m
    sq = math.sqrt(2 * 20 * m)
    assert daly_interval_s(20, m) == pytest.approx(sq * (1 + math.sqrt(r / 2) / 3 + r / 18) - 20, rel=1e-12)
    assert daly_interval_s(20, m) == pytest.approx(927.956, rel=1e-5)
    assert daly_interval_s(300, 100) == 100, "a save dearer than 2M: Daly's interval is M"


def test_auto_interval_is_dalys_in_whole_steps() -> None:
    m = system_mtbf_s(6300, 1024)
    assert auto_save_interval(20, 3.0, 6300, 1024) == round(daly_interval_s(20, m) / 3.0) == 309
    assert auto_save_interval(20, 1e5, 6300, 1024) == 1, "at least one step"
    assert auto_save_interval(20, 3.0, 6300, 64) > auto_save_interval(20, 3.0, 6300, 1024), (
        "fewer nodes, rarer saves"
    )


def test_dalys_interval_maximises_the_expected_goodput() -> None:
    for save_s, recover_s, mtbf_s in ((20, 600, 22148.0), (5, 60, 3600.0), (200, 1200, 9000.0)):
        best = daly_interval_s(save_s, mtbf_s)
        g = expected_goodput(best, save_s, recover_s, mtbf_s)
        assert g > expected_goodput(0.9 * best, save_s, recover_s, mtbf_s)
        assert g > expected_goodput(1.1 * best, save_s, recover_s, mtbf_s)
        assert 0 < g < 1
    # no failures in sight: the goodput is the compute share of a segment
    assert expected_goodput(100, 1, 0, 1e15) == pytest.approx(100 / 101)
    # short segments lose about half of one per failure
    assert lost_per_failure_s(100, 0, 1e9) == pytest.approx(50, rel=1e-3)


@pytest.mark.parametrize(
    "nodes, node_mtbf_s, save_s, load_s, recover_s",
    [
        (8, 8 * 1000.0, 10.0, 20.0, 30.0),  # a failure every 1,000 s, cheap recovery
        (64, 64 * 3000.0, 60.0, 60.0, 600.0),  # requeue-like recovery
        (1, 500.0, 30.0, 0.0, 100.0),  # one node, saves dear against M
    ],
)
def test_simulator_agrees_with_the_analytic_goodput_within_its_ci(
    nodes: int, node_mtbf_s: float, save_s: float, load_s: float, recover_s: float
) -> None:
    mtbf = node_mtbf_s / nodes
    tau = daly_interval_s(save_s, mtbf)
    run = RunModel(200 * tau, tau, save_s, load_s, recover_s, nodes, node_mtbf_s)  # whole segments
    r = simulate(run, replications=100, seed=3)
    analytic = expected_goodput(tau, save_s, recover_s + load_s, mtbf)
    assert r.low <= analytic <= r.high, (r, analytic)
    assert r.high - r.low < 0.05
    assert r.lost_per_failure_s == pytest.approx(lost_per_failure_s(tau, save_s, mtbf), rel=0.1)
    assert r.failures > 10
    assert r.one_run[0] < r.low <= r.high < r.one_run[1], "one run spreads wider than the mean's interval"


def test_simulator_is_deterministic_given_a_seed_and_sees_a_worse_interval() -> None:
    run = RunModel(100_000.0, 300.0, 10.0, 10.0, 60.0, 4, 4 * 2000.0)
    assert simulate(run, 30, seed=7) == simulate(run, 30, seed=7)
    assert simulate(run, 30, seed=7) != simulate(run, 30, seed=8)
    rare = RunModel(100_000.0, 6000.0, 10.0, 10.0, 60.0, 4, 4 * 2000.0)
    assert simulate(rare, 30, seed=7).high < simulate(run, 30, seed=7).low, (
        "20x Daly's interval costs goodput"
    )


def test_interval_table_marks_auto_and_configured() -> None:
    rows = interval_table(step_s=10.0, save_s=20.0, recover_s=600.0, mtbf_s=22148.0, configured=50)
    marks = {r.steps: r.mark for r in rows}
    best = round(daly_interval_s(20.0, 22148.0) / 10.0)
    assert marks[best] == "auto" and marks[50] == "configured"
    assert max(rows, key=lambda r: r.goodput).steps == best
    assert [r.steps for r in rows] == sorted(r.steps for r in rows)


def test_auto_without_mtbf_is_a_config_error_naming_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"pretrain\.save_interval='auto'.*cluster\.node_mtbf_hours"):
        build_config({"pretrain": {"save_interval": "auto"}})
    with pytest.raises(
        ConfigError, match=r"pretrain\.save_interval='often': must be auto or an integer >= 1"
    ):
        build_config({"pretrain": {"save_interval": "often"}})
    with pytest.raises(ConfigError, match=r"cluster\.node_mtbf_hours=-1"):
        build_config({"cluster": {"node_mtbf_hours": -1}})
    cfg = build_config({"pretrain": {"save_interval": "auto"}, "cluster": {"node_mtbf_hours": 5000}})
    assert cfg.pretrain.save_interval == "auto"
    # a stage not in run.stages may keep auto without an MTBF
    assert build_config({"run": {"stages": ["data_prep"]}, "pretrain": {"save_interval": "auto"}})


def test_planner_prints_the_goodput_table_and_the_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    """The 64-node 70B plan of docs/fault-tolerance.md: its goodput table and simulation are printed as there."""
    args = [*PLAN_70B, "cluster.node_mtbf_hours=6300", "pretrain.iters=100000", "cluster.max_requeues=20"]
    assert main([*args, "--simulate-failures"]) == 0
    out = capsys.readouterr().out
    assert "one every 98.4 h on 64 node(s)" in out
    assert "<- auto" in out and "<- configured" in out and "expected goodput" in out
    assert "failure simulation (200 replications, seed 0" in out
    assert "in-job restart" in out and "requeue" in out and "(auto)" in out and "(configured)" in out
    table = out[out.index("goodput (Young/Daly") :].replace("\n== pretrain\n", "\n").rstrip()
    assert table in (REPO / "docs" / "fault-tolerance.md").read_text(), "docs/fault-tolerance.md is stale"
    assert main([*PLAN_70B, "--simulate-failures"]) == 0
    assert "set cluster.node_mtbf_hours" in capsys.readouterr().out
    assert main([*PLAN_70B, "--replications=x"]) == 2
    assert "--replications=x" in capsys.readouterr().err


def test_planner_table_uses_the_planners_checkpoint_estimate() -> None:
    from pipeline.cli.plan_goodput import stage_costs
    from pipeline.schema.estimates import estimate_stage

    cfg = compose_config([*PLAN_70B, "cluster.node_mtbf_hours=6300"])
    est = estimate_stage(cfg, "pretrain")
    costs = stage_costs(cfg, est)
    assert costs is not None and est.checkpoint is not None
    assert costs.save_s == est.checkpoint.save_s and 10 < costs.save_s < 30  # about 17 s at 2 GB/s per node
    assert costs.mtbf_s == system_mtbf_s(6300, 64)
