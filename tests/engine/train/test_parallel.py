"""3D parallelism with megatron-core on gloo: every layout trains like one rank, recompute changes nothing,
checkpoints reshard across layouts, and bad layouts fail before any process starts.

Every run is a fresh process group in subprocesses (tests/support/engine_worker.py). The single-rank baseline runs
once per module and saves its initial weights; each layout either loads them or (the layout-invariance
test) initialises on its own and must start from the same weights. Losses are the trainer's global,
token-weighted ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.plan import compose_config  # noqa: E402
from pipeline.schema.errors import ConfigError  # noqa: E402
from tests.support.engine_worker import launch
from tests.support.metrics import FP32_REL, max_rel_delta

MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}
STEPS = 5
BF16_REL = 2e-2
RESHARD_REL = 1e-5
GLOBAL_BATCH = 8


def spec(parallel: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    """A 5-step run of the tiny GPT (dropout off) on 64 synthetic samples: every step sees new data."""
    return {
        "model": dict(MODEL),
        "parallel": {"micro_batch_size": 2, "global_batch_size": GLOBAL_BATCH, **(parallel or {})},
        "stage": {"iters": STEPS, "lr": 3e-3, "min_lr": 3e-4},
        "samples": 64,
        **over,
    }


def world(parallel: dict[str, Any]) -> int:
    return parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)


def losses(result: dict[str, Any]) -> list[float]:
    return [h["loss"] for h in result["history"]]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The single-rank fp32 run and the checkpoint root holding its initial weights."""
    tmp = tmp_path_factory.mktemp("baseline")
    weights = tmp / "weights"
    return launch(1, spec(save_weights=str(weights)), tmp / "run"), weights


def run_like_baseline(
    parallel: dict[str, Any], baseline: tuple[dict[str, Any], Path], tmp: Path
) -> tuple[list[float], list[float]]:
    """(this layout's losses, the baseline's) from the same initial weights."""
    result = launch(world(parallel), spec(parallel, load_weights=str(baseline[1])), tmp)
    return losses(result), losses(baseline[0])


# ---------------------------------------------------------------------------- layouts match one rank

LAYOUTS = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "dp2": {"dp": 2},
    "tp2-pp2": {"tp": 2, "pp": 2},
    "pp2-dp2-distopt": {"pp": 2, "dp": 2, "distributed_optimizer": True},
    "pp2-vpp2": {"pp": 2, "vpp": 2},
}


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank_fp32(layout: str, baseline: tuple[dict, Path], tmp_path: Path) -> None:
    got, want = run_like_baseline(LAYOUTS[layout], baseline, tmp_path)
    delta = max_rel_delta(got, want)
    print(f"{layout} fp32: max relative loss delta over {STEPS} steps = {delta:.2e}")
    assert delta < FP32_REL, (got, want)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_bf16_tp2_pp2_matches_single_rank_fp32(baseline: tuple[dict, Path], tmp_path: Path) -> None:
    got, want = run_like_baseline({"tp": 2, "pp": 2, "precision": "bf16"}, baseline, tmp_path)
    delta = max_rel_delta(got, want)
    print(f"tp2-pp2 bf16: max relative loss delta over {STEPS} steps = {delta:.2e}")
    assert delta < BF16_REL, (got, want)


# ---------------------------------------------------------------------------- layout-invariant initial weights

INIT_LAYOUTS = {
    "pp2": {"pp": 2},
    "pp2-vpp2": {"pp": 2, "vpp": 2},
    "tp2": {"tp": 2},
    "tp2-pp2": {"tp": 2, "pp": 2},
}


def full_weights(root: Path, dest: Path) -> dict[str, Any]:
    """The full (unsharded, layout-free) tensors of a weights checkpoint saved at iteration 0."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(root / "iter_0000000", dest)
    return {k: v for k, v in torch.load(dest, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(INIT_LAYOUTS))
def test_same_initial_weights_and_first_loss_at_any_layout(
    layout: str, baseline: tuple[dict, Path], tmp_path: Path
) -> None:
    """No weights loaded: each layout initialises on its own and starts exactly where one rank starts."""
    par = INIT_LAYOUTS[layout]
    one_step = {**spec()["stage"], "iters": 1}
    result = launch(world(par), spec(par, stage=one_step, save_weights=str(tmp_path / "w")), tmp_path / "run")
    want = full_weights(baseline[1], tmp_path / "baseline.pt")
    got = full_weights(tmp_path / "w", tmp_path / "layout.pt")
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch_equal(got[k], want[k])]
    assert not differ, f"{layout}: initial weights differ from one rank's in {differ}"
    first, base = losses(result)[0], losses(baseline[0])[0]
    print(f"{layout}: first-step loss {first!r} (one rank: {base!r})")
    if "tp" in par:  # tensor parallel sums partial products in another order: last-bit differences only
        assert first == pytest.approx(base, rel=1e-6)
    else:
        assert first == base


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.parametrize(("dim", "stride"), [(0, 1), (1, 1), (0, 2)])
def test_tensor_parallel_shard_is_megatrons_slice_of_the_full_tensor(dim: int, stride: int) -> None:
    """The shard drawn by global name is what megatron's CPU initialisation gives each rank (split, stride)."""
    import torch
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from engine.models.init_weights import _tp_slice, param_seed

    tp, full = 2, torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for rank in range(tp):
        local = list(full.shape)
        local[dim] //= tp
        want = torch.empty(local)
        _initialize_affine_weight_cpu(
            want, 8, 6, local[dim], dim, lambda w: w.copy_(full), stride, rank=rank, world_size=tp
        )
        assert torch.equal(_tp_slice(full, want, rank, tp), want)
    assert param_seed(1234, "decoder.layers.3.mlp.linear_fc1.weight") != param_seed(
        1234, "decoder.layers.2.mlp.linear_fc1.weight"
    )


# ---------------------------------------------------------------------------- activation recompute


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_loss(recompute: str, baseline: tuple[dict, Path], tmp_path: Path) -> None:
    result = launch(1, spec({"recompute": recompute}, load_weights=str(baseline[1])), tmp_path)
    assert result["recompute"] == recompute  # megatron's TransformerConfig really recomputes
    delta = max_rel_delta(losses(result), losses(baseline[0]))
    print(f"recompute={recompute}: max relative loss delta = {delta:.2e}")
    assert delta < 1e-6, (losses(result), losses(baseline[0]))


# ---------------------------------------------------------------------------- resharding checkpoints

SAVED = {"tp": 2, "dp": 2, "distributed_optimizer": True}
RESUME_STEP, LAST_STEP = 5, 6
RESHARD_TARGETS = {
    "tp1-pp2-dp2": {"pp": 2, "dp": 2, "distributed_optimizer": True},
    "tp1-dp4": {"dp": 4, "distributed_optimizer": True},
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """TP2xDP2 (distributed optimizer) trained to step 6, saving at step 5; its result and checkpoint root."""
    tmp = tmp_path_factory.mktemp("tp2dp2")
    root = tmp / "ckpt"
    over = {"stage": {**spec()["stage"], "iters": LAST_STEP}, "ckpt": str(root), "save_interval": RESUME_STEP}
    return launch(world(SAVED), spec(SAVED, **over), tmp / "run"), root


def copy_checkpoint(root: Path, iteration: int, dest: Path) -> Path:
    """A checkpoint root holding only ``iteration`` of ``root`` (as if the job had died right after it)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(root / name, dest / name)
    (dest / "latest").write_text(name + "\n")
    return dest


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", list(RESHARD_TARGETS))
def test_checkpoint_reshards_and_keeps_the_data_position(
    target: str, uninterrupted: tuple[dict, Path], tmp_path: Path
) -> None:
    from megatron.core import dist_checkpointing

    full, root = uninterrupted
    saved = dist_checkpointing.load_common_state_dict(str(root / f"iter_{RESUME_STEP:07d}"))
    assert saved["checkpoint"]["state"]["consumed_samples"] == RESUME_STEP * GLOBAL_BATCH
    ckpt = copy_checkpoint(root, RESUME_STEP, tmp_path / "ckpt")
    par = RESHARD_TARGETS[target]
    over = {"stage": {**spec()["stage"], "iters": LAST_STEP}, "ckpt": str(ckpt)}
    result = launch(world(par), spec(par, **over), tmp_path / "run")
    resumed = result["resumed"]  # the trainer's state right after restoring
    assert (resumed["iteration"], resumed["consumed_samples"]) == (RESUME_STEP, RESUME_STEP * GLOBAL_BATCH)
    (step6,) = result["history"]
    want = full["history"][RESUME_STEP]
    delta = abs(step6["loss"] - want["loss"]) / abs(want["loss"])
    print(f"TP2xDP2 -> {target}: step {LAST_STEP} relative loss delta = {delta:.2e}")
    assert delta < RESHARD_REL, (step6, want)
    assert step6["lr"] == pytest.approx(want["lr"], rel=1e-12)  # the schedule resumed too


# ---------------------------------------------------------------------------- bad layouts, before any process

GPU_CLUSTER = ["cluster.executor=slurm", "cluster.gpus_per_node=8"]
BAD_LAYOUTS = [
    # interleaved 1F1B: micro batches per rank (12 / 4 = 3) must be a multiple of pp=2
    (
        ["pretrain.parallel.pp=2", "pretrain.parallel.vpp=2", "pretrain.parallel.micro_batch_size=4"]
        + ["pretrain.parallel.global_batch_size=12"],
        "pretrain.parallel.global_batch_size=12: the interleaved schedule",
    ),
    (
        ["model.num_query_groups=2", "pretrain.parallel.tp=4"],
        "pretrain.parallel.tp=4: model.num_query_groups",
    ),
    (
        ["model.ffn_hidden_size=510", "pretrain.parallel.tp=4"],
        "pretrain.parallel.tp=4: model.ffn_hidden_size",
    ),
    (
        ["pretrain.parallel.nodes=3", "pretrain.parallel.tp=2", "pretrain.parallel.dp=1"],
        "pretrain.parallel.nodes=3",
    ),
]
CPU_BAD_LAYOUTS = [
    (["pretrain.parallel.tp=4", "pretrain.parallel.nodes=1"], "pretrain.parallel.nodes=1"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_LAYOUTS, ids=[m.split(":")[0] for _, m in BAD_LAYOUTS])
def test_bad_gpu_layout_fails_at_config_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        compose_config([*GPU_CLUSTER, *overrides])
    assert str(e.value).startswith(message), str(e.value)


def test_fp16_is_accepted_on_cpu() -> None:
    """fp16 with dynamic loss scaling trains on CPU ranks too (tests/engine/train/test_precision.py)."""
    assert compose_config(["pretrain.parallel.precision=fp16"]).pretrain.parallel.precision == "fp16"


@pytest.mark.parametrize(("overrides", "message"), CPU_BAD_LAYOUTS, ids=[m for _, m in CPU_BAD_LAYOUTS])
def test_bad_cpu_layout_fails_at_config_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        compose_config(overrides)
    assert str(e.value).startswith(message), str(e.value)
