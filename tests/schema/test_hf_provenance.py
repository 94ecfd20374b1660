"""What the user set decides, not whether a value differs from the tiny default, through the CLI:

- an override that contradicts config.json is an error even when it equals the default model's value (it used to
  be replaced silently, the run hash unchanged);
- a shipped preset's model keys (``experiment=tiny``) give way to the model a stage starts from;
- an error naming a key the user did not type says where its value came from (a file and line, config.json, or
  the schema default); ``--cfg job`` prints the resolved values with their origins.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.__main__ import main
from tests.support.env import REPO
from tests.support.hf_models import make
from tests.support.timing import scaled

LINE = re.compile(r"^config error: \S+=.*: .+$")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf").resolve()
    llama = make(
        "llama3", root / "llama"
    )  # 2 layers, hidden 64, untied, RMSNorm, RoPE base 500000 scaled x32
    qwen = make("qwen2", root / "qwen")  # qkv biases, tied, RoPE without scaling
    deep = root / "deep"  # another shape than experiment=tiny's (config.json only: read before any job)
    deep.mkdir()
    for f in llama.iterdir():
        (deep / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((llama / "config.json").read_text())
    (deep / "config.json").write_text(
        json.dumps({**cfg, "num_hidden_layers": 3, "hidden_size": 96, "head_dim": 24})
    )
    return {"llama": llama, "qwen": qwen, "deep": deep}


def cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    code = main([*args, f"run.root={tmp_path / 'runs'}"])
    out = capsys.readouterr()
    return code, out.out, [ln for ln in out.err.splitlines() if ln.strip()]


def one_error(tmp_path: Path, code: int, err: list[str], *needles: str) -> None:
    assert code == 2 and len(err) == 1 and LINE.match(err[0]), err
    for n in needles:
        assert n in err[0], (n, err)
    assert not (tmp_path / "runs").exists()


# (model, override equal to the default ModelConfig's value, what the line says)
DEFAULT_VALUED = [
    ("llama", "model.tie_embeddings=true", "model.tie_embeddings=True: contradicts"),
    ("llama", "model.rotary_scaling_factor=8", "model.rotary_scaling_factor=8.0: contradicts"),
    ("llama", "model.rotary_base=10000", "model.rotary_base=10000: contradicts"),
    ("llama", "model.rotary_scaling=false", "model.rotary_scaling=False: contradicts"),
    ("llama", "model.normalization=LayerNorm", "model.normalization='LayerNorm': contradicts"),
    ("llama", "model.activation=gelu", "model.activation='gelu': contradicts"),
    ("llama", "model.add_bias_linear=true", "model.add_bias_linear=True: contradicts"),
    (
        "llama",
        "model.position_embedding=learned_absolute",
        "model.position_embedding='learned_absolute': contradicts",
    ),
    ("qwen", "model.add_qkv_bias=false", "model.add_qkv_bias=False: contradicts"),
    ("qwen", "model.rotary_scaling_factor=8", "only model.rotary_scaling=true reads it"),
]


@pytest.mark.parametrize(("kind", "override", "says"), DEFAULT_VALUED, ids=[o for _, o, _ in DEFAULT_VALUED])
def test_override_equal_to_the_default_still_contradicts_config_json(
    kind: str,
    override: str,
    says: str,
    models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hf = models[kind]
    code, _, err = cli(
        capsys, tmp_path, f"sft.init_from=hf:{hf}", "run.stages=[data_prep,sft]", "run.dry_run=true", override
    )
    one_error(tmp_path, code, err, says, f"{hf}/config.json")


def test_agreeing_overrides_and_the_users_name_are_kept(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = models["llama"]
    code, out, err = cli(
        capsys,
        tmp_path,
        "--cfg",
        "job",
        f"sft.init_from=hf:{hf}",
        "run.stages=[data_prep,sft]",
        "model.num_layers=2",
        "model.tie_embeddings=false",
        "model.name=tiny-gpt",  # the default model's name, typed: kept (not replaced by the directory's)
    )
    assert code == 0, err
    assert "  num_layers: 2  # the command line (model.num_layers=2)" in out, out
    assert "  name: tiny-gpt  # the command line (model.name=tiny-gpt)" in out, out
    assert f"  rotary_base: 500000  # {hf}/config.json (sft.init_from=hf:{hf})" in out, out


def test_a_users_file_that_contradicts_names_its_line(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conf = (tmp_path / "conf").resolve()
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "mine.yaml").write_text(
        f"# @package _global_\nsft:\n  init_from: hf:{models['llama']}\nmodel:\n  rotary_base: 10000\n"
    )
    code, _, err = cli(
        capsys, tmp_path, "--config-dir", str(conf), "experiment=mine", "run.stages=[data_prep,sft]"
    )
    one_error(
        tmp_path,
        code,
        err,
        "model.rotary_base=10000: contradicts",
        f"[model.rotary_base set at {conf}/experiment/mine.yaml:5 (experiment=mine)",
    )


def test_the_tiny_preset_gives_way_to_the_model(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = models["deep"]
    args = ("experiment=tiny", f"sft.init_from=hf:{deep}", "run.stages=[data_prep,sft]")
    code, out, err = cli(capsys, tmp_path, "--cfg", "job", *args)
    assert code == 0, err
    assert f"  num_layers: 3  # {deep}/config.json (sft.init_from=hf:{deep})" in out, out
    assert f"  hidden_size: 96  # {deep}/config.json" in out, out
    assert "  seq_length: 64  # conf/experiment/tiny.yaml" in out, (
        out
    )  # not an architecture key: the preset's
    plan = subprocess.run(
        [sys.executable, "-m", "pipeline.plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert plan.returncode == 0 and "deep" in plan.stdout, plan.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["model.num_layers=6", "sft.parallel.pp=3"],
            [
                "sft.parallel.nodes=2:",
                "[sft.parallel.nodes is not set (null, the schema default): its value is derived",
            ],
        ),
        (
            ["sft.parallel.pp=3"],
            [
                "model.num_layers=4",
                "[model.num_layers set at conf/model/tiny.yaml:3 (model=tiny, the default)",
            ],
        ),
        (
            ["experiment=tiny", "sft.parallel.pp=3"],
            ["model.num_layers=2", "[model.num_layers set at conf/experiment/tiny.yaml:12 (experiment=tiny)"],
        ),
        (
            ["experiment=tiny", "sft.parallel.tp=3"],
            ["model.num_attention_heads=4", "conf/experiment/tiny.yaml:14 (experiment=tiny)"],
        ),
        (
            ["cluster=gpu_ib", "run.dry_run=true", "cluster.time_min=2"],
            [
                "cluster.signal_delay_s=180",
                "[cluster.signal_delay_s set at conf/cluster/gpu_ib.yaml:13 (cluster=gpu_ib)",
            ],
        ),
    ],
)
def test_an_error_says_where_a_value_it_names_came_from(
    args: list[str], needles: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, tmp_path, "run.stages=[data_prep,sft]", *args)
    one_error(tmp_path, code, err, *needles)


def test_a_layout_error_names_config_json(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = models["deep"]
    code, _, err = cli(
        capsys,
        tmp_path,
        "experiment=tiny",
        f"sft.init_from=hf:{deep}",
        "run.stages=[data_prep,sft]",
        "sft.parallel.pp=2",
    )
    one_error(
        tmp_path,
        code,
        err,
        "model.num_layers=3 is not divisible",
        f"[model.num_layers set at {deep}/config.json",
    )
