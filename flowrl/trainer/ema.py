"""An exponential moving average of the trained parameters (`trainer.ema`), as Flow-GRPO keeps one
for evaluation and checkpoints.

`ParameterEMA(named_parameters, decay, update_every, moves_per_update)`:
- `step(t)` after optimizer step t (the optimizer steps taken so far): when (t + 1) is a multiple
  of `update_every`, the average moves `moves_per_update` times toward the weights,
  ema += (1 - d) * (weights - ema), d = min(decay, (1 + t) / (10 + t)) (the warm-up lets early
  averages follow the weights faster). This is Flow-GRPO's loop (scripts/train_sd3.py with
  flow_grpo/ema.py): it calls its EMA after every training micro-batch with the optimizer-step
  count, which moves when (count + 1) % interval == 0, so at such a count it moves once per
  micro-batch of that optimizer step on its process (`moves_per_update`; 2 in its SD3.5-M OCR
  config, 6 in its FLUX PickScore config) with the same weights and decay;
- `applied()`: a context in which the parameters hold the average (in place, so an engine sharing
  the modules samples with it), the trained values restored exactly afterwards;
- `state_dict()` / `load_state_dict()`: the averages by parameter name (the names of
  `flowrl.models.lora.trainable_state_dict`) and a small JSON-ready meta dict.

Averages are kept in float32 on the parameters' device. This module knows parameters by name and
nothing about models, optimizers or the checkpoint layout.
"""

from __future__ import annotations

import contextlib

import torch


class ParameterEMA:
    def __init__(
        self,
        named_parameters: dict[str, torch.nn.Parameter],
        decay: float,
        update_every: int,
        moves_per_update: int = 1,
    ):
        if not 0.0 <= decay < 1.0 or update_every < 1 or moves_per_update < 1:
            raise ValueError(
                f"trainer.ema: decay={decay} must be in [0, 1), update_every={update_every} >= 1 and "
                f"moves_per_update={moves_per_update} >= 1"
            )
        self.parameters = dict(named_parameters)
        self.decay = decay
        self.update_every = update_every
        self.moves_per_update = moves_per_update
        self.num_updates = 0
        self.averages: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Start the average at the parameters' current values."""
        self.averages = {name: p.detach().float().clone() for name, p in self.parameters.items()}
        self.num_updates = 0

    def current_decay(self, num_optimizer_steps: int) -> float:
        t = num_optimizer_steps
        return min(self.decay, (1.0 + t) / (10.0 + t))

    @torch.no_grad()
    def step(self, num_optimizer_steps: int) -> bool:
        """Call after each optimizer step with the number taken so far; returns whether the
        average moved (module docstring)."""
        if (num_optimizer_steps + 1) % self.update_every:
            return False
        # `moves_per_update` moves toward the same weights with weight w each: one move of
        # 1 - (1 - w)^moves, as the reference's repeated calls leave it (up to rounding).
        weight = 1.0 - self.current_decay(num_optimizer_steps) ** self.moves_per_update
        for name, param in self.parameters.items():
            average = self.averages[name]
            average.add_(param.detach().float() - average, alpha=weight)
        self.num_updates += 1
        return True

    @contextlib.contextmanager
    def applied(self):
        """The parameters hold the average inside the block; their own values come back after."""
        trained = {name: p.detach().clone() for name, p in self.parameters.items()}
        with torch.no_grad():
            for name, param in self.parameters.items():
                param.copy_(self.averages[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.parameters.items():
                    param.copy_(trained[name])

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(averages by name on the CPU, meta)."""
        tensors = {name: t.cpu().contiguous() for name, t in self.averages.items()}
        return tensors, self.meta()

    def meta(self) -> dict:
        """The JSON-ready settings and counter of the average (state_dict's second half)."""
        return {
            "decay": self.decay,
            "update_every": self.update_every,
            "moves_per_update": self.moves_per_update,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore averages written by `state_dict`; names and shapes must match the parameters."""
        if set(tensors) != set(self.parameters):
            missing = sorted(set(self.parameters) - set(tensors))[:5]
            extra = sorted(set(tensors) - set(self.parameters))[:5]
            raise ValueError(
                f"the checkpoint's EMA weights do not match the trainable parameters (missing {missing}, "
                f"unexpected {extra}); resume with the trainer.lora settings the checkpoint was written with"
            )
        for name, tensor in tensors.items():
            if tensor.shape != self.parameters[name].shape:
                raise ValueError(
                    f"the checkpoint's EMA weight {name} has shape {tuple(tensor.shape)}, the model "
                    f"{tuple(self.parameters[name].shape)}; resume with the same trainer.lora settings"
                )
            self.averages[name] = tensor.to(self.parameters[name].device, torch.float32).clone()
        self.num_updates = int(meta.get("num_updates", 0))
