"""Verification shared by the ranks (engine.checkpoint.integrity.verify_collective, latest.find_latest, load.load_latest).

The two-rank tests run this file as a script on 2 gloo ranks: each rank hashes only its share of a
hand-made checkpoint, and a corrupted file in rank 1's share still makes both ranks skip it (no megatron);
and a resume (the trainer's Checkpointer.restore), whose hashing overlaps the load, finds a corrupted
tensor file of rank 1, loads nothing of it and falls back to the checkpoint before (megatron's
dist_checkpointing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.checkpoint import errors, integrity, latest, layout
from engine.checkpoint import load as ckload
from engine.checkpoint import save as cksave
from tests.support.env import rank_env
from tests.support.timing import scaled

FILES = ("__0_0.distcp", "__1_0.distcp", "rng.rank0.pt", "rng.rank1.pt", "common.pt", ".metadata")


def make_checkpoint(root: Path, iteration: int, size: int = 3000, algo: str = integrity.HASH) -> Path:
    path = root / layout.iter_dir_name(iteration)
    path.mkdir(parents=True)
    for i, name in enumerate(FILES):
        (path / name).write_bytes(bytes((iteration * 7 + i + j) % 251 for j in range(size)))
    files = {name: integrity.file_record(path / name, algo=algo) for name in FILES}
    layout.write_marker(path, {"iteration": iteration, "files": files})
    (root / layout.LATEST).write_text(path.name + "\n")
    return path


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_shares_cover_every_file_once() -> None:
    files = {name: {} for name in (*FILES, "__2_0.distcp", "__3_1.distcp", "rng.rank3.pt")}
    for world in (1, 2, 3):
        shares = [[rel for rel, _ in integrity.share(files, r, world)] for r in range(world)]
        assert sorted(sum(shares, [])) == sorted(files)
    assert [rel for rel, _ in integrity.share(files, 1, 2)] == [
        "__1_0.distcp",
        "__3_1.distcp",
        "rng.rank1.pt",
        "rng.rank3.pt",
    ]


def test_sampled_mode_checks_sampled_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "_HASH_BLOCK", 64)
    path = make_checkpoint(tmp_path, 1, size=64 * 20)  # 20 blocks, 8 sampled: 0, 3, 5, ..., 19
    record = json.loads((path / layout.MARKER).read_text())["files"]["__1_0.distcp"]
    assert (
        sorted(map(int, record["blocks"])) == integrity._sample_blocks(64 * 20) and len(record["blocks"]) == 8
    )
    flip_byte(path / "__1_0.distcp", 64 * 19 + 5)  # in the last block: sampled
    assert "block 19" in integrity.verify(path, mode="sampled")[0]
    flip_byte(path / "__1_0.distcp", 64 * 19 + 5)
    flip_byte(path / "__1_0.distcp", 64 * 1 + 5)  # block 1 is not sampled: only full verification sees it
    assert integrity.verify(path, mode="sampled") == []
    assert integrity.HASH in integrity.verify(path, mode="full")[0]


@pytest.mark.parametrize("mode", ["full", "sampled"])
def test_markers_with_sha256_still_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Checkpoints whose marker records sha256 (written before xxh3_128) verify with sha256."""
    monkeypatch.setattr(integrity, "_HASH_BLOCK", 64)
    path = make_checkpoint(tmp_path, 1, size=64 * 20, algo="sha256")
    record = json.loads((path / layout.MARKER).read_text())["files"]["__1_0.distcp"]
    assert "sha256" in record and integrity.HASH not in record
    assert integrity.verify(path, mode=mode) == []
    flip_byte(path / "__1_0.distcp", 64 * 19 + 5)  # the last block: sampled and hashed in full
    problem = integrity.verify(path, mode=mode)[0]
    assert "sha256" in problem and "__1_0.distcp" in problem


@pytest.mark.dist
def test_two_ranks_verify_their_own_files_and_agree(tmp_path: Path) -> None:
    from pipeline.submit.launch import free_port

    root = tmp_path / "checkpoints"
    make_checkpoint(root, 1)
    newest = make_checkpoint(root, 2)
    flip_byte(newest / "__1_0.distcp", 1500)  # same size: only rank 1's hashing can notice
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(root)],
            env=rank_env(r, 2, port, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=scaled(300))
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        outs.append((json.loads(out.strip().splitlines()[-1]), err))
    (r0, err0), (r1, _) = outs
    assert r0["found"] == r1["found"] == str(root / "iter_0000001")
    corrupt = str(newest / "__1_0.distcp")
    assert corrupt in r1["hashed"] and corrupt not in r0["hashed"]
    assert not any("__1_" in f or "rank1" in f for f in r0["hashed"]), r0["hashed"]
    assert not any("__0_" in f or "rank0" in f or "common" in f for f in r1["hashed"]), r1["hashed"]
    assert (
        f"skipping checkpoint {newest}: {corrupt}: {integrity.HASH}" in err0
    )  # rank 0 reports rank 1's finding


@pytest.mark.dist
def test_resume_verifies_while_loading_and_falls_back(tmp_path: Path) -> None:
    """Rank 1's tensor file of the newest checkpoint corrupted (same size): ``load(verify="full")`` fails
    naming it with nothing loaded on either rank, and the resume loads the checkpoint before."""
    from tests.support.engine_worker import launch

    out = launch(
        2,
        {"root": str(tmp_path / "checkpoints")},
        tmp_path / "work",
        timeout_s=scaled(600),
        script=Path(__file__),
    )
    corrupt = out["corrupt"]
    assert "__1_" in Path(corrupt).name
    for rank, r in enumerate(out["ranks"]):
        assert r["error"].startswith(
            f"refusing to load {Path(corrupt).parent}: {corrupt}: {integrity.HASH}"
        ), r
        assert r["after_error"] == [-1.0], "a tensor of the corrupted checkpoint reached the model"
        assert r["resumed"] == {"iteration": 1, "it": 1} and r["after_resume"] == [1.0], r
        assert (corrupt in r["hashed"]) == (rank == 1), r["hashed"]  # only rank 1 hashes its own file
    log0 = (tmp_path / "work" / "rank0.log").read_text()
    assert f"skipping checkpoint {Path(corrupt).parent}: {corrupt}: {integrity.HASH}" in log0
    for r in out["ranks"]:  # every checkpoint bad
        assert r["restore_1"] is None and r["after_1"] == [-1.0], r  # the only one: verified first, untouched
        assert r["restore_2"].endswith("run the stage again to start from scratch"), r
        assert "no checkpoint verifies (iter_0000002, iter_0000001 failed while loading)" in r["restore_2"], r


def _load_worker(spec: dict) -> dict:
    """Save iterations 1 and 2 (weights all 1.0, then 2.0), corrupt rank 1's tensor file of 2, load, resume."""
    import logging

    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    from engine.checkpoint.manager import Checkpointer
    from engine.runtime import distributed as D

    logging.basicConfig(level=logging.WARNING)
    D.init(1, 1, None, seed=1, threads=1)
    rank, world = D.rank(), D.world_size()

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1 << 16), requires_grad=False)

        def sharded_state_dict(self) -> dict:
            return {"w": ShardedTensor.from_rank_offsets("w", self.w.data, (0, rank, world), replica_id=0)}

        def load_state_dict(self, state: dict, strict: bool = True) -> tuple[list, list]:
            self.w.data.copy_(state["w"])
            return [], []

    chunk, root = Chunk(), Path(spec["root"])
    for it in (1, 2):
        chunk.w.data.fill_(float(it))
        cksave.save(root, it, model_chunks=[chunk], optimizer=None, scheduler=None, state={"it": it})
    newest = root / layout.iter_dir_name(2)
    corrupt = max(newest.glob("__1_*.distcp"), key=lambda p: p.stat().st_size)
    if rank == 1:
        flip_byte(corrupt, corrupt.stat().st_size // 2)
    D.barrier()
    hashed: list[str] = []
    record = integrity.file_record
    integrity.file_record = lambda path, **kw: hashed.append(str(path)) or record(path, **kw)  # type: ignore
    chunk.w.data.fill_(-1.0)
    try:
        ckload.load(newest, model_chunks=[chunk], verify="full")
        error = "loaded"
    except errors.CorruptCheckpoint as e:
        error = str(e)
    after_error = sorted(set(chunk.w.data.tolist()))
    state = Checkpointer(root, 1000).restore([chunk], None, None)
    mine = {
        "error": error,
        "after_error": after_error,
        "resumed": {k: state[k] for k in ("iteration", "it")} if state else None,
        "after_resume": sorted(set(chunk.w.data.tolist())),
        "hashed": [h for h in hashed if Path(h).parent == newest],
        **_all_bad(chunk, root.parent, rank),
    }
    ranks = D.all_gather_object(mine)
    D.shutdown()
    return {"corrupt": str(corrupt), "ranks": ranks}


def _all_bad(chunk: Any, tmp: Path, rank: int) -> dict:
    """Every checkpoint corrupt: one alone is verified before it loads (a clean fresh start); after a failed
    load of a newer one, the resume stops with an error naming them."""
    from engine.checkpoint.manager import Checkpointer
    from engine.runtime import distributed as D

    out: dict[str, Any] = {}
    for n in (1, 2):
        root = tmp / f"all-bad-{n}"
        for it in range(1, n + 1):
            chunk.w.data.fill_(float(it))
            path = cksave.save(root, it, model_chunks=[chunk], optimizer=None, scheduler=None, state={})
            if rank == 1:
                bad = max(path.glob("__1_*.distcp"), key=lambda p: p.stat().st_size)
                flip_byte(bad, bad.stat().st_size // 2)
        D.barrier()
        chunk.w.data.fill_(-1.0)
        try:
            out[f"restore_{n}"] = Checkpointer(root, 1000).restore([chunk], None, None)
        except errors.CheckpointError as e:
            out[f"restore_{n}"] = str(e)
        out[f"after_{n}"] = sorted(set(chunk.w.data.tolist()))
    return out


def _worker(root: str) -> None:
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    hashed: list[str] = []
    record = integrity.file_record

    def spy(path: Path, **kw: object) -> dict:
        hashed.append(str(path))
        return record(path, **kw)  # type: ignore[arg-type]

    integrity.file_record = spy  # type: ignore[assignment]
    found = latest.find_latest(Path(root))
    print(json.dumps({"found": str(found), "hashed": hashed}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1].endswith(".json"):  # launched by engine_worker.launch: the resume test's ranks
        from tests.support.engine_worker import serve

        serve(_load_worker)
    else:
        _worker(sys.argv[1])
