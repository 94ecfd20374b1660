"""Origins recorded at composition: who set each key (command line, which file and line, which group choice),
in Hydra's merge order; ``--cfg job`` prints the resolved config with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.__main__ import main
from pipeline.schema.build import build_config
from pipeline.schema.compose import compose_traced
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.origins import FILE, OVERRIDE


def test_merge_order_lists_whole_mappings_by_key(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\n"
        "data:\n  sources:\n    - path: a.txt\n    - path: b.txt\n      weight: 2\n"
        "pretrain:\n  parallel:\n    tp: 2\n    dp: 1\n"
    )
    _, o = compose_traced(
        [
            f"hydra.searchpath=[file://{tmp_path}]",
            "experiment=mine",
            "pretrain.parallel={dp: 2}",
            "parallel@sft.parallel=tp2",
        ]
    )
    src = o.of("data.sources[1].weight")
    assert src is not None and (src.kind, src.line, src.choice, src.user) == (
        FILE,
        6,
        "experiment=mine",
        True,
    )
    tp, dp = o.of("pretrain.parallel.tp"), o.of("pretrain.parallel.dp")
    assert tp is not None and tp.line == 9  # the file's, kept: a mapping merges key by key
    assert dp is not None and dp.kind == OVERRIDE and dp.user
    sft_tp = o.of(
        "sft.parallel.tp"
    )  # a shipped group file chosen on the command line: a preset, not the user's
    assert (
        sft_tp is not None and sft_tp.where == "conf/parallel/tp2.yaml" and sft_tp.chosen and not sft_tp.user
    )
    model = o.of("model.num_layers")  # conf/config.yaml's default choice
    assert model is not None and model.describe() == "conf/model/tiny.yaml:3 (model=tiny, the default)"
    assert o.of("model.hidden_dropout") is None  # the schema default
    _, o2 = compose_traced(
        [f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine", "data.sources=[{path: c.txt}]"]
    )
    assert o2.of("data.sources[1].weight") is not None and o2.of("data.sources[1].weight").kind == OVERRIDE  # type: ignore[union-attr]
    assert "data.sources[1].weight" not in o2.keys  # the whole list was replaced
    assert o2.user_set("data.sources") and not o2.user_set("data.sources[0].weight")


def test_plain_mappings_count_values_that_differ_from_the_default() -> None:
    data = PipelineConfig().to_dict()
    data["pretrain"]["beta"] = 0.1  # the default: without a composition, nothing says it was set
    build_config(data)
    data["pretrain"]["beta"] = 0.5
    with pytest.raises(ConfigError, match=r"^pretrain.beta=0.5: only rlhf reads it"):
        build_config(data)


def test_cfg_job_prints_resolved_values_with_origins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["--cfg", "job", "experiment=tiny", "pretrain.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "  num_layers: 2  # conf/experiment/tiny.yaml:12 (experiment=tiny)\n" in out, out
    assert "  lr: 0.01  # the command line (pretrain.lr=0.01)\n" in out, out
    assert "  init_method_std: 0.02\n" in out, out  # the schema default: no comment
    assert main(["-c", "job", "experiment=tiny", "pretrain.warmup_iters=6"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("config error: pretrain.warmup_iters=6: must be < iters=6"), (
        err
    )
