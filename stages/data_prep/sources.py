"""corpus=sources: units of work over every source (engine.data.sources), shards per unit (resumable), merge,
blend, manifest."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from stages.data_prep.corpus import HELD_OUT, iter_task_documents, rng, task_document_count
from stages.data_prep.outputs import merge_shards, write_manifest, write_shard, write_task_files
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
    tok_json = world.on_root(lambda: _tokenizer_json(cfg, units, held))
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

    def tokenize_units() -> int:
        resumed = 0
        for u in units[world.rank :: world.size]:
            if ds.unit_done(scratch, u) is not None:
                resumed += 1
                continue
            ds.write_unit(u, d.sources[u.source], d, tokenizer, dtype, scratch)
        return resumed

    resumed = world.sum(on_every_rank(world, tokenize_units))
    timings["tokenize_s"] = time.perf_counter() - t
    t = time.perf_counter()
    merged = world.on_root(lambda: _merge_text(cfg, out, scratch, units, fmts, dtype))
    timings["merge_s"] = time.perf_counter() - t  # rank 0 alone: block copies and dedup
    t = time.perf_counter()
    n_task = task_document_count(merged.train_docs, d.task_mix_fraction, at_least=1)
    if d.task_mix_fraction <= 0:
        n_task = 0
    lo, hi = world.shard(n_task)
    docs = iter_task_documents(held, merged.train_docs, d.task_mix_fraction, d.seed, 1, lo, hi)
    task_shard = scratch / f"task-{world.rank:05d}"
    merged.tokens["task"] = world.sum(
        on_every_rank(world, lambda: write_shard(tokenizer, docs, task_shard, dtype))
    )
    timings["task_mix_s"] = time.perf_counter() - t  # every rank generates and tokenizes its range
    if world.rank != 0:
        world.barrier()
        return {"rank": world.rank}
    try:
        if n_task > 0:
            shards = [scratch / f"task-{r:05d}" for r in range(world.size)]
            merge_shards(shards, out / "text_train-task", dtype)
            merged.text_files.append("text_train-task")
            merged.blend.append(
                {"prefix": "text_train-task", "weight": d.task_mix_fraction, "source": "task"}
            )
        result = _finish_sources(cfg, out, units, held, tokenizer, dtype, tok_json, merged, n_task)
    finally:
        world.barrier()
    shutil.rmtree(scratch, ignore_errors=True)
    result.update(ranks=world.size, units=len(units), units_resumed=resumed)
    result["timings"] = {k: round(v, 3) for k, v in timings.items()}
    return result


def _tokenizer_json(cfg: PipelineConfig, units: list[Any], held: tasks.TaskSplit) -> str:
    """data.tokenizer_path's tokenizer, or a BPE trained on the sources' first tokenizer_sample_mb of clean
    documents plus their share of task documents (streamed to the trainer, never held)."""
    from engine.data import sources as ds

    d = cfg.data
    if d.tokenizer_path is not None:
        return tokenizer_text(d, [])

    def training_text() -> Iterator[str]:
        n = 0
        for doc in ds.sample_documents(units, d.sources, d, int(d.tokenizer_sample_mb * 1e6)):
            n += 1
            yield doc
        yield from iter_task_documents(held, n, d.task_mix_fraction, d.seed)

    return str(build_tokenizer(d, training_text()).to_str())


def on_every_rank(world: World, fn: Callable[[], int]) -> int:
    """``fn()`` on this rank; an error on any rank is raised on every rank (or the others would wait at the
    next exchange forever)."""
    value, error = 0, None
    try:
        value = fn()
    except Exception as e:
        error = e
    for err in world.allgather(error):
        if err is not None:
            raise err
    return value


@dataclass
class Merged:
    """The sources' text merged by rank 0 (what every rank learns of it, and what the manifest needs)."""

    train_docs: int
    per: dict[str, dict[str, Any]]
    blend: list[dict[str, Any]] = field(default_factory=list)
    text_files: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)


def _merge_text(
    cfg: PipelineConfig, out: Path, scratch: Path, units: list[Any], fmts: list[str], dtype: type[np.number]
) -> Merged:
    """The units' shards merged into one training prefix per source and the valid/test splits (dedup across
    all of them, in source order), and the blend of the sources."""
    from engine.data import sources as ds

    d = cfg.data
    names = [ds.source_name(s, i) for i, s in enumerate(d.sources)]
    m = Merged(0, _source_counts(scratch, units, names))
    seen = ds.SeenHashes() if d.dedup else None
    text_weight = 1.0 - (d.task_mix_fraction if d.task_mix_fraction > 0 else 0.0)
    total_w = sum(s.weight for s in d.sources)
    for i, (src, fmt) in enumerate(zip(d.sources, fmts)):
        w = text_weight * src.weight / total_w
        if FORMATS[fmt].tokenized:  # joins the blend as it is
            m.blend.append({"prefix": str(Path(src.path).resolve()), "weight": w, "source": names[i]})
            n, toks = prefix_tokens(src.path)
            m.per[names[i]].update(documents=n, tokens_train=toks)
            continue
        prefix = f"text_train-{names[i]}"
        n, toks, dups = ds.merge_units(
            scratch, [u for u in units if u.source == i], "train", out / prefix, dtype, seen
        )
        m.per[names[i]]["tokens_train"] = toks
        for j, k in dups.items():
            m.per[names[j]]["duplicates"] += k
        m.train_docs += n
        m.text_files.append(prefix)
        m.blend.append({"prefix": prefix, "weight": w, "source": names[i]})
    for split in ("valid", "test"):
        n, toks, dups = ds.merge_units(scratch, units, split, out / f"text_{split}", dtype, seen)
        m.tokens[split] = toks
        m.text_files.append(f"text_{split}")
        for j, k in dups.items():
            m.per[names[j]]["duplicates"] += k
    return m


def _finish_sources(
    cfg: PipelineConfig,
    out: Path,
    units: list[Any],
    held: tasks.TaskSplit,
    tokenizer: Tokenizer,
    dtype: type[np.number],
    tok_json: str,
    m: Merged,
    task_docs: int,
) -> dict[str, Any]:
    """Rank 0: the task files, tokenizer, chat files, the checks of what remains after cleaning, the manifest."""
    d = cfg.data
    per = m.per
    _report_malformed(per)
    counts = write_task_files(out, d, held)
    _atomic_write(out / "tokenizer.json", tok_json)
    copy_hf_tokenizer_files(d, out)
    counts.update(write_chat_files(out, d, tokenizer))
    text_tokens = sum(int(c.get("tokens_train", 0)) for c in per.values())
    counts.update(
        documents_train=m.train_docs + task_docs,
        documents_task=task_docs,
        tokens_train=text_tokens + m.tokens.get("task", 0),
        tokens_train_text=text_tokens,
        tokens_valid=m.tokens["valid"],
        tokens_test=m.tokens["test"],
    )
    check_prepared(cfg, counts, per)  # what remains after cleaning, before the manifest
    extra = {"blend": m.blend, "sources": per}
    files = [str(u.path) for u in units]
    manifest = write_manifest(out, d, tokenizer, dtype, counts, sorted(set(files)), m.text_files, extra)
    return {
        "data_dir": str(out),
        "vocab_size": tokenizer.vocab_size,
        "counts": manifest["counts"],
        "sources": per,
        "blend": m.blend,
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
