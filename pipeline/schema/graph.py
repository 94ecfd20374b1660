"""The stage graph, declared in one place: ``REGISTRY`` (one ``Stage`` entry per stage).

Everything else is derived from it: the order stages run in (``STAGES``), the default selection
(``DEFAULT_STAGES``: the non-optional ones), which stages train (``TRAIN_STAGES``) and which of those produce a
language model (``LM_STAGES``: eval scores them, export exports them, ``init_from: auto`` chains through them),
dependencies, what a stage reads under a config (``required``) and the config section's dataclass (``section``;
``pipeline.schema.config`` checks at import that ``PipelineConfig`` has a field of that type per stage). Adding a
stage: one ``Stage(...)`` here, its section field in ``PipelineConfig``, its module ``stages/<name>.py`` with
``main(cfg, ctx)``, which ``stages.entry`` finds by the name (docs/EXTENDING.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.schema.errors import ConfigError
from pipeline.schema.rl import reads_reward_model

Reads = Callable[[Any, tuple[str, ...]], tuple[str, ...]]
Parts = Callable[[Any], tuple[tuple[str, tuple[str, ...]], ...]]


@dataclass(frozen=True)
class Stage:
    """One stage of the graph."""

    name: str
    upstream: tuple[str, ...] = ()
    """Stages whose outputs it may read (graph order); optional ones only when ``required`` says so."""
    trains: bool = False
    """Trains with the engine (a TrainStage-shaped section, checkpoints, init_from, resume)."""
    lm: bool = True
    """(training stages) its checkpoints are a language model: eval scores it, export exports it, and a later
    stage's ``init_from: auto`` loads the last such upstream stage."""
    optional: bool = False
    """Opt-in: runs only when named in ``run.stages`` (never in the default selection)."""
    section: str = "TrainStage"
    """The dataclass of its config section ``cfg.<name>`` (pipeline.schema.stage_sections)."""
    reads: Reads | None = None
    """``reads(cfg, upstream) -> the upstream stages it reads under cfg`` (default: the non-optional ones,
    minus the weights' source when ``init_from`` is not ``auto``)."""
    torch: bool = True
    """Its job imports torch and megatron.core (with ``cluster.prefork`` its local ranks are forked from a
    process that imported them: pipeline.submit.prefork)."""
    shared: bool = False
    """Its outputs depend only on the data identity (pipeline.schema.data_identity): one copy per identity under
    ``run.root``, linked into each run, prepared by the first job that needs it and reused by the others."""
    parts: Parts | None = None
    """``parts(cfg) -> ((part, upstream stages it reads), ...)``: pieces of the stage that run as jobs of their
    own before the stage's job (eval: one per model), each after only the stages it reads; the stage's job then
    gathers them (``StageContext.part`` tells a job which piece it runs; None: the stage's own job)."""


def _rlhf_reads(cfg: Any, ups: tuple[str, ...]) -> tuple[str, ...]:
    """rlhf reads the reward model only when its algorithm reads a reward (pipeline/schema/rl.py) and that
    reward comes from the model (``rlhf.reward: model | both``)."""
    base = _default_reads("rlhf", cfg, ups)
    if reads_reward_model(cfg.rlhf.algorithm, cfg.rlhf.reward):
        return (*base, "reward_model")
    return base


def _eval_reads(cfg: Any, ups: tuple[str, ...]) -> tuple[str, ...]:
    """eval reads the stages it scores: ``eval.models``, and the reward model when it is in the run."""
    scored = set(cfg.eval.models) | ({"reward_model"} & set(cfg.run.stages))
    return tuple(u for u in ups if u == "data_prep" or u in scored)


def _eval_parts(cfg: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """One eval job per model when there are two or more to score: a stage model after its own stage, an
    ``hf:`` directory after data_prep alone (models not in the run are left to the gathering job to report)."""
    reads = required("eval", cfg)
    models = [m for m in cfg.eval.models if m.startswith("hf:") or m in reads]
    if len(models) < 2:
        return ()
    return tuple((m, ("data_prep",) if m.startswith("hf:") else ("data_prep", m)) for m in models)


def _export_reads(cfg: Any, ups: tuple[str, ...]) -> tuple[str, ...]:
    """export reads data_prep (tokenizer) and the stage it exports (``export.stage``)."""
    return ("data_prep", export_source(cfg))


REGISTRY: tuple[Stage, ...] = (
    Stage("data_prep", (), section="DataPrepStage", torch=False, shared=True),
    Stage("pretrain", ("data_prep",), trains=True),
    Stage("sft", ("data_prep", "pretrain"), trains=True),
    Stage(
        "reward_model", ("data_prep", "sft"), trains=True, lm=False, optional=True, section="RewardModelStage"
    ),
    Stage("rlhf", ("data_prep", "sft", "reward_model"), trains=True, section="RLHFStage", reads=_rlhf_reads),
    Stage(
        "eval",
        ("data_prep", "pretrain", "sft", "reward_model", "rlhf"),
        section="EvalStage",
        reads=_eval_reads,
        parts=_eval_parts,
    ),
    Stage(
        "export",
        ("data_prep", "pretrain", "sft", "rlhf"),
        optional=True,
        section="ExportStage",
        reads=_export_reads,
    ),
)
"""Every stage, in the order they run."""

SPECS: dict[str, Stage] = {s.name: s for s in REGISTRY}
DEPENDS: dict[str, tuple[str, ...]] = {s.name: s.upstream for s in REGISTRY}
"""Each stage and the stages whose outputs it may read."""
STAGES: tuple[str, ...] = tuple(SPECS)
"""Every stage, in the order they run."""
DEFAULT_STAGES: tuple[str, ...] = tuple(s.name for s in REGISTRY if not s.optional)
"""The default ``run.stages``: every stage that is not opt-in."""
OPTIONAL_STAGES: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.optional)
TRAIN_STAGES: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.trains)
"""The stages that train a model with the engine."""
LM_STAGES: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.trains and s.lm)
"""Training stages whose checkpoints are a language model (scored by eval, exported by export)."""


def _check_registry() -> None:
    seen: set[str] = set()
    for s in REGISTRY:
        for u in s.upstream:
            if u not in seen:
                raise RuntimeError(
                    f"pipeline.schema.graph: {s.name} reads {u}, which is not declared before it"
                )
        seen.add(s.name)


_check_registry()


def spec(stage: str) -> Stage:
    if stage not in SPECS:
        raise ConfigError(f"run.stages={stage!r}: must be one of {list(STAGES)}")
    return SPECS[stage]


def upstream(stage: str) -> tuple[str, ...]:
    """Direct upstream stages of ``stage`` in the full graph."""
    return spec(stage).upstream


def weights_upstream(stage: str) -> str | None:
    """The training stage whose final checkpoint ``<stage>.init_from: auto`` loads (None: random init)."""
    ups = [u for u in upstream(stage) if u in LM_STAGES]
    return ups[-1] if ups else None


def _default_reads(stage: str, cfg: Any, ups: tuple[str, ...]) -> tuple[str, ...]:
    plain = tuple(u for u in ups if not SPECS[u].optional)
    if spec(stage).trains and getattr(cfg, stage).init_from != "auto":
        w = weights_upstream(stage)
        return tuple(u for u in plain if u != w)
    return plain


def required(stage: str, cfg: Any) -> tuple[str, ...]:
    """Upstream stages whose outputs ``stage`` reads under ``cfg``: a training stage whose init_from is not
    ``auto`` (a path, hf:<dir>, null) does not read its predecessor's weights; eval reads the stages it scores;
    an optional stage is read only by the stages that use it under ``cfg``."""
    s = spec(stage)
    if s.reads is not None:
        return s.reads(cfg, s.upstream)
    return _default_reads(stage, cfg, s.upstream)


def parts(stage: str, cfg: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The pieces of ``stage`` that run as jobs of their own under ``cfg`` (Stage.parts; none for most)."""
    s = spec(stage)
    return s.parts(cfg) if s.parts is not None else ()


def hash_upstream(stage: str, cfg: Any) -> tuple[str, ...]:
    """Upstream stages whose hashes go into ``stage``'s hash: every non-optional one, and the optional ones
    it reads under ``cfg`` (so an unused opt-in stage never changes another stage's identity)."""
    reads = set(required(stage, cfg))
    return tuple(u for u in upstream(stage) if not SPECS[u].optional or u in reads)


def export_source(cfg: Any) -> str:
    """The stage the export step exports: ``export.stage``, else the last language-model training stage in
    ``run.stages`` (else rlhf)."""
    chosen = cfg.export.stage
    if chosen:
        return str(chosen)
    in_run = [s for s in LM_STAGES if s in cfg.run.stages]
    return in_run[-1] if in_run else LM_STAGES[-1]


def order(selected: list[str]) -> list[str]:
    """The selected stages in graph order (duplicates dropped)."""
    for s in selected:
        upstream(s)
    return [s for s in STAGES if s in selected]


def dependencies(stage: str, selected: list[str]) -> list[str]:
    """Upstream stages of ``stage`` that run in this submission (the rest must already be complete)."""
    return [u for u in upstream(stage) if u in selected]


def downstream(stage: str, selected: list[str]) -> list[str]:
    """Selected stages that depend on ``stage`` directly or transitively."""
    out: list[str] = []
    for s in order(selected):
        if any(u == stage or u in out for u in upstream(s)):
            out.append(s)
    return out
