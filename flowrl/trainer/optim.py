"""The optimizer over the trainable parameters and the steps every algorithm's update takes with it.

`Optimization` holds AdamW (trainer.lr, betas, weight_decay), the mixed precision the update's
forwards run under (trainer.mixed_precision; fp16 with a gradient scaler) and the count of
optimizer steps taken (a checkpoint saves and restores it). `step()` sums the gradients over ranks
(flowrl.distributed.DataParallel), clips their norm (trainer.grad_clip), steps and moves the EMA
(trainer.ema). Algorithms build one each and differ only in the losses they backpropagate.
"""

from __future__ import annotations

import torch

from flowrl.models.base import MIXED_PRECISION_DTYPES


class Optimization:
    def __init__(self, adapter, params: list[torch.nn.Parameter], trainer_cfg, parallel, ema=None):
        self.params, self.parallel, self.ema = params, parallel, ema
        self.grad_clip = trainer_cfg.grad_clip
        self.optimizer = torch.optim.AdamW(
            params, lr=trainer_cfg.lr, betas=tuple(trainer_cfg.betas), weight_decay=trainer_cfg.weight_decay
        )
        self.autocast_dtype = MIXED_PRECISION_DTYPES[trainer_cfg.mixed_precision]
        self.scaler = torch.amp.GradScaler(adapter.device.type) if trainer_cfg.mixed_precision == "fp16" else None
        self.num_optimizer_steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        """One optimizer step on the gradients accumulated since the last (module docstring);
        returns the gradient norm before clipping."""
        self.parallel.reduce_gradients(self.params)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.parallel.clip_gradients(self.params, self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_optimizer_steps += 1
        if self.ema is not None:
            self.ema.step(self.num_optimizer_steps)
        return grad_norm
