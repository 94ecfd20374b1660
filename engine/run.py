"""What every training stage does around the loop: layout, model, optimizer, init_from, resume, shutdown.

``train_stage(cfg, ctx, step=..., sources=...)`` is the body of stages/pretrain.py, sft.py and rlhf.py;
``sources(tokenizer, stage, seq_length, chunks, checkpointer)`` returns ``(train_source, valid_source)``
after distributed init and model build. A stage whose step trains more than one sample source's worth
(rlhf: DPO's reference, GRPO's rollouts) passes ``unit=`` instead: ``unit(env: StageEnv)`` returns
``(TrainUnit, valid_source)`` (engine.train.units); ``env.frozen_model()`` builds a frozen copy of the model
holding the stage's starting weights (init_from), through the same checkpointer the policy uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.context import MetricsWriter, StageContext
from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.graph import weights_upstream

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.checkpoint.interval import AutoInterval
    from engine.checkpoint.manager import Checkpointer
    from engine.data.truncation import Truncation
    from engine.runtime.fault_injection import FaultInjector
    from engine.train.step import Step
    from engine.train.trainer import Trainer
    from engine.train.units import TrainUnit

Sources = Callable[..., tuple[Any, Any]]
InitWeights = Callable[["Checkpointer", list[Any]], bool]
"""A stage's own loading of its starting weights: ``(checkpointer, chunks) -> loaded``."""
UnitFactory = Callable[["StageEnv"], tuple["TrainUnit", Any]]
"""``unit(env)``: the stage's ``(TrainUnit, valid_source)`` (``train_stage(unit=...)``)."""


@dataclass
class StageEnv:
    """What a unit factory (``train_stage(unit=...)``) gets: built after distributed init and the policy."""

    cfg: PipelineConfig
    ctx: StageContext
    stage: TrainStage
    tokenizer: Any
    seq_length: int
    policy: list[Any]
    """The trained policy's chunks (its weights are loaded later, by the trainer's restore)."""
    checkpointer: Checkpointer

    def frozen_model(self, weights: str = "init_from") -> list[Any]:
        """A frozen model of the same architecture and layout: ``init_from`` weights (the policy before
        training; as built when the stage has no init_from), or ``built`` (as built: the seed's init)."""
        from engine.models.gpt import build_model

        chunks = build_model(self.cfg.model, self.stage.parallel, self.tokenizer.vocab_size, trainable=False)
        if weights == "init_from":
            self.checkpointer.load_init_weights(chunks)
        return chunks


def resolve_init_from(cfg: PipelineConfig, ctx: StageContext) -> Path | None:
    """``<stage>.init_from``: auto = the upstream stage's checkpoints/, a path, or None (random init)."""
    value = _stage_cfg(cfg, ctx.stage).init_from
    key = f"{ctx.stage}.init_from"
    if value is None or value in ("", "none", "null"):
        return None
    if value == "auto":
        up = weights_upstream(ctx.stage)  # the one stage graph (pipeline.schema.graph.DEPENDS)
        if up is None:
            return None
        if up not in ctx.inputs:
            raise ValueError(f"{key}=auto: upstream stage {up!r} has no output directory in this run")
        return ctx.inputs[up] / "checkpoints"
    from pipeline.schema.hf_arch import parse_ref

    path = parse_ref(value) or Path(value)
    if not path.exists():
        raise ValueError(f"{key}={value!r}: no such checkpoint directory")
    return path


def startup_record(marks: dict[str, float]) -> dict[str, Any]:
    """``{"kind": "startup", "to_first_step_s", ...}``: seconds from the process's start (the job's, for a
    stage's job) to the first training step, and the parts: interpreter and imports, distributed init,
    model build, data and optimizer, checkpoint restore (marks: wall times at the end of each part)."""
    try:
        import psutil

        t0 = psutil.Process().create_time()
    except Exception:  # no psutil, no /proc: count from the first mark
        t0 = marks["imports"]
    names = {
        "imports": "imports_s",
        "init": "init_s",
        "model": "model_s",
        "data": "data_s",
        "restore": "restore_s",
    }
    record: dict[str, Any] = {"kind": "startup", "to_first_step_s": round(time.time() - t0, 3)}
    prev = t0
    for key, name in names.items():
        record[name] = round(marks[key] - prev, 3)
        prev = marks[key]
    return record


def _stage_cfg(cfg: PipelineConfig, name: str) -> TrainStage:
    st = cfg.stage(name)
    if not isinstance(st, TrainStage):
        raise ValueError(f"run.stages={name!r}: not a training stage")
    return st


def data_dir(ctx: StageContext) -> Path:
    if "data_prep" not in ctx.inputs:
        raise ValueError(f"{ctx.stage}: needs the data_prep stage's outputs (ctx.inputs['data_prep'])")
    return ctx.inputs["data_prep"]


@dataclass
class BuiltStage:
    """A training stage assembled by ``build_stage``, ready for ``train_stage`` to restore and run."""

    trainer: Trainer
    checkpointer: Checkpointer
    metrics: MetricsWriter
    weights_loaded: bool
    """The stage loaded its starting weights itself (``init_weights``): a fresh start skips init_from."""
    marks: dict[str, float]
    """Wall times at the end of each start-up part (``startup_record``)."""
    truncation: Truncation | None = None
    """What cutting the stage's examples at its sequence length cost (None: nothing is cut)."""


def train_stage(
    cfg: PipelineConfig,
    ctx: StageContext,
    *,
    step: Step,
    sources: Sources | None = None,
    unit: UnitFactory | None = None,
    init_weights: InitWeights | None = None,
) -> dict[str, Any]:
    """Run one training stage on this rank; returns rank-0 outputs (checkpoint, final_loss, steps, ...).

    ``init_weights(checkpointer, chunks)``: the stage loads its starting weights itself (before its
    sources are built) and returns whether it did; then a fresh start does not load init_from again.
    """
    from engine.checkpoint.latest import find_latest
    from engine.models.gpt import num_parameters
    from engine.runtime import distributed as D
    from engine.runtime.oom import oom_report

    with ExitStack() as cleanup:
        built = build_stage(cfg, ctx, step, cleanup, sources=sources, unit=unit, init_weights=init_weights)
        trainer, marks = built.trainer, built.marks
        trainer.restore(init_weights=not built.weights_loaded, attempt=ctx.attempt)
        marks["restore"] = time.time()
        if D.is_rank0():
            built.metrics.write(startup_record(marks))
        with oom_report(cfg, ctx, built.metrics):
            summary = trainer.fit()
        latest = summary["checkpoint"] or find_latest(ctx.checkpoint_dir)
        init_from = built.checkpointer.init_from
        cut = built.truncation
        return {
            **summary,
            "checkpoint": str(latest) if latest else None,
            "params_per_rank": num_parameters(trainer.chunks),
            "init_from": str(init_from) if init_from else None,
            **({"truncation": cut.as_dict()} if cut else {}),
        }


def build_stage(
    cfg: PipelineConfig,
    ctx: StageContext,
    step: Step,
    cleanup: ExitStack,
    *,
    sources: Sources | None = None,
    unit: UnitFactory | None = None,
    init_weights: InitWeights | None = None,
) -> BuiltStage:
    """Signals, distributed init, model, optimizer, checkpointer, data (sources or unit), callbacks and the
    Trainer, in this order (the RNG draws follow it); ``cleanup`` gets what undoes them at the stage's end."""
    from engine.callbacks.setup import flops_per_step, peak_tflops, stage_callbacks
    from engine.checkpoint.integrity import set_verify_mode
    from engine.data.datasets import load_tokenizer
    from engine.models.gpt import build_model
    from engine.models.moe import routing_stats
    from engine.runtime import distributed as D
    from engine.runtime.fault_injection import FaultInjector
    from engine.runtime.signals import StopFlag, Watchdog
    from engine.train.meter import StepMeter
    from engine.train.optimizer import build_optimizer
    from engine.train.trainer import LoopServices, Trainer

    st = _stage_cfg(cfg, ctx.stage)
    par, plan = st.parallel, ctx.plan
    marks = {"imports": time.time()}
    stop_flag = StopFlag().install()  # before init: a signal during start-up is not lost
    requeue_on_hang = ctx.may_requeue and not ctx.injob_left  # else restarted inside the job
    watchdog = Watchdog(st.hang_timeout_s, may_requeue=requeue_on_hang, on_hang=ctx.on_hang).start()
    vpp = plan.vpp if plan else par.vpp
    D.init(par.tp, par.pp, vpp, ep=par.ep, etp=par.etp, seed=st.seed, threads=st.threads, env=ctx.dist)
    faults = FaultInjector(ctx.out_dir, D.rank(), ctx.faults, released=lambda: stop_flag.requested)
    cleanup.callback(_shutdown, watchdog, stop_flag)
    set_verify_mode(st.checkpoint_verify)
    marks["init"] = time.time()
    tokenizer = load_tokenizer(data_dir(ctx) / "tokenizer.json")
    chunks = build_model(cfg.model, par, tokenizer.vocab_size, peft=st.peft, customize=step.customize_model)
    marks["model"] = time.time()
    optimizer, scheduler = build_optimizer(chunks, st, par)
    ckpt = _checkpointer(cfg, ctx, st, faults)
    seq_length = st.seq_length or cfg.model.seq_length
    weights_loaded = init_weights(ckpt, chunks) if init_weights is not None else False
    env = StageEnv(cfg, ctx, st, tokenizer, seq_length, chunks, ckpt)
    train_unit, train_source, valid_source = _stage_data(env, sources, unit)
    cut = train_unit.truncation if train_unit is not None else train_source.truncation
    metrics = MetricsWriter(ctx.metrics_path, enabled=D.is_rank0())
    _note_truncation(metrics, ctx.stage, st, cut)
    callbacks = stage_callbacks(cfg, ctx, st, metrics, D.rank(), D.world_size())
    cleanup.callback(callbacks.close)
    check_health(cfg, metrics, callbacks, ctx.may_requeue)
    flops = flops_per_step(cfg, st, seq_length, tokenizer.vocab_size, step.sequences_per_sample)
    services = LoopServices(
        metrics=metrics,
        checkpointer=ckpt,
        faults=faults,
        stop_flag=stop_flag,
        watchdog=watchdog,
        callbacks=callbacks,
        meter=StepMeter(flops, peak_tflops(cfg), D.world_size()),
        routing=routing_stats(chunks, cfg.model, par),
        tasks=_in_loop_tasks(cfg, ctx, st, tokenizer, seq_length),
        stragglers=straggler_monitor(cfg, chunks, ctx.may_requeue),
    )
    trainer = Trainer(
        chunks,
        optimizer,
        scheduler,
        step,
        stage=st,
        seq_length=seq_length,
        train_source=train_source,
        valid_source=valid_source,
        unit=train_unit,
        services=services,
    )
    marks["data"] = time.time()
    return BuiltStage(trainer, ckpt, metrics, weights_loaded, marks, cut)


def _note_truncation(metrics: MetricsWriter, stage: str, st: TrainStage, cut: Truncation | None) -> None:
    """What cutting the stage's examples cost, as an info line (pipeline.records.progress prints it)."""
    if cut is None:
        return
    from engine.data.truncation import stage_limit

    line = stage_limit(stage, st.max_truncated_fraction).describe(cut)
    metrics.write({"kind": "info", "message": line, "truncation": cut.as_dict()})


def check_health(cfg: PipelineConfig, metrics: MetricsWriter, callbacks: Any, may_requeue: bool) -> None:
    """``cluster.health.policy`` warn or exclude: the node check on every rank before training; rank 0 writes a
    ``health`` line, and a ``slow_node`` alarm naming each slow or failing node (log, status, sinks). exclude,
    with a requeue left (``may_requeue``) and enough nodes left in the partition: every rank then raises
    NodesExcluded (the launcher requeues the job without those nodes)."""
    policy = cfg.cluster.health.policy
    if policy == "off":
        return
    from engine.runtime import distributed as D
    from engine.runtime.health import NodesExcluded, exclusion_blocked, node_check

    report = node_check(cfg.cluster.health)
    slow: dict[str, str] = D.broadcast_object(report.slow if report is not None else {})
    excluding = policy == "exclude" and bool(slow) and may_requeue
    blocked = exclusion_blocked(sorted(slow)) if excluding else None
    excluding = excluding and blocked is None
    if report is not None:
        metrics.write(report.as_record())
        for host, why in slow.items():
            rec = {
                "kind": "alarm",
                "alarm": "slow_node",
                "step": None,
                "host": host,
                "message": f"node {host}: {why}" + (f"; not excluded: {blocked}" if blocked else ""),
            }
            then = (
                "excluding it and requeueing the job" if excluding else f"policy {policy}: training goes on"
            )
            if blocked:
                then = f"it cannot be excluded ({blocked}): training goes on"
            log.warning("health check: node %s is slow or sick (%s); %s", host, why, then)
            metrics.write(rec)
            callbacks.emit("on_alarm", 0, rec)
    if excluding:
        raise NodesExcluded(slow)


def straggler_monitor(cfg: PipelineConfig, chunks: list[Any], may_requeue: bool) -> Any:
    """``cluster.health.straggler_interval``: the loop's straggler checks (None: off, or a frozen model)."""
    health = cfg.cluster.health
    if not health.straggler_interval:
        return None
    import socket

    from engine.models.gpt import sync_clock
    from engine.runtime import distributed as D
    from engine.runtime.stragglers import StragglerMonitor

    clock = sync_clock(chunks)
    if clock is None:
        return None
    exclude = health.policy == "exclude" and may_requeue
    return StragglerMonitor(health, clock, socket.gethostname(), D.rank(), D.pp_rank(), exclude)


def _stage_data(env: StageEnv, sources: Sources | None, unit: UnitFactory | None) -> tuple[Any, Any, Any]:
    """(unit or None, train source, valid source) from exactly one of ``sources`` and ``unit``."""
    if unit is not None:
        train_unit, valid_source = unit(env)
        return train_unit, train_unit.source, valid_source
    if sources is not None:
        train, valid = sources(env.tokenizer, env.stage, env.seq_length, env.policy, env.checkpointer)
        return None, train, valid
    raise ValueError("train_stage: give sources or unit")


def _checkpointer(
    cfg: PipelineConfig, ctx: StageContext, st: TrainStage, faults: FaultInjector
) -> Checkpointer:
    from engine.checkpoint.manager import Checkpointer

    return Checkpointer(
        ctx.checkpoint_dir,
        st.save_interval if isinstance(st.save_interval, int) else 0,
        resolve_init_from(cfg, ctx),
        st.keep_last,
        st.async_save,
        keep_incomplete=st.keep_incomplete,
        peft=st.peft if st.peft.method == "lora" else None,
        faults=faults,
        auto_interval=_auto_interval(cfg, ctx, st),
    )


def _auto_interval(cfg: PipelineConfig, ctx: StageContext, st: TrainStage) -> AutoInterval | None:
    """save_interval=auto: the interval chooser, seeded with the planner's save time (build_config made sure
    cluster.node_mtbf_hours is set)."""
    from engine.checkpoint.interval import AutoInterval
    from engine.runtime import distributed as D
    from pipeline.schema.estimates import stage_checkpoint_estimate

    mtbf = cfg.cluster.node_mtbf_hours
    if st.save_interval != "auto" or mtbf is None:
        return None
    nodes = ctx.plan.nodes if ctx.plan else 1
    estimate = stage_checkpoint_estimate(cfg, ctx.stage).save_s
    return AutoInterval(mtbf, nodes, estimate, agree=D.all_reduce_max)


def _shutdown(watchdog: Any, stop_flag: Any) -> None:
    """Undo the stage's start (after its callbacks are closed): the watchdog, the signal handlers, distributed."""
    from engine.runtime import distributed as D

    watchdog.stop()
    stop_flag.uninstall()
    D.shutdown()


def _in_loop_tasks(cfg: PipelineConfig, ctx: StageContext, st: Any, tokenizer: Any, seq_length: int) -> Any:
    """``<stage>.eval_tasks`` as the loop's in-training evaluator (None without tasks); stops at data_prep's
    stop tokens, as the eval stage's generations do."""
    if not st.eval_tasks:
        return None
    from engine.data.datasets import read_manifest
    from engine.evaluation.in_loop import in_loop_tasks

    stops = read_manifest(data_dir(ctx), verify=False).get("stop_token_ids") or [tokenizer.eod]
    return in_loop_tasks(cfg, st, tokenizer, seq_length, list(stops))
