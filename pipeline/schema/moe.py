"""Mixture of Experts: the relations between the ``model.moe_*`` keys, and of a layout's ep/etp to them.

``check_moe(model)`` runs in ModelConfig.__post_init__ (keys of one section: errors name the bare key,
build_config prefixes ``model.``); ``check_moe_layout`` runs in pipeline.schema.layout.check_layout for every
stage (errors name ``<stage>.parallel.ep`` / ``.etp``). megatron-core's rules (TransformerConfig.__post_init__,
parallel_state.initialize_model_parallel) are checked here, before any job starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from pipeline.schema.domains import choice, fail
from pipeline.schema.errors import ConfigError

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
ROUTER_DTYPES = ("fp32", "fp64", "model")


class _MoEModel(Protocol):
    """The MoE keys of pipeline.schema.sections.ModelConfig."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int | None: ...
    @property
    def moe_router_topk(self) -> int: ...
    @property
    def moe_ffn_hidden_size(self) -> int | None: ...
    @property
    def ffn_hidden_size(self) -> int | None: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def moe_shared_expert_intermediate_size(self) -> int | None: ...
    @property
    def add_bias_linear(self) -> bool: ...


class _ExpertParallel(Protocol):
    @property
    def tp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def etp(self) -> int | None: ...
    @property
    def moe_token_dispatcher(self) -> str: ...


def is_moe(model: Any) -> bool:
    """Whether the model has routed experts (num_experts None or 0: dense)."""
    return bool(model.num_experts)


def moe_layers(model: Any) -> list[bool]:
    """Per layer (global index from 0): whether it is a MoE layer (megatron's moe_layer_freq semantics)."""
    if not is_moe(model):
        return [False] * model.num_layers
    if model.moe_layer_pattern:
        return [bool(v) for v in model.moe_layer_pattern]
    return [i % model.moe_layer_freq == 0 for i in range(model.num_layers)]


def expert_ffn(model: _MoEModel) -> int:
    """Width of one routed expert's MLP."""
    return model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def check_moe(model: Any) -> None:
    """Relations between the MoE keys of one ModelConfig (ConfigError naming the key)."""
    choice("moe_router_score_function", model.moe_router_score_function, SCORE_FUNCTIONS)
    choice("moe_router_load_balancing_type", model.moe_router_load_balancing_type, LOAD_BALANCING)
    choice("moe_router_dtype", model.moe_router_dtype, ROUTER_DTYPES)
    if not is_moe(model):
        for f in dataclasses.fields(model):
            value = getattr(model, f.name)
            if f.name.startswith("moe_") and value != _default(f):
                fail(
                    f.name,
                    value,
                    f"a MoE setting, but num_experts={model.num_experts} (a dense model ignores it); set "
                    "num_experts or leave it at its default",
                )
        return
    _check_router(model)
    _check_layers(model)
    if model.moe_shared_expert_gate and model.moe_shared_expert_intermediate_size is None:
        fail(
            "moe_shared_expert_gate", True, "gates the shared expert: set moe_shared_expert_intermediate_size"
        )
    if model.moe_shared_expert_intermediate_size is not None and model.add_bias_linear:
        fail(
            "moe_shared_expert_intermediate_size",
            model.moe_shared_expert_intermediate_size,
            "megatron-core's shared expert has no biases: set add_bias_linear=false",
        )
    coeff = next(f for f in dataclasses.fields(model) if f.name == "moe_aux_loss_coeff")
    if model.moe_router_load_balancing_type == "none" and model.moe_aux_loss_coeff != _default(coeff):
        fail(
            "moe_aux_loss_coeff",
            model.moe_aux_loss_coeff,
            "moe_router_load_balancing_type=none computes no load-balancing loss; leave it at its default",
        )


def _check_router(model: Any) -> None:
    k, n = model.moe_router_topk, model.num_experts
    if k > n:
        fail("moe_router_topk", k, f"must be <= num_experts={n} (a token goes to top-k distinct experts)")
    softmax = model.moe_router_score_function == "softmax"
    if softmax and k == 1 and model.moe_router_norm_topk:
        fail(
            "moe_router_norm_topk",
            True,
            "with top-k 1 a renormalised softmax is always 1 and the router gets no gradient: set it to false "
            "(softmax over all experts, megatron's pre-softmax routing)",
        )
    if not softmax and k > 1 and not model.moe_router_norm_topk:
        fail(
            "moe_router_norm_topk",
            False,
            "moe_router_score_function=sigmoid: megatron-core always renormalises the top-k scores; set it to true",
        )


def _check_layers(model: Any) -> None:
    pattern = model.moe_layer_pattern
    if pattern and model.moe_layer_freq != 1:
        fail("moe_layer_pattern", pattern, "give moe_layer_pattern or moe_layer_freq, not both")
    if pattern and len(pattern) != model.num_layers:
        fail(
            "moe_layer_pattern",
            pattern,
            f"must list num_layers={model.num_layers} entries, each 1 (MoE) or 0 (dense)",
        )
    if model.moe_layer_freq > model.num_layers:
        fail("moe_layer_freq", model.moe_layer_freq, f"must be <= num_layers={model.num_layers}")
    if not any(moe_layers(model)):
        fail("moe_layer_pattern", pattern, "no MoE layer: list at least one 1, or set num_experts to null")


def check_moe_layout(model: _MoEModel, par: _ExpertParallel, key: str) -> None:
    """A stage's ep/etp against the model: experts split evenly over ep, expert widths over etp (before the
    plan: these errors name the expert count, not a rank count derived from it)."""
    n = model.num_experts
    if not n:
        for name, value, default in (("ep", par.ep, 1), ("etp", par.etp, None)):
            if value != default:
                raise ConfigError(
                    f"{key}.{name}={value}: expert parallelism needs experts, but model.num_experts={n} "
                    "(a dense model); leave it at its default"
                )
        return
    if n % par.ep:
        raise ConfigError(f"{key}.ep={par.ep}: does not divide the {n} experts of model.num_experts")
    etp = par.etp or par.tp
    width = expert_ffn(model)
    if width % etp:
        raise ConfigError(
            f"{key}.etp={etp}: the expert width {width} (model.moe_ffn_hidden_size) is not divisible by it"
        )
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None and shared % par.tp:
        raise ConfigError(
            f"{key}.tp={par.tp}: model.moe_shared_expert_intermediate_size={shared} is not divisible by it"
        )
    if model.add_bias_linear and etp > 1:
        raise ConfigError(
            f"{key}.etp={etp}: megatron-core supports biases in experts only with etp=1 "
            f"(model.add_bias_linear=true); set {key}.etp=1 or model.add_bias_linear=false"
        )


def check_moe_peft(model: Any, peft: Any, key: str) -> None:
    """LoRA on a MoE model adapts attention, dense MLPs and the shared expert, never the routed experts: MLP
    targets (linear_fc1/fc2) that would adapt nothing are an error naming ``<stage>.peft.target_modules``."""
    if not is_moe(model) or peft.method != "lora":
        return
    mlp = [t for t in peft.target_modules if t in ("linear_fc1", "linear_fc2")]
    if mlp and all(moe_layers(model)) and model.moe_shared_expert_intermediate_size is None:
        attention = [t for t in peft.target_modules if t not in mlp] or ["linear_qkv", "linear_proj"]
        raise ConfigError(
            f"{key}.peft.target_modules={list(peft.target_modules)}: every MLP of this MoE model is routed experts, "
            f"which LoRA does not adapt ({mlp} would adapt nothing); set {key}.peft.target_modules="
            f"[{','.join(attention)}]"
        )


def check_expert_ranks(par: _ExpertParallel, key: str, tp_dp: int) -> None:
    """ep x etp against the ranks of one pipeline stage, ``tp_dp`` = tp x dp (megatron-core carves the
    expert-parallel groups out of them: the world must divide by etp x ep x pp)."""
    etp = par.etp or par.tp
    if tp_dp % (par.ep * etp):
        raise ConfigError(
            f"{key}.ep={par.ep}: ep x etp = {par.ep} x {etp} must divide tp x dp = {tp_dp} (expert-parallel "
            "groups are carved out of the data- and tensor-parallel ranks of a pipeline stage); raise dp"
        )


def check_moe_training(model: Any, par: Any, key: str) -> None:
    """A training stage's layout for a MoE model: megatron-core's MoE layer refuses to train with tensor
    parallelism but without sequence parallel (which needs Transformer Engine)."""
    if is_moe(model) and par.tp > 1 and not par.sequence_parallel:
        raise ConfigError(
            f"{key}.tp={par.tp}: megatron-core's MoE layer trains with tensor parallelism only together with "
            f"sequence parallel ({key}.sequence_parallel=true, Transformer Engine needed); split a MoE model "
            f"with {key}.ep, dp and pp instead, or set {key}.tp=1"
        )
