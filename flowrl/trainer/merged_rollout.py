"""rollout.merge_lora for any algorithm: training rollouts sample with the LoRA adapter merged into
the weights (flowrl.accel.merged_lora), stochastically rounded with a seed from (rollout.seed, the
policy version) that every rank shares, or with rank 0's fresh one when rollout.seed is null.
`MergedRollout(setup)(version)` is the context; `lora_merge_s` holds the last merge's seconds (the
device's included)."""

from __future__ import annotations

import contextlib

import numpy as np


class MergedRollout:
    def __init__(self, setup):
        self.setup = setup
        self.rollout = setup.cfg.rollout
        self.compiled = setup.cfg.engine.compile
        self.lora_merge_s = 0.0

    @contextlib.contextmanager
    def __call__(self, policy_version: int):
        if not self.rollout.merge_lora:
            yield
            return
        from flowrl.accel import merged_lora

        world = self.setup.parallel.world
        if self.rollout.seed is None:  # fresh randomness, rank 0's on every rank
            seed = world.broadcast(int(np.random.SeedSequence().generate_state(1)[0]))
        else:
            seed = int(np.random.SeedSequence([self.rollout.seed, policy_version]).generate_state(1)[0])
        t0 = world.device_idle_time()
        with merged_lora(self.setup.adapter.transformer, seed, compiled=self.compiled):
            self.lora_merge_s = world.device_idle_time() - t0
            yield
