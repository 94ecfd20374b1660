"""Identity of data: input fingerprints in data_prep's hash, the size+mtime pre-check, one shared prepared copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.data.formats import check_chat_file, check_source
from pipeline.records.ledger import COMPLETED, Ledger, StageRecord
from pipeline.schema import data_identity
from pipeline.schema.compose import load_config
from pipeline.schema.identity import run_hash, stage_hashes
from pipeline.submit.orchestrate import decide, run_dir_for
from tests.support.env import REPO
from tests.support.timing import scaled


def write_corpus(path: Path, n: int = 60, tag: str = "doc") -> None:
    words = "the king queen sword crown night day love war peace river stone".split()
    rows = [
        {"text": f"{tag} {i}: " + " ".join(words[(i + j) % len(words)] for j in range(25))} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def overrides(root: Path, corpus: Path) -> list[str]:
    return [
        f"run.root={root}",
        "data.corpus=sources",
        f"data.sources=[{{path: {corpus}}}]",
        "data.vocab_size=300",
        "data.num_sft_examples=20",
        "data.num_pref_pairs=20",
        "data.num_eval_examples=10",
        "data.max_operand=99",
        "eval.num_task_examples=10",
    ]


def test_fingerprint_precheck_and_in_place_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus)
    cfg = load_config(overrides(tmp_path, corpus))
    hashed: list[str] = []
    real = data_identity.sha256_file
    monkeypatch.setattr(data_identity, "sha256_file", lambda p: (hashed.append(str(p)), real(p))[1])
    first = stage_hashes(cfg)
    assert hashed == [str(corpus.resolve())] and not (tmp_path / ".data").exists()  # planning writes nothing
    data_identity.fingerprints(
        cfg, save=True
    )  # as submitting a data_prep job does: from the memo, no re-read
    assert len(hashed) == 1
    data_identity._MEMO.clear()  # a new process: the cache file under run.root answers, nothing is re-read
    assert stage_hashes(cfg) == first and len(hashed) == 1
    fp = json.loads((tmp_path / ".data" / "fingerprints.json").read_text())
    assert fp[str(corpus.resolve())][0] == corpus.stat().st_size

    led = Ledger(run_dir_for(cfg))
    for s, h in first.items():
        led.write(StageRecord(stage=s, status=COMPLETED, hash=h))
    assert decide(cfg, led).submit == []
    write_corpus(corpus, tag="edited")  # in place: same path, same config
    os.utime(corpus, ns=(corpus.stat().st_atime_ns, corpus.stat().st_mtime_ns + 1000))
    assert run_dir_for(cfg) == led.run_dir  # the run directory stays; its data_prep no longer matches
    d = decide(cfg, led)
    assert d.submit == ["data_prep", "pretrain", "sft", "rlhf", "eval"] and len(hashed) == 2
    assert run_hash(cfg) == run_hash(load_config(overrides(tmp_path, corpus)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lr_sweep_prepares_data_once_and_an_edit_reruns_it(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus)
    args = [*overrides(tmp_path / "runs", corpus), "run.stages=[data_prep]", "cluster=local"]
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "-m", "pretrain.lr=1e-3,2e-3,3e-3", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    dirs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name.startswith("default-"))
    assert len(dirs) == 3
    outs = [Ledger(d).read("data_prep").outputs for d in dirs]  # type: ignore[union-attr]
    assert sorted(bool(o.get("reused")) for o in outs) == [False, True, True]
    shared = {o["shared_dir"] for o in outs}
    assert (
        len(shared) == 1 and len(list((tmp_path / "runs" / ".data").glob("data_prep-*/manifest.json"))) == 1
    )
    prepared = next(o for o in outs if not o.get("reused"))
    assert "timings" in prepared and str(corpus.resolve()) in prepared["inputs"]
    assert all((d / "stages" / "data_prep").resolve() == Path(shared.pop()) for d in dirs[:1])

    write_corpus(corpus, tag="edited")
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "pretrain.lr=1e-3", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "skipped" not in r.stdout
    again = [Ledger(d).read("data_prep").outputs for d in dirs]  # type: ignore[union-attr]
    assert (
        sum(not o.get("reused") and "timings" in o for o in again) == 1
    )  # prepared anew, in a new shared copy
    assert len(list((tmp_path / "runs" / ".data").glob("data_prep-*/manifest.json"))) == 2


def test_preflight_names_missing_empty_and_unparseable_inputs(tmp_path: Path) -> None:
    good = tmp_path / "c.jsonl"
    write_corpus(good, n=200)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"txt": "no text field"}\n')
    cfg = load_config(overrides(tmp_path, good))
    assert data_identity.check_data_inputs(cfg, check_source, check_chat_file) == []
    cfg.data.sources[0].path = str(tmp_path / "*.jsonl")
    cfg.data.sft_paths = [str(tmp_path / "missing.jsonl")]
    problems = "\n".join(data_identity.check_data_inputs(cfg, check_source, check_chat_file))
    assert "empty: " + str(tmp_path / "empty.jsonl") in problems
    assert "bad.jsonl:1: no string field 'text'" in problems
    assert "not found: " + str(tmp_path / "missing.jsonl") in problems
    # each problem names the key and the value as written; a relative path says where it was looked for
    assert f"data.sources[0].path={tmp_path / '*.jsonl'}: input file is empty: " in problems
    cfg.data.sft_paths = ["chat/missing.jsonl"]
    (line,) = [p for p in data_identity.check_data_inputs(cfg, check_source, check_chat_file) if "found" in p]
    assert line.startswith("data.sft_paths[0]=chat/missing.jsonl: input file not found: "), line
    assert "(a relative path, resolved against the working directory" in line
