"""The ranks of data prep: one process, an MPI world (mpiexec / srun --mpi, mpi4py imported only then), or ranks
started by the job launcher without MPI that meet through files (``FileWorld``, corpus=sources)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from engine.context import DistEnv, StageContext
from pipeline.records.files import atomic_write_bytes
from pipeline.records.files import atomic_write_text as _atomic_write
from pipeline.schema.config import PipelineConfig

T = TypeVar("T")


class World:
    """One process, or the MPI world when launched by mpiexec (mpi4py imported only then)."""

    folder: Path | None = None
    """Where the ranks of a FileWorld meet (None: they meet through MPI, or there is one)."""

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank() if comm else 0
        self.size = comm.Get_size() if comm else 1

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's contiguous slice [lo, hi) of ``n`` items."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def on_root(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and give its result (or its error) to every rank."""
        if self.size == 1:
            return fn()
        result: tuple[str, Any] = ("ok", None)
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except Exception as e:
                result = ("error", e)
        result = self._from_root(result)
        if result[0] == "error":
            raise result[1]
        return result[1]

    def _from_root(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        return self.comm.bcast(value, root=0)

    def sum(self, value: int) -> int:
        return value if self.comm is None else int(self.comm.allreduce(value))

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def allgather(self, value: Any) -> list[Any]:
        return [value] if self.comm is None else list(self.comm.allgather(value))


def _job_nonce(dist: DistEnv) -> str:
    """Names one launch of the job (every rank sees the same rendezvous address and port)."""
    return f"{dist.master_addr}-{dist.master_port}".replace("/", "_")


class FileWorld(World):
    """N ranks started by the job launcher without MPI (local executor tasks, srun tasks): they meet through
    files in a folder every rank sees (the stage's output directory, on a shared filesystem on clusters)."""

    POLL_S = 0.05

    def __init__(self, rank: int, size: int, folder: Path) -> None:
        super().__init__()
        self.rank, self.size, self.folder, self._dir, self._n = rank, size, folder, folder, 0
        folder.mkdir(parents=True, exist_ok=True)

    def _put(self, name: str, value: Any) -> None:
        import pickle

        atomic_write_bytes(self._dir / name, pickle.dumps(value))

    def _get(self, name: str) -> Any:
        import pickle

        path = self._dir / name
        while not path.is_file():
            time.sleep(self.POLL_S)
        return pickle.loads(path.read_bytes())

    def _exchange(self, value: Any) -> list[Any]:
        self._n += 1
        self._put(f"{self._n}-{self.rank}", value)
        return [self._get(f"{self._n}-{r}") for r in range(self.size)]

    def _from_root(self, value: Any) -> Any:
        return self._exchange(value)[0]

    def sum(self, value: int) -> int:
        return int(sum(self._exchange(value)))

    def barrier(self) -> None:
        self._exchange(None)

    def allgather(self, value: Any) -> list[Any]:
        return self._exchange(value)


_MPI_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def under_mpi() -> bool:
    """Started by an MPI launcher with more than one rank (its own contract: mpi4py reads the same)."""
    return any(int(os.environ.get(k, "1") or 1) > 1 for k in _MPI_ENV)


def needs_mpiexec(cfg: PipelineConfig) -> bool:
    """data_prep.launcher=mpi outside SLURM: this single job task starts the MPI world itself."""
    dp = cfg.data_prep.parallel.dp or 1
    return cfg.data_prep.launcher == "mpi" and dp > 1 and cfg.cluster.executor != "slurm" and not under_mpi()


def mpiexec_path() -> str:
    """The venv's mpiexec (pip ``mpich`` wheel, next to the interpreter), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.is_file() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError(
            "data_prep.launcher=mpi: no mpiexec next to the interpreter nor on PATH; install the `mpich` "
            "package (pip install mpich) or set data_prep.launcher=files"
        )
    return found


def run_under_mpiexec(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    """``mpiexec -n dp python -m stages.data_prep``: the ranks form one MPI world (mpi4py); rank 0 writes
    the stage's outputs to a file this process returns."""
    out = Path(ctx.out_dir)
    work = out.parent / f".{out.name}.mpi-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        (work / "config.json").write_text(json.dumps(cfg.to_dict()))
        args = {"run_dir": str(ctx.run_dir), "stage": ctx.stage, "out_dir": str(out)}
        (work / "context.json").write_text(json.dumps(args))
        n = str(cfg.data_prep.parallel.dp)
        cmd = [mpiexec_path(), "-n", n, sys.executable, "-m", "stages.data_prep", str(work)]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        print(f"[data_prep] launching {n} MPI ranks: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, env=env, check=False).returncode
        result = work / "result.json"
        if rc != 0 or not result.is_file():
            raise RuntimeError(f"data_prep under mpiexec failed (exit {rc}): see the ranks' output above")
        return dict(json.loads(result.read_text()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def mpi_rank_main(work: Path, main: Callable[[PipelineConfig, StageContext], dict[str, Any]]) -> None:
    """One rank started by ``run_under_mpiexec``: runs the stage's ``main`` on the config and context saved there."""
    from pipeline.schema.build import from_dict

    cfg = from_dict(json.loads((work / "config.json").read_text()))
    a = json.loads((work / "context.json").read_text())
    ctx = StageContext(run_dir=Path(a["run_dir"]), stage=a["stage"], out_dir=Path(a["out_dir"]))
    out = main(cfg, ctx)
    if make_world(cfg, None).rank == 0:
        _atomic_write(work / "result.json", json.dumps(out, default=str))


def make_world(cfg: PipelineConfig, dist: DistEnv | None, out: Path | None = None) -> World:
    """This process's data-prep world: MPI's, else the launcher's ranks meeting through files under ``out``
    (``dist``: the job's place from StageContext.dist; None: one process)."""
    job_world = dist.world_size if dist else 1
    mpi = under_mpi()
    if not mpi and dist is not None and job_world > 1 and cfg.data.corpus == "sources" and out is not None:
        return FileWorld(dist.rank, job_world, out / f".world-{_job_nonce(dist)}")
    if not mpi:
        if (cfg.data_prep.parallel.dp or 1) > 1 and job_world == 1:
            warnings.warn(
                "data_prep.parallel.dp > 1 but not launched by mpiexec: tokenizing on one rank", stacklevel=2
            )
        return World()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return World(comm if comm.Get_size() > 1 else None)
