"""Online Diffusion-DPO (flowrl.trainer.online_dpo): its loss equals the reference's formula,
pairs are each group's best and worst sample re-noised alike, its reference snapshot refreshes
on schedule and resumes, and bad settings are refused before loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from resume_runs import assert_resumed_as_straight

from flowrl.trainer.dpo_loss import dpo_loss, flow_errors
from flowrl.trainer.online_dpo import preference_pairs

DPO = (
    "algorithm.name=online_dpo",
    "rollout.sampling.noise_level=0.0",
    "rollout.sampling.logprobs=false",
    "rollout.n=3",
    "trainer.prompts_per_step=3",
    "trainer.micro_batch_size=2",
    "trainer.lr=0.01",
    "algorithm.train_timestep_fraction=0.5",
    "trainer.lora.enabled=true",
    "trainer.lora.rank=4",
)


def test_loss_and_gradient_equal_the_reference_formula():
    """flow_grpo scripts/train_sd3_dpo.py's loss of a batch, from its formula."""
    g = torch.Generator().manual_seed(0)
    x0, noise, v_ref = (torch.randn(8, 3, 4, 4, generator=g) for _ in range(3))
    v = torch.randn(8, 3, 4, 4, generator=g)
    beta = 100.0
    v_a = v.clone().requires_grad_(True)
    loss, margin = dpo_loss(flow_errors(v_a, x0, noise), flow_errors(v_ref, x0, noise), beta)
    loss.mean().backward()

    v_b = v.clone().requires_grad_(True)
    target = noise - x0
    theta = ((v_b.float() - target.float()) ** 2).reshape(8, -1).mean(dim=1)
    ref = ((v_ref.float() - target.float()) ** 2).reshape(8, -1).mean(dim=1)
    w_diff, l_diff = theta[:4] - ref[:4], theta[4:] - ref[4:]
    expected = torch.mean(-F.logsigmoid(-0.5 * beta * (w_diff - l_diff)))
    expected.backward()
    assert abs(float(loss.mean().detach()) - float(expected.detach())) < 1e-6
    torch.testing.assert_close(v_a.grad, v_b.grad, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(margin.detach(), -(w_diff - l_diff).detach())


def test_pairs_are_each_groups_best_and_worst():
    rewards = np.array([0.2, 0.9, 0.5, 0.4, 0.4, 0.4, np.nan, 0.1, 0.3])
    uids = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    partner = preference_pairs(rewards, uids)
    assert partner.tolist() == [-1, 0, -1, -1, -1, -1, -1, -1, 7]  # b has no spread; c's NaN row is out
    swapped = [preference_pairs(rewards, uids, (0, step, 11)) for step in range(20)]
    roles = {tuple(np.flatnonzero(p >= 0)) for p in swapped}
    assert roles >= {(1, 8), (0, 7)}  # the control swaps some pairs' roles
    for p in swapped:
        chosen = np.flatnonzero(p >= 0)
        assert sorted(chosen.tolist() + p[chosen].tolist()) == [0, 1, 7, 8]


def test_a_pair_shares_its_noise_and_timestep(build_trainer, make_cfg, monkeypatch):
    trainer = build_trainer(make_cfg(*DPO, "trainer.total_steps=1"))
    algo = trainer.algorithm
    captured = {}
    prepare = algo.prepare

    def capture(rollout, rows, weights, step):
        batch = prepare(rollout, rows, weights, step)
        captured.update(batch=batch, rows=rows, rewards=np.asarray(rows.rewards), uids=list(rows.uids))
        return batch

    monkeypatch.setattr(algo, "prepare", capture)
    trainer.train_step()
    batch, rows = captured["batch"], captured["rows"]
    pairs = [pair for step in batch.steps for pair in step]
    assert pairs
    for pair in pairs:
        half = len(pair.forward.rows) // 2
        chosen, rejected = pair.forward.rows[:half], pair.forward.rows[half:]
        torch.testing.assert_close(pair.noise[:half], pair.noise[half:], rtol=0, atol=0)
        torch.testing.assert_close(pair.sigma[:half], pair.sigma[half:], rtol=0, atol=0)
        for c, r in zip(chosen.tolist(), rejected.tolist()):
            gc, gr = rows.mine[c], rows.mine[r]
            assert captured["uids"][gc] == captured["uids"][gr]
            group = [i for i, u in enumerate(captured["uids"]) if u == captured["uids"][gc]]
            assert captured["rewards"][gc] == max(captured["rewards"][group])
            assert captured["rewards"][gr] == min(captured["rewards"][group])


def test_the_reference_snapshot_refreshes_on_schedule_and_resumes(build_trainer, make_cfg):
    small = (*DPO, "trainer.lora.enabled=false", "algorithm.dpo.ref_update_every=2", "trainer.lr=0.001")
    keys = ("reward/mean", "actor/dpo_loss", "actor/margin", "actor/grad_norm")
    a = assert_resumed_as_straight(build_trainer, make_cfg, small, keys, ("trainable", "dpo_reference"))
    assert [r["dpo/reference_refreshed"] for r in a] == [0.0, 1.0, 0.0]
    # Right after a refresh the trained weights are the reference: the loss is log 2 exactly.
    assert a[2]["actor/dpo_loss"] == pytest.approx(np.log(2.0), abs=1e-6)
    assert a[1]["actor/dpo_loss"] != pytest.approx(np.log(2.0), abs=1e-6)


def test_bad_settings_are_refused_before_loading(make_cfg):
    from flowrl.run.checks import check_before_loading

    with pytest.raises(ValueError, match="algorithm.dpo.ref_update_every=0 takes the LoRA-disabled model"):
        make_cfg(*DPO, "trainer.lora.enabled=false")
    with pytest.raises(ValueError, match=r"rollout\.n=1 .*online_dpo compares samples within a prompt's group"):
        make_cfg(*DPO, "rollout.n=1")
    # Settings online DPO would ignore: the group advantages' and the KL's.
    for setting in ("algorithm.kl_beta=0.1", "algorithm.std_mode=group", "algorithm.adv_clip_max=2.0"):
        with pytest.raises(ValueError, match=rf"{setting.split('=')[0]}=.* is a setting of algorithm\.name=flow_grpo"):
            make_cfg(*DPO, setting)
    with pytest.raises(ValueError, match=r"algorithm\.dpo\.beta=5(\.0)? is a setting of algorithm\.name=online_dpo"):
        make_cfg("algorithm.dpo.beta=5")
    with pytest.raises(ValueError, match=r"rollout\.sampling\.noise_level=0\.7: algorithm\.name=online_dpo"):
        check_before_loading(make_cfg(*DPO, "rollout.sampling.noise_level=0.7"))
