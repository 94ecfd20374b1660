"""The fault accounting of a stage shows save_interval=auto's last choice and the measured goodput (status)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.records.ledger import accounting, measured_goodput
from pipeline.reporting.status import format_accounting


def train(step: int, t: float, compute_s: float) -> dict:
    return {"kind": "train", "step": step, "time": t, "time_data_s": 0.0, "time_fwd_bwd_s": compute_s,
            "time_optimizer_s": 0.0, "time_checkpoint_s": 0.5}  # fmt: skip


def test_goodput_is_training_time_over_wall_time_across_attempts(tmp_path: Path) -> None:
    # 10 steps of 1 s, logged every 5; a resume after 20 s down replays 2 steps: 10 s useful of 40 s
    records = [
        {"kind": "info", "time": 0.0},
        train(5, 6.0, 1.0),
        {"kind": "resume", "time": 26.0, "steps_lost": 2, "down_s": 20.0},
        train(5, 34.0, 1.0),
        train(10, 40.0, 1.0),
    ]
    assert measured_goodput(records) == 10 / 40
    assert measured_goodput(records[:2]) is None, "one train line says nothing yet"
    auto = {"kind": "save_interval", "time": 30.0, "step": 3, "interval": 7, "stall_s": 0.25,
            "step_s": 1.0, "mtbf_h": 2.5, "nodes": 4, "source": "measured"}  # fmt: skip
    path = tmp_path / "stages" / "pretrain" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [*records, auto]))
    acc = accounting(tmp_path, "pretrain")
    assert acc["save_interval"]["interval"] == 7 and acc["goodput"] == 10 / 40
    line = format_accounting(acc, attempts=2)
    assert (
        "save_interval auto: 7 steps (stall 0.25s measured, step 1s, a failure every 2.5h on 4 node(s))"
        in line
    )
    assert "goodput 25.0% measured" in line
