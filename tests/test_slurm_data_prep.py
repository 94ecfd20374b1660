"""data_prep with 2 ranks on 2 nodes of the local SLURM cluster: output byte-identical to 1 rank, with the
ranks meeting through files (data_prep.launcher=files) or as one MPI world (launcher=mpi: srun --mpi=pmi2).

The local cluster's nodes share one host in separate namespaces: MPICH's UCX shared-memory transport cannot
reach across them, so the MPI run sets ``UCX_TLS=tcp`` through the profile's ``cluster.env``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from slurm_helpers import TINY, fail_text, pipeline, run_dirs, wait_settled

from stages.engine.data import read_manifest

pytestmark = pytest.mark.slurm

WORDS = "the a of data rank node shard token merge split blend file line".split()


@pytest.mark.timeout(600)
def test_data_prep_on_two_nodes_byte_identical_to_one_rank(cluster, tmp_path):
    rng = np.random.default_rng(0)
    for f in range(3):
        lines = [f"f{f} {i}: " + " ".join(rng.choice(WORDS, size=20)) for i in range(120)]
        (tmp_path / f"c{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    common = [
        *TINY,
        "run.stages=[data_prep]",
        "data.corpus=sources",
        f"data.sources=[{{path: '{tmp_path}/*.jsonl'}}]",
        "data.shard_mb=0.01",
        "data_prep.threads=1",
    ]
    outs = []
    for n, launcher in ((1, "files"), (2, "files"), (2, "mpi")):
        extra = ["+cluster.env.UCX_TLS=tcp"] if launcher == "mpi" else []
        r = pipeline(
            cluster,
            *common,
            *extra,
            f"run.root={tmp_path / f'r{n}{launcher}'}",
            f"data_prep.parallel.dp={n}",
            f"data_prep.parallel.nodes={n}",
            f"data_prep.launcher={launcher}",
        )
        assert r.returncode == 0, fail_text(r)
        [run_dir] = run_dirs(r.stdout)
        views = wait_settled(run_dir, ["data_prep"], deadline_s=300)
        logs = "".join(p.read_text()[-3000:] for p in sorted(run_dir.rglob("*_log.err")))
        assert views["data_prep"].state == "completed", (launcher, views, logs)
        (d,) = [p for p in (tmp_path / f"r{n}{launcher}" / ".data").glob("data_prep-*") if p.is_dir()]
        assert json.loads((d / "outputs.json").read_text())["ranks"] == n
        outs.append(d)
        names = sorted(read_manifest(outs[0])["files"]) + ["manifest.json"]
        assert any(n.startswith("text_train-") for n in names)
        for name in names:
            assert (outs[0] / name).read_bytes() == (d / name).read_bytes(), (name, launcher)
    script = next((run_dir / "jobs" / "data_prep").rglob("*_submission.sh")).read_text()
    assert "--mpi=pmi2" in script, script
