"""corpus=sources: every input format, cleaning counts, bad-record policies, splits, blends, resume per shard."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from engine.data import sources as ds
from engine.data.datasets import load_tokenizer, read_manifest
from pipeline.schema.config import DataConfig, PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.sections import DataSource
from tests.support.prep import prep_config, run_prep
from tests.support.timing import scaled

WORDS = "the king queen sword crown night day love war peace river stone fire wind".split()


def docs(n: int, seed: int, tag: str) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        f"{tag} {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(15, 40)))) + "." for i in range(n)
    ]


def write_all_formats(root: Path) -> dict[str, list[str]]:
    """One small file per format; returns the documents each holds (in order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    out = {k: docs(40, s, k) for s, k in enumerate(("text", "jsonl", "gz", "zst", "parquet", "hf"))}
    (root / "a.txt").write_text("\n\n".join(out["text"]) + "\n")
    lines = "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(out["jsonl"]))
    (root / "b.jsonl").write_text(lines)
    with gzip.open(root / "c.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in out["gz"]))
    (root / "d.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in out["zst"]).encode()
        )
    )
    titles = [t.split(":")[0] for t in out["parquet"]]
    bodies = [t.split(": ", 1)[1] for t in out["parquet"]]
    pq.write_table(pa.table({"title": titles, "body": bodies}), root / "e.parquet", row_group_size=16)
    out["parquet"] = [f"{a}: {b}" for a, b in zip(titles, bodies)]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": out["hf"]}).save_to_disk(str(root / "f_hf"))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("formats")
    return root, write_all_formats(root)


def sources_cfg(root: Path, **data: object) -> PipelineConfig:
    srcs = [
        DataSource(path=str(root / "a.txt"), name="text"),
        DataSource(path=str(root / "b.jsonl"), name="jsonl"),
        DataSource(path=str(root / "c.jsonl.gz"), name="gz"),
        DataSource(path=str(root / "d.jsonl.zst"), name="zst"),
        DataSource(path=str(root / "e.parquet"), template="{title}: {body}", name="parquet"),
        DataSource(path=str(root / "f_hf"), text_field="content", name="hf"),
    ]
    fields: dict[str, object] = dict(
        corpus="sources",
        sources=srcs,
        vocab_size=300,
        valid_fraction=0.1,
        test_fraction=0.1,
        task_mix_fraction=0.0,
        num_sft_examples=10,
        num_pref_pairs=10,
        num_eval_examples=10,
        max_operand=99,
    )
    return prep_config(fields, data)


def read_docs(prefix: Path, tok) -> list[str]:  # noqa: ANN001
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    d = IndexedDataset(str(prefix))
    return [tok.decode(d[i][:-1]) for i in range(len(d))]


@pytest.fixture(scope="module")
def prepared(corpus: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root, _ = corpus
    out = tmp_path_factory.mktemp("run") / "data_prep"
    return out, run_prep(sources_cfg(root), out)


def test_every_format_round_trips_text_tokens_indexed_dataset(
    corpus: tuple[Path, dict], prepared: tuple[Path, dict]
) -> None:
    _, expected = corpus
    out, result = prepared
    read_manifest(out)  # every file listed and checksummed
    tok = load_tokenizer(out / "tokenizer.json")
    got_all: set[str] = set()

    def paras(ds_docs: list[str]) -> list[str]:  # plain text is packed into ~4000-character documents
        return [p for d in ds_docs for p in d.split("\n\n")]

    for name, texts in expected.items():
        got = paras(read_docs(out / f"text_train-{name}", tok))
        assert got and set(got) <= set(texts), name
        assert got == [t for t in texts if t in set(got)], f"{name}: not in file order"
        got_all |= set(got)
    held = set(paras(read_docs(out / "text_valid", tok))) | set(paras(read_docs(out / "text_test", tok)))
    everything = {t for texts in expected.values() for t in texts}
    assert got_all | held == everything and not got_all & held  # every document in exactly one split
    assert result["sources"]["parquet"]["documents"] == 40
    assert [b["source"] for b in result["blend"]] == list(expected)


def test_splits_are_deterministic_by_document(
    corpus: tuple[Path, dict], prepared: tuple[Path, dict], tmp_path: Path
) -> None:
    root, expected = corpus
    out, _ = prepared
    tok = load_tokenizer(out / "tokenizer.json")
    # the split of a document depends on its content and the seed only: another file order, same split
    cfg = sources_cfg(root, tokenizer_path=str(out / "tokenizer.json"))
    cfg.data.sources = list(reversed(cfg.data.sources))
    run_prep(cfg, tmp_path / "dp")
    assert set(read_docs(tmp_path / "dp" / "text_valid", tok)) == set(read_docs(out / "text_valid", tok))
    v = sum(len(read_docs(out / f"text_{s}", tok)) for s in ("valid", "test"))
    assert 0.1 * 240 < v < 0.3 * 240


def test_dedup_and_length_filters_are_counted(tmp_path: Path) -> None:
    texts = docs(30, 7, "x")
    rows = texts + texts[:5] + ["short"] * 3 + ["y" * 500]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    b_rows = texts[10:14] + docs(1, 8, "y")  # four seen in source a first, one new
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in b_rows))
    cfg = sources_cfg(tmp_path, min_chars=20, max_chars=400, valid_fraction=0.0, test_fraction=0.0)
    cfg.data.sources = [
        DataSource(path=str(tmp_path / "a.jsonl"), name="a"),
        DataSource(path=str(tmp_path / "b.jsonl"), name="b"),
    ]
    r = run_prep(cfg, tmp_path / "dp")
    a, b = r["sources"]["a"], r["sources"]["b"]
    assert (a["documents"], a["duplicates"], a["too_short"], a["too_long"]) == (35, 5, 3, 1)
    assert (b["documents"], b["duplicates"]) == (5, 4)  # four were seen in source a first
    assert r["counts"]["documents_train"] == 31
    from pipeline.submit.orchestrate import data_counts_lines  # the results summary's lines

    assert "a: 30 documents kept (dropped: duplicates 5, too_short 3, too_long 1)" in data_counts_lines(r)
    cfg.data.dedup = False
    assert run_prep(cfg, tmp_path / "dp2")["counts"]["documents_train"] == 40


def test_bad_records_fail_names_file_and_line_or_skip_with_counts(tmp_path: Path) -> None:
    good = docs(20, 3, "g")
    lines = [json.dumps({"text": t}) for t in good]
    lines.insert(4, "{not json")
    lines.insert(9, json.dumps({"other": 1}))
    raw = ("\n".join(lines) + "\n").encode() + b'{"text": "\xff\xfe bad bytes"}\n'
    (tmp_path / "bad.jsonl").write_bytes(raw)
    cfg = sources_cfg(tmp_path, valid_fraction=0.0, test_fraction=0.0)
    cfg.data.sources = [DataSource(path=str(tmp_path / "bad.jsonl"), name="bad")]
    with pytest.raises(ValueError, match=r"bad\.jsonl:5: not valid JSON"):
        run_prep(cfg, tmp_path / "dp")
    cfg.data.bad_records = "skip"
    r = run_prep(cfg, tmp_path / "dp")
    c = r["sources"]["bad"]
    assert (c["documents"], c["malformed"]) == (20, 3)
    assert "bad.jsonl:5" in c["examples"][0] and "bad.jsonl:10" in c["examples"][1]
    assert read_manifest(tmp_path / "dp")["sources"]["bad"]["malformed"] == 3


def test_byte_ranges_do_not_change_the_output(
    corpus: tuple[Path, dict], prepared: tuple[Path, dict], tmp_path: Path
) -> None:
    root, _ = corpus
    out, _ = prepared
    # 500-byte units: many per plain file. JSON lines come out the same; plain text is packed into documents
    # within a unit, so shard_mb (a data setting, like the seed) may move its document boundaries.
    cfg = sources_cfg(root, shard_mb=0.0005, tokenizer_path=str(out / "tokenizer.json"))
    r = run_prep(cfg, tmp_path / "dp")
    assert r["units"] > 20
    for f in ("text_train-jsonl.bin", "text_train-jsonl.idx", "text_train-hf.bin", "text_train-parquet.idx"):
        assert (tmp_path / "dp" / f).read_bytes() == (out / f).read_bytes(), f


def test_killed_prep_resumes_per_shard(
    corpus: tuple[Path, dict], prepared: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus
    cfg = sources_cfg(root, shard_mb=0.002)
    out = tmp_path / "uninterrupted"
    run_prep(cfg, out)
    real = ds.write_unit
    calls: list[int] = []

    def dying(unit, *a, **k):  # noqa: ANN001, ANN002, ANN003
        calls.append(unit.index)
        if len(calls) == 4:
            Path(a[-1], f"u{unit.index:06d}-train.bin").write_bytes(b"half")  # a half-written shard
            raise KeyboardInterrupt("killed")
        return real(unit, *a, **k)

    monkeypatch.setattr(ds, "write_unit", dying)
    with pytest.raises(KeyboardInterrupt):
        run_prep(cfg, tmp_path / "dp")
    assert not (tmp_path / "dp" / "manifest.json").exists()
    calls.clear()
    monkeypatch.setattr(
        ds, "write_unit", lambda unit, *a, **k: (calls.append(unit.index), real(unit, *a, **k))[1]
    )
    r = run_prep(cfg, tmp_path / "dp")
    assert r["units_resumed"] == 3 and calls[0] == 3 and len(calls) == r["units"] - 3
    for f in ("text_train-text.bin", "text_train-hf.bin", "text_valid.idx", "manifest.json"):
        assert (tmp_path / "dp" / f).read_bytes() == (out / f).read_bytes(), f


def test_megatron_prefix_joins_the_blend_untokenized(prepared: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = prepared
    (tmp_path / "x.txt").write_text("\n\n".join(docs(30, 9, "m")) + "\n")
    cfg = sources_cfg(
        tmp_path,
        tokenizer_path=str(out / "tokenizer.json"),
        task_mix_fraction=0.2,
        valid_fraction=0,
        test_fraction=0,
    )
    cfg.data.sources = [
        DataSource(path=str(out / "text_train-jsonl"), weight=3.0, name="mega"),
        DataSource(path=str(tmp_path / "x.txt"), weight=1.0),
    ]
    r = run_prep(cfg, tmp_path / "dp")
    blend = {b["source"]: b for b in r["blend"]}
    assert blend["mega"]["prefix"] == str(out / "text_train-jsonl")
    assert blend["mega"]["weight"] == pytest.approx(0.6) and blend["s1"]["weight"] == pytest.approx(0.2)
    assert blend["task"]["weight"] == pytest.approx(0.2)


@pytest.mark.dist
def test_blend_weights_respected_over_10000_samples(prepared: tuple[Path, dict], tmp_path: Path) -> None:
    import torch.distributed as dist

    from engine.data.datasets import read_manifest as rm

    out, _ = prepared
    tok = load_tokenizer(out / "tokenizer.json")
    prefixes, _ = ds.pretrain_blend(out, rm(out, verify=False))  # type: ignore[misc]
    weights = [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        blended = ds.blended_gpt_dataset(prefixes, weights, tok, 16, 10_000, 1, tmp_path / "cache")
        counts = np.bincount(np.asarray(blended.dataset_index[:10_000]), minlength=len(weights)) / 10_000
        source = ds.pretrain_train_source(
            out, tok, 16, 200, 1
        )  # what the pretrain stage reads: the manifest's blend
        assert len(source) >= 200 and source[5]["tokens"].shape == (16,)
    finally:
        dist.destroy_process_group()
    assert np.abs(counts - np.array(weights)).max() < 0.01, counts


def test_source_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"format='xml'"):
        DataSource(path="x", format="xml")
    with pytest.raises(ConfigError, match=r"weight"):
        DataSource(path="x", weight=0)
    with pytest.raises(ConfigError, match=r"sources"):
        DataConfig(corpus="sources")
    with pytest.raises(ConfigError, match=r"bad_records"):
        DataConfig(bad_records="ignore")
    cfg = sources_cfg(tmp_path)
    cfg.data.sources = [DataSource(path=str(tmp_path / "missing.jsonl"))]
    with pytest.raises(ValueError, match=r"data\.sources\[0\]\.path=.*missing\.jsonl"):
        run_prep(cfg, tmp_path / "dp")


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_two_ranks_under_the_local_executor_byte_identical_to_one(tmp_path: Path) -> None:
    """``data_prep.parallel.dp=2``: the local executor starts 2 processes that share the units through files
    (launcher=files), or its one task runs ``mpiexec -n 2`` and the ranks use mpi4py (launcher=mpi)."""
    import subprocess
    import sys

    for f in range(3):
        (tmp_path / f"c{f}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in docs(150, f, f"f{f}"))
        )
    common = [
        "run.stages=[data_prep]",
        "data.corpus=sources",
        f"data.sources=[{{path: '{tmp_path}/*.jsonl'}}]",
        "data.shard_mb=0.01",
        "data.vocab_size=300",
        "data.num_sft_examples=10",
        "data.num_pref_pairs=10",
        "data.num_eval_examples=10",
        "eval.num_task_examples=10",
        "data.max_operand=99",
        "data_prep.threads=1",
    ]
    shared = []
    for n, launcher in ((1, "files"), (2, "files"), (2, "mpi")):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                f"run.root={tmp_path / f'r{n}{launcher}'}",
                f"data_prep.parallel.dp={n}",
                f"data_prep.launcher={launcher}",
                *common,
            ],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        (d,) = [p for p in (tmp_path / f"r{n}{launcher}" / ".data").glob("data_prep-*") if p.is_dir()]
        assert json.loads((d / "outputs.json").read_text())["ranks"] == n
        shared.append(d)
    names = sorted(read_manifest(shared[0])["files"]) + ["manifest.json"]
    assert any(n.startswith("text_train-") for n in names)
    # launcher=mpi: the local job had one task; its 2 ranks (outputs "ranks") came from mpiexec
    logs = "".join(p.read_text() for p in (tmp_path / "r2mpi").rglob("*_log.out"))
    assert "launching 2 MPI ranks" in logs, logs[-2000:]
    for name in names:
        for other in shared[1:]:
            assert (shared[0] / name).read_bytes() == (other / name).read_bytes(), (name, other)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pretrain_trains_on_a_weighted_blend_through_the_cli(tmp_path: Path) -> None:
    from tests.support.cli import run_pipeline

    for f in range(2):
        (tmp_path / f"c{f}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in docs(300, f, f"f{f}"))
        )
    r = run_pipeline(
        "experiment=tiny",
        "cluster=debug",
        f"run.root={tmp_path / 'runs'}",
        "run.stages=[data_prep,pretrain]",
        "data.corpus=sources",
        "pretrain.iters=3",
        f"data.sources=[{{path: {tmp_path / 'c0.jsonl'}, weight: 3}}, {{path: {tmp_path / 'c1.jsonl'}}}]",
        timeout=scaled(500),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "[pretrain] step 3/3" in r.stdout and "s0: " in r.stdout and "documents kept" in r.stdout


def test_sentencepiece_model_as_tokenizer(tmp_path: Path) -> None:
    """``data.tokenizer_path=<spm>.model``: documents get SentencePiece's own ids (plus eod)."""
    import os

    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = docs(200, 3, "sp")
    (tmp_path / "train.txt").write_text("\n".join(texts))
    with open(os.devnull, "w") as quiet:
        spm.SentencePieceTrainer.train(
            input=str(tmp_path / "train.txt"),
            model_prefix=str(tmp_path / "m"),
            vocab_size=60,
            hard_vocab_limit=False,
            logstream=quiet,
        )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = sources_cfg(
        tmp_path, valid_fraction=0.0, test_fraction=0.0, tokenizer_path=str(tmp_path / "m.model")
    )
    cfg.data.sources = [DataSource(path=str(tmp_path / "a.jsonl"), name="a")]
    out = tmp_path / "dp"
    run_prep(cfg, out)
    tok = load_tokenizer(out / "tokenizer.json")
    assert tok.vocab_size == sp.get_piece_size() + len(tok.special_ids)  # special tokens after its pieces
    d = IndexedDataset(str(out / "text_train-a"))
    got = {tuple(int(x) for x in d[i]) for i in range(len(d))}
    assert got == {(*sp.encode(t), tok.eod) for t in texts}
    from pipeline.submit.preflight import preflight

    cfg.model.vocab_size = tok.vocab_size - 1  # the pre-flight check sizes the model against the .model
    with pytest.raises(ConfigError, match=rf"model\.vocab_size.*set model\.vocab_size >= {tok.vocab_size}"):
        preflight(cfg)
    with pytest.raises(ValueError, match=r"data\.tokenizer_path=.*nope\.model"):
        cfg.data.tokenizer_path = str(tmp_path / "nope.model")
        run_prep(cfg, tmp_path / "dp2")


# ---------------------------------------------------------------------------- the format registry, csv/tsv


def test_format_registry_matches_the_schema_names() -> None:
    from engine.data.formats import FORMATS
    from pipeline.schema.sections import SOURCE_FORMATS

    assert set(FORMATS) == set(SOURCE_FORMATS) - {"auto"}


def write_csv_pair(root: Path) -> dict[str, list[str]]:
    """A .csv (quoted commas and newlines) and a .tsv of title/body rows; returns the rows' "title: body"."""
    import csv

    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {}
    for name, delim in (("g.csv", ","), ("h.tsv", "\t")):
        texts = docs(30, len(out) + 10, name[0])
        rows = [(t.split(": ", 1)[0], t.split(": ", 1)[1].replace(" war", ", war\nand")) for t in texts]
        with open(root / name, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, delimiter=delim)
            w.writerow(["id", "title", "body"])
            w.writerows([(i, a, b) for i, (a, b) in enumerate(rows)])
        out[name] = [f"{a}: {b}" for a, b in rows]
    return out


def test_csv_and_tsv_read_a_column_or_a_template(tmp_path: Path) -> None:
    expected = write_csv_pair(tmp_path)
    for name, texts in expected.items():
        for src, want in (
            (DataSource(path=str(tmp_path / name), template="{title}: {body}"), texts),
            (DataSource(path=str(tmp_path / name), text_field="body"), [t.split(": ", 1)[1] for t in texts]),
        ):
            units, fmts = ds.plan_units([src], 1 << 20)
            assert fmts == ["csv"] and len(units) == 1
            assert list(ds.unit_records(units[0], src)) == want


def test_csv_bad_rows_are_counted_or_fail_naming_the_line(tmp_path: Path) -> None:
    good = docs(20, 5, "c")
    raw = "title,body\n" + "".join(f'"t{i}","{t}"\n' for i, t in enumerate(good[:10]))
    raw += "only-one-column\n"  # line 12: wrong column count
    raw += '"t","a","b"\n'  # line 13: one column too many
    data = (
        raw.encode()
        + b'"t","\xff\xfe bad bytes"\n'
        + "".join(f't{i},"{t}"\n' for i, t in enumerate(good[10:])).encode()
    )
    (tmp_path / "bad.csv").write_bytes(data)
    cfg = sources_cfg(tmp_path, valid_fraction=0.0, test_fraction=0.0)
    cfg.data.sources = [DataSource(path=str(tmp_path / "bad.csv"), text_field="body", name="bad")]
    with pytest.raises(ValueError, match=r"bad\.csv:12: 1 columns, the header has 2"):
        run_prep(cfg, tmp_path / "dp")
    cfg.data.bad_records = "skip"
    c = run_prep(cfg, tmp_path / "dp")["sources"]["bad"]
    assert (c["documents"], c["malformed"]) == (20, 3)
    assert "bad.csv:13" in c["examples"][1] and "undecodable" in c["examples"][2]
    cfg.data.sources = [DataSource(path=str(tmp_path / "bad.csv"), template="{title} {nope}", name="bad")]
    with pytest.raises(
        ValueError,
        match=r"source 'bad' contributes nothing: 0 of 23 records kept \(malformed 23\).*no field 'nope'",
    ):
        run_prep(cfg, tmp_path / "dp2")  # every row skipped: data_prep fails, naming the source and counts
    assert not (tmp_path / "dp2" / "manifest.json").exists()


def test_csv_sources_end_to_end(tmp_path: Path) -> None:
    expected = write_csv_pair(tmp_path)
    cfg = sources_cfg(tmp_path, valid_fraction=0.0, test_fraction=0.0)
    cfg.data.sources = [
        DataSource(path=str(tmp_path / "g.csv"), template="{title}: {body}", name="csv"),
        DataSource(path=str(tmp_path / "h.tsv"), format="csv", template="{title}: {body}", name="tsv"),
    ]
    out = tmp_path / "dp"
    r = run_prep(cfg, out)
    read_manifest(out)
    tok = load_tokenizer(out / "tokenizer.json")
    assert read_docs(out / "text_train-csv", tok) == expected["g.csv"]
    assert read_docs(out / "text_train-tsv", tok) == expected["h.tsv"]
    assert r["sources"]["csv"]["documents"] == 30 and r["sources"]["tsv"]["malformed"] == 0


def test_one_paragraph_packer_for_corpus_files_and_sources(tmp_path: Path) -> None:
    from stages import data_prep

    paras = [" ".join(docs(3, i, "p")) + ("  \n  indented line" if i % 3 else "") for i in range(300)]
    (tmp_path / "a.txt").write_text("\n\n\n".join(paras) + "\n \n")
    files_docs, _ = data_prep.read_corpus(DataConfig(corpus="files", text_paths=[str(tmp_path / "a.txt")]))
    src = DataSource(path=str(tmp_path / "a.txt"))
    units, _ = ds.plan_units([src], 1 << 30)
    assert len(files_docs) > 5 and list(ds.unit_records(units[0], src)) == files_docs


def test_preflight_sample_check_of_a_csv_names_the_missing_column(tmp_path: Path) -> None:
    from engine.data.formats import check_source

    write_csv_pair(tmp_path)
    assert check_source(DataSource(path=str(tmp_path / "g.csv"), text_field="body"), "k") == []
    (problem,) = check_source(DataSource(path=str(tmp_path / "h.tsv"), template="{title} {nope}"), "k")
    assert "h.tsv: no column 'nope'" in problem
