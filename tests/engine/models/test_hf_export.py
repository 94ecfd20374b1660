"""Hugging Face models out: import (under TP2 / PP2) -> checkpoint -> export gives bit-identical tensors, the
export verifies itself against transformers, and a failed check leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine_worker import launch
from tests.support.env import REPO as ROOT
from tests.support.hf_models import make
from tests.support.timing import scaled

WORKER = ROOT / "tests" / "support" / "hf_worker.py"

EXPORT = """
import json, sys
from pathlib import Path
from engine.checkpoint.latest import find_latest
from engine.convert.hf_export import export
from pipeline.schema.hf_arch import model_config
hf, root, out, tol = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
m = export(model_config(hf, seq_length=32), find_latest(root, collective=False), out, hf, tolerance=tol,
           max_shard_bytes=200_000)
print(json.dumps(m["check"]))
"""


def run_export(hf: Path, root: Path, out: Path, tol: float = 1e-4) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", EXPORT, str(hf), str(root), str(out), str(tol)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


def tensors(d: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


@pytest.mark.dist
@pytest.mark.parametrize(
    "kind,layout", [("llama3", {"tp": 2}), ("qwen2", {"pp": 2})], ids=["llama3-tp2", "qwen2-pp2"]
)
def test_import_export_roundtrip(kind: str, layout: dict[str, int], tmp_path: Path) -> None:
    hf = make(kind, tmp_path / kind)
    root = tmp_path / "ckpt"
    spec = {"hf_dir": str(hf), "parallel": layout, "tokens": [[1, 2, 3, 4]], "save_weights": str(root)}
    launch(layout.get("tp", 1) * layout.get("pp", 1), spec, tmp_path / "run", script=WORKER)
    out = tmp_path / "export"
    done = run_export(hf, root, out)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["check"]["passed"] and manifest["check"]["max_rel_diff"] < 1e-5, manifest["check"]
    assert len(manifest["shards"]) > 1 and (out / "model.safetensors.index.json").is_file()  # sharded
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f
    want, got = tensors(hf), tensors(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name  # type: ignore[attr-defined]
        assert bool((got[name] == t).all()), name  # type: ignore[operator]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "<|user|>hi<|assistant|>"
    )
    # a check that cannot pass: nothing is left at the destination
    failed = run_export(hf, root, tmp_path / "never", tol=0.0 - 1.0)
    assert failed.returncode != 0 and "differ" in failed.stderr
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".tmp.never*"))
