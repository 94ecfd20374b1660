"""scripts/compare_runs.py: two run directories are the same run bit for bit, or the differences are named."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_runs.py"


def _run_dir(root: Path, loss: float = 2.5, elapsed: float = 1.0, shard: bytes = b"\x00\x01") -> Path:
    stage = root / "stages" / "pretrain"
    ck = stage / "checkpoints" / "iter_0000002"
    ck.mkdir(parents=True)
    (stage / "checkpoints" / "latest").write_text("iter_0000002")
    (ck / "__0_0.distcp").write_bytes(shard)
    (ck / "COMPLETE.json").write_text(json.dumps({"time": elapsed}))
    (ck / ".metadata").write_bytes(
        pickle.dumps(SimpleNamespace(state_dict_metadata={"w": "size 2"}, id=elapsed))
    )
    rows = [{"kind": "train", "step": 2, "loss": loss, "elapsed_s": elapsed, "time": elapsed}]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True)


def test_same_run_with_other_timings_is_identical(tmp_path: Path) -> None:
    out = _compare(_run_dir(tmp_path / "a"), _run_dir(tmp_path / "b", elapsed=7.0))
    assert out.returncode == 0, out.stdout
    assert "pretrain      identical" in out.stdout


def test_a_changed_shard_or_loss_is_named(tmp_path: Path) -> None:
    a = _run_dir(tmp_path / "a")
    out = _compare(a, _run_dir(tmp_path / "b", shard=b"\x00\x02"))
    assert out.returncode == 1 and "__0_0.distcp: bytes differ" in out.stdout
    out = _compare(a, _run_dir(tmp_path / "c", loss=2.6))
    assert out.returncode == 1 and "metrics.jsonl" in out.stdout
