"""Parallel plans as plain data, derived from a stage's layout and the cluster profile, checkable on CPU.

``stage_plan(cfg, stage)`` gives world size, nodes, tasks per node, GPUs and CPUs per task: the sbatch
resources are derived from it and never typed twice. ``check_layout`` raises ConfigError naming the key.
Memory, FLOPs and step-time estimates live in ``pipeline.schema.estimates``; ``python -m pipeline.plan [overrides]``
prints them per training stage (``pipeline.cli.plan``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

from pipeline.schema.errors import ConfigError
from pipeline.schema.graph import TRAIN_STAGES, spec
from pipeline.schema.moe import check_expert_ranks, check_moe_layout, check_moe_training

# What a layout reads of the config, as protocols: pipeline.schema.build validates with check_layout, so this
# module names the fields it reads instead of importing the schema (no cycle, type-only included).


class _Parallel(Protocol):
    """A stage's ``parallel`` section (pipeline.schema.sections.ParallelConfig)."""

    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def vpp(self) -> int | None: ...
    @property
    def dp(self) -> int | None: ...
    @property
    def nodes(self) -> int | None: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def ep(self) -> int: ...
    @property
    def etp(self) -> int | None: ...
    @property
    def moe_token_dispatcher(self) -> str: ...


class _Stage(Protocol):
    @property
    def parallel(self) -> _Parallel: ...


class _TrainStage(_Stage, Protocol):
    @property
    def seq_length(self) -> int | None: ...


class _Model(Protocol):
    """The ``model`` section (pipeline.schema.sections.ModelConfig): the sizes a layout splits."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_query_groups(self) -> int | None: ...
    @property
    def ffn_hidden_size(self) -> int | None: ...
    @property
    def seq_length(self) -> int: ...
    @property
    def num_experts(self) -> int | None: ...
    @property
    def moe_ffn_hidden_size(self) -> int | None: ...
    @property
    def moe_shared_expert_intermediate_size(self) -> int | None: ...
    @property
    def moe_router_topk(self) -> int: ...
    @property
    def add_bias_linear(self) -> bool: ...


class _Cluster(Protocol):
    @property
    def gpus_per_node(self) -> int: ...
    @property
    def ranks_per_node(self) -> int: ...
    @property
    def cpus_per_node(self) -> int: ...
    @property
    def max_nodes(self) -> int | None: ...


class _Config(Protocol):
    """The whole config (pipeline.schema.config.PipelineConfig), as far as layouts read it."""

    @property
    def model(self) -> _Model: ...
    @property
    def cluster(self) -> _Cluster: ...
    def stage(self, name: str) -> _Stage: ...


@dataclass(frozen=True)
class ParallelPlan:
    """A stage's process layout."""

    tp: int
    pp: int
    dp: int
    vpp: int | None
    world_size: int
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    ep: int = 1
    """Expert parallel size (carved out of tp x dp: it adds no ranks)."""
    etp: int = 1
    """Expert tensor parallel size (megatron-core's default: tp)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ranks_per_node(cfg: _Config) -> int:
    c = cfg.cluster
    return c.gpus_per_node if c.gpus_per_node > 0 else c.ranks_per_node


def stage_plan(cfg: _Config, stage: str) -> ParallelPlan:
    """Derive the full layout of ``stage`` (raises ConfigError on an impossible request)."""
    par = cfg.stage(stage).parallel
    key = f"{stage}.parallel"
    per_node = _ranks_per_node(cfg)
    mp = par.tp * par.pp
    if par.dp is not None:
        dp = par.dp
        world = mp * dp
        nodes = par.nodes if par.nodes is not None else math.ceil(world / per_node)
    elif par.nodes is not None:
        nodes = par.nodes
        if (nodes * per_node) % mp:
            raise ConfigError(
                f"{key}.nodes={nodes}: {nodes} node(s) x {per_node} ranks/node is not divisible by "
                f"tp x pp = {mp}; set {key}.dp explicitly"
            )
        dp = nodes * per_node // mp
        world = mp * dp
    else:
        dp = _fewest_dp(par)
        world = mp * dp
        nodes = math.ceil(world / per_node)
    if world % nodes:
        raise ConfigError(
            f"{key}.nodes={nodes}: world size tp x pp x dp = {world} does not split evenly over {nodes} nodes"
        )
    tasks = world // nodes
    if tasks > per_node:
        what = "gpus_per_node" if cfg.cluster.gpus_per_node else "ranks_per_node"
        raise ConfigError(
            f"{key}: {tasks} ranks per node exceeds cluster.{what}={per_node}; use more {key}.nodes or fewer ranks"
        )
    if cfg.cluster.max_nodes is not None and nodes > cfg.cluster.max_nodes:
        raise ConfigError(
            f"{key}.nodes={nodes}: the cluster profile allows at most cluster.max_nodes={cfg.cluster.max_nodes}"
        )
    gpus = tasks if cfg.cluster.gpus_per_node else 0
    cpus = max(1, cfg.cluster.cpus_per_node // tasks)
    etp = par.etp or par.tp
    return ParallelPlan(par.tp, par.pp, dp, par.vpp, world, nodes, tasks, gpus, cpus, ep=par.ep, etp=etp)


def _fewest_dp(par: _Parallel) -> int:
    """dp when neither dp nor nodes is given: 1, or the fewest data-parallel ranks that hold the expert
    groups (megatron carves ep x etp out of tp x dp: ``pretrain.parallel.ep=2`` alone means dp=2)."""
    experts = par.ep * (par.etp or par.tp)
    return math.lcm(par.tp, experts) // par.tp


def check_layout(cfg: _Config, stage: str) -> ParallelPlan:
    """All layout checks for one stage, before anything is submitted."""
    st = cfg.stage(stage)
    key = f"{stage}.parallel"
    par = st.parallel
    if not spec(stage).trains:
        plan = stage_plan(cfg, stage)
        if stage == "eval":  # eval runs any tp x pp (x vpp) layout (same numbers as one rank)
            _check_model_split(cfg.model, par, key)
            check_moe_layout(cfg.model, par, key)
            check_expert_ranks(par, key, par.tp * plan.dp)
            return plan
        if par.tp * par.pp != 1:
            raise ConfigError(f"{key}: {stage} runs without pipeline or model parallelism; set tp=1 and pp=1")
        return plan
    if stage not in TRAIN_STAGES:
        raise ConfigError(f"run.stages={stage!r}: not a training stage")
    st = cast(_TrainStage, st)
    if st.seq_length is not None and st.seq_length > cfg.model.seq_length:
        raise ConfigError(
            f"{stage}.seq_length={st.seq_length}: must be <= model.seq_length={cfg.model.seq_length}"
        )
    _check_model_split(cfg.model, par, key)
    check_moe_layout(cfg.model, par, key)
    plan = stage_plan(cfg, stage)
    check_expert_ranks(par, key, par.tp * plan.dp)
    check_moe_training(cfg.model, par, key)
    _check_batch(par, plan, key)
    _check_features(cfg, par, key)
    return plan


def _check_model_split(m: _Model, par: _Parallel, key: str) -> None:
    """Heads, key/value groups and MLP width split over tp; layers over pp x vpp."""
    if m.num_attention_heads % par.tp:
        raise ConfigError(
            f"{key}.tp={par.tp}: model.num_attention_heads={m.num_attention_heads} is not divisible by it"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if groups % par.tp:
        raise ConfigError(f"{key}.tp={par.tp}: model.num_query_groups={groups} is not divisible by it")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % par.tp:
        raise ConfigError(f"{key}.tp={par.tp}: model.ffn_hidden_size={ffn} is not divisible by it")
    chunks = par.pp * (par.vpp or 1)
    if m.num_layers % chunks:
        what = f"{key}.pp={par.pp}" if par.vpp is None else f"{key}.pp={par.pp} x {key}.vpp={par.vpp}"
        raise ConfigError(f"{what}: model.num_layers={m.num_layers} is not divisible by pp x vpp = {chunks}")


def _check_batch(par: _Parallel, plan: ParallelPlan, key: str) -> None:
    """The global batch splits into whole micro batches per data-parallel rank (a multiple of pp interleaved)."""
    if par.global_batch_size % (par.micro_batch_size * plan.dp):
        raise ConfigError(
            f"{key}.global_batch_size={par.global_batch_size}: must be divisible by micro_batch_size x dp = "
            f"{par.micro_batch_size} x {plan.dp}"
        )
    if par.vpp and par.vpp > 1 and (par.global_batch_size // (par.micro_batch_size * plan.dp)) % par.pp:
        raise ConfigError(
            f"{key}.global_batch_size={par.global_batch_size}: the interleaved schedule needs the number of "
            f"micro batches per rank to be a multiple of pp={par.pp}"
        )


def _check_features(cfg: _Config, par: _Parallel, key: str) -> None:
    """Sequence parallel needs Transformer Engine and tp >= 2 (fp16 runs everywhere: tests/engine/train/test_precision.py)."""
    if par.sequence_parallel and not _has_transformer_engine():
        raise ConfigError(
            f"{key}.sequence_parallel=True: needs the Transformer Engine layer spec (GPU with transformer_engine "
            "installed); the local spec's torch LayerNorm cannot do it. Set it to false."
        )
    if par.sequence_parallel and par.tp < 2:
        raise ConfigError(f"{key}.sequence_parallel=True: needs tp >= 2")


def _has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None
