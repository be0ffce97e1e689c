"""An average of the trained weights whose rate follows a schedule: DiffusionNFT's old policy (the
weights its rollouts are drawn with; NVlabs DiffusionNFT, scripts/train_nft_sd3.py `return_decay`)
and AWM's EMA policy (the second KL's target; scxue/advantage_weighted_matching, kl_ema_decay).

After each training step that took t optimizer steps so far, old <- d old + (1 - d) theta with
d = 0 while t < flat, else min(max, rate * (t - flat)). d = 0 makes the average the trained
weights themselves; DiffusionNFT's presets are (flat 0, rate 0.001, max 0.5), its default, and
(75, 0.0075, 0.999), its OCR setting; AWM's is (0, 0.001, 0.3). The average starts at the weights
the run starts from. It is a flowrl.trainer.ema.ParameterEMA with that schedule in place of the
warm-up decay: `applied()` puts it into the parameters (so the engine, which shares them, samples
with it), and checkpoints keep it under the name its algorithm gives it.
"""

from __future__ import annotations

import torch

from flowrl.trainer.ema import ParameterEMA


class ScheduledAverage(ParameterEMA):
    def __init__(self, named_parameters: dict[str, torch.nn.Parameter], flat: int, rate: float, max_decay: float):
        if flat < 0 or rate < 0 or not 0.0 <= max_decay < 1.0:
            raise ValueError(
                f"a scheduled average needs flat={flat} and rate={rate} >= 0 and max={max_decay} in [0, 1)"
            )
        super().__init__(named_parameters, decay=max_decay, update_every=1)
        self.flat, self.rate = flat, rate

    def current_decay(self, num_optimizer_steps: int) -> float:
        t = num_optimizer_steps
        return 0.0 if t < self.flat else min(self.decay, self.rate * (t - self.flat))

    def meta(self) -> dict:
        return {**super().meta(), "flat": self.flat, "rate": self.rate}

    @torch.no_grad()
    def step(self, num_optimizer_steps: int) -> bool:
        """Call after each training step with the optimizer steps taken so far (module docstring)."""
        if self.current_decay(num_optimizer_steps) == 0.0:  # the trained weights themselves, exactly
            for name, param in self.parameters.items():
                self.averages[name].copy_(param.detach())
            self.num_updates += 1
            return True
        return super().step(num_optimizer_steps)
