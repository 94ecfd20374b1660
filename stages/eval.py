"""Eval: held-out perplexity, task accuracy by greedy generation and preference accuracy, per trained model.

For each stage named in ``eval.models`` whose output is in ``ctx.inputs``, the newest verified checkpoint
under ``<stage>/checkpoints`` is loaded (weights only) into one model built from ``cfg.model`` (layout
``eval.parallel``: one rank, or any tensor- and pipeline-parallel layout; the numbers do not depend on it), and scored on data_prep's held-out files:

- perplexity: ``exp(mean next-token NLL)`` over up to ``eval.perplexity_batches x eval.batch_size`` samples
  of ``text_valid`` (megatron GPTDataset, ``model.seq_length`` tokens each);
- task accuracy: greedy generation (KV cache) from the prompt rendered with the run's chat template up to
  its generation prompt (engine.data.chat.task_prompts) until a stop token (data_prep's ``stop_token_ids``)
  or ``eval.max_new_tokens``, on the first ``eval.num_task_examples`` lines of ``eval_task.jsonl``, scored
  by ``stages.tasks.is_correct``;
- preference accuracy: the fraction of ``eval_pref.jsonl`` pairs (as the run renders them) where the summed
  log-prob of the chosen reply (and its closing token) exceeds the rejected one's; a pair cut at
  ``model.seq_length`` so short that a reply lost every token is left out (``pref_pairs_left_out``).

``results.json`` (written atomically to ``ctx.out_dir``), format 1::

    {
      "format": 1,
      "settings": {"seq_length", "batch_size", "perplexity_batches", "num_task_examples", "max_new_tokens"},
      "data": {"dir", "task", "max_operand", "valid_tokens", "task_examples", "task_prompts_cut" (prompts
               cut on the left to fit model.seq_length), "pref_pairs", "pref_pairs_left_out"},
      "models": {
        "<stage>": {
          "checkpoint": "<path of iter_NNNNNNN>", "iteration": int,
          "valid_loss": float, "perplexity": float,   (null when a score has no data)
          "task_accuracy": float, "task_correct": int,
          "pref_accuracy": float, "pref_margin": float (mean logp(chosen) - logp(rejected)),
          "samples": [{"prompt", "answer", "generated", "correct"}, ...]  (first 5)
        }
      },
      (with eval.tasks, each model also has "lm_eval": {"<task>": {"metrics": {"<metric>[,<filter>]": {"value",
       "stderr"}}, "version", "config_hash", "num_fewshot", "fewshot_seed", "samples" (documents scored)}},
       and "settings" has "lm_eval": {"tasks", "task_paths", "num_fewshot", "limit", "fewshot_seed", "max_gen_toks"})
      "skipped": {"<stage>": "<reason>"}   (in eval.models but not in the run, or no checkpoint)
      "reward_model": {"checkpoint", "iteration", "pref_accuracy" (r(chosen) > r(rejected) on eval_pref),
                       "reward_margin" (mean r(chosen) - r(rejected)), "pairs"}
                      (when the reward_model stage is in run.stages or eval.models)
    }

With two or more models each is scored by a job of its own (``ctx.part``: pipeline.schema.graph ``Stage.parts``)
that writes only its part result (pipeline.records.parts); this stage's own job gathers them, taking a model's
result while the checkpoint it scored is still the newest, and scores the rest itself.

One ``{"kind": "eval", "model", "perplexity", "task_accuracy", "pref_accuracy"}`` line per model goes to
``metrics.jsonl`` (and with ``eval.tasks`` one ``{"kind": "eval_task", "model", "task", "<metric>",
"<metric>_stderr", ...}`` line per model and lm-eval task), and a comparison table is printed.

lm-eval tasks (``eval.tasks``, ``eval.task_paths``): each model is run on them through the engine's lm-eval
backend (engine.evaluation) with the run's tokenizer, ``model.seq_length`` tokens of context and
``eval.batch_size`` requests per forward; ``eval.log_samples`` keeps lm-eval's per-document samples under
``lm_eval_samples/<model>/<task>.jsonl`` in the stage directory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from engine.context import STAGE_EVENTS, StageContext
from pipeline.records.parts import read_part, write_part
from pipeline.schema.config import PipelineConfig
from pipeline.schema.identity import stage_hashes
from stages import tasks
from stages.eval_output import RESULTS, format_table, write_results
from stages.eval_own_tasks import own_task_configs

SAMPLES = "lm_eval_samples"
"""Folder of lm-eval's per-document samples (``eval.log_samples``), one subfolder per model."""
NUM_SAMPLES = 5
"""Generated answers kept per model in results.json, for reading."""


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.data.datasets import load_tokenizer, read_manifest
    from engine.runtime import distributed as D

    if "data_prep" not in ctx.inputs:
        raise ValueError("eval: needs the data_prep stage's outputs (ctx.inputs['data_prep'])")
    data = Path(ctx.inputs["data_prep"])
    manifest = read_manifest(data, verify=False)
    ev, seq = cfg.eval, cfg.model.seq_length
    par = ev.parallel
    vpp = ctx.plan.vpp if ctx.plan else par.vpp
    D.init(par.tp, par.pp, vpp, ep=par.ep, etp=par.etp, seed=cfg.data.seed, threads=ev.threads, env=ctx.dist)
    try:
        tok = load_tokenizer(data / "tokenizer.json")
        sets = _load_sets(data, tok, cfg)
        model = _Lazy(lambda: _build(cfg, tok))
        results, skipped = _eval_models(cfg, ctx, model, tok, sets)
        reward = None if ctx.part else _eval_reward_model(ctx, cfg, tok, sets, skipped)
    finally:
        D.shutdown()
    if ctx.part:  # one model's job: its result is the part file; the stage's own job gathers them
        return {"part": ctx.part, "models": {k: _summary(v) for k, v in results.items()}, "skipped": skipped}

    out = {
        "format": 1,
        "settings": {
            "seq_length": seq,
            "batch_size": ev.batch_size,
            "perplexity_batches": ev.perplexity_batches,
            "num_task_examples": ev.num_task_examples,
            "max_new_tokens": ev.max_new_tokens,
            **({"lm_eval": _lm_settings(cfg)} if ev.tasks else {}),
        },
        "data": {
            "dir": str(data),
            "task": manifest["task"]["name"],
            "max_operand": manifest["task"]["max_operand"],
            "valid_tokens": sets["valid_tokens"],
            "task_examples": len(sets["task"]),
            "task_prompts_cut": sets["task_prompts_cut"],
            "pref_pairs": len(sets["pref"]),
            "pref_pairs_left_out": sets["pref_pairs_left_out"],
        },
        "models": results,
        "skipped": skipped,
    }
    if reward is not None:
        out["reward_model"] = reward
    if D.is_rank0():
        write_results(ctx, out)
        print(format_table(out), flush=True)
    summary = {k: _summary(v) for k, v in results.items()}
    if reward is not None:
        summary["reward_model"] = {"pref_accuracy": reward["pref_accuracy"]}
    return {
        "results": str(Path(ctx.out_dir) / RESULTS),
        "models": summary,
        "skipped": skipped,
        STAGE_EVENTS: [
            {
                "event": "eval_task",
                "model": m,
                "task": t,
                "metrics": sec["metrics"],
                "samples": sec["samples"],
            }
            for m, r in results.items()
            for t, sec in (r.get("lm_eval") or {}).items()
        ],
    }


def _build(cfg: PipelineConfig, tok: Any) -> list[Any]:
    from engine.models.gpt import build_model

    chunks = build_model(cfg.model, cfg.eval.parallel, tok.vocab_size)
    for c in chunks:
        c.eval()
    return chunks


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    """What the ledger keeps of one model's results: its scores and its lm-eval metrics (value and stderr)."""
    out = {m: r[m] for m in ("perplexity", "task_accuracy", "pref_accuracy")}
    if r.get("lm_eval"):
        out["lm_eval"] = {task: sec["metrics"] for task, sec in r["lm_eval"].items()}
    return out


def _eval_models(
    cfg: PipelineConfig, ctx: StageContext, model: _Lazy, tok: Any, sets: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each model of ``eval.models`` (a part's job: its one model) scored and run on ``eval.tasks``, one at a
    time in the weights of ``model``; a model whose part result is on disk for this config and checkpoint is
    taken from it (its own job scored it), every model scored here leaves one (a re-run redoes only the rest)."""
    from engine.runtime import distributed as D

    identity = stage_hashes(cfg)["eval"]
    wanted = [ctx.part] if ctx.part else list(cfg.eval.models)
    # read before any scoring, on every rank alike: rank 0 writes results as it goes
    done = {} if ctx.part else {m: read_part(ctx.out_dir, m, identity) for m in wanted}
    manager = _Lazy(lambda: (_task_manager(cfg), own_task_configs(ctx.out_dir, sets, cfg)))
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for m in wanted:
        got = done.get(m)
        if got is None or not _current(got, ctx, m):
            got = _eval_one(cfg, ctx, model, tok, sets, m, manager)
            if D.is_rank0():
                write_part(ctx.out_dir, m, identity, got)
        if "skipped" in got:
            skipped[m] = got["skipped"]
        else:
            results[m] = got["model"]
    return results, skipped


def _current(got: dict[str, Any], ctx: StageContext, m: str) -> bool:
    """A part result still stands: an ``hf:`` model's always, a stage's while its newest checkpoint is the
    one it scored (a model reported skipped is looked at again)."""
    from engine.checkpoint.latest import find_latest

    if "model" not in got:
        return False
    if m.startswith("hf:"):
        return True
    ckpt = find_latest(Path(ctx.inputs[m]) / "checkpoints") if m in ctx.inputs else None
    return ckpt is not None and got["model"].get("checkpoint") == str(ckpt)


def _eval_one(
    cfg: PipelineConfig,
    ctx: StageContext,
    model: _Lazy,
    tok: Any,
    sets: dict[str, Any],
    stage: str,
    manager: _Lazy,
) -> dict[str, Any]:
    """One model's scores as a part result: ``{"model": {...}}``, or ``{"skipped": reason}``."""
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load_weights
    from pipeline.schema.hf_arch import parse_ref

    stops = list(sets.get("stop_tokens") or [tok.eod])
    chat = _chat(cfg, tok, None)
    if stage.startswith("hf:"):  # a Hugging Face directory, scored as it is (e.g. the base model)
        from engine.evaluation.load import hf_stop_tokens

        hf_dir = parse_ref(stage) or Path(stage)
        stops += hf_stop_tokens(hf_dir)
        chat = _chat(cfg, tok, hf_dir)
        out = {"checkpoint": stage[3:], "iteration": None, **_eval_hf(model(), stage, tok, sets, cfg)}
    elif stage not in ctx.inputs:
        return {"skipped": "not in this run"}
    elif (ckpt := find_latest(Path(ctx.inputs[stage]) / "checkpoints")) is None:
        return {"skipped": f"no verified checkpoint under {ctx.inputs[stage]}/checkpoints"}
    else:
        load_weights(ckpt, model())
        out = {"checkpoint": str(ckpt), "iteration": _iteration(ckpt), **evaluate(model(), tok, sets, cfg)}
    if cfg.eval.tasks:
        tm, own = manager()
        out["lm_eval"] = _lm_eval(cfg, ctx, model(), tok, stops, stage, tm, own, chat)
    return {"model": out}


class _Lazy:
    """A value built on first use (the model's chunks, lm-eval's task manager and the own tasks' configs): a
    gathering job whose models
    were all scored by their own jobs builds neither."""

    def __init__(self, build: Any) -> None:
        self._build, self._value, self._built = build, None, False

    def __call__(self) -> Any:
        if not self._built:
            self._value, self._built = self._build(), True
        return self._value


def _chat(cfg: PipelineConfig, tok: Any, hf_dir: Path | None) -> Any:
    """The chat template lm-eval's prompts get under eval.apply_chat_template (None without it): the run's
    (data.chat_template) for its stages, a hf:<dir> model's own (None when it has none: the pre-flight refuses)."""
    if not (cfg.eval.tasks and cfg.eval.apply_chat_template):
        return None
    from engine.data.chat import run_template
    from engine.evaluation.load import dir_template

    if hf_dir is not None:
        return dir_template(hf_dir, tok)
    return run_template(cfg.data.chat_template, cfg.data.tokenizer_path, tok)


def _lm_run(cfg: PipelineConfig) -> Any:
    from engine.evaluation.tasks import TaskRun

    ev = cfg.eval
    return TaskRun(
        tasks=list(ev.tasks),
        task_paths=list(ev.task_paths),
        num_fewshot=ev.num_fewshot,
        limit=ev.limit,
        fewshot_seed=ev.fewshot_seed,
        log_samples=ev.log_samples,
        apply_chat_template=ev.apply_chat_template,
        fewshot_as_multiturn=ev.fewshot_as_multiturn,
    )


def _lm_settings(cfg: PipelineConfig) -> dict[str, Any]:
    ev = cfg.eval
    return {
        "tasks": list(ev.tasks),
        "task_paths": list(ev.task_paths),
        "num_fewshot": ev.num_fewshot,
        "limit": ev.limit,
        "fewshot_seed": ev.fewshot_seed,
        "max_gen_toks": ev.max_gen_toks,
        "apply_chat_template": ev.apply_chat_template,
    }


def _task_manager(cfg: PipelineConfig) -> Any:
    """lm-eval's TaskManager for ``eval.tasks`` (built once for every model); None when no task is asked for."""
    if not cfg.eval.tasks:
        return None
    from engine.evaluation.tasks import task_manager
    from pipeline.schema.stage_sections import OWN_LM_TASKS

    named = [t for t in cfg.eval.tasks if t not in OWN_LM_TASKS]  # the own ones come as configs
    return task_manager(list(cfg.eval.task_paths), named)


def _lm_eval(
    cfg: PipelineConfig,
    ctx: StageContext,
    chunks: list[Any],
    tok: Any,
    stops: list[int],
    stage: str,
    manager: Any,
    own: dict[str, dict[str, Any]],
    chat: Any,
) -> dict[str, Any]:
    """``eval.tasks`` on the weights now in ``chunks`` through the engine's lm-eval backend (one section per task);
    ``own``: the configs of the run's own tasks (stages.eval_own_tasks); ``chat``: the model's chat template
    (used with eval.apply_chat_template)."""
    from engine.evaluation.lm import EngineLM
    from engine.evaluation.tasks import run_tasks

    lm = EngineLM(
        chunks,
        tok,
        max_length=cfg.model.seq_length,
        batch_size=cfg.eval.batch_size,
        max_gen_toks=cfg.eval.max_gen_toks,
        stop_tokens=stops,
        chat=chat,
    )
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", stage)  # an hf:<dir> model gets a file-safe folder name
    run = dataclasses.replace(_lm_run(cfg), tasks=[own.get(t, t) for t in cfg.eval.tasks])
    return run_tasks(lm, run, manager, Path(ctx.out_dir) / SAMPLES / name)


def _eval_reward_model(
    ctx: StageContext, cfg: PipelineConfig, tok: Any, sets: dict[str, Any], skipped: dict[str, str]
) -> dict[str, Any] | None:
    """The reward model's accuracy on the held-out pairs (r(chosen) > r(rejected)), when eval reads it."""
    from engine.checkpoint.latest import find_latest
    from engine.rl.frozen_reward import RewardModel
    from pipeline.schema.graph import required

    if "reward_model" not in required("eval", cfg):
        return None
    if "reward_model" not in ctx.inputs:
        skipped["reward_model"] = "not in this run"
        return None
    ckpt = find_latest(Path(ctx.inputs["reward_model"]) / "checkpoints")
    if ckpt is None:
        skipped["reward_model"] = f"no verified checkpoint under {ctx.inputs['reward_model']}/checkpoints"
        return None
    rm = RewardModel(
        ckpt,
        cfg.model,
        cfg.eval.parallel,
        tok.vocab_size,
        pad_id=tok.pad,
        eod_id=tok.eod,
        batch_size=cfg.eval.batch_size,
    )
    seqs = []
    for item in sets["pref"]:  # [2, s] each: the tokens up to the last trained label, chosen then rejected
        for row in range(2):
            mask = item["loss_mask"][row]
            last = int(np.nonzero(mask > 0)[0].max()) if mask.any() else 0
            seqs.append(item["tokens"][row, : last + 1].tolist())
    r = rm(seqs, [[] for _ in seqs]).reshape(-1, 2) if seqs else np.zeros((0, 2), np.float32)
    margin = r[:, 0] - r[:, 1]
    return {
        "checkpoint": str(ckpt),
        "iteration": _iteration(ckpt),
        "pref_accuracy": float(np.mean(margin > 0)) if len(margin) else None,
        "reward_margin": float(np.mean(margin)) if len(margin) else None,
        "pairs": len(margin),
    }


def _eval_hf(
    chunks: list[Any], ref: str, tok: Any, sets: dict[str, Any], cfg: PipelineConfig
) -> dict[str, Any]:
    from engine.models.hf_weights import load_hf
    from pipeline.schema.hf_arch import model_config, parse_ref

    hf_dir = parse_ref(ref) or Path(ref)
    load_hf(chunks, hf_dir, model_config(hf_dir))
    return evaluate(chunks, tok, sets, cfg)


# ---------------------------------------------------------------------------- data


def _load_sets(data: Path, tok: Any, cfg: PipelineConfig) -> dict[str, Any]:
    """The held-out sets, every prompt rendered with the run's chat template (engine.data.chat)."""
    from engine.data.chat import held_out_pairs, task_prompts
    from engine.data.datasets import read_manifest, stacked_source, valid_source

    ev, seq = cfg.eval, cfg.model.seq_length
    valid = valid_source(data / "text_valid", tok, seq, cfg.data.seed)  # None: no validation text
    n_valid = 0 if valid is None else min(len(valid), ev.perplexity_batches * ev.batch_size)
    valid_items = [valid[i] for i in range(n_valid)] if valid is not None else []
    manifest = read_manifest(data, verify=False)
    task = task_prompts(data, "eval_task", tok)[: ev.num_task_examples]
    room = seq - ev.max_new_tokens  # a longer prompt is cut on the left (generate)
    rows, pair_texts, cut = held_out_pairs(data, tok, seq)  # pairs left without a reply token are left out
    pref = stacked_source(rows, cfg.data.seed, "eval pairs") if rows else None  # its seeded order
    return {
        "stop_tokens": manifest.get("stop_token_ids"),
        "valid": valid_items,
        "valid_tokens": int(sum(x["loss_mask"].sum() for x in valid_items)),
        "task": task,
        "task_prompts_cut": sum(len(ids) > room for ids in tok.encode_batch([r["prompt"] for r in task])),
        "pref": [pref[i] for i in range(len(pref))] if pref is not None else [],
        "pref_pairs_left_out": cut.emptied,
        "pref_texts": pair_texts,
    }


# ---------------------------------------------------------------------------- scoring


def evaluate(chunks: list[Any], tok: Any, sets: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    """All three scores of the weights now in ``chunks`` (this rank's model chunks: one, or its pipeline
    stages')."""
    import torch

    bs = cfg.eval.batch_size
    with torch.no_grad():
        nll, count = 0.0, 0.0
        for i in range(0, len(sets["valid"]), bs):
            batch = _stack(sets["valid"][i : i + bs])
            per_token = _nll(chunks, batch["tokens"], batch["labels"])
            nll += float((per_token * batch["loss_mask"]).sum())
            count += float(batch["loss_mask"].sum())
        valid_loss = nll / count if count else None

        margins: list[float] = []
        for i in range(0, len(sets["pref"]), bs):
            batch = _stack(sets["pref"][i : i + bs])  # [b, 2, s]
            per_token = _nll(chunks, batch["tokens"].flatten(0, 1), batch["labels"].flatten(0, 1))
            logp = -(per_token.reshape(batch["loss_mask"].shape) * batch["loss_mask"]).sum(-1)
            margins += (logp[:, 0] - logp[:, 1]).tolist()

        samples: list[dict[str, Any]] = []
        for i in range(0, len(sets["task"]), bs):
            recs = sets["task"][i : i + bs]
            outs = generate(
                chunks,
                tok,
                [r["prompt"] for r in recs],
                cfg.eval.max_new_tokens,
                cfg.model.seq_length,
                stop_tokens=sets.get("stop_tokens"),
            )
            samples += [
                {
                    "prompt": r.get("question", r["prompt"]),
                    "answer": r["answer"],
                    "generated": o,
                    "correct": tasks.is_correct(o, r["answer"]),
                }
                for r, o in zip(recs, outs)
            ]
    correct = sum(s["correct"] for s in samples)
    return {
        "valid_loss": valid_loss,
        "perplexity": math.exp(valid_loss) if valid_loss is not None else None,
        "task_accuracy": correct / len(samples) if samples else None,
        "task_correct": correct,
        "pref_accuracy": float(np.mean([m > 0 for m in margins])) if margins else None,
        "pref_margin": float(np.mean(margins)) if margins else None,
        "samples": samples[:NUM_SAMPLES],
    }


def _stack(items: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Items stacked into a batch on the engine's device (where the model is)."""
    import torch

    from engine.runtime import distributed as D

    dev = D.device()
    return {k: torch.from_numpy(np.stack([x[k] for x in items])).to(dev) for k in items[0]}


def _nll(chunks: list[Any], tokens: Any, labels: Any) -> Any:
    """Per-token next-token NLL [b, s] (megatron computes it from labels on the last pipeline stage; every
    stage gets it)."""
    import torch

    from engine.models.generate import forward_logits
    from engine.runtime import distributed as D

    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    loss = forward_logits(chunks, tokens, pos, labels=labels)
    return D.pp_broadcast_tensor(loss.float() if loss is not None else None, (b, s))


def generate(
    chunks: list[Any],
    tok: Any,
    prompts: list[str],
    max_new_tokens: int,
    seq_length: int,
    stop_tokens: list[int] | None = None,
) -> list[str]:
    """Greedy continuations of ``prompts`` (rendered with the run's chat template up to the generation prompt;
    cut on the left to leave room for ``max_new_tokens``) up to a stop token (default eod; not included) or
    ``max_new_tokens``.

    Batched, with the KV cache, on the model's device: the engine's generator (engine/models/generate.py).
    """
    from engine.models.generate import SamplingParams
    from engine.models.generate import generate as engine_generate

    ids = [tok.encode(p) for p in prompts]
    seqs = [x[-(seq_length - max_new_tokens) :] for x in ids]
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_tokens=tuple(stop_tokens or (tok.eod,)))
    out = engine_generate(chunks, seqs, params, vocab_size=tok.vocab_size, pad_id=tok.pad)
    return [tok.decode(ids) for ids in out.tokens]


def _iteration(ckpt: Path) -> int | None:
    m = re.search(r"iter_(\d+)$", str(ckpt))
    return int(m.group(1)) if m else None
