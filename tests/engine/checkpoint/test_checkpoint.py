"""Checkpoint commit protocol, verification, resume policy and retention (engine.checkpoint: save, load, latest, integrity).

Saving needs torch.distributed and the CPU compatibility layer (which patches torch), so saves and loads run
in a worker subprocess: this file run as a script (see ``_worker`` at the bottom). The checks on the files
(verify, find_latest, corruption) run here, in the test process, as the resume logic would.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint import errors, integrity, latest, layout, writer
from engine.checkpoint import load as ckload
from engine.checkpoint import save as cksave
from engine.checkpoint import state as ckstate
from tests.support.env import REPO, python_env

WORKER_TIMEOUT_S = 300


def run_worker(*args: str, expect_rc: int = 0) -> dict:
    """Run this file as a worker; returns the JSON object it prints last."""
    proc = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
        cwd=REPO,
        env=python_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == expect_rc, f"worker {args} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------- tests


def test_save_commits_marker_and_latest_then_loads(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    saved = run_worker("save", str(root), "--iters", "1", "2")
    assert names(root) == ["iter_0000001", "iter_0000002", "latest"]
    assert (root / "latest").read_text() == "iter_0000002\n"
    path = root / "iter_0000002"
    meta = json.loads((path / layout.MARKER).read_text())
    on_disk = {p.name for p in path.iterdir()} - {layout.MARKER}
    assert set(meta["files"]) == on_disk
    assert {"common.pt", "metadata.json", ".metadata", "__0_0.distcp", "rng.rank0.pt"} <= on_disk
    assert meta["iteration"] == 2 and meta["final"] is False and meta["world_size"] == 1
    assert integrity.verify(path) == []
    assert latest.find_latest(root) == path

    loaded = run_worker("load", str(path))
    assert loaded["state"] == {"consumed_samples": 16, "iteration": 2, "torch_threads": 1}
    assert loaded["weight"] == 2.0
    assert loaded["draw_after_load"] == saved["draw_after_save"]["2"], "RNG state not restored"


def test_async_save_commits_in_finalize(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    out = run_worker("save", str(root), "--iters", "1", "2", "3", "--final-at", "3", "--async-save")
    assert out["committed_at_return"] == [False, False, True]  # the final save is synchronous
    assert names(root) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    assert all(integrity.verify(root / f"iter_000000{i}") == [] for i in (1, 2, 3))
    loaded = run_worker("load", str(root / "iter_0000002"))
    assert loaded["weight"] == 2.0 and loaded["state"]["iteration"] == 2


def test_state_must_hold_plain_values() -> None:
    import torch

    with pytest.raises(errors.CheckpointError, match=r"state\['rng'\]: .*saved per rank"):
        ckstate.plain_state({"consumed_samples": 8, "rng": {"torch": torch.zeros(2)}})


def test_crash_before_marker_leaves_only_a_temp_dir(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    out = run_worker("save", str(root), "--iters", "1", "2", "--crash-at", "2", expect_rc=3)
    assert "simulated crash" in out["error"] and "iter_0000002" in out["error"]
    tmp = [n for n in names(root) if n.startswith("tmp.iter_0000002.")]
    assert len(tmp) == 1 and "iter_0000002" not in names(root)
    assert (root / "latest").read_text() == "iter_0000001\n"
    assert integrity.verify(root / tmp[0])[0].endswith("missing (the save did not complete)")

    with caplog.at_level(logging.WARNING, logger=latest.__name__):
        assert latest.find_latest(root) == root / "iter_0000001"
    assert tmp[0] in caplog.text and "did not finish" in caplog.text
    assert (root / tmp[0]).is_dir(), "find_latest must never delete"


def test_truncated_and_flipped_files_are_detected_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    run_worker("save", str(root), "--iters", "1", "2", "3", "--keep-last", "5")
    truncated = root / "iter_0000003" / "__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:-7])
    flipped = root / "iter_0000002" / "common.pt"
    flip_byte(flipped, flipped.stat().st_size // 2)

    assert integrity.verify(root / "iter_0000003") == [
        f"{truncated}: size {truncated.stat().st_size} bytes, "
        f"the marker records {truncated.stat().st_size + 7}"
    ]
    problems = integrity.verify(root / "iter_0000002")
    assert len(problems) == 1 and problems[0].startswith(f"{flipped}: {integrity.HASH} ")
    assert integrity.verify(root / "iter_0000002", checksums=False) == []

    with caplog.at_level(logging.WARNING, logger=latest.__name__):
        assert latest.find_latest(root) == root / "iter_0000001"
    assert str(truncated) in caplog.text and str(flipped) in caplog.text
    assert "latest" in caplog.text  # the pointer names iter_0000003, which failed
    assert names(root) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]


def test_retention_keeps_last_and_final(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "iter_0000000").mkdir(parents=True)  # no marker: not ours to delete
    (root / "tmp.iter_0000001.dead").mkdir()  # a crashed save: kept for inspection
    run_worker(
        "save", str(root), "--iters", "1", "2", "3", "3", "4", "5", "6", "--keep-last", "2", "--final-at", "3"
    )
    assert names(root) == [
        "iter_0000000",
        "iter_0000003",
        "iter_0000005",
        "iter_0000006",
        "latest",
        "tmp.iter_0000001.dead",
    ]
    assert json.loads((root / "iter_0000003" / layout.MARKER).read_text())["final"] is True
    assert (
        integrity.verify(root / "iter_0000003") == []
    )  # re-saved once: the replaced copy is gone, the new one good
    assert latest.find_latest(root) == root / "iter_0000006"


def test_verify_and_find_latest_on_hand_made_dirs(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert latest.find_latest(root) is None
    good = root / "iter_0000004"
    good.mkdir(parents=True)
    (good / "a.bin").write_bytes(b"abc")
    layout.write_marker(good, {"iteration": 4, "files": {"a.bin": integrity.file_record(good / "a.bin")}})
    assert integrity.verify(good) == [] and latest.find_latest(root) == good

    bad_marker = root / "iter_0000005"
    bad_marker.mkdir()
    (bad_marker / layout.MARKER).write_text("{not json")
    assert "unreadable" in integrity.verify(bad_marker)[0]
    wrong_iter = root / "iter_0000006"
    wrong_iter.mkdir()
    layout.write_marker(wrong_iter, {"iteration": 7, "files": {}})
    assert "does not match the name" in integrity.verify(wrong_iter)[0]
    (good / "a.bin").unlink()
    assert integrity.verify(good) == [f"{good / 'a.bin'}: missing"]
    assert latest.find_latest(root) is None

    cksave.mark_final(wrong_iter)
    assert json.loads((wrong_iter / layout.MARKER).read_text())["final"] is True


def test_load_refuses_an_uncommitted_dir(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp.iter_0000001.abcd"
    tmp.mkdir()
    with pytest.raises(errors.CheckpointError, match=r"refusing to load .*COMPLETE.json: missing"):
        ckload.load(tmp, model_chunks=[])
    with pytest.raises(errors.CheckpointError, match="refusing to load"):
        ckload.load_weights(tmp, [])


def test_file_owner_rule() -> None:
    assert layout.owner("__3_0.distcp") == 3
    assert layout.owner("rng.rank12.pt") == 12
    assert layout.owner("common.pt") == layout.owner(".metadata") == layout.owner("metadata.json") == 0


# ---------------------------------------------------------------------------- worker (a subprocess)


def _worker(argv: list[str]) -> int:
    """``save ROOT --iters ...`` or ``load PATH``: a 1-rank gloo process with a one-tensor "model"."""
    import argparse
    import tempfile

    import torch
    import torch.distributed as dist

    from engine.runtime import cpu_compat

    parser = argparse.ArgumentParser()
    parser.add_argument("cmd", choices=["save", "load"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--iters", type=int, nargs="*", default=[])
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--final-at", type=int, default=None)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="ckpt-test-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cpu_compat.install()
    try:
        return _worker_save(args) if args.cmd == "save" else _worker_load(args)
    finally:
        dist.destroy_process_group()


def _make_chunk(value: float):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    class OneTensor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((64, 8), value))

        def sharded_state_dict(self) -> dict:
            return {"w": ShardedTensor.from_rank_offsets("test.w", self.w, replica_id=0)}

    return OneTensor()


def _worker_save(args) -> int:
    import torch

    draws, pending = {}, []
    for it in args.iters:
        if it == args.crash_at:
            cksave.write_marker = _crash
        chunk = _make_chunk(float(it))
        try:
            path = cksave.save(
                args.path,
                it,
                model_chunks=[chunk],
                optimizer=None,
                scheduler=None,
                state={"consumed_samples": it * 8},
                keep_last=args.keep_last,
                async_save=args.async_save,
                final=it == args.final_at,
            )
        except errors.CheckpointError as e:
            print(json.dumps({"error": str(e)}))
            return 3
        draws[it] = torch.rand(1).item()
        with torch.no_grad():
            chunk.w.fill_(-5.0)  # training goes on: an async save must still hold the values of the call
        pending.append(path.is_dir())
    writer.finalize_async(blocking=True)
    print(json.dumps({"draw_after_save": draws, "committed_at_return": pending}))
    return 0


def _crash(directory, *args, **kwargs) -> None:
    """The process dies while writing the marker (a save that *fails* with an error removes its temp dir)."""
    print(json.dumps({"error": f"simulated crash writing the marker of {directory}"}), flush=True)
    os._exit(3)


def _worker_load(args) -> int:
    import torch

    chunk = _make_chunk(-1.0)
    torch.manual_seed(999)
    state = ckload.load(args.path, model_chunks=[chunk])
    w = chunk.w.detach()
    assert bool((w == w.flatten()[0]).all())
    print(
        json.dumps({"state": state, "weight": w.flatten()[0].item(), "draw_after_load": torch.rand(1).item()})
    )
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
