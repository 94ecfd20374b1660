"""The fused attention (engine.models.attention.SDPAttention) against megatron's unfused DotProductAttention,
and SFT packing (sft_source(pack=True) + the block-diagonal mask) against one example per row.

Both run this file as a worker (fresh process per run: the CPU compatibility layer patches torch):
- 1 rank and TP2: same weights, GQA (4 heads, 2 groups); per-token losses and gradients of both modules
  agree within fp32 tolerance, with the causal mask and with a packed block-diagonal mask.
- the local spec's linears (F.linear where megatron's linear function is a plain product) against megatron's
  own, 1 rank and TP2: losses and gradients agree within fp32 tolerance.
- packing: every example's summed response loss is the same packed (several per row, positions restarting,
  attention kept per example) as alone in a row, for learned absolute positions and for RoPE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.timing import scaled

VOCAB, SEQ = 96, 32
TOL = 2e-5


def _run(world: int, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from tests.support.engine_worker import launch

    return launch(world, spec, tmp, timeout_s=scaled(600), script=Path(__file__))


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_equals_unfused_attention(tp: int, tmp_path: Path) -> None:
    out = _run(tp, {"tp": tp, "check": "attention"}, tmp_path)
    for case in ("causal", "packed"):
        assert out[case]["loss_diff"] < TOL * out[case]["loss_scale"], out
        assert out[case]["grad_diff"] < TOL * out[case]["grad_scale"], out
        assert out[case]["loss_scale"] > 0 and out[case]["grad_scale"] > 0


@pytest.mark.dist
@pytest.mark.parametrize(("tp", "tie"), [(1, True), (2, True), (1, False)])
def test_local_linears_equal_megatrons(tp: int, tie: bool, tmp_path: Path) -> None:
    """The local spec's F.linear fast path (engine.models.linear) against megatron's linear function, the
    output layer's too (with the embedding's weight when tied, its own when not)."""
    out = _run(tp, {"tp": tp, "tie": tie, "check": "linear"}, tmp_path)
    assert out["fast_linears"] == 4 * 2 + 1  # qkv, proj, fc1, fc2 of both layers; the output layer
    assert out["output_weight"] == ("tied" if tie else "own")
    assert out["loss_diff"] < TOL * out["loss_scale"], out
    assert out["grad_diff"] < TOL * out["grad_scale"], out
    assert out["loss_scale"] > 0 and out["grad_scale"] > 0


@pytest.mark.dist
def test_packing_changes_no_examples_loss(tmp_path: Path) -> None:
    out = _run(1, {"tp": 1, "check": "packing"}, tmp_path)
    for pos, r in out.items():
        assert r["rows_packed"] < r["rows_unpacked"], (pos, r)  # several examples share a row
        assert len(r["packed"]) == len(r["unpacked"]) == r["examples"]
        for a, b in zip(r["packed"], r["unpacked"], strict=True):
            assert a == pytest.approx(b, rel=TOL, abs=TOL), (pos, r)


# ---------------------------------------------------------------------------- worker


class _FakeTokenizer:
    """Just what sft_source needs: special tokens and encode_batch (text "<|user|>3 17 5" -> ids [2, 3, 17, 5])."""

    eod, pad = 0, 1
    special_tokens = {
        "eod": "<|endoftext|>",
        "pad": "<|pad|>",
        "user": "<|user|>",
        "assistant": "<|assistant|>",
    }

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            for i, token in enumerate(self.special_tokens.values()):
                text = text.replace(token, f" {i} ")
            out.append([int(t) for t in text.split()])
        return out


def _models(tp: int, position: str, tie: bool = True) -> dict[str, Any]:
    from engine.models.gpt import build_model, unwrap
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.sections import ParallelConfig

    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2}
    base |= {"seq_length": SEQ, "position_embedding": position, "tie_embeddings": tie}
    models = {}
    for backend in ("unfused", "sdpa"):
        D.set_seed(1234)
        chunk = build_model(ModelConfig(**base, attention_backend=backend), ParallelConfig(tp=tp), VOCAB)[0]
        models[backend] = chunk
    unwrap(models["sdpa"]).load_state_dict(unwrap(models["unfused"]).state_dict())
    return models


def _attention(tp: int) -> dict[str, Any]:
    import torch

    from engine.models.attention import SDPAttention
    from engine.models.gpt import unwrap
    from engine.train.steps import _per_token_nll

    models = _models(tp, "learned_absolute")
    assert any(isinstance(m, SDPAttention) for m in models["sdpa"].modules())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, VOCAB, (3, SEQ), generator=gen)
    labels = torch.randint(4, VOCAB, (3, SEQ), generator=gen)
    segments = torch.tensor([[0] * 10 + [1] * 12 + [2] * 10, [0] * 32, [0] * 5 + [1] * 27])
    positions = torch.cat([torch.arange(n) for n in (10, 12, 10, 32, 5, 27)]).reshape(3, SEQ)
    out = {}
    for case, packed in (("causal", None), ("packed", {"segment_ids": segments, "position_ids": positions})):
        losses, grads = {}, {}
        for name, model in models.items():
            model.zero_grad_buffer()  # megatron DDP accumulates into param.main_grad
            nll = _per_token_nll(unwrap(model), tokens, labels, packed)
            nll.sum().backward()
            losses[name] = nll.detach()
            grads[name] = torch.cat([p.main_grad.flatten() for p in model.parameters()])
        out[case] = {
            "loss_diff": float((losses["sdpa"] - losses["unfused"]).abs().max()),
            "loss_scale": float(losses["unfused"].abs().max()),
            "grad_diff": float((grads["sdpa"] - grads["unfused"]).abs().max()),
            "grad_scale": float(grads["unfused"].abs().max()),
        }
    return out


def _linear(tp: int, tie: bool) -> dict[str, Any]:
    """Losses and gradients of one model with the local spec's linears, then with megatron's (same weights)."""
    import torch

    from engine.models import linear
    from engine.models.gpt import unwrap
    from engine.train.steps import _per_token_nll

    model = _models(tp, "learned_absolute", tie)["sdpa"]
    fast = [m for m in model.modules() if type(m) in (linear.ColumnParallelLinear, linear.RowParallelLinear)]
    output_weight = "own" if unwrap(model).output_layer.weight is not None else "tied"
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, VOCAB, (3, SEQ), generator=gen)
    labels = torch.randint(4, VOCAB, (3, SEQ), generator=gen)
    losses, grads = [], []
    for _ in ("fast", "megatron"):
        model.zero_grad_buffer()
        nll = _per_token_nll(unwrap(model), tokens, labels, None)
        nll.sum().backward()
        losses.append(nll.detach())
        grads.append(torch.cat([p.main_grad.flatten() for p in model.parameters()]))
        for m in fast:
            m.__class__ = type(m).__base__  # megatron's own class: its linear function
    return {
        "fast_linears": len(fast),
        "output_weight": output_weight,
        "loss_diff": float((losses[0] - losses[1]).abs().max()),
        "loss_scale": float(losses[1].abs().max()),
        "grad_diff": float((grads[0] - grads[1]).abs().max()),
        "grad_scale": float(grads[1].abs().max()),
    }


def _packing(tmp: Path) -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    from engine.data.chat import sft_source
    from engine.models.gpt import unwrap
    from engine.train.steps import _per_token_nll

    rnd = random.Random(0)
    words = lambda n: " ".join(str(rnd.randrange(4, VOCAB)) for _ in range(n))  # noqa: E731
    path = tmp / "sft.jsonl"
    recs = [{"prompt": words(rnd.randint(2, 6)), "response": words(rnd.randint(1, 4))} for _ in range(12)]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in recs))
    out = {}
    for position in ("learned_absolute", "rope"):
        model = unwrap(_models(1, position)["sdpa"])
        r: dict[str, Any] = {"examples": 12}
        for mode, pack in (("packed", True), ("unpacked", False)):
            src = sft_source(path, _FakeTokenizer(), SEQ, seed=0, pack=pack)  # type: ignore[arg-type]
            rows = [src.fetch(j) for j in range(len(src))]  # file order (indexing shuffles per epoch)
            r[f"rows_{mode}"] = len(rows)
            batch = {k: torch.from_numpy(np.stack([row[k] for row in rows])) for k in rows[0]}
            with torch.no_grad():
                nll = _per_token_nll(model, batch["tokens"], batch["labels"], batch)
            per_token = (nll * batch["loss_mask"]).double()
            if pack:
                seg = batch["segment_ids"]
                lossy = batch["loss_mask"] > 0  # every example has response tokens; padding has none
                r[mode] = [
                    float(per_token[i][seg[i] == s].sum())
                    for i in range(len(seg))
                    for s in sorted(set(seg[i][lossy[i]].tolist()))
                ]
            else:
                r[mode] = [float(x) for x in per_token.sum(-1)]
        out[position] = r
    return out


def run(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from engine.runtime import distributed as D

    D.init(spec["tp"], 1, None, seed=1234, threads=1)
    try:
        if spec["check"] == "linear":
            return _linear(spec["tp"], spec["tie"])
        return _attention(spec["tp"]) if spec["check"] == "attention" else _packing(tmp)
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(lambda spec: run(spec, Path(sys.argv[1]).parent))
