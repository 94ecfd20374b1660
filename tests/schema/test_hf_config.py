"""``<stage>.init_from=hf:<dir>``: the architecture and tokenizer come from the directory, before any job.

A contradicting override and an unsupported field are config errors naming the values; the run's pre-flight
refuses a tokenizer that does not fit the model and a directory without the tokenizer or the weights (naming
the files), while the planner plans from config.json alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli.compose import load
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from tests.support.env import REPO as ROOT
from tests.support.hf_models import make
from tests.support.timing import scaled


def load_config(overrides: list[str]) -> PipelineConfig:
    """The front door's compose + validate (hf: references resolved), without the pre-flight of inputs."""
    return load(overrides, inputs=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make("llama3", tmp_path_factory.mktemp("hf") / "tiny-llama")


def test_architecture_and_tokenizer_from_the_directory(llama: Path) -> None:
    pc = load_config(
        [
            f"sft.init_from=hf:{llama}",
            "run.stages=[data_prep,sft]",
            "model.seq_length=32",
            "sft.seq_length=32",
        ]
    )
    hf = json.loads((llama / "config.json").read_text())
    m = pc.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.vocab_size) == (2, 64, 2, hf["vocab_size"])
    assert m.rotary_scaling and m.rotary_scaling_factor == 32.0 and m.activation == "swiglu"
    assert m.seq_length == 32 and m.name == "tiny-llama" and m.make_vocab_size_divisible_by == 1
    assert pc.data.tokenizer_path == str(llama.resolve())


def test_every_stage_accepts_hf(llama: Path) -> None:
    for stage in ("pretrain", "sft", "rlhf"):
        pc = load_config([f"{stage}.init_from=hf:{llama}", f"run.stages=[{stage}]"])
        assert pc.model.num_layers == 2
    pc = load_config([f"eval.models=[hf:{llama}]", "run.stages=[eval]"])
    assert pc.model.hidden_size == 64


def test_contradicting_override_names_both_values(llama: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.hidden_size=96: contradicts .*config.json's 64"):
        load_config([f"sft.init_from=hf:{llama}", "run.stages=[sft]", "model.hidden_size=96"])


def test_unsupported_field_fails_naming_it(llama: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in llama.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    hf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"sft.init_from=.*hidden_act='gelu': unsupported"):
        load_config([f"sft.init_from=hf:{bad}", "run.stages=[sft]"])


def test_tokenizer_larger_than_model_vocab_is_an_error(tmp_path: Path) -> None:
    small = make("llama3", tmp_path / "small", vocab_size=300)
    over = [f"sft.init_from=hf:{small}", "run.stages=[sft]", f"run.root={tmp_path / 'runs'}"]
    with pytest.raises(ConfigError, match=r"tokenizer vocabulary 30\d .* exceeds the model's vocab_size 300"):
        load(over, inputs=True)  # the run's pre-flight
    assert load_config(over).model.vocab_size == 300  # the plan reads config.json alone


def test_run_preflight_refuses_a_folder_without_tokenizer_or_weights(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m pipeline`` of config.json alone: one config error naming each missing file, nothing
    written; with the tokenizer files added, only the weights."""
    from pipeline.__main__ import main

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_bytes((llama / "config.json").read_bytes())
    over = [f"sft.init_from=hf:{folder}", "run.stages=[data_prep,sft]", f"run.root={tmp_path / 'runs'}"]
    assert main(over) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"config error: sft.init_from='hf:{folder}': {folder / 'tokenizer.json'}: no such file"
    )
    assert f"{folder / '*.safetensors'}: no such file (the run starts from the model's weights)" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "runs").exists()
    for f in llama.iterdir():  # the tokenizer files (and generation_config.json), not the weights
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    assert main(over) == 2
    err = capsys.readouterr().err
    assert "*.safetensors: no such file" in err and "tokenizer.json" not in err


def test_planner_plans_from_config_json(llama: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.plan", f"sft.init_from=hf:{llama}", "run.stages=[sft]"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 0, out.stderr
    assert "sft" in out.stdout and "tiny-llama" in out.stdout, out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline.plan", f"sft.init_from=hf:{llama}", "model.num_layers=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert bad.returncode == 2 and "model.num_layers=3: contradicts" in bad.stderr, bad.stderr
