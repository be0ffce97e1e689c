"""Checkpoint/resume: N+M steps straight equal N steps, a fresh process-like restart, M steps
(EMA of the weights and the validation it samples included); and the saved LoRA loads into the
diffusers pipeline."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from flowrl.run.checkpoint import latest_checkpoint
from flowrl.trainer.trainer import Trainer

SMALL = (
    "rollout.n=2",
    "trainer.prompts_per_step=3",
    "trainer.micro_batch_size=3",
    "trainer.lora.enabled=true",
    "trainer.lora.rank=4",
    "trainer.lr=0.01",
    "rollout.sampling.sde_window_size=2",
    "algorithm.old_log_prob=recompute",
    "algorithm.kl_beta=0.01",
    "algorithm.train_timestep_fraction=0.5",
    "trainer.updates_per_step=2",
    "trainer.ema.enabled=true",
    "trainer.ema.update_every=3",
    "trainer.val_every=2",
    "trainer.num_val_images=2",
)
COMPARED = (
    "reward/mean",
    "reward/std",
    "actor/policy_loss",
    "actor/approx_kl",
    "actor/kl",
    "actor/grad_norm",
    "actor/ratio_max",
    "rollout/policy_version",
)


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _final_weights(output_dir, name="trainable"):
    return load_file(str(latest_checkpoint(output_dir) / f"{name}.safetensors"))


def test_resume_equals_straight_run(build_trainer, make_cfg):
    straight_cfg = make_cfg(*SMALL, "trainer.total_steps=4", "trainer.save_every=4", output="straight")
    build_trainer(straight_cfg).fit()

    first = make_cfg(*SMALL, "trainer.total_steps=2", "trainer.save_every=2", output="resumed")
    build_trainer(first).fit()
    second = make_cfg(*SMALL, "trainer.total_steps=4", "trainer.save_every=4", "trainer.resume=auto", output="resumed")
    resumed = build_trainer(second)
    assert resumed.step == 2 and resumed.policy_version == 4  # two optimizer steps per training step
    resumed.fit()

    out_a, out_b = straight_cfg.trainer.output_dir, second.trainer.output_dir
    from pathlib import Path

    a, b = _metrics(Path(out_a) / "metrics.jsonl"), _metrics(Path(out_b) / "metrics.jsonl")
    train_a, train_b = ([r for r in m if "reward/mean" in r] for m in (a, b))
    assert [r["step"] for r in train_a] == [r["step"] for r in train_b] == [1, 2, 3, 4]
    for ra, rb in zip(train_a, train_b):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-9), (ra["step"], key)
    # Validation samples with the EMA weights, which the resumed run restored.
    val_a, val_b = ({r["step"]: r["val/reward_mean"] for r in m if "val/reward_mean" in r} for m in (a, b))
    assert sorted(val_a) == sorted(val_b) == [0, 2, 4]
    for step in val_a:
        assert val_a[step] == pytest.approx(val_b[step], rel=1e-5, abs=1e-9), step
    for name in ("trainable", "ema"):
        wa, wb = _final_weights(out_a, name), _final_weights(out_b, name)
        assert wa.keys() == wb.keys()
        for key in wa:
            torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-7)


def test_saved_lora_loads_into_the_diffusers_pipeline(build_trainer, make_cfg):
    from diffusers import StableDiffusion3Pipeline

    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.lora.enabled=true",
        "trainer.lora.rank=4",
        "trainer.lora.alpha=16",
        "trainer.lr=0.05",
        "trainer.total_steps=2",
        "trainer.save_every=2",
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    lora_dir = latest_checkpoint(cfg.trainer.output_dir) / "lora"
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file()

    def sample(pipe):
        return pipe(
            prompt="a red apple",
            height=64,
            width=64,
            num_inference_steps=3,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    pipe = StableDiffusion3Pipeline.from_pretrained(cfg.model.path)
    pipe.set_progress_bar_config(disable=True)
    base = sample(pipe)
    pipe.load_lora_weights(str(lora_dir))
    with_lora = sample(pipe)
    trained = sample(trainer.adapter.pipeline)  # the trainer's own model, LoRA active
    assert (with_lora - base).abs().max() > 1e-4
    torch.testing.assert_close(with_lora, trained, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def one_step_run(tiny_run_config, tmp_path_factory):
    """A 1-step run of SMALL with its checkpoint, trained once: the tests that resume from it
    copy it to their own folder (`copy_to`)."""
    out = tmp_path_factory.mktemp("one_step") / "run"
    with Trainer(tiny_run_config(out, *SMALL, "trainer.total_steps=1", "trainer.save_every=1")) as trainer:
        trainer.fit()

    def copy_to(tmp_path):
        shutil.copytree(out, tmp_path / "run")

    return copy_to


def test_resume_applies_changeable_keys_and_reports_them(build_trainer, make_cfg, one_step_run, tmp_path, capsys):
    one_step_run(tmp_path)
    cfg = make_cfg(
        *SMALL, "trainer.total_steps=2", "trainer.lr=0.003", "trainer.betas=[0.8,0.95]", "trainer.save_every=1"
    )
    trainer = build_trainer(cfg)
    out = capsys.readouterr().out
    report = [line for line in out.splitlines() if "config changes" in line]
    assert len(report) == 1, out
    for fragment in ("trainer.lr: 0.01 -> 0.003", "trainer.total_steps: 1 -> 2", "trainer.betas:", "new values apply"):
        assert fragment in report[0], report[0]
    groups = trainer.algorithm.updater.optimizer.param_groups
    assert all(g["lr"] == 0.003 and tuple(g["betas"]) == (0.8, 0.95) for g in groups)
    assert trainer.algorithm.updater.optimizer.state  # the Adam moments were restored, not reset
    trainer.fit()
    state = json.loads((latest_checkpoint(cfg.trainer.output_dir) / "state.json").read_text())
    assert all(g["lr"] == 0.003 for g in state["optimizer"]["param_groups"])


def test_resume_refuses_keys_that_change_what_the_checkpoint_means(make_cfg, one_step_run, tmp_path):
    from flowrl.config import config_to_dict
    from flowrl.run.resume import plan_run

    one_step_run(tmp_path)
    cfg = make_cfg(
        *SMALL,
        "trainer.total_steps=2",
        "rollout.n=4",
        "trainer.lora.rank=8",
        "algorithm.clip_range=0.2",
        "trainer.lr=1",
    )
    with pytest.raises(ValueError) as caught:
        plan_run(cfg, config_to_dict(cfg))
    message = str(caught.value)
    assert "\n" not in message
    for fragment in (
        "rollout.n (2 -> 4)",
        "trainer.lora.rank (4 -> 8)",
        "algorithm.clip_range",
        "trainer.resume=never",
    ):
        assert fragment in message, message
    assert "trainer.lr" not in message  # changeable: not part of the refusal


def test_every_config_key_has_a_resume_rule():
    from flowrl.config import FlowRLConfig, config_to_dict
    from flowrl.run.resume import RESUME_RULES, flatten

    patterns = [p for p, _ in RESUME_RULES]
    for key in flatten(config_to_dict(FlowRLConfig())):
        assert any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns), key
