"""GPU: the colocated trainer on CUDA with a bf16 model and bf16 autocast (device placement of
every tensor of the update, mixed precision, gradient checkpointing), and the size of the
rollout-vs-trainer log-prob gap there."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.trainer.trainer import FlowGRPOTrainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("old_log_prob", ["rollout", "recompute"])
def test_tiny_training_on_cuda_bf16(make_cfg, old_log_prob):
    cfg = make_cfg("model.device=cuda", "model.dtype=bfloat16", "trainer.mixed_precision=bf16",
                   "trainer.gradient_checkpointing=true", "trainer.lora.enabled=true", "trainer.lr=0.01",
                   "algorithm.kl_beta=0.01", f"algorithm.old_log_prob={old_log_prob}",
                   "rollout.sampling.guidance_scale=2.0", "trainer.total_steps=3", "trainer.save_every=3",
                   "trainer.val_every=3", output=f"gpu-{old_log_prob}")
    trainer = FlowGRPOTrainer(cfg)
    assert trainer.adapter.device.type == "cuda"
    summary = trainer.fit()
    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines() if '"reward/mean"' in line]
    assert len(records) == 3
    for record in records:
        for key in ("actor/policy_loss", "actor/grad_norm", "actor/kl", "actor/logprob_gap_max"):
            assert record[key] is not None and torch.isfinite(torch.tensor(record[key])), (key, record)
    print(old_log_prob, "log-prob gap per step:", [(r["actor/logprob_gap_mean"], r["actor/logprob_gap_max"]) for r in records])
    # bf16 rollout forwards vs the trainer's bf16-autocast forwards: small but nonzero on GPU.
    assert records[0]["actor/logprob_gap_max"] < 0.5
    assert records[0]["rollout/policy_lag"] == 0
