"""``cluster.health.policy=exclude`` without a cluster: the policy needs SLURM (config error naming the key), the
run remembers its excluded nodes (a union), every later sbatch script of the run carries ``--exclude``, status
names them, and the stop they cause is classified a node failure. The real job on the local SLURM cluster:
tests/slurm/test_slurm_health.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime.health import NodesExcluded
from pipeline.records.causes import classify, from_exception
from pipeline.records.ledger import Ledger
from pipeline.reporting.status import format_status, run_status
from pipeline.schema.build import from_dict
from pipeline.schema.errors import ConfigError
from pipeline.submit.launch import sbatch_script


def test_exclude_needs_slurm_and_is_checked_with_the_key_named() -> None:
    cfg = from_dict({"cluster": {"executor": "slurm", "health": {"policy": "exclude"}}})
    assert cfg.cluster.health.policy == "exclude"
    with pytest.raises(
        ConfigError, match=r"cluster\.health\.policy='exclude': needs cluster\.executor=slurm"
    ):
        from_dict({"cluster": {"executor": "local", "health": {"policy": "exclude"}}})


def test_the_run_remembers_its_excluded_nodes_for_every_later_job(tmp_path: Path) -> None:
    cfg = from_dict({"cluster": {"executor": "slurm", "health": {"policy": "exclude"}}})
    ledger = Ledger(tmp_path)
    assert ledger.excluded_nodes() == {} and "--exclude" not in sbatch_script(cfg, "pretrain", tmp_path)
    ledger.exclude_nodes({"node2": "matmul_s 9.00 ms = 3.0x the other nodes' median 3.00 ms"})
    every = ledger.exclude_nodes({"node5": "health check failed: RuntimeError: CUDA error"})
    assert sorted(every) == ["node2", "node5"] == sorted(ledger.excluded_nodes())
    for stage in ("pretrain", "sft"):
        assert "#SBATCH --exclude=node2,node5" in sbatch_script(cfg, stage, tmp_path)
    ledger.update("pretrain", status="completed")
    text = format_status(tmp_path, run_status(tmp_path))
    assert "excluded node: node2 (matmul_s 9.00 ms" in text and "excluded node: node5" in text, text


def test_an_exclusion_is_a_node_failure() -> None:
    e = NodesExcluded({"node2": "matmul_s 9.00 ms = 3.0x the other nodes' median 3.00 ms"})
    cause = classify(from_exception(e))
    assert (cause.name, cause.rule) == ("node_failure", "unhealthy_node")
    assert "node node2: matmul_s 9.00 ms" in cause.detail
