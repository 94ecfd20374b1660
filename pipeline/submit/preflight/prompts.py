"""Prompts: every stage that builds them renders them with the run's chat template, and they fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.graph import order
from pipeline.schema.identity import run_dir_for
from pipeline.submit.preflight.checks import check_file, fail, reads
from pipeline.submit.preflight.data import names_eos

# ---------------------------------------------------------------------------- prompts

PROMPT_STAGES = ("data_prep", "sft", "reward_model", "rlhf", "eval")
"""The stages that render prompts with the run's chat template (engine.data.chat)."""


@reads(*PROMPT_STAGES)
def _prompts(cfg: PipelineConfig, stage: str) -> None:
    """Every stage that builds prompts renders them with ``data.chat_template`` (engine.data.chat): the
    template (a file: it is there to read) loads and renders a user/assistant conversation as SFT, DPO, the reward model, RL and eval
    use it; the project template needs the tokenizer's role tokens; and, where the tokenizer is known
    before any job (a Hugging Face tokenizer used unchanged, or data_prep's from an earlier command), the
    generated task's shortest prompt leaves room in the sequence length of every stage that reads it
    (else all its examples would be left out: the stage could not train). Run once per command."""
    if stage != next(s for s in order(cfg.run.stages) if s in PROMPT_STAGES):
        return
    from jinja2.exceptions import TemplateError

    from engine.data import chat

    d = cfg.data
    if d.chat_template not in ("project", "tokenizer"):  # a template file: there to read
        check_file("data.chat_template", d.chat_template, Path(d.chat_template).expanduser())
    tok = _known_tokenizer(cfg)
    special = tok.special_tokens if tok is not None else {"eod": "<|endoftext|>"}
    try:
        source = chat.load_template(d.chat_template, d.tokenizer_path)
        tpl = chat.ChatTemplate(source, eos_token=special["eod"], bos_token=special.get("bos", ""))
    except (OSError, ValueError, TemplateError) as e:
        fail("data.chat_template", d.chat_template, f"cannot load the template: {e}")
    try:
        chat.check_template(tpl)
    except ValueError as e:
        fail("data.chat_template", d.chat_template, f"{stage} builds its prompts with it, but {e}")
    if tok is None:
        return
    if d.chat_template == "project" and (tok.user is None or tok.assistant is None):
        fail(
            "data.chat_template",
            d.chat_template,
            f"the project template writes <|user|>/<|assistant|>, which the tokenizer {tok.source} (used "
            "unchanged) lacks: set data.chat_template=tokenizer (its own template) or a .jinja file",
        )
    _prompt_room(
        cfg, min(len(tok.encode(tpl.render([m], add_generation_prompt=True))) for m in _short_prompts(cfg))
    )


def _known_tokenizer(cfg: PipelineConfig) -> Any:
    """The run's tokenizer when it is known before data_prep runs: data_prep's output of an earlier command,
    or a Hugging Face tokenizer directory used unchanged (else None: data_prep trains or extends one)."""
    from engine.data.datasets import load_tokenizer

    if "data_prep" not in cfg.run.stages:
        path = run_dir_for(cfg) / "stages" / "data_prep" / "tokenizer.json"
    elif cfg.data.tokenizer_path is not None:
        p = Path(cfg.data.tokenizer_path)
        folder = p if p.is_dir() else p.parent
        if p.suffix == ".model" or not names_eos(folder):
            return None
        path = folder / "tokenizer.json"
    else:
        return None
    try:
        return load_tokenizer(path)
    except (OSError, ValueError):
        return None  # the tokenizer's own checks (_tokenizer, the job) name what is wrong


def _short_prompts(cfg: PipelineConfig) -> list[dict[str, str]]:
    """User messages of the generated task's shortest prompts (single-digit operands: with a pre-tokenizer
    that splits digits from words, no prompt of the task has fewer tokens)."""
    from stages import tasks

    d, top = cfg.data, min(cfg.data.max_operand, 9)
    ops = tasks.TASKS[d.task]
    pairs = (
        [(a, 1) for a in range(top + 1)]
        if ops == ("after",)
        else [(a, b) for a in range(top + 1) for b in range(a + 1)]
    )
    return [{"role": "user", "content": tasks.Problem(a, op, b).prompt} for op in ops for a, b in pairs]


def _prompt_room(cfg: PipelineConfig, shortest: int) -> None:
    """Each selected stage that reads the generated task keeps its examples: the shortest rendered prompt
    (``shortest`` tokens) leaves room for a trained token (online RL: for a response) in its sequence length."""
    from pipeline.schema.rl import algorithm

    d = cfg.data
    why = f"the generated task's prompts rendered with data.chat_template={d.chat_template} take {shortest}+ tokens"
    for name in (s for s in ("sft", "reward_model", "rlhf") if s in cfg.run.stages):
        st = cfg.stage(name)
        assert isinstance(st, TrainStage)
        seq = st.seq_length or cfg.model.seq_length
        if name == "rlhf" and "prompts" in algorithm(st.algorithm).reads:
            need = shortest + cfg.rlhf.max_new_tokens
            if need > seq:
                fail(
                    "rlhf.seq_length",
                    seq,
                    f"{why} + rlhf.max_new_tokens={cfg.rlhf.max_new_tokens}: no prompt leaves room for a "
                    f"response; raise it to {need} or more (or lower rlhf.max_new_tokens)",
                )
        elif not (d.sft_paths if name == "sft" else d.pref_paths) and shortest > seq:
            # users' data is rendered by data_prep: its lengths are checked at the start of the stage
            fail(
                f"{name}.seq_length",
                seq,
                f"{why}: every {name} example would lose all its trained tokens; raise it above {shortest}",
            )
    if "eval" in cfg.run.stages and shortest + cfg.eval.max_new_tokens > cfg.model.seq_length:
        fail(
            "model.seq_length",
            cfg.model.seq_length,
            f"{why} + eval.max_new_tokens={cfg.eval.max_new_tokens}: eval would cut every prompt; raise it",
        )
