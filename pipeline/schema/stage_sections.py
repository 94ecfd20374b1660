"""The stages' config sections: data prep, the training stages (with their monitor and peft), rlhf, eval, export.

The section of each stage in pipeline.schema.graph's registry is one of these (``Stage.section``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.schema import rl
from pipeline.schema.domains import check_domains, choice, fail, num
from pipeline.schema.graph import LM_STAGES, TRAIN_STAGES
from pipeline.schema.sections import ParallelConfig


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
        choice("data_prep.launcher", self.launcher, ("files", "mpi"))


SINK_NAMES: tuple[str, ...] = ("tensorboard", "wandb", "mlflow", "prometheus")
"""The logging sinks ``<stage>.monitor.sinks`` may name (engine.callbacks.setup.SINKS: one factory per name)."""


@dataclass
class MonitorConfig:
    """What a training stage reports besides metrics.jsonl (sinks, rank 0 only) and when it raises an alarm."""

    sinks: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where rank 0 mirrors metrics.jsonl, any of tensorboard (<stage dir>/tensorboard), wandb (pip extra ``wandb``), mlflow (pip extra ``mlflow``), prometheus (an HTTP endpoint and/or a node_exporter textfile, docs/observability.md); e.g. ``pretrain.monitor.sinks=[tensorboard,wandb]``."""
    wandb_project: str = "llm-pipeline"
    """W&B project; runs are grouped by the run directory's name, one W&B run per stage."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (None: ``sqlite:///<run_dir>/mlflow.db``, artifacts in <run_dir>/mlartifacts); one experiment per run directory, one MLflow run per stage."""
    prometheus_http: bool = True
    """prometheus sink: serve the metrics over HTTP on rank 0 (its address in <stage dir>/prometheus.json)."""
    prometheus_port: int = num(0, ge=0, le=65535)
    """prometheus sink: the HTTP endpoint's port; 0 = a free port (each attempt may get another: read prometheus.json)."""
    prometheus_addr: str = "0.0.0.0"
    """prometheus sink: the address the HTTP endpoint listens on (0.0.0.0: every interface; 127.0.0.1: this host only)."""
    prometheus_textfile_dir: str | None = None
    """prometheus sink: also write <dir>/llm_<run>_<stage>.prom at every logged step, for node_exporter's textfile collector (--collector.textfile.directory); None = no textfile."""
    loss_swing: float = num(0.15, gt=0, lt=1)
    """prometheus sink: a logged loss more than this fraction above or below the one before counts as a swing (llm_loss_swings_in_a_row; the LLMLossSwinging alert fires at 3)."""
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
    alarm_routing_collapse: float = num(0.9, gt=0, le=1, or_zero=True)
    """MoE: alarm when one expert gets at least this share of a MoE layer's tokens (moe_layer<i>_tokens_max) while another gets less, for alarm_routing_steps logged lines in a row; 0 = off."""
    alarm_routing_steps: int = num(3, ge=1)
    """Logged lines in a row a routing collapse must last before its alarm fires."""

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.wandb_project or "/" in self.wandb_project:
            fail("wandb_project", self.wandb_project, "must be a non-empty name without '/'")
        for name in self.sinks:
            choice("sinks", name, SINK_NAMES)
        if len(set(self.sinks)) != len(self.sinks):
            fail("sinks", self.sinks, "each sink at most once")
        if not self.prometheus_addr:
            fail("prometheus_addr", self.prometheus_addr, "must be an address to listen on, e.g. 0.0.0.0")


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
        choice("method", self.method, ("none", "lora"))
        if not self.target_modules:
            fail("target_modules", self.target_modules, f"name at least one of {list(LORA_TARGETS)}")
        for t in self.target_modules:
            choice("target_modules", t, LORA_TARGETS)
        if len(set(self.target_modules)) != len(self.target_modules):
            fail("target_modules", self.target_modules, "each linear kind at most once")


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
    eval_tasks: list[str] = field(default_factory=list)
    """lm-eval tasks run on the training ranks with each validation (every eval_interval steps and at the end), eval_task_limit documents each, eval's task_paths, num_fewshot, fewshot_seed and max_gen_toks applying; the values go to metrics.jsonl (eval_task lines), the sinks and the report. Training is not touched (its RNG and data position are kept). Empty: none."""
    eval_task_limit: int = num(16, ge=1)
    """Documents per in-training task (a quick check, not the final benchmark)."""
    save_interval: int | str = num(50, ge=1, or_word="auto")
    """Steps between checkpoints (the final step is always saved); auto: chosen by Young/Daly from the save's stall and the stage's failure rate (cluster.node_mtbf_hours / nodes), from the planner's estimate of the stall before the first save and the measured stall after it (docs/fault-tolerance.md)."""
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
    """SFT: pack consecutive examples into each sequence of seq_length tokens (positions restart and attention stays within each example; a sample is then a packed row). Applies to the generated examples and to users' chat data (data.sft_paths) alike."""
    max_truncated_fraction: float = num(0.05, ge=0, le=1)
    """Examples are cut at seq_length; one cut so short that it keeps no trained token (its prompt fills the sequence; online RL: a prompt that leaves no room for max_new_tokens) is left out and counted (console, ledger, report). The stage refuses to start, before training, when more than this share of its examples (SFT examples, preference pairs, RL prompts) is lost, and always when all of them are: raise seq_length. Not read by pretrain (its samples are windows of the token stream: nothing is cut)."""
    checkpoint_verify: str = "full"
    """How a resume checks the newest checkpoint, each rank its own files in parallel: full (every byte against the marker's whole-file checksum), sampled (sizes plus 8 sampled 4 MiB blocks per file), sizes."""
    beta: float = num(0.1, ge=0)
    """Strength of the KL anchor to the frozen reference model (rlhf only): DPO's beta (> 0); GRPO's KL penalty coefficient (k3 estimator; 0: none, DAPO's and GSPO's presets); PPO's per-token KL penalty in the rewards (k1 estimator)."""
    algorithm: str = "dpo"
    """rlhf algorithm, one of those declared in pipeline/schema/rl.py (each with the rlhf keys it reads): dpo (offline, preference pairs), grpo (online: sampling, rewards, group-normalised advantages, clipped policy loss), dr_grpo (GRPO without the std division of the advantages and the per-response length normalisation of the loss), dapo (GRPO with clip-higher, dynamic sampling and overlong shaping), gspo (a sequence-level ratio, clipped per sequence) or ppo (online, with a trained critic: GAE advantages, clipped policy and value losses)."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """TensorBoard / W&B sinks and alarm thresholds (no effect on results)."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """sft/rlhf: full fine-tuning (method=none) or LoRA adapters (method=lora, rank, alpha, dropout, target_modules)."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("nan_policy", self.nan_policy, ("skip", "rollback", "stop"))
        choice("checkpoint_verify", self.checkpoint_verify, ("full", "sampled", "sizes"))
        if self.warmup_iters >= self.iters:
            # megatron's scheduler asserts warmup < decay steps inside the job
            fail("warmup_iters", self.warmup_iters, f"must be < iters={self.iters}")
        if self.min_lr > self.lr:
            fail("min_lr", self.min_lr, f"must be <= lr={self.lr}")
        if self.init_from is not None and not str(self.init_from).strip():
            fail("init_from", self.init_from, "auto, a checkpoint path, or null (random init)")
        choice("algorithm", self.algorithm, RLHF_ALGORITHMS)


OWN_LM_TASKS = ("pipeline_task", "pipeline_pref")
"""lm-eval task names the eval stage defines itself (stages.eval_own_tasks): ``pipeline_task`` is the run's generated
held-out task (eval_task.jsonl as the run renders it, greedy answers checked by its program) as an lm-eval
generate-until task; ``pipeline_pref`` its held-out preference pairs as a two-choice multiple-choice task."""
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
    clip_low: float = num(0.2, gt=0, lt=1)
    """DAPO, GSPO: the ratio is clipped to [1 - clip_low, 1 + clip_high] (GSPO: a sequence's length-normalised ratio, so a much narrower range: conf/rlhf/gspo.yaml)."""
    clip_high: float = num(0.28, gt=0, le=10)
    """DAPO, GSPO: upper clip of the ratio (DAPO's clip-higher: above clip_low, so unlikely tokens can gain probability)."""
    sampling_rounds: int = num(1, ge=1)
    """DAPO: rollout rounds per step at most; groups whose rewards are all equal are dropped and the batch refilled from the next prompts (1: no dynamic sampling)."""
    overlong_buffer: int = num(0, ge=0)
    """DAPO: soft overlong punishment over the last overlong_buffer tokens of max_new_tokens: a response of L > max_new_tokens - overlong_buffer tokens loses overlong_penalty x (L - (max_new_tokens - overlong_buffer)) / overlong_buffer of its reward (0: off)."""
    overlong_penalty: float = num(1.0, ge=0)
    """DAPO: the reward a response of max_new_tokens tokens loses with overlong_buffer > 0."""
    overlong_filter: bool = False
    """DAPO: responses cut at max_new_tokens (no stop token sampled) are left out of the loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("reward", self.reward, REWARDS)
        keys = rl.algorithm(self.algorithm).keys
        if rl.algorithm(self.algorithm).scaled_by_beta and self.beta <= 0:
            fail(
                "beta",
                self.beta,
                f"must be > 0 for rlhf.algorithm={self.algorithm} (its loss is scaled by beta)",
            )
        if "overlong_buffer" in keys and self.overlong_buffer > self.max_new_tokens:
            fail(
                "overlong_buffer",
                self.overlong_buffer,
                f"must be at most max_new_tokens={self.max_new_tokens}",
            )
        if "group_size" not in keys:
            return
        gbs = self.parallel.global_batch_size
        if gbs % self.group_size:
            fail(
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
    """Sequences per forward pass (lm-eval requests too)."""
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (or groups) by lm-eval's own names (e.g. arc_easy, hellaswag, gsm8k), those
    defined under task_paths, pipeline_task or pipeline_pref (the run's own generated task and preference pairs as
    lm-eval tasks), run on every evaluated model with the engine backend; empty: none."""
    task_paths: list[str] = field(default_factory=list)
    """Folders of users' own lm-eval task YAMLs (lm-eval's include_path); each must exist."""
    num_fewshot: int | None = num(None, integer=True, ge=0)
    """Few-shot examples per prompt for every task (None: each task's own default)."""
    limit: int | None = num(None, integer=True, ge=1)
    """Documents per task (None: all), for quick or in-training checks."""
    fewshot_seed: int = num(1234, ge=0)
    """Seed of lm-eval's few-shot sampler (lm-eval's default, 1234)."""
    max_gen_toks: int = num(256, ge=1)
    """New tokens of a generate-until request when its task does not say (lm-eval's default, 256)."""
    log_samples: bool = False
    """Write lm-eval's per-document samples to <eval stage dir>/lm_eval_samples/<model>/<task>.jsonl."""
    apply_chat_template: bool = False
    """Render every lm-eval prompt with the model's chat template (lm-eval's --apply_chat_template): the run's
    data.chat_template for the run's stages, a hf:<dir> model's own (refused before any job when it has none)."""
    fewshot_as_multiturn: bool = True
    """With apply_chat_template: few-shot examples as alternating user/assistant turns (lm-eval's default)."""

    def __post_init__(self) -> None:
        check_domains(self)
        for m in self.models:
            if not m.startswith("hf:"):
                choice("models", m, TRAIN_STAGES)
        for key, values in (("tasks", self.tasks), ("task_paths", self.task_paths)):
            for i, v in enumerate(values):
                if not isinstance(v, str) or not v.strip():
                    fail(f"{key}[{i}]", v, "a non-empty string")


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
            choice("stage", self.stage, LM_STAGES)
        if self.out is not None and not str(self.out).strip():
            fail("out", self.out, "a directory path, or null for <run_dir>/export/<stage>")
