"""Resource estimates for a training stage: parameters, memory per GPU, FLOPs and step time. Pure arithmetic.

Nothing here imports torch or megatron, so plans are made on a laptop. Sources of the formulas:

- Parameters: what megatron-core's GPTModel (local layer spec) holds for a ``ModelConfig``; the tests
  check the count against a GPTModel built on the meta device. Mixture of Experts (pipeline.schema.moe_sizes):
  total and active parameters; per rank the routed experts divide by ep and etp, the rest by tp and pp.
- Weights, gradients and optimizer state per parameter: Megatron-LM's distributed optimizer documentation
  (bf16 weights with fp32 gradients: 2 + 4 + 12 = 18 bytes; the 12 bytes of fp32 master weights and Adam
  moments divide by dp with the distributed optimizer).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  section 4: per layer and micro batch ``s b h (34 + 5 a s / h)`` bytes (16-bit activations, no dropout
  savings, no flash attention), ``s b h (10 + 24/t + 5 a s / (h t))`` with tensor parallelism, all of it
  divided by t with sequence parallelism. Selective recompute drops the ``5 a s / h`` term, full recompute
  keeps only each layer's input ``2 s b h``. GPT-shaped (4h MLP, multi-head attention): for Llama shapes
  (gated MLP, grouped-query attention) the error is a few percent.
- FLOPs: Narayanan et al. 2021, ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))`` for forward and backward,
  generalized to grouped-query attention and gated MLPs as Megatron-LM's ``num_floating_point_operations``
  does (identical for GPT shapes).
- MoE: the FLOPs of the active parameters (top-k experts, the shared expert, the router); the distributed
  optimizer shards the experts' state over their own data-parallel ranks (tp x dp / (ep x etp)).
- Step time: model FLOPs / (GPUs x planner.gpu_peak_tflops x planner.mfu), the definition of MFU, so the
  assumed MFU absorbs recompute, the pipeline bubble and communication (both are printed beside it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.schema.config import ModelConfig, PipelineConfig, TrainStage
from pipeline.schema.errors import ConfigError
from pipeline.schema.graph import TRAIN_STAGES
from pipeline.schema.layout import ParallelPlan, check_layout
from pipeline.schema.moe_sizes import dispatch_bytes, mlp_flops_ratio, moe_activation_extra, rank_layers
from pipeline.schema.params import (
    _ffn,
    _kv_channels,
    config_vocab,
    lora_layer_params,
    padded_vocab,
    rank_param_split,
)
from pipeline.schema.sections import ParallelConfig

GiB = 2**30
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")

# precision -> bytes per parameter of (weights, gradients, optimizer state); Megatron-LM distributed optimizer docs.
# fp16 keeps an fp32 copy of the gradients in the optimizer (4) besides fp32 master weights and Adam m, v (12);
# bf16 accumulates gradients in fp32 directly; fp32 needs no master copy.
BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"fp32": (4, 4, 8), "bf16": (2, 4, 12), "fp16": (2, 2, 16)}


# ---------------------------------------------------------------------------- activations


def layer_activation_bytes(
    m: ModelConfig, micro_batch: int, tp: int, recompute: str, sequence_parallel: bool = False
) -> float:
    """Activation bytes one layer keeps for one micro batch (Korthikanti et al. 2022, 16-bit activations)."""
    s, b, h, a = m.seq_length, micro_batch, m.hidden_size, m.num_attention_heads
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    scores = 5 * a * s / h if recompute == "none" else 0.0
    if sequence_parallel:
        return sbh * (34 + scores) / tp
    return sbh * (10 + 24 / tp + scores / tp)


def inflight_layers(num_layers: int, pp: int, vpp: int | None, pp_rank: int, micro_batches: int) -> int:
    """Layer activations (in units of one layer x one micro batch) pipeline rank ``pp_rank`` holds at the
    peak of megatron's 1F1B schedule: warmup micro batches + 1, each of num_layers / (pp x vpp) layers."""
    v = vpp or 1
    if v == 1:
        warmup = pp - pp_rank - 1
    else:
        warmup = 2 * (pp - pp_rank - 1) + (v - 1) * pp
    chunks = min(warmup + 1, micro_batches * v)
    return chunks * num_layers // (pp * v)


def rank_activation_bytes(
    m: ModelConfig, par: ParallelConfig, vocab: int, pp_rank: int, micro_batches: int, recompute: str
) -> int:
    """All activation bytes of one GPU of pipeline rank ``pp_rank``: its in-flight layers, plus the
    embedding dropout mask on the first rank (s b h per in-flight micro batch) and the output layer with
    fp32 logits on the last (4 s b h / t (1 + V/h)); MoE layers their wider MLP and permuted tokens
    (moe_sizes.moe_activation_extra). Doubled for fp32 activations."""
    layers = inflight_layers(m.num_layers, par.pp, par.vpp, pp_rank, micro_batches)
    per_layer = layer_activation_bytes(m, par.micro_batch_size, par.tp, recompute, par.sequence_parallel)
    per_layer += moe_activation_extra(m, par.micro_batch_size, par.tp, recompute)
    total = layers * per_layer
    sbh = m.seq_length * par.micro_batch_size * m.hidden_size
    if pp_rank == 0:
        total += min(par.pp, micro_batches) * sbh / (par.tp if par.sequence_parallel else 1)
    if pp_rank == par.pp - 1:
        total += 4 * sbh / par.tp * (1 + vocab / m.hidden_size)
    return round(total * (2 if par.precision == "fp32" else 1))


# ---------------------------------------------------------------------------- FLOPs


def step_flops(m: ModelConfig, vocab: int, global_batch: int, recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one optimizer step, forward and backward.

    Model FLOPs: ``12 B s L h^2 ((1 + g/a + s/h) q/h + (f/h) x gated + V/(2 L h))`` with gated = 1.5 for
    swiglu (Megatron-LM), which is ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))`` for GPT shapes. Executed
    FLOPs add the recomputed forward: the attention core (``4 B s^2 q L``) for selective, every layer's
    forward (a third of its forward and backward) for full. A MoE layer's MLP term counts its active
    parameters (moe_sizes.mlp_flops_ratio: top-k experts, the shared expert, the router).
    """
    b, s, n, h = global_batch, m.seq_length, m.num_layers, m.hidden_size
    q_ratio = m.num_attention_heads * _kv_channels(m) / h
    groups = (m.num_query_groups or m.num_attention_heads) / m.num_attention_heads
    gated = 1.5 if m.activation == "swiglu" else 1.0
    unit = 12.0 * b * s * n * h * h
    layers = unit * ((1 + groups + s / h) * q_ratio + mlp_flops_ratio(m, _ffn(m) / h * gated))
    model = layers + unit * vocab / (2 * n * h)
    extra = {"none": 0.0, "selective": 4.0 * b * s * s * q_ratio * h * n, "full": layers / 3}[recompute]
    return model, model + extra


# ---------------------------------------------------------------------------- per-stage estimate


@dataclass(frozen=True)
class RankMemory:
    """Memory of one GPU of one pipeline rank, in bytes; activations for each recompute mode."""

    pp_rank: int
    params: int
    weights: int
    gradients: int
    optimizer: int
    activations: dict[str, int]
    trainable: int | None = None
    """LoRA: the adapter parameters (gradients and optimizer state are theirs only); None: all of params."""
    expert_params: int = 0
    """The routed experts' share of params (num_experts / ep of them, each split over etp)."""
    dispatch_bytes: int = 0
    """Bytes this GPU sends to others in MoE token dispatch per step (moe_sizes.dispatch_bytes)."""

    def total(self, recompute: str) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations[recompute]


@dataclass(frozen=True)
class CheckpointEstimate:
    """Size of one checkpoint and the time to save, verify and load it, from bytes per rank and assumed speeds.

    A checkpoint holds the weights (training precision) and the optimizer state (fp32 main params and Adam
    moments); replicated tensors are written once, by data-parallel rank 0, and the distributed optimizer
    spreads its state over the data-parallel ranks. Every rank writes and reads its files at once; a node's
    ranks share ``cluster.fs_bandwidth_gb_s``. Verification (on resume, every rank its own files) reads the
    files again and hashes them at ``planner.checksum_gb_s`` per rank.
    """

    total_bytes: int
    rank_bytes: int
    """The most bytes one rank writes (dp rank 0 of the largest pipeline rank)."""
    node_bytes: int
    save_s: float
    load_s: float
    verify_s: float
    verify_rank0_alone_s: float
    """What verification would take if one process hashed every file (for comparison)."""


def checkpoint_estimate(cfg: PipelineConfig, est: StageEstimate) -> CheckpointEstimate:
    """``CheckpointEstimate`` of stage estimate ``est`` under ``cfg.cluster`` / ``cfg.planner`` speeds."""
    w, _, o = BYTES_PER_PARAM[est.parallel.precision]
    dp = est.plan.dp
    opt_share = dp if est.parallel.distributed_optimizer else 1
    # a LoRA stage saves its adapters and their optimizer state only (the base comes from init_from)
    saved = [r.params if r.trainable is None else r.trainable for r in est.ranks]
    rank_bytes = max(n * w + n * o // opt_share for n in saved)
    # every tensor once: the tp slices of the rest, the ep x etp slices of the routed experts
    experts = [0 if r.trainable is not None else r.expert_params for r in est.ranks]
    expert_copies = est.plan.ep * est.plan.etp
    total = sum((n - e) * est.plan.tp + e * expert_copies for n, e in zip(saved, experts)) * (w + o)
    node_bytes = min(rank_bytes * est.plan.tasks_per_node, total)
    bw = cfg.cluster.fs_bandwidth_gb_s * 1e9
    hash_rate = cfg.planner.checksum_gb_s * 1e9
    io_s = node_bytes / bw
    return CheckpointEstimate(
        total_bytes=total,
        rank_bytes=rank_bytes,
        node_bytes=node_bytes,
        save_s=io_s,
        load_s=io_s,
        verify_s=max(io_s, rank_bytes / hash_rate),
        verify_rank0_alone_s=max(total / bw, total / hash_rate),
    )


@dataclass(frozen=True)
class StageEstimate:
    """Everything the planner says about one training stage."""

    stage: str
    model: ModelConfig
    parallel: ParallelConfig
    plan: ParallelPlan
    vocab: int
    micro_batches: int
    ranks: tuple[RankMemory, ...]
    model_flops: float
    executed_flops: float
    step_time_s: float
    capacity: int | None
    suggestion: str | None = None
    checkpoint: CheckpointEstimate | None = None

    @property
    def peak(self) -> RankMemory:
        """The pipeline rank needing the most memory with the configured recompute."""
        return max(self.ranks, key=lambda r: r.total(self.parallel.recompute))

    @property
    def peak_bytes(self) -> int:
        return self.peak.total(self.parallel.recompute)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak_bytes <= self.capacity

    @property
    def tokens_per_step(self) -> int:
        return self.parallel.global_batch_size * self.model.seq_length

    @property
    def bubble(self) -> float:
        """Pipeline bubble as a fraction of the ideal step: (pp - 1) / (vpp x micro batches)."""
        return (self.plan.pp - 1) / ((self.plan.vpp or 1) * self.micro_batches)

    def warnings(self) -> list[str]:
        if self.fits:
            return []
        assert self.capacity is not None
        msg = (
            f"{self.stage}: needs {self.peak_bytes / GiB:.1f} GiB per GPU (pipeline rank {self.peak.pp_rank}), "
            f"more than the {self.capacity / GiB:.1f} GiB usable; "
        )
        if self.suggestion:
            return [msg + f"the cheapest change that fits: {self.suggestion}"]
        return [msg + "no change of precision, layout, recompute, optimizer or up to 4x the nodes fits"]


def capacity_bytes(cfg: PipelineConfig, plan: ParallelPlan) -> int | None:
    """Usable bytes per rank: GPU memory less the reserve; CPU ranks: cluster.mem_gb shared by the node's
    ranks (None when unknown: no check)."""
    if cfg.cluster.gpus_per_node > 0:
        return int((cfg.planner.gpu_memory_gb - cfg.planner.reserve_gb) * GiB)
    if cfg.cluster.mem_gb is None:
        return None
    return cfg.cluster.mem_gb * GiB // plan.tasks_per_node


def rank_memory(
    m: ModelConfig,
    par: ParallelConfig,
    dp: int,
    vocab: int,
    pp_rank: int,
    micro_batches: int,
    peft: Any = None,
) -> RankMemory:
    """Weights, gradients, optimizer state (sharded over dp with the distributed optimizer) and activations.

    The routed experts (num_experts / ep on this GPU, each split over etp) have their own data-parallel
    ranks, tp x dp / (ep x etp): the distributed optimizer shards their state over those. ``peft``
    (method=lora): the adapters are added to the weights; gradients and optimizer state are the adapters'
    only (the base is frozen)."""
    etp = par.etp or par.tp
    dense, experts = rank_param_split(m, vocab, par.tp, par.pp, pp_rank, par.ep, etp, par.vpp)
    params = dense + experts
    w, g, o = BYTES_PER_PARAM[par.precision]
    acts = {r: rank_activation_bytes(m, par, vocab, pp_rank, micro_batches, r) for r in RECOMPUTE_MODES}
    sent = dispatch_bytes(m, par, pp_rank, micro_batches)
    shard = dp if par.distributed_optimizer else 1
    expert_shard = max(1, par.tp * dp // (par.ep * etp)) if par.distributed_optimizer else 1
    if peft is not None and peft.method == "lora":
        targets = list(peft.target_modules)
        layers = rank_layers(m.num_layers, par.pp, par.vpp, pp_rank)
        trainable = sum(lora_layer_params(m, peft.rank, targets, par.tp, i) for i in layers)
        optimizer = trainable * o // shard
        total = params + trainable
        return RankMemory(pp_rank, total, total * w, trainable * g, optimizer, acts, trainable, experts, sent)
    optimizer = dense * o // shard + experts * o // expert_shard
    return RankMemory(pp_rank, params, params * w, params * g, optimizer, acts, None, experts, sent)


def _estimate(cfg: PipelineConfig, stage: str) -> StageEstimate:
    """The estimate of one training stage, without searching for a fix."""
    plan = check_layout(cfg, stage)
    st = cfg.stage(stage)
    if not isinstance(st, TrainStage):
        raise ConfigError(
            f"run.stages={stage!r}: the planner estimates training stages ({', '.join(TRAIN_STAGES)})"
        )
    m, par = cfg.model, st.parallel
    vocab = padded_vocab(m, config_vocab(cfg), par.tp)
    micro = par.global_batch_size // (par.micro_batch_size * plan.dp)
    ranks = tuple(rank_memory(m, par, plan.dp, vocab, r, micro, st.peft) for r in range(par.pp))
    if stage == "rlhf":  # DPO keeps a frozen reference model: weights only
        ranks = tuple(dataclasses.replace(r, weights=2 * r.weights) for r in ranks)
    model_flops, executed = step_flops(m, vocab, par.global_batch_size, par.recompute)
    peak = cfg.planner.gpu_peak_tflops * 1e12 * cfg.planner.mfu * plan.world_size
    return StageEstimate(
        stage,
        m,
        par,
        plan,
        vocab,
        micro,
        ranks,
        model_flops,
        executed,
        model_flops / peak,
        capacity_bytes(cfg, plan),
    )


def stage_checkpoint_estimate(cfg: PipelineConfig, stage: str) -> CheckpointEstimate:
    """The checkpoint estimate of ``stage`` alone (no search for a fix): the engine's first guess of a save's cost."""
    return checkpoint_estimate(cfg, _estimate(cfg, stage))


def estimate_stage(cfg: PipelineConfig, stage: str) -> StageEstimate:
    """Estimate ``stage``; when it does not fit, attach the cheapest change that does (``suggest_fix``)."""
    est = _estimate(cfg, stage)
    est = dataclasses.replace(est, checkpoint=checkpoint_estimate(cfg, est))
    if est.fits:
        return est
    return dataclasses.replace(est, suggestion=suggest_fix(cfg, stage))


# ---------------------------------------------------------------------------- the cheapest fix

# Cost of each step of change, in a fixed order: bf16 from fp32 (half the bytes of weights and activations,
# faster matmuls: the first change anyone makes) < distributed optimizer (no extra communication volume) <
# selective recompute (a few % compute) = doubling ep (MoE: the experts over more of the same ranks, more
# dispatch traffic) < halving the micro batch < doubling tp (inside a node) < doubling
# pp (bubble) < full recompute (a third more compute) < doubling the GPUs (more hardware).
_COST = {
    "bf16": 1,
    "distributed_optimizer": 2,
    "selective": 4,
    "ep": 4,
    "micro": 6,
    "tp": 8,
    "pp": 10,
    "full": 16,
    "gpus": 20,
}


def _options(
    cfg: PipelineConfig, par: ParallelConfig, plan: ParallelPlan
) -> dict[str, list[tuple[Any, int]]]:
    """For each knob, (value, cost) pairs: the current value at cost 0, then dearer ones.

    More GPUs means more nodes when the layout gives nodes (dp follows), else a larger dp.
    """
    per_node = cfg.cluster.gpus_per_node or cfg.cluster.ranks_per_node
    recompute = {
        "none": [("none", 0), ("selective", _COST["selective"]), ("full", _COST["full"])],
        "selective": [("selective", 0), ("full", _COST["full"])],
    }
    precision = {"fp32": [("fp32", 0), ("bf16", _COST["bf16"])]}  # never fp16 (loss scaling); 16 bits stay
    dist_opt = [(False, 0), (True, _COST["distributed_optimizer"])]
    options: dict[str, list[tuple[Any, int]]] = {
        "precision": precision.get(par.precision, [(par.precision, 0)]),
        "distributed_optimizer": [(True, 0)] if par.distributed_optimizer else dist_opt,
        "recompute": recompute.get(par.recompute, [("full", 0)]),
        "micro_batch_size": _halvings(par.micro_batch_size, _COST["micro"]),
        "tp": _doublings(par.tp, per_node, _COST["tp"]),
        "pp": _doublings(par.pp, cfg.model.num_layers, _COST["pp"]),
    }
    if cfg.model.num_experts:  # the experts over more ranks: no more GPUs, more dispatch traffic
        options["ep"] = _doublings(par.ep, cfg.model.num_experts, _COST["ep"])
    if par.nodes is not None and par.dp is None:
        options["nodes"] = _doublings(par.nodes, 4 * par.nodes, _COST["gpus"])
    elif par.nodes is None:
        options["dp"] = _doublings(plan.dp, 4 * plan.dp, _COST["gpus"])
    return options


def _doublings(value: int, limit: int, cost: int) -> list[tuple[int, int]]:
    """value, then value x 2^k up to limit, the k-th doubling costing k x cost."""
    return [(value << k, k * cost) for k in range(0, 64) if value << k <= limit] or [(value, 0)]


def _halvings(value: int, cost: int) -> list[tuple[int, int]]:
    """value, then value / 2^k while it divides evenly, the k-th halving costing k x cost."""
    return [(value >> k, k * cost) for k in range(0, value.bit_length()) if value % (1 << k) == 0]


def _candidates(cfg: PipelineConfig, par: ParallelConfig, plan: ParallelPlan) -> Iterator[dict[str, Any]]:
    """Every combination of knob values except the current one, cheapest first (then fewest knobs)."""
    options = _options(cfg, par, plan)
    names = list(options)
    combos = []
    for values in itertools.product(*(options[n] for n in names)):
        cost = sum(c for _, c in values)
        if cost:
            changed = sum(c > 0 for _, c in values)
            combos.append((cost, changed, {n: v for n, (v, _) in zip(names, values)}))
    combos.sort(key=lambda c: (c[0], c[1]))
    for _, _, knobs in combos:
        yield knobs


def _apply(cfg: PipelineConfig, stage: str, knobs: dict[str, Any]) -> PipelineConfig:
    """cfg with the stage's parallel settings changed to ``knobs`` (stage_plan derives the rest)."""
    st = cfg.stage(stage)
    par = dataclasses.replace(st.parallel, **knobs)
    changes: dict[str, Any] = {stage: dataclasses.replace(st, parallel=par)}
    return dataclasses.replace(cfg, **changes)


def suggest_fix(cfg: PipelineConfig, stage: str) -> str | None:
    """The cheapest change of the stage's precision and layout that fits in memory, as Hydra overrides (None:
    none found)."""
    plan = check_layout(cfg, stage)
    par = cfg.stage(stage).parallel
    for knobs in _candidates(cfg, par, plan):
        try:
            est = _estimate(_apply(cfg, stage, knobs), stage)
        except ConfigError:
            continue
        if est.fits:
            return _overrides(stage, par, plan, knobs) + f" (then {est.peak_bytes / GiB:.1f} GiB per GPU)"
    return None


def _overrides(stage: str, par: ParallelConfig, plan: ParallelPlan, knobs: dict[str, Any]) -> str:
    """The knobs that differ from the current layout as ``stage.parallel.key=value`` Hydra overrides."""
    current = {**dataclasses.asdict(par), "dp": plan.dp, "nodes": plan.nodes}
    changed = {k: v for k, v in knobs.items() if current[k] != v}
    return " ".join(
        f"{stage}.parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changed.items()
    )
