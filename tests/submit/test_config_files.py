"""Mistakes inside the user's own YAML files, through the CLI: whether the directory comes with ``--config-dir``
or ``hydra.searchpath``, a tab, a bad indent, an open quote, a wrong type, an unknown key (also inside one
``data.sources`` item), a bad value or a broken relation is one line ``config error: <key>=<value>: ... [<key>
set at <file>:<line> (<group>=<option>)]``, exit 2, nothing written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.__main__ import main
from tests.support.env import REPO
from tests.support.timing import scaled

LINE = re.compile(r"^config error: \S+=.*: .+$")

GLOBAL = "# @package _global_\n"
FILES: dict[str, str] = {
    "experiment/tab.yaml": GLOBAL + "model:\n\tnum_layers: 2\n",
    "experiment/indent.yaml": GLOBAL + "pretrain:\n  iters: 6\n    lr: 0.1\n",
    "experiment/quote.yaml": GLOBAL + "run:\n  name: 'tiny\npretrain:\n  iters: 6\n",
    "experiment/badtype.yaml": GLOBAL + "run:\n  name: x\npretrain:\n  iters: many\n",
    "experiment/badkey.yaml": GLOBAL + "pretrain:\n  lrr: 0.1\n",
    "experiment/baddomain.yaml": GLOBAL + "sft:\n  clip_grad: -1\n",
    "experiment/relation.yaml": GLOBAL + "pretrain:\n  iters: 5\n  warmup_iters: 5\n",
    "experiment/itemkey.yaml": GLOBAL
    + "data:\n  corpus: sources\n  sources:\n    - path: a.txt\n    - path: b.jsonl\n      txt_field: body\n",
    "experiment/itemvalue.yaml": GLOBAL
    + "data:\n  corpus: sources\n  sources:\n    - path: a.txt\n      weight: -2\n",
    "experiment/interp.yaml": GLOBAL + "run:\n  name: ${nowhere}\n",
    "model/mine.yaml": "name: mine\nnum_layrs: 2\n",
    "parallel/mine.yaml": "tp: two\n",
}

# choice -> (text that must be in the line, the file and line named)
CASES: dict[str, tuple[list[str], str]] = {
    "experiment=tab": (["model.num_layers=2", "not valid YAML", "tabs"], "experiment/tab.yaml:3"),
    "experiment=indent": (
        ["pretrain.lr=0.1", "not valid YAML", "indented deeper"],
        "experiment/indent.yaml:4",
    ),
    "experiment=quote": (["run.name='tiny", "never closed"], "experiment/quote.yaml:3"),
    "experiment=badtype": (["pretrain.iters=many", "an integer >= 1"], "experiment/badtype.yaml:5"),
    "experiment=badkey": (["pretrain.lrr=0.1", "did you mean 'pretrain.lr'"], "experiment/badkey.yaml:3"),
    "experiment=baddomain": (["sft.clip_grad=-1", ">= 0"], "experiment/baddomain.yaml:3"),
    "experiment=relation": (["pretrain.warmup_iters=5", "< iters=5"], "experiment/relation.yaml:4"),
    "experiment=itemkey": (
        [
            "data.sources[1].txt_field=body",
            "did you mean 'data.sources[1].text_field'",
            "keys of data.sources[1]",
        ],
        "experiment/itemkey.yaml:7",
    ),
    "experiment=itemvalue": (["data.sources[0].weight=-2", "> 0"], "experiment/itemvalue.yaml:6"),
    "experiment=interp": (["run.name=", "nowhere"], "experiment/interp.yaml:3"),
    "model=mine": (
        ["model.num_layrs=2", "did you mean 'model.num_layers'", "(model=mine)"],
        "model/mine.yaml:2",
    ),
    "parallel@sft.parallel=mine": (
        ["sft.parallel.tp=two", "an integer >= 1", "(parallel@sft.parallel=mine)"],
        "parallel/mine.yaml:1",
    ),
}


@pytest.fixture(scope="module")
def conf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("myconf").resolve()
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


def _run(
    capsys: pytest.CaptureFixture[str], root: Path, *args: str, stages: str = "[data_prep]"
) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main([*args, f"run.root={root}", f"run.stages={stages}", "run.dry_run=true"])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
@pytest.mark.parametrize("choice", list(CASES))
def test_mistake_in_a_yaml_file_is_one_line_with_file_and_line(
    choice: str, how: str, conf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ["--config-dir", str(conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{conf}]"]
    code, err = _run(capsys, tmp_path / "runs", *where, choice)
    needles, at = CASES[choice]
    assert code == 2, err
    assert len(err) == 1 and LINE.match(err[0]), err
    for n in [*needles, f"{conf}/{at}"]:
        assert n in err[0], (n, err)
    assert not (tmp_path / "runs").exists(), "a config error must write nothing"


def test_a_mistake_in_a_shipped_preset_names_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value of a shipped file that a command-line override makes invalid: the error says where it came from."""
    code, err = _run(
        capsys, tmp_path / "runs", "experiment=tiny", "pretrain.warmup_iters=6", stages="[data_prep,sft]"
    )
    assert code == 2 and len(err) == 1, err
    assert "pretrain.warmup_iters=6: must be < iters=6" in err[0], err
    code, err = _run(
        capsys, tmp_path / "runs", "experiment=tiny", "sft.seq_length=100", stages="[data_prep,sft]"
    )
    assert (
        code == 2 and "[model.seq_length set at conf/experiment/tiny.yaml:15 (experiment=tiny)]" in err[0]
    ), err


def test_config_dir_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, tmp_path / "runs", "--config-dir", str(tmp_path / "nope"), "experiment=tiny")
    assert code == 2 and len(err) == 1 and f"--config-dir={tmp_path / 'nope'}: no such directory" in err[0], (
        err
    )


def test_yaml_mistake_through_a_fresh_interpreter(conf: Path, tmp_path: Path) -> None:
    """The console command, not only main(): no traceback, one line, exit 2."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "--config-dir",
            str(conf),
            "experiment=tab",
            f"run.root={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "experiment/tab.yaml:3:1" in err[0], r.stderr[-2000:]
