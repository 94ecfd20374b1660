"""Stage parts: which pieces of a stage run as jobs of their own (pipeline.schema.graph), and their result files
(pipeline.records.parts): written whole, read back only for the identity they were written for."""

from __future__ import annotations

import io
from pathlib import Path

from pipeline.records.parts import part_file, read_part, write_part
from pipeline.schema.compose import load_config as compose
from pipeline.schema.graph import parts
from pipeline.submit.launch import pending_parts


def test_eval_has_one_part_per_model_after_only_what_it_reads() -> None:
    cfg = compose(["experiment=tiny", "eval.models=[hf:/m/base,pretrain,sft,rlhf]"])
    assert parts("eval", cfg) == (
        ("hf:/m/base", ("data_prep",)),
        ("pretrain", ("data_prep", "pretrain")),
        ("sft", ("data_prep", "sft")),
        ("rlhf", ("data_prep", "rlhf")),
    )
    assert parts("pretrain", cfg) == ()
    assert parts("eval", compose(["experiment=tiny", "eval.models=[sft]"])) == ()  # one model: one job


def test_part_files_are_file_safe_and_read_back_only_for_their_identity(tmp_path: Path) -> None:
    a, b = part_file(tmp_path, "hf:/m/base"), part_file(tmp_path, "hf:/m_base")
    assert a != b and a.parent == b.parent == tmp_path / "parts" and a.name.startswith("hf_m_base-")
    assert part_file(tmp_path, "sft").name == "sft.json"
    write_part(tmp_path, "sft", "hash1", {"model": {"perplexity": 3.0}})
    assert read_part(tmp_path, "sft", "hash1") == {"model": {"perplexity": 3.0}}
    assert read_part(tmp_path, "sft", "hash2") is None  # another config
    assert read_part(tmp_path, "rlhf", "hash1") is None  # never written
    part_file(tmp_path, "rlhf").write_text('{"part": "rlhf", "identity": "ha')  # cut short
    assert read_part(tmp_path, "rlhf", "hash1") is None


def test_pending_parts_skip_done_ones_unless_what_they_read_runs_again(tmp_path: Path) -> None:
    from pipeline.schema.identity import stage_hashes

    cfg = compose(["experiment=tiny", f"run.root={tmp_path}"])
    out = tmp_path / "stages" / "eval"
    write_part(out, "sft", stage_hashes(cfg)["eval"], {"model": {}})
    write_part(out, "rlhf", "another config", {"model": {}})
    said = io.StringIO()
    assert [p for p, _ in pending_parts(cfg, tmp_path, "eval", ["eval"], said)] == ["pretrain", "rlhf"]
    assert said.getvalue() == "[eval:sft] done earlier with the same config: skipped\n"
    todo = pending_parts(cfg, tmp_path, "eval", ["sft", "eval"], io.StringIO())
    assert [p for p, _ in todo] == ["pretrain", "sft", "rlhf"]
