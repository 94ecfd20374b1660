"""Data for the engine: the tokenizer, sample sources for each kind of training, the global sample index.

A *sample source* is any object with ``__len__`` (samples per epoch) and ``__getitem__(i)`` returning a
dict of numpy arrays. Every ``i >= 0`` is valid: index ``i`` falls in epoch ``i // len`` and position
``i % len`` of that epoch's seeded permutation, so the sample at a given global index is the same on
every rank, every layout and every resume (see :func:`sample_range` and docs/ARCHITECTURE.md).

Sources and their items (``seq`` = sequence length):

- :func:`pretrain_source` / :func:`valid_source`: megatron-core ``GPTDataset`` over the indexed text
  datasets written by data_prep. ``tokens``, ``labels`` int64 [seq], ``loss_mask`` float32 [seq] (0 on
  pad), ``position_ids`` int64 [seq].
- chat examples (SFT, preference pairs, task prompts) are built by engine.data.chat, every one rendered with
  the run's chat template; its rows are made here (``_row``, :func:`stacked_source`).

megatron's dataset builder works with or without ``torch.distributed``: without it each process builds
(and caches) its own indices; with it, global rank 0 builds the cache first and every other rank reads
it after a barrier, so *all ranks must call* :func:`pretrain_source` / :func:`valid_source` together.
The index cache lives in ``<data dir>/cache``.

Nothing heavy is imported at module level (megatron, torch and tokenizers load on first use).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.truncation import Truncation
from pipeline.records.files import sha256_file  # noqa: F401  (re-exported for data_prep)

SPECIAL_TOKENS: dict[str, str] = {
    "eod": "<|endoftext|>",
    "pad": "<|pad|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
}
"""Special tokens by role, in the order they are created (ids 0..3 for a tokenizer trained by data_prep)."""

MANIFEST = "manifest.json"


# ---------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """A HF ``tokenizers`` tokenizer with the pipeline's special-token ids.

    Usable as megatron's dataset tokenizer (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``).
    ``special`` maps roles to token strings: the pipeline's :data:`SPECIAL_TOKENS` by default (every role
    required); a Hugging Face tokenizer used unchanged (:func:`hf_special_tokens`) has ``eod`` = its eos token,
    ``pad`` = its pad token (else the eos token; pad positions never count) and no ``user``/``assistant``
    tokens: its data is rendered with its chat template (engine.data.chat), as every run's is.
    """

    def __init__(self, hf: Any, source: str = "", special: dict[str, str] | None = None) -> None:
        self.hf = hf
        self.source = source
        roles = special or SPECIAL_TOKENS
        ids: dict[str, int] = {}
        for role, token in roles.items():
            tid = hf.token_to_id(token)
            if tid is None:
                raise ValueError(f"tokenizer {source or '<in memory>'} lacks the special token {token!r}")
            ids[role] = tid
        if special:  # a published tokenizer may still hold the pipeline's role tokens
            for role in ("user", "assistant"):
                tid = hf.token_to_id(SPECIAL_TOKENS[role])
                if role not in ids and tid is not None:
                    ids[role], roles = tid, {**roles, role: SPECIAL_TOKENS[role]}
        self.special_tokens = dict(roles)
        self.special_ids = ids
        self.eod: int = ids["eod"]
        self.pad: int = ids["pad"]
        self.user: int | None = ids.get("user")
        self.assistant: int | None = ids.get("assistant")
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(hf.to_str().encode()).hexdigest()[:16]
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(
            [("class", "ByteLevelBPE"), ("sha256", digest), ("vocab_size", self.vocab_size)]
        )

    @property
    def eos(self) -> int:
        return self.eod

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [ids.tolist() for ids in self.encode_arrays(texts)]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each text (int32). Long texts go in pieces and the tokenizer gets bounded batches
        (engine.data.pieces), so memory follows those bounds and a few bytes per token of the output."""
        from engine.data.pieces import bounded_batches, text_pieces

        parts: list[list[np.ndarray]] = [[] for _ in texts]
        pieces = ((i, p) for i, t in enumerate(texts) for p in text_pieces(t))
        for batch in bounded_batches(pieces, lambda x: len(x[1])):
            encoded = self.hf.encode_batch_fast([p for _, p in batch], add_special_tokens=False)
            for (i, _), e in zip(batch, encoded):
                parts[i].append(np.asarray(e.ids, dtype=np.int32))
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in parts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept as their text."""
        return str(self.hf.decode([int(i) for i in ids], skip_special_tokens=False))


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json / special_tokens_map.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def hf_special_tokens(tokenizer_dir: str | Path) -> dict[str, str] | None:
    """Roles of a Hugging Face tokenizer directory used unchanged: ``{"eod": eos, "pad": pad or eos}`` plus
    ``bos`` when it has one (the pipeline's ``user``/``assistant`` tokens are looked up by Tokenizer).

    None when the directory names no eos token (tokenizer_config.json, else special_tokens_map.json): then
    the tokenizer is the pipeline's kind and must hold :data:`SPECIAL_TOKENS`.
    """
    d = Path(tokenizer_dir)
    cfg: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        if (d / name).is_file():
            data = json.loads((d / name).read_text())
            cfg |= {k: v for k, v in data.items() if _token_text(v)}
    eos = _token_text(cfg.get("eos_token"))
    if eos is None:
        return None
    out = {"eod": eos, "pad": _token_text(cfg.get("pad_token")) or eos}
    if _token_text(cfg.get("bos_token")):
        out["bos"] = str(_token_text(cfg.get("bos_token")))
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (a file, or a directory holding one).

    A ``tokenizer_config.json`` next to it naming an eos token makes it a Hugging Face tokenizer used
    unchanged (:func:`hf_special_tokens`); otherwise the pipeline's role tokens are required.
    """
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer file not found: {p}")
    try:
        hf = HFTokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own Exception type
        raise ValueError(f"tokenizer file {p} is not a valid tokenizers JSON: {e}") from e
    return Tokenizer(hf, source=str(p), special=hf_special_tokens(p.parent))


def read_manifest(data_dir: str | Path, verify: bool = True) -> dict[str, Any]:
    """data_prep's manifest; with ``verify``, check every listed file's size and sha256 (ValueError if not)."""
    d = Path(data_dir)
    path = d / MANIFEST
    if not path.is_file():
        raise ValueError(f"{path}: no manifest, so data_prep did not complete in {d}")
    manifest: dict[str, Any] = json.loads(path.read_text())
    if verify:
        for name, info in manifest["files"].items():
            f = d / name
            if not f.is_file() or f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
                raise ValueError(f"{f}: missing or does not match its checksum in {path}")
    return manifest


# ---------------------------------------------------------------------------- sources


class EpochSource:
    """``n`` base samples repeated in epochs, each epoch in its own seeded permutation; any ``i >= 0``."""

    def __init__(
        self,
        n: int,
        fetch: Callable[[int], dict[str, np.ndarray]],
        seed: int,
        name: str,
        *,
        truncation: Truncation | None = None,
    ) -> None:
        if n <= 0:
            raise ValueError(f"{name}: no samples")
        self.n = n
        self.fetch = fetch
        self.seed = seed
        self.name = name
        self.truncation = truncation
        """Chat examples: how many were read, cut at seq_length and left out (engine.data.truncation); None
        for windows of a token stream (pretraining), which lose nothing."""
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.n

    @property
    def num_truncated(self) -> int:
        """Examples cut at seq_length."""
        return self.truncation.truncated if self.truncation else 0

    @property
    def num_examples(self) -> int:
        """Examples read (more than ``n`` when several are packed into one row, fewer when some were left out)."""
        return self.truncation.examples if self.truncation else self.n

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perms[epoch] = perm
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if i < 0:
            raise IndexError(f"{self.name}: sample index {i} < 0")
        epoch, j = divmod(i, self.n)
        return self.fetch(int(self._perm(epoch)[j]))


def _gpt_dataset(
    prefix: Path, tokenizer: Tokenizer, seq_length: int, num_samples: int | None, seed: int, split: int
) -> Any:
    """A megatron GPTDataset over one indexed dataset, built as split ``split`` (0 train, 1 valid)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefix = Path(prefix)
    for ext in (".bin", ".idx"):
        if not prefix.with_name(prefix.name + ext).is_file():
            raise ValueError(f"indexed dataset {prefix}{ext} not found")
    blends: list[Any] = [None, None, None]
    blends[split] = ([str(prefix)], None)
    sizes: list[int | None] = [None, None, None]
    sizes[split] = num_samples
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=blends,
        path_to_cache=str(prefix.parent / "cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return built[split]


def _gpt_source(ds: Any, seed: int, name: str) -> EpochSource:
    def fetch(j: int) -> dict[str, np.ndarray]:
        item = ds[j]
        return {
            "tokens": item["tokens"].numpy().astype(np.int64),
            "labels": item["labels"].numpy().astype(np.int64),
            "loss_mask": item["loss_mask"].numpy().astype(np.float32),
            "position_ids": item["position_ids"].numpy().astype(np.int64),
        }

    if ds is None or len(ds) == 0:
        raise ValueError(f"{name}: the dataset yields no sample of this sequence length")
    return EpochSource(len(ds), fetch, seed, name)


def pretrain_source(
    prefix: Path, tokenizer: Tokenizer, seq_length: int, num_samples: int, seed: int
) -> EpochSource:
    """Pretraining samples from ``prefix``.bin/.idx (e.g. ``<data>/text_train``), at least ``num_samples`` per epoch."""
    ds = _gpt_dataset(Path(prefix), tokenizer, seq_length, num_samples, seed, split=0)
    return _gpt_source(ds, seed, f"pretrain_source({prefix})")


def valid_source(prefix: Path, tokenizer: Tokenizer, seq_length: int, seed: int) -> EpochSource | None:
    """Validation samples from ``prefix`` (e.g. ``<data>/text_valid``): one pass over its tokens per epoch.

    None when the dataset holds no tokens (``data.valid_fraction=0``).
    """
    bin_path = Path(f"{prefix}.bin")
    if bin_path.is_file() and bin_path.stat().st_size == 0:
        return None
    ds = _gpt_dataset(Path(prefix), tokenizer, seq_length, None, seed, split=1)
    return _gpt_source(ds, seed, f"valid_source({prefix})")


def read_jsonl(path: Path, keys: Sequence[str]) -> list[dict[str, str]]:
    """Records of a JSON-lines file, each checked to hold string ``keys`` (ValueError naming file and line)."""
    from engine.data.formats.base import Bad
    from engine.data.formats.jsonl import json_lines, numbered_lines

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    out: list[dict[str, str]] = []
    for n, rec in json_lines(numbered_lines(path)):
        if isinstance(rec, Bad):
            raise ValueError(f"{path}:{n}: {rec.reason}")
        for k in keys:
            if not isinstance(rec.get(k), str):
                raise ValueError(f"{path}:{n}: field {k!r} missing or not a string")
        out.append(rec)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def stacked_source(
    rows: list[dict[str, np.ndarray]], seed: int, name: str, *, truncation: Truncation | None = None
) -> EpochSource:
    """An epoch source over ``rows`` stacked into arrays (one row per sample)."""
    if not rows:
        raise ValueError(f"{name}: no samples")
    arrays = _stack(rows)
    return EpochSource(
        len(rows), lambda j: {k: v[j] for k, v in arrays.items()}, seed, name, truncation=truncation
    )


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _warn_truncated(name: str, count: int, total: int, seq_length: int) -> None:
    if count:
        warnings.warn(
            f"{name}: {count} of {total} examples longer than seq_length={seq_length} were truncated",
            stacklevel=3,
        )


def _row(
    ids: list[int], loss: list[int], seq_length: int, pad: int, starts: list[int] | None = None
) -> dict[str, np.ndarray]:
    """Arrays of one row from token ids and per-id loss flags (label j is ids[j + 1]).

    ``starts``: offsets of the packed examples in ``ids``; adds ``segment_ids`` and restarts
    ``position_ids`` per example (see engine.data.chat.sft_source).
    """
    n = len(ids) - 1
    tokens = np.full(seq_length, pad, dtype=np.int64)
    labels = np.full(seq_length, pad, dtype=np.int64)
    mask = np.zeros(seq_length, dtype=np.float32)
    tokens[:n], labels[:n], mask[:n] = ids[:-1], ids[1:], loss[1:]
    row: dict[str, np.ndarray] = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask,
        "position_ids": np.arange(seq_length, dtype=np.int64),
    }
    if starts is not None:
        segments = np.full(seq_length, len(starts), dtype=np.int64)
        bounds = [*starts, n]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            segments[a:b] = i
            row["position_ids"][a:b] = np.arange(b - a)
        row["position_ids"][n:] = np.arange(seq_length - n)
        row["segment_ids"] = segments
    return row


# ---------------------------------------------------------------------------- global sample index


def sample_range(step: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> range:
    """Global sample indices of data-parallel rank ``dp_rank`` at ``step``: a contiguous slice of the global batch."""
    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp={dp_size}")
    per_rank = global_batch_size // dp_size
    start = step * global_batch_size + dp_rank * per_rank
    return range(start, start + per_rank)


def collate(items: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack samples into a batch (leading batch dimension)."""
    return _stack(list(items))
