"""corpus=sources: units of work over every source (engine.data.sources), shards per unit (resumable), merge,
blend, manifest."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.datasets import MANIFEST, Tokenizer
from engine.data.formats import FORMATS
from engine.data.formats.megatron import check_prefix, prefix_tokens
from pipeline.records.files import atomic_write_text as _atomic_write
from pipeline.schema.config import PipelineConfig
from pipeline.schema.data_needs import check_prepared
from stages import tasks
from stages.data_prep.chat_files import write_chat_files
from stages.data_prep.corpus import HELD_OUT, MIX, iter_task_documents, rng, task_document_count
from stages.data_prep.outputs import write_manifest, write_shard, write_task_files
from stages.data_prep.tokenizer import (
    build_tokenizer,
    copy_hf_tokenizer_files,
    token_dtype,
    tokenizer_from_str,
    tokenizer_text,
)
from stages.data_prep.world import World


def prepare_sources(cfg: PipelineConfig, out: Path, world: World) -> dict[str, Any]:
    """corpus=sources: units of work over every source, shards per unit (resumable), merge, blend, manifest.

    See ``engine.data.sources``. The scratch folder ``.shards-<key>`` is named by the data config and
    the tokenizer, so a rerun after a kill keeps every finished shard and redoes only the others.
    """
    from engine.data import sources as ds

    d = cfg.data
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if world.rank == 0:
        (out / MANIFEST).unlink(missing_ok=True)
    units, fmts = world.on_root(lambda: ds.plan_units(d.sources, max(1, int(d.shard_mb * 1e6))))
    if world.rank == 0:
        _check_token_sources(cfg, fmts)
    held = tasks.make_split(d.num_eval_examples, d.max_operand, rng(d.seed, HELD_OUT), d.task)

    def training_text() -> Iterator[str]:  # streamed to the trainer, never held
        n = 0
        for doc in ds.sample_documents(units, d.sources, d, int(d.tokenizer_sample_mb * 1e6)):
            n += 1
            yield doc
        yield from iter_task_documents(held, n, d.task_mix_fraction, rng(d.seed, MIX))

    def tokenizer_json() -> str:
        if d.tokenizer_path is not None:
            return tokenizer_text(d, [])
        return str(build_tokenizer(d, training_text()).to_str())

    tok_json = world.on_root(tokenizer_json)
    tokenizer = tokenizer_from_str(tok_json, d)
    dtype = token_dtype(tokenizer.vocab_size)
    timings["tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    key = _digest({"data": cfg.to_dict()["data"], "tokenizer": tok_json})
    scratch = out / f".shards-{key}"
    if world.rank == 0:
        for stale in [*out.glob(".shards-*"), *out.glob(".world-*")]:
            if stale not in (scratch, world.folder):
                shutil.rmtree(stale, ignore_errors=True)
        scratch.mkdir(exist_ok=True)
    world.barrier()
    error: Exception | None = None
    resumed = 0
    try:
        for u in units[world.rank :: world.size]:
            if ds.unit_done(scratch, u) is not None:
                resumed += 1
                continue
            ds.write_unit(u, d.sources[u.source], d, tokenizer, dtype, scratch)
    except Exception as e:  # every rank must learn of it, or the others wait at the barrier forever
        error = e
    errors = world.allgather(error)
    for err in errors:
        if err is not None:
            raise err
    resumed = world.sum(resumed)
    timings["tokenize_s"] = time.perf_counter() - t
    if world.rank != 0:
        world.barrier()
        return {"rank": world.rank}
    try:
        t = time.perf_counter()
        result = _merge_sources(cfg, out, scratch, units, fmts, held, tokenizer, dtype, tok_json, timings)
        timings["merge_s"] = time.perf_counter() - t  # all rank 0 writes, task_mix_s included
    finally:
        world.barrier()
    shutil.rmtree(scratch, ignore_errors=True)
    result.update(ranks=world.size, units=len(units), units_resumed=resumed)
    result["timings"] = {k: round(v, 3) for k, v in timings.items()}
    return result


def _merge_sources(
    cfg: PipelineConfig,
    out: Path,
    scratch: Path,
    units: list[Any],
    fmts: list[str],
    held: tasks.TaskSplit,
    tokenizer: Tokenizer,
    dtype: type[np.number],
    tok_json: str,
    timings: dict[str, float],
) -> dict[str, Any]:
    from engine.data import sources as ds

    d = cfg.data
    names = [ds.source_name(s, i) for i, s in enumerate(d.sources)]
    per = _source_counts(scratch, units, names)
    seen = ds.SeenHashes() if d.dedup else None
    blend: list[dict[str, Any]] = []
    text_files: list[str] = []
    tokens: dict[str, int] = {}
    text_weight = 1.0 - (d.task_mix_fraction if d.task_mix_fraction > 0 else 0.0)
    total_w = sum(s.weight for s in d.sources)
    train_docs = 0
    for i, (src, fmt) in enumerate(zip(d.sources, fmts)):
        w = text_weight * src.weight / total_w
        if FORMATS[fmt].tokenized:  # joins the blend as it is
            blend.append({"prefix": str(Path(src.path).resolve()), "weight": w, "source": names[i]})
            n, toks = prefix_tokens(src.path)
            per[names[i]].update(documents=n, tokens_train=toks)
            continue
        prefix = f"text_train-{names[i]}"
        n, toks, dups = ds.merge_units(
            scratch, [u for u in units if u.source == i], "train", out / prefix, dtype, seen
        )
        per[names[i]]["tokens_train"] = toks
        for j, k in dups.items():
            per[names[j]]["duplicates"] += k
        train_docs += n
        text_files.append(prefix)
        blend.append({"prefix": prefix, "weight": w, "source": names[i]})
    for split in ("valid", "test"):
        n, toks, dups = ds.merge_units(scratch, units, split, out / f"text_{split}", dtype, seen)
        tokens[split] = toks
        text_files.append(f"text_{split}")
        for j, k in dups.items():
            per[names[j]]["duplicates"] += k
    t = time.perf_counter()
    task_docs = _task_mix(cfg, out, held, train_docs, tokenizer, dtype, tokens)
    timings["task_mix_s"] = time.perf_counter() - t  # generated and tokenized on rank 0 alone
    if task_docs > 0:
        text_files.append("text_train-task")
        blend.append({"prefix": "text_train-task", "weight": 1.0 - text_weight, "source": "task"})
    _report_malformed(per)
    counts = write_task_files(out, d, held)
    _atomic_write(out / "tokenizer.json", tok_json)
    copy_hf_tokenizer_files(d, out)
    counts.update(write_chat_files(out, d, tokenizer))
    text_tokens = sum(int(c.get("tokens_train", 0)) for c in per.values())
    counts.update(
        documents_train=train_docs + task_docs,
        documents_task=task_docs,
        tokens_train=text_tokens + tokens.get("task", 0),
        tokens_train_text=text_tokens,
        tokens_valid=tokens["valid"],
        tokens_test=tokens["test"],
    )
    check_prepared(cfg, counts, per)  # what remains after cleaning, before the manifest
    extra = {"blend": blend, "sources": per}
    files = [str(u.path) for u in units]
    manifest = write_manifest(out, d, tokenizer, dtype, counts, sorted(set(files)), text_files, extra)
    return {
        "data_dir": str(out),
        "vocab_size": tokenizer.vocab_size,
        "counts": manifest["counts"],
        "sources": per,
        "blend": blend,
    }


def _report_malformed(per: dict[str, dict[str, Any]]) -> None:
    for name, c in per.items():
        if c.get("malformed"):
            print(
                f"[data_prep] {name}: skipped {c['malformed']} malformed records, e.g. {c.get('examples', [])}"
            )


def _check_token_sources(cfg: PipelineConfig, fmts: list[str]) -> None:
    """One run, one tokenizer (as the pre-flight checks it): every megatron prefix holds ids of this run's."""
    for i, (src, fmt) in enumerate(zip(cfg.data.sources, fmts)):
        if FORMATS[fmt].tokenized:
            problem = check_prefix(src, f"data.sources[{i}]", cfg.data.tokenizer_path)
            if problem:
                raise ValueError(problem)


def _task_mix(
    cfg: PipelineConfig,
    out: Path,
    held: tasks.TaskSplit,
    train_docs: int,
    tokenizer: Tokenizer,
    dtype: type[np.number],
    tokens: dict[str, int],
) -> int:
    """The generated task's own dataset in the blend (text_train-task), weighted task_mix_fraction; at least
    one document, generated as they are tokenized. Returns their number; the tokens go into ``tokens["task"]``."""
    d = cfg.data
    if d.task_mix_fraction <= 0:
        return 0
    n = task_document_count(train_docs, d.task_mix_fraction, at_least=1)
    task_docs = iter_task_documents(held, train_docs, d.task_mix_fraction, rng(d.seed, MIX), at_least=1)
    tmp = out / ".text_train-task.tmp"
    tokens["task"] = write_shard(tokenizer, task_docs, tmp, dtype)
    for ext in (".bin", ".idx"):
        os.replace(f"{tmp}{ext}", out / f"text_train-task{ext}")
    return n


def _source_counts(scratch: Path, units: list[Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per source: the units' counts summed (documents, malformed, empty, too_short, too_long; duplicates are
    counted at the merge) and the first malformed examples."""
    from engine.data import sources as ds

    per: dict[str, dict[str, Any]] = {
        n: {"documents": 0, "malformed": 0, "empty": 0, "too_short": 0, "too_long": 0, "duplicates": 0}
        for n in names
    }
    for u in units:
        info = ds.unit_done(scratch, u)
        assert info is not None, f"unit {u.index} has no done marker"
        c = per[names[u.source]]
        for k, v in info["counts"].items():
            c[k] += v
        for ex in info["examples"]:
            c.setdefault("examples", [])
            if len(c["examples"]) < ds.EXAMPLES_KEPT:
                c["examples"].append(ex)
    return per


def _digest(obj: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
