"""What the selected stages need of data_prep's output, and the checks of what remains after cleaning.

Two checks, one set of needs (:func:`needs`):

- Before any job (``pipeline.submit.preflight``): :func:`estimate_problem` bounds the training tokens from the
  size of the inputs, the same way for every ``data.corpus`` (:data:`BYTES_PER_TOKEN`), and refuses a corpus
  that cannot hold one global batch of pretrain whatever the tokenizer (compressed files are decompressed
  only until they hold that much).
- In data_prep, after cleaning, deduplication and the split, before its manifest is written:
  :func:`prepared_problems` on the exact counts. A problem makes data_prep fail (no manifest, so the ledger never
  says completed and a re-run prepares again); the pre-flight applies the same function to the manifest of
  data prepared earlier (or shared from another run) before a later stage reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.schema.rl import algorithm

BYTES_PER_TOKEN = 1.0
"""The pre-flight's one assumption, for every corpus mode: a token spans at least one byte of text (a byte-level
BPE token covers one byte or more), so N bytes of text give at most N / BYTES_PER_TOKEN tokens. The estimate
refuses only a corpus too small for any tokenizer; data_prep counts exactly after cleaning (typically 3-4 bytes
per token for English with a 4k-32k BPE)."""

VALID_READERS = ("pretrain", "sft", "eval")
"""Stages that read sequences of text_valid (validation loss, perplexity) when it holds any tokens."""

DROPPED = ("duplicates", "malformed", "empty", "too_short", "too_long")
"""Per-source counts of records data_prep did not keep (engine.data.sources), in the order messages list them."""


@dataclass(frozen=True)
class Need:
    """At least ``amount`` of ``what`` (a key of data_prep's counts), because of ``why``; ``key``=``value`` is
    the setting an error names, ``fix`` what to do."""

    what: str
    amount: int
    why: str
    key: str
    value: Any
    fix: str


@dataclass(frozen=True)
class Shortfall:
    """One problem of prepared data: the setting (or source) it concerns and what is wrong."""

    key: str
    value: Any
    text: str

    def line(self) -> str:
        return f"{self.key}={self.value!r}: {self.text}"


CLEANING = "data.bad_records, data.min_chars, data.max_chars, data.dedup"


def _seq(cfg: Any, stage: str) -> int:
    if stage == "eval":
        return int(cfg.model.seq_length)
    return int(cfg.stage(stage).seq_length or cfg.model.seq_length)


def needs(cfg: Any) -> list[Need]:
    """What the selected stages (``run.stages``) read of data_prep's output, at the least."""
    stages, d = cfg.run.stages, cfg.data
    out: list[Need] = []
    if "pretrain" in stages:
        gbs, seq = cfg.pretrain.parallel.global_batch_size, _seq(cfg, "pretrain")
        why = f"one global batch of pretrain: {gbs * (seq + 1)} = global_batch_size {gbs} x (seq_length {seq} + 1)"
        fix = f"add text, relax the cleaning ({CLEANING}) or lower the batch"
        out.append(
            Need("tokens_train_text", gbs * (seq + 1), why, "pretrain.parallel.global_batch_size", gbs, fix)
        )
    readers = [(s, _seq(cfg, s)) for s in VALID_READERS if s in stages]
    for what, key, value in (
        ("tokens_valid", "data.valid_fraction", d.valid_fraction),
        ("tokens_test", "data.test_fraction", d.test_fraction if d.corpus == "sources" else 0),
    ):
        if not value:
            continue
        s, seq = max(readers, key=lambda r: r[1]) if readers and what == "tokens_valid" else ("", 0)
        why = f"one sequence of {s} ({seq} + 1 tokens)" if s else "a split that was asked for"
        fix = f"add documents, raise {key} or set it to 0"
        out.append(Need(what, seq + 1 if s else 1, why, key, value, fix))
    for what, paths, readers_of in (
        ("sft_chat", d.sft_paths, ("sft",)),
        ("pref_chat", d.pref_paths, ("reward_model", "rlhf")),
    ):
        for s in readers_of:
            reads = s != "rlhf" or "preferences" in algorithm(cfg.rlhf.algorithm).reads
            if paths and s in stages and reads:
                gbs = cfg.stage(s).parallel.global_batch_size
                why = f"one global batch of {s} ({gbs})"
                out.append(
                    Need(
                        what,
                        gbs,
                        why,
                        f"{s}.parallel.global_batch_size",
                        gbs,
                        "add examples or lower the batch",
                    )
                )
    return out


def train_need(cfg: Any) -> Need | None:
    """The training tokens the selected stages need (pretrain's global batch), if any."""
    return next((n for n in needs(cfg) if n.what == "tokens_train_text"), None)


def estimate_problem(cfg: Any, text_bytes: int, tokens: int) -> str | None:
    """The pre-flight's bound, the same for every corpus mode: ``text_bytes`` of text to tokenize and
    ``tokens`` already tokenized (megatron prefixes) hold at most ``text_bytes / BYTES_PER_TOKEN + tokens``
    training tokens. The problem when that is below pretrain's need."""
    need = train_need(cfg)
    at_most = int(text_bytes / BYTES_PER_TOKEN) + tokens
    if need is None or at_most >= need.amount:
        return None
    prefixes = f" plus {tokens} tokens of megatron prefixes" if tokens else ""
    return (
        f"the corpus holds at most {at_most} training tokens ({text_bytes} bytes of text at one token per "
        f"byte at most{prefixes}), fewer than {need.why}: add text or lower the batch"
    )


def source_line(name: str, c: dict[str, Any]) -> str:
    """``s0: 1 of 600 records kept (duplicates 599), 40 training tokens``: one source's counts."""
    return f"{name}: {_kept(c)}"


def _kept(c: dict[str, Any]) -> str:
    dropped = [f"{k} {c[k]}" for k in DROPPED if c.get(k)]
    records = int(c.get("documents", 0)) + sum(int(c.get(k, 0)) for k in DROPPED if k != "duplicates")
    kept = int(c.get("documents", 0)) - int(c.get("duplicates", 0))
    line = f"{kept} of {records} records kept"
    if dropped:
        line += f" ({', '.join(dropped)})"
    return f"{line}, {int(c.get('tokens_train', 0))} training tokens"


def _source_problems(cfg: Any, sources: dict[str, dict[str, Any]]) -> list[Shortfall]:
    """Each source must give training tokens (the blend gives it a weight)."""
    where = {
        str(s.name or f"s{i}"): (f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources)
    }
    out = []
    for name, c in sources.items():
        if int(c.get("tokens_train", 0)) > 0:
            continue
        key, value = where.get(name, ("data.sources", name))
        kept = int(c.get("documents", 0)) - int(c.get("duplicates", 0))
        if kept <= 0:
            example = f"; e.g. {c['examples'][0]}" if c.get("examples") else ""
            text = f"source {name!r} contributes nothing: {_kept(c)}{example}"
        else:
            text = f"source {name!r} contributes no training tokens: all {kept} kept documents fell in valid/test"
        out.append(
            Shortfall(key, value, f"{text}: fix its records, relax the cleaning ({CLEANING}) or remove it")
        )
    return out


def _count(counts: dict[str, Any], what: str) -> int:
    if what == "tokens_train_text" and what not in counts:  # a manifest of an older version
        what = "tokens_train"
    return int(counts.get(what, 0))


def check_prepared(
    cfg: Any, counts: dict[str, Any], sources: dict[str, dict[str, Any]] | None = None
) -> None:
    """data_prep's check after cleaning, before its manifest is written: ValueError, one line naming the
    sources and the counts, when the output falls short of :func:`needs` or a source gives nothing."""
    problems = prepared_problems(cfg, counts, sources)
    if problems:
        lines = [p.line() for p in problems]
        many = f" ({len(lines)} problems)" if len(lines) > 1 else ""
        raise ValueError(f"data_prep after cleaning{many}: " + "; also ".join(lines))


def prepared_problems(
    cfg: Any, counts: dict[str, Any], sources: dict[str, dict[str, Any]] | None = None
) -> list[Shortfall]:
    """What is wrong with data_prep's output for the selected stages, from its exact counts (after cleaning,
    deduplication and the split); [] when nothing.

    ``counts``: the manifest's counts (``tokens_train_text``: the training tokens of the user's text,
    generated task documents left out; ``tokens_valid``, ``tokens_test``, ``sft_chat``, ``pref_chat``).
    ``sources``: corpus=sources, the counts of each source by name: each must give training tokens.
    """
    problems = _source_problems(cfg, sources or {})
    per = " / ".join(source_line(n, c) for n, c in (sources or {}).items())
    if not sources and "documents_text" in counts:  # corpus=files|shakespeare: the documents read
        kept = int(counts.get("documents_train", 0)) - int(counts.get("documents_task", 0))
        per = f"data.corpus={cfg.data.corpus}: documents read {counts['documents_text']}, for training {kept}"
    for need in needs(cfg):
        have = _count(counts, need.what)
        if have >= need.amount:
            continue
        if need.what == "tokens_train_text":
            what = f"the training text after cleaning holds {have} tokens" + (f" ({per})" if per else "")
        elif need.what in ("tokens_valid", "tokens_test"):
            split = "validation" if need.what == "tokens_valid" else "test"
            docs = counts.get(f"documents_{need.what.removeprefix('tokens_')}")
            what = f"the {split} split holds {have} tokens" + (
                f" ({docs} documents)" if docs is not None else ""
            )
        else:
            paths = "data.sft_paths" if need.what == "sft_chat" else "data.pref_paths"
            what = f"{paths} hold {have} examples"
        problems.append(Shortfall(need.key, need.value, f"{what}, fewer than {need.why}: {need.fix}"))
    return problems
