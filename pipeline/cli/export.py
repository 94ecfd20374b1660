"""``python -m pipeline.export <run_dir> [stage] [--out DIR]``: a stage's final checkpoint as a Hugging Face model.

Writes ``DIR`` (default ``<run_dir>/export/<stage>``): config.json, model-XXXXX-of-YYYYY.safetensors with
model.safetensors.index.json, the run's tokenizer files (tokenizer.json, tokenizer_config.json with the chat
template), generation_config.json and export_manifest.json (a run from ``hf:<dir>`` keeps that model's
``pad_token_id``: provenance/hf_source). The stage defaults to the last completed
training stage (rlhf, sft, pretrain). The checkpoint may have been saved under any parallel layout.

Every export checks itself: transformers loads the directory on CPU and its logits on a fixed batch are
compared with the megatron model's; the maximum difference goes into export_manifest.json and into the
run's event log (``export`` event). Over the tolerance, nothing is written and the exit code is 1.
Exit code 2: bad arguments (no such run, stage or checkpoint; a model without a Hugging Face twin).

A LoRA stage (``<stage>.peft.method=lora``) exports ``--merged`` (default: the adapters folded into the base
weights, then the same files and check) or ``--peft``: a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) that ``peft`` loads onto the base model, checked the same way
(engine/convert/peft_export.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.cli.compose import stopped_on_ctrl_c
from pipeline.records.ledger import COMPLETED, Ledger
from pipeline.schema.build import from_dict
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.graph import LM_STAGES
from pipeline.submit.interrupt import CtrlC, ctrl_c_raises
from pipeline.submit.provenance import hf_source


def run_config(run_dir: Path) -> PipelineConfig:
    """The resolved config the run was submitted with (provenance/config.yaml)."""
    import yaml

    path = run_dir / "provenance" / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"run_dir={str(run_dir)!r}: no {path.relative_to(run_dir)} (not a run directory?)")
    return from_dict(yaml.safe_load(path.read_text()))


def pick_stage(ledger: Ledger, stage: str | None) -> str:
    if stage is not None:
        if stage not in LM_STAGES:
            raise ConfigError(f"stage={stage!r}: must be one of {list(LM_STAGES)}")
        return stage
    for s in reversed(LM_STAGES):
        rec = ledger.read(s)
        if rec and rec.status == COMPLETED:
            return s
    raise ConfigError(f"stage: no completed training stage in {ledger.run_dir}; name one")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline.export", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("stage", nargs="?", help="pretrain | sft | rlhf (default: the last completed one)")
    ap.add_argument(
        "--out", type=Path, help="output directory (default: <run_dir>/export/<stage>, --peft: <stage>-peft)"
    )
    ap.add_argument("--tolerance", type=float, default=None, help="largest relative logit difference")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument(
        "--merged",
        dest="peft",
        action="store_false",
        help="a LoRA stage: its adapters merged into the base weights, one full model (the default)",
    )
    kind.add_argument(
        "--peft",
        dest="peft",
        action="store_true",
        help="a LoRA stage: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) for "
        "its base model (a Hugging Face base is referenced, a checkpoint base is exported into <out>/base)",
    )
    ap.set_defaults(peft=False)  # else the first action (store_false) makes --peft the default
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir = args.run_dir.resolve()
    try:
        cfg = run_config(run_dir)
        ledger = Ledger(run_dir)
        stage = pick_stage(ledger, args.stage)
        from engine.checkpoint.latest import find_latest

        ckpt = find_latest(run_dir / "stages" / stage / "checkpoints", collective=False)
        if ckpt is None:
            raise ConfigError(
                f"stage={stage!r}: no verified checkpoint under {run_dir}/stages/{stage}/checkpoints"
            )
        tokenizer_dir = run_dir / "stages" / "data_prep"
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise ConfigError(f"run_dir: {tokenizer_dir}/tokenizer.json missing (data_prep did not complete)")
        # data_prep's copy of the run's tokenizer: a Hugging Face model's files unchanged (tokenizer.json,
        # tokenizer_config.json with its chat template), and the manifest's stop tokens
        out = (args.out or run_dir / "export" / (f"{stage}-peft" if args.peft else stage)).resolve()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from engine.convert.hf_export import TOLERANCE, ExportError, export
    from pipeline.schema.hf_arch import HFConfigError

    run_export: Callable[..., dict[str, Any]] = export
    if args.peft:
        from engine.convert.peft_export import export_peft

        run_export = export_peft
    try:
        with ctrl_c_raises():
            manifest = run_export(
                cfg.model,
                ckpt,
                out,
                tokenizer_dir,
                tolerance=args.tolerance or TOLERANCE,
                threads=cfg.eval.threads,
                source=hf_source(run_dir, cfg),
            )
    except HFConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CtrlC:  # the export writes into a temporary folder, removed on any exception
        return stopped_on_ctrl_c("export", f"nothing written to {out}; run the same command again")
    except ExportError as e:
        ledger.event("export_failed", stage, error=str(e))
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    check = manifest["check"]
    ledger.event("export", stage, out=str(out), checkpoint=str(ckpt), **{k: check[k] for k in check})
    rec = ledger.read(stage)
    if rec is not None:
        rec.extra["export"] = {"out": str(out), "checkpoint": str(ckpt), **check}
        ledger.write(rec)
    print(json.dumps({"out": str(out), "checkpoint": str(ckpt), "check": check}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
