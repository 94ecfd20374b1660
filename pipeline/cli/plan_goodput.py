"""The planner's goodput blocks: expected goodput per checkpoint interval (Young/Daly, pipeline.schema.goodput)
and, with ``--simulate-failures``, the discrete-event simulation of the planned run (pipeline.schema.failsim)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.estimates import StageEstimate
from pipeline.schema.failsim import RunModel, simulate
from pipeline.schema.goodput import auto_save_interval, interval_table, system_mtbf_s

_LABEL = 40


@dataclass(frozen=True)
class Costs:
    """What a failure and a save cost the planned stage, seconds, and its failure rate."""

    step_s: float
    save_s: float
    load_s: float
    mtbf_s: float
    nodes: int
    node_mtbf_hours: float


def stage_costs(cfg: PipelineConfig, est: StageEstimate) -> Costs | None:
    """The stage's costs from the planner's estimates; None without an MTBF, a step time or a checkpoint."""
    mtbf_h = cfg.cluster.node_mtbf_hours
    if mtbf_h is None or not est.plan.gpus_per_node or est.checkpoint is None:
        return None
    ck = est.checkpoint
    load = max(ck.load_s, ck.verify_s)  # the resume verifies while it loads
    mtbf = system_mtbf_s(mtbf_h, est.plan.nodes)
    return Costs(est.step_time_s, ck.save_s, load, mtbf, est.plan.nodes, mtbf_h)


def _configured(cfg: PipelineConfig, stage: str) -> int | None:
    st = cfg.stage(stage)
    value = st.save_interval if isinstance(st, TrainStage) else None
    return value if isinstance(value, int) else None


def goodput_lines(cfg: PipelineConfig, est: StageEstimate) -> list[str]:
    """The expected goodput for Daly's interval, fractions and multiples of it and the configured one."""
    costs = stage_costs(cfg, est)
    if costs is None:
        why = (
            "set cluster.node_mtbf_hours (one node's MTBF, hours)"
            if cfg.cluster.node_mtbf_hours is None
            else "no step time predicted for CPU ranks"
        )
        return ["goodput", f"  {why} to see the expected goodput per checkpoint interval"]
    recover = cfg.planner.requeue_s + costs.load_s
    lines = [
        "goodput (Young/Daly; docs/fault-tolerance.md)",
        "  failures".ljust(_LABEL) + f"one every {_dur(costs.mtbf_s)} on {costs.nodes} node(s) "
        f"(cluster.node_mtbf_hours={costs.node_mtbf_hours:g} per node)",
        "  cost of a save / a failure".ljust(_LABEL) + f"{_dur(costs.save_s)} stall / {_dur(recover)} down "
        f"(planner.requeue_s + load) and the work since the last save",
        "  save_interval (steps)   between saves   expected goodput   lost per failure",
    ]
    for row in interval_table(costs.step_s, costs.save_s, recover, costs.mtbf_s, _configured(cfg, est.stage)):
        mark = f"   <- {row.mark}" if row.mark else ""
        lines.append(
            f"  {row.steps:>21,}   {_dur(row.interval_s):>13}   {row.goodput:>16.2%}   {_dur(row.lost_s):>16}{mark}"
        )
    return lines


def simulation_lines(cfg: PipelineConfig, est: StageEstimate, replications: int, seed: int) -> list[str]:
    """Simulated goodput of the planned run for each interval (auto, configured) and recovery (restart, requeue)."""
    costs = stage_costs(cfg, est)
    if costs is None:
        return ["failure simulation: needs cluster.node_mtbf_hours and a predicted step time (GPUs)"]
    st = cfg.stage(est.stage)
    iters = st.iters if isinstance(st, TrainStage) else 0
    best = auto_save_interval(costs.save_s, costs.step_s, costs.node_mtbf_hours, costs.nodes)
    intervals = {"auto": best}
    configured = _configured(cfg, est.stage)
    if configured is not None and configured != best:
        intervals["configured"] = configured
    recoveries = {"in-job restart": cfg.planner.restart_s, "requeue": cfg.planner.requeue_s}
    work = iters * costs.step_s
    lines = [
        f"failure simulation ({replications} replications, seed {seed}; {iters:,} steps = {_dur(work)} of compute, "
        f"node failures exponential with the MTBF)",
        "  interval (steps)        recovery                   goodput (95% CI)        failures   lost per failure"
        "   one run (5-95%)",
    ]
    failures = 0.0
    for label, steps in intervals.items():
        for how, recover_s in recoveries.items():
            run = RunModel(work, steps * costs.step_s, costs.save_s, costs.load_s, recover_s, costs.nodes,
                           costs.node_mtbf_hours * 3600)  # fmt: skip
            r = simulate(run, replications, seed)
            failures = max(failures, r.failures)
            ci = f"{r.goodput:.2%} [{r.low:.2%}, {r.high:.2%}]"
            what = f"{how} ({_dur(recover_s)})"
            lines.append(
                f"  {f'{steps:,} ({label})':<22}  {what:<25}  {ci:<24}{r.failures:>9.1f}   "
                f"{_dur(r.lost_per_failure_s):>16}   {r.one_run[0]:.1%}-{r.one_run[1]:.1%}"
            )
    if failures > cfg.cluster.max_requeues:
        lines.append(
            f"WARNING: {failures:.1f} failures expected per run, more than cluster.max_requeues="
            f"{cfg.cluster.max_requeues}: a requeued run would stop before it ends; raise cluster.max_requeues"
        )
    return lines


def _dur(s: float) -> str:
    if s >= 7200:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"
