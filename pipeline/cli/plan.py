"""``python -m pipeline.plan [hydra overrides]``: print each training stage's layout, memory per GPU, FLOPs
and step time, and warn (with the cheapest fix) when a layout does not fit in GPU memory.

Composes conf/ with Hydra's compose API, validates with ``build_config`` and never imports torch, so it runs
on a laptop. A model from ``<stage>.init_from=hf:<dir>`` is planned from its config.json alone; the plan names
what a run will also need that the directory lacks (tokenizer, weights: pipeline.schema.hf_model.RUN_FILES). Exit status: 0 every stage fits, 1 some stage does not fit, 2 invalid configuration.

With ``cluster.node_mtbf_hours`` set, each stage's block ends with the expected goodput per checkpoint
interval (Young/Daly). ``--simulate-failures`` adds a discrete-event simulation of the planned run (node
failures, saves, restart or requeue, loads): goodput with a 95% confidence interval, failures per run and
the work lost per failure, for the auto and the configured interval, an in-job restart
(planner.restart_s) and a requeue (planner.requeue_s). ``--replications=N`` (default 200) and
``--seed=N`` (default 0) set the simulation; the same seed gives the same figures.

Example (70B on 64 nodes of 8 GPUs)::

    python -m pipeline.plan model=llama3.1-70b cluster.executor=slurm cluster.gpus_per_node=8 \\
        run.stages=[pretrain] pretrain.parallel.tp=8 pretrain.parallel.pp=8 pretrain.parallel.nodes=64 \\
        pretrain.parallel.micro_batch_size=1 pretrain.parallel.global_batch_size=1024 \\
        pretrain.parallel.precision=bf16 pretrain.parallel.distributed_optimizer=true \\
        pretrain.parallel.recompute=selective
"""

from __future__ import annotations

import sys

from pipeline.cli.compose import config_dir_overrides, load, report, stopped_on_ctrl_c
from pipeline.cli.plan_goodput import goodput_lines, simulation_lines
from pipeline.schema.compose import CONF_DIR as CONF_DIR  # re-exported (tests, the docs)
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.estimates import (
    BYTES_PER_PARAM,
    RECOMPUTE_MODES,
    GiB,
    StageEstimate,
    estimate_stage,
)
from pipeline.schema.graph import TRAIN_STAGES
from pipeline.schema.hf_model import missing_run_files, model_ref
from pipeline.schema.moe import expert_ffn, is_moe, moe_layers
from pipeline.schema.params import active_param_count, config_vocab, param_count
from pipeline.submit.interrupt import CtrlC, ctrl_c_raises

_LABEL = 40
_COLUMN = 16


def compose_config(overrides: list[str]) -> PipelineConfig:
    """Compose and validate as ``python -m pipeline`` does (pipeline.cli.compose.load), without the input pre-flight:
    planning needs no data or checkpoints."""
    return load(config_dir_overrides(list(overrides)), inputs=False)


def main(argv: list[str] | None = None) -> int:
    """Print the plan of every training stage in run.stages; the exit status says whether all fit."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        flags, overrides = _flags(args)
        cfg = compose_config(overrides)
        estimates = [estimate_stage(cfg, s) for s in cfg.run.stages if s in TRAIN_STAGES]
    except ConfigError as e:
        return report(e)
    print(format_plan(cfg, estimates))
    if "simulate" in flags:
        try:
            with ctrl_c_raises():
                for est in estimates:
                    lines = simulation_lines(cfg, est, flags["replications"], flags["seed"])
                    print("", f"== {est.stage}", *lines, sep="\n")
        except CtrlC:  # a long simulation (many --replications): the plan above stands
            return stopped_on_ctrl_c(
                "plan", "the failure simulation is left out (fewer --replications run faster)"
            )
    return 0 if all(e.fits for e in estimates) else 1


def _flags(args: list[str]) -> tuple[dict[str, int], list[str]]:
    """(--simulate-failures, --replications=N, --seed=N; the other arguments, for compose_config)."""
    out, rest = {"replications": 200, "seed": 0}, []
    for a in args:
        name, _, value = a.partition("=")
        if a == "--simulate-failures":
            out["simulate"] = 1
        elif name in ("--replications", "--seed"):
            if not value.isdigit():
                raise ConfigError(f"{a}: {name} takes a whole number, e.g. {name}=1")
            out[name[2:]] = int(value)
        else:
            rest.append(a)
    if out["replications"] < 2:
        raise ConfigError(
            f"--replications={out['replications']}: at least 2 (the confidence interval needs them)"
        )
    return out, rest


# ---------------------------------------------------------------------------- formatting


def format_plan(cfg: PipelineConfig, estimates: list[StageEstimate]) -> str:
    """The whole report: model and GPU assumptions, then one block per training stage."""
    m, p = cfg.model, cfg.planner
    params = param_count(m, config_vocab(cfg))
    lines = [
        f"model {m.name}: {params:,} parameters ({_count(params)}){_active(cfg)}, {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.num_query_groups or m.num_attention_heads} "
        f"kv groups, ffn {m.ffn_hidden_size or 4 * m.hidden_size}, vocab {config_vocab(cfg)}, seq {m.seq_length}",
        f"assumed GPU: {p.gpu_peak_tflops:g} TFLOP/s peak, {p.gpu_memory_gb:g} GiB ({p.reserve_gb:g} GiB "
        f"reserved), MFU {p.mfu:g} (planner.*); filesystem {cfg.cluster.fs_bandwidth_gb_s:g} GB/s per node, "
        f"checksums {p.checksum_gb_s:g} GB/s per rank",
        *_run_needs(cfg),
    ]
    if not estimates:
        lines.append("no training stage in run.stages: nothing to estimate")
    for est in estimates:
        lines += ["", *format_stage(est), "", *goodput_lines(cfg, est)]
    return "\n".join(lines)


def _run_needs(cfg: PipelineConfig) -> list[str]:
    """One line naming what a run from the ``hf:<dir>`` needs that is not there (the plan reads config.json)."""
    ref = model_ref(cfg)
    missing = missing_run_files(ref[2]) if ref else []
    if not ref or not missing:
        return []
    files = " and ".join(f"its {f.what} ({f.pattern})" for f in missing)
    return [f"planned from {ref[2] / 'config.json'} alone: a run will also need {files} in {ref[2]}"]


def _active(cfg: PipelineConfig) -> str:
    """MoE: the active parameters and the experts of a token."""
    m = cfg.model
    if not is_moe(m):
        return ""
    active = active_param_count(m, config_vocab(cfg))
    width = m.moe_shared_expert_intermediate_size
    shared = f" + a shared expert of width {width}" if width else ""
    return (
        f", {active:,} active per token ({_count(active)}: top-{m.moe_router_topk} of {m.num_experts} experts "
        f"of width {expert_ffn(m)}{shared} in {sum(moe_layers(m))} of {m.num_layers} layers)"
    )


def format_stage(est: StageEstimate) -> list[str]:
    """One stage's block: layout, batch, memory table per pipeline rank, compute, warnings."""
    lines = _header(est) + [""] + _memory_table(est) + [""] + _compute(est) + _checkpoint(est)
    return lines + [f"WARNING: {w}" for w in est.warnings()]


def _checkpoint(est: StageEstimate) -> list[str]:
    ck = est.checkpoint
    if ck is None:
        return []
    rows = [
        ("size", f"{_bytes(ck.total_bytes)} in all, {_bytes(ck.rank_bytes)} per rank (most), "
         f"{_bytes(ck.node_bytes)} per node"),
        ("save / load", f"{_duration(ck.save_s)} / {_duration(ck.load_s)} (cluster.fs_bandwidth_gb_s per node)"),
        ("verify on resume, per rank", f"{_duration(ck.verify_s)} (one process alone: "
         f"{_duration(ck.verify_rank0_alone_s)}; planner.checksum_gb_s)"),
    ]  # fmt: skip
    return ["checkpoint"] + [f"  {label}".ljust(_LABEL) + value for label, value in rows]


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.2f} kB"


def _header(est: StageEstimate) -> list[str]:
    pl, par = est.plan, est.parallel
    gpus = f"{pl.gpus_per_node} GPUs/node" if pl.gpus_per_node else "CPU ranks"
    return [
        f"== {est.stage} " + "=" * 60,
        f"layout    tp={pl.tp} pp={pl.pp} dp={pl.dp} vpp={pl.vpp or '-'}{_experts_layout(est)}: "
        f"{pl.world_size} ranks on {pl.nodes} "
        f"node(s) x {pl.tasks_per_node} tasks/node ({gpus})",
        f"batch     global {par.global_batch_size} = micro {par.micro_batch_size} x {est.micro_batches} micro "
        f"batches x dp {pl.dp}; {est.model.seq_length} tokens/sequence, {_count(est.tokens_per_step)} tokens/step",
        f"training  {par.precision}, distributed optimizer {'on' if par.distributed_optimizer else 'off'}, "
        f"recompute={par.recompute}, sequence parallel {'on' if par.sequence_parallel else 'off'}; "
        f"vocab padded to {est.vocab}",
    ]


def _experts_layout(est: StageEstimate) -> str:
    if not is_moe(est.model):
        return ""
    pl = est.plan
    return f" ep={pl.ep} etp={pl.etp} ({est.parallel.moe_token_dispatcher} dispatch)"


def _memory_table(est: StageEstimate) -> list[str]:
    par = est.parallel
    ranks = [est.ranks[0]] if len(est.ranks) == 1 else [est.ranks[0], est.ranks[-1]]
    w, g, o = BYTES_PER_PARAM[par.precision]
    shard = f" / dp {est.plan.dp}" if par.distributed_optimizer else ""
    ref = " x2 (DPO reference)" if est.stage == "rlhf" else ""
    lora = ranks[0].trainable is not None
    rows: list[tuple[str, list[str]]] = [
        ("  parameters", [_count(r.params) for r in ranks]),
    ]
    if is_moe(est.model):
        label = f"  of which routed experts (/ ep {est.plan.ep} x etp {est.plan.etp})"
        rows.append((label, [_count(r.expert_params) for r in ranks]))
    if ranks[0].trainable is not None:
        rows.append(("  trainable (LoRA adapters)", [_count(r.trainable or 0) for r in ranks]))
    rows += [
        (f"  weights ({w} B/param{ref})", [_gib(r.weights) for r in ranks]),
        (f"  gradients ({g} B/{'adapter ' if lora else ''}param)", [_gib(r.gradients) for r in ranks]),
        (
            f"  optimizer state ({o} B/{'adapter ' if lora else ''}param{shard})",
            [_gib(r.optimizer) for r in ranks],
        ),
    ]
    for mode in RECOMPUTE_MODES:
        mark = "*" if mode == par.recompute else " "
        rows.append((f"{mark} activations, recompute={mode}", [_gib(r.activations[mode]) for r in ranks]))
    rows.append(("  total (* = configured)", [_gib(r.total(par.recompute)) for r in ranks]))
    per = "GPU" if est.plan.gpus_per_node else "rank"
    head = f"memory per {per}".ljust(_LABEL) + "".join(f"pp rank {r.pp_rank}".rjust(_COLUMN) for r in ranks)
    table = [head] + [label.ljust(_LABEL) + "".join(v.rjust(_COLUMN) for v in vals) for label, vals in rows]
    return table + [_verdict(est)]


def _verdict(est: StageEstimate) -> str:
    if est.capacity is None:
        return "  usable: unknown (CPU ranks without cluster.mem_gb): not checked"
    status = "fits" if est.fits else "DOES NOT FIT"
    per = "GPU" if est.plan.gpus_per_node else "rank"
    return f"  usable {_gib(est.capacity)} per {per}: {status} (peak {_gib(est.peak_bytes)})"


def _compute(est: StageEstimate) -> list[str]:
    world = est.plan.world_size
    tokens_s = est.tokens_per_step / est.step_time_s
    rows = [
        ("model FLOPs per step", _flops(est.model_flops)),
        (f"executed FLOPs (recompute={est.parallel.recompute})", _flops(est.executed_flops)),
        ("step time at the assumed MFU", f"{_duration(est.step_time_s)} on {world} GPUs"),
        ("throughput", f"{_count(tokens_s)} tokens/s ({_count(tokens_s / world)} per GPU)"),
        ("pipeline bubble (pp-1)/(vpp x micro)", f"{est.bubble:.1%} of the step (part of the MFU)"),
    ]
    if is_moe(est.model):
        sent = max(r.dispatch_bytes for r in est.ranks)
        what = "none: ep=1" if est.plan.ep == 1 else f"{_bytes(sent)} sent per GPU per step (most)"
        rows.append(("MoE token dispatch", what))
    if not est.plan.gpus_per_node:
        rows[2:4] = [("step time", "not predicted for CPU ranks (planner.* describes a GPU)")]
    return ["compute"] + [f"  {label}".ljust(_LABEL) + value for label, value in rows]


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _flops(x: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.3g} FLOP"


def _duration(s: float) -> str:
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.3g} ms"


if __name__ == "__main__":
    sys.exit(main())
