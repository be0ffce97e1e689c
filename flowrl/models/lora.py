"""Which transformer parameters train: a peft LoRA adapter injected in place, or all of them.

In place matters: the engine holds the same transformer object, so after `apply_trainable` the
next rollout already samples from the adapted model, with no weight copy. The reference policy of
the KL term is the same module with the adapter switched off (`adapter_disabled`), never a second
copy of the model.

LoRA weights are float32 master weights (AdamW updates in bf16 would mostly round away), but the
low-rank product runs in the activations' dtype (`forward_in_activation_dtype`, which every
adapted Linear gets). peft's own forward casts the activations to float32 instead, which on a
bf16 model makes every adapted projection two float32 GEMMs on CUDA cores plus float32 copies of
its input and output. Rollout and trainer call the same forward, so their log-probs stay
comparable. (A compiled model's rollout graphs add the low-rank term inside the base projection's
cuBLAS calls instead: flowrl.accel.lora_fold, installed by flowrl.accel.compile_adapter.)

Saved LoRA weights use the diffusers LoRA format (`pytorch_lora_weights.safetensors` with
`transformer.`-prefixed keys plus the adapter config as metadata), so `pipe.load_lora_weights(dir)`
of the model family's diffusers pipeline loads them with the trained alpha/rank.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import torch
import torch.nn.functional as F


def _peft_init(init: str):
    """peft's `init_lora_weights` value for trainer.lora.init (whose choices the config's Literal
    holds): True selects peft's default (kaiming A, zero B); the others are peft's own names."""
    return True if init == "default" else init


def _all_module_names(module: torch.nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name]


def _check_targets(transformer: torch.nn.Module, targets: list[str]) -> None:
    """Fail loudly when a target matches no module (LoRA on nothing would train nothing)."""
    names = _all_module_names(transformer)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear_leaves = sorted(
            {n.split(".")[-1] for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ValueError(
            f"trainer.lora.target_modules={list(targets)} has entries that match no module of the "
            f"transformer: {missing}; linear layers it has include {linear_leaves[:24]}"
        )


# The attribute where flowrl.accel.lora_merge keeps a LoRA Linear's merged weight during a rollout.
MERGED_WEIGHT = "_flowrl_merged_weight"


def merged_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """The merged weight W + s B A that a training rollout computes `layer` with
    (flowrl.accel.lora_merge), in forwards without grad while it is set; None otherwise, so a
    forward with grad always runs the adapter itself."""
    if torch.is_grad_enabled():
        return None
    return getattr(layer, MERGED_WEIGHT, None)


def adapter_delta(layer: torch.nn.Module) -> torch.Tensor:
    """s B A summed over a LoRA Linear's active adapters, in float32 on the layer's device: what
    the adapters add to the base weight."""
    weight = layer.base_layer.weight
    delta = None
    for name in layer.active_adapters:
        if name in layer.lora_A:
            term = torch.mm(layer.lora_B[name].weight.float() * layer.scaling[name], layer.lora_A[name].weight.float())
            delta = term if delta is None else delta.add_(term)
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if delta is None else delta


def forward_in_activation_dtype(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA Linear's forward computing base(x) + (x A^T)(s B)^T with the float32 master
    weights A and s B cast to x's dtype (module docstring), or x W'^T + bias with the merged weight
    W' of a training rollout (`merged_weight`); anything this does not cover (adapter disabled or
    merged by peft, extra arguments, DoRA and other variants) runs peft's forward."""
    merged = merged_weight(self)
    if merged is not None and not (args or kwargs):
        return F.linear(x, merged, self.base_layer.bias)
    if self.disable_adapters or self.merged or args or kwargs or self.lora_variant:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    for name in self.active_adapters:
        if name in self.lora_A:
            down = self.lora_A[name].weight.to(x.dtype)
            up = (self.lora_B[name].weight * self.scaling[name]).to(x.dtype)
            result = result + F.linear(F.linear(self.lora_dropout[name](x), down), up)
    return result


def _compute_lora_in_activation_dtype(transformer: torch.nn.Module) -> int:
    """Route every peft LoRA Linear under `transformer` through `forward_in_activation_dtype`,
    per instance (marked `_flowrl_lora_forward`); returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in transformer.modules():
        if type(module) is LoraLinear:
            module.forward = types.MethodType(forward_in_activation_dtype, module)
            module._flowrl_lora_forward = True
            count += 1
    return count


def apply_trainable(transformer: torch.nn.Module, lora_cfg) -> list[torch.nn.Parameter]:
    """Make the transformer trainable per `lora_cfg` (trainer.lora) and return the parameters
    to optimize. LoRA: peft adapter "default" injected in place, base weights frozen, LoRA weights
    kept in float32 whatever the model dtype, their product computed in the activations' dtype
    (module docstring). Full fine-tuning (lora.enabled=false): every
    transformer parameter trains."""
    transformer.requires_grad_(False)
    if not lora_cfg.enabled:
        transformer.requires_grad_(True)
        return [p for p in transformer.parameters() if p.requires_grad]
    from peft import LoraConfig

    targets = list(lora_cfg.target_modules)
    _check_targets(transformer, targets)
    config = LoraConfig(
        r=int(lora_cfg.rank),
        lora_alpha=float(lora_cfg.alpha),
        target_modules=targets,
        init_lora_weights=_peft_init(lora_cfg.init),
        lora_dropout=float(lora_cfg.dropout),
    )
    transformer.add_adapter(config)
    params = _lora_as_flowrl_trains_it(transformer)
    if not params:
        raise ValueError(f"trainer.lora.target_modules={targets} produced no LoRA parameters")
    return params


def _lora_as_flowrl_trains_it(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """After peft injected an adapter into `module`: LoRA weights as float32 master weights (Adam
    updates in bf16 would mostly round away) that train, everything else frozen, and every LoRA
    Linear on flowrl's forward. Returns the LoRA parameters."""
    params = []
    for name, param in module.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
            param.requires_grad_(True)
            params.append(param)
        else:
            param.requires_grad_(False)
    _compute_lora_in_activation_dtype(module)
    return params


def inject_lora(
    module: torch.nn.Module, rank: int, targets, alpha: float | None = None, dropout: float = 0.0
) -> list[torch.nn.Parameter]:
    """The trainer's LoRA setup on any module, e.g. one transformer block in a benchmark or test:
    peft's adapter (gaussian init, alpha = 2 x rank unless given) on `targets`, then as
    `apply_trainable` sets it up. Returns the LoRA parameters."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2.0 * rank if alpha is None else alpha,
        target_modules=list(targets),
        lora_dropout=dropout,
        init_lora_weights="gaussian",
    )
    inject_adapter_in_model(config, module)
    return _lora_as_flowrl_trains_it(module)


def has_lora(transformer: torch.nn.Module) -> bool:
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def adapter_disabled(transformer: torch.nn.Module):
    """Run the base model (the KL reference): LoRA switched off inside the block."""
    if not has_lora(transformer):
        raise ValueError(
            "the KL reference is the model with its LoRA adapter disabled, but this transformer has "
            "no LoRA adapter; set trainer.lora.enabled=true or algorithm.kl_beta=0"
        )
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def lora_settings(transformer: torch.nn.Module) -> dict | None:
    """The injected adapter's settings {rank, alpha, target_modules, dropout} (None without LoRA):
    what a server without the adapter needs to add the same one."""
    if not has_lora(transformer):
        return None
    peft = transformer.peft_config["default"]
    return {
        "rank": peft.r,
        "alpha": peft.lora_alpha,
        "target_modules": sorted(peft.target_modules),
        "dropout": peft.lora_dropout,
    }


def trainable_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor of every parameter that trains (LoRA weights, or the full model)."""
    return {name: p.detach() for name, p in transformer.named_parameters() if p.requires_grad}


def check_trainable_names(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """ValueError unless `state` names exactly the parameters that train."""
    expected = {name for name, p in transformer.named_parameters() if p.requires_grad}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state))[:5], sorted(set(state) - expected)[:5]
        raise ValueError(
            f"checkpoint weights do not match the trainable parameters (missing {missing}, unexpected "
            f"{extra}); resume with the same trainer.lora settings the checkpoint was written with"
        )


def load_trainable_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable weights back; names and shapes must match exactly."""
    check_trainable_names(transformer, state)
    params = dict(transformer.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"checkpoint weight {name} has shape {tuple(tensor.shape)}, the model "
                    f"{tuple(params[name].shape)}; resume with the same trainer.lora settings"
                )
            params[name].copy_(tensor)


def save_lora_for_diffusers(adapter, directory: str | Path) -> Path:
    """Write the LoRA in the diffusers format of the adapter's pipeline (loadable with
    `pipe.load_lora_weights(directory)`). Returns the directory."""
    from peft.utils import get_peft_model_state_dict

    transformer = adapter.transformer
    if not has_lora(transformer):
        raise ValueError("save_lora_for_diffusers: the transformer has no LoRA adapter (full fine-tuning?)")
    pipeline_cls = type(adapter.pipeline)
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = transformer.peft_config["default"].to_dict()
    pipeline_cls.save_lora_weights(
        directory,
        transformer_lora_layers=state,
        safe_serialization=True,
        transformer_lora_adapter_metadata=metadata,
    )
    return directory
