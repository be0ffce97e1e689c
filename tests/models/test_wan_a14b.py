"""Training one expert of Wan2.2-T2V-A14B (model.trained_expert) on the tiny two-expert checkpoint:
sampling is the same function whichever expert is the trained `transformer`; a FlowGRPO run
(LoRA, or full fine-tuning) changes its expert alone, its rollout log-probs the trainer's; a
forward-process run trains only the timesteps its expert predicts; windows on the other expert's
steps, a two-expert model without the setting and the setting on a one-expert model are refused
with the fix; a started replica holds the trained expert as its transformer; a low expert's
exported LoRA loads into WanPipeline's transformer_2 and computes what the trainer's does, and
flowrl's own loader puts it back into the same expert.

The tiny checkpoint's boundary is 0.875: at 4 steps (sigmas 1, 0.973, 0.923, 0.801) steps 0-2 are
the high expert's; at 6 steps (1, 0.984, 0.96, 0.923, 0.858, 0.707) steps 0-3 are, 4-5 the low's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from wan_runs import FRAMES, SIZE, wan_train_config

from flowrl.engine import DiffusionEngine, SamplingParams

PROMPT = "a red circle moving right"


@pytest.fixture(scope="module")
def a14b_path(tmp_path_factory):
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("wan2.2-a14b", tmp_path_factory.mktemp("tiny_a14b") / "a14b", seed=0)


def _train_config(path, output, *overrides):
    return wan_train_config(path, output, "rollout.n=2", "trainer.prompts_per_step=2", "trainer.lr=0.05", *overrides)


LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=16")
# Per expert: the steps and an SDE window on its side of the boundary (module docstring).
WINDOWS = {
    "high": ("rollout.sampling.num_inference_steps=4",),  # the default window, steps 0-2
    "low": ("rollout.sampling.num_inference_steps=6", "rollout.sampling.sde_window=[4,5]"),
}
OTHER = {"high": "low", "low": "high"}


def _expert_state(adapter, expert: str) -> dict[str, torch.Tensor]:
    """The expert's weights as the checkpoint names them (peft's wrapper names folded back)."""
    module = adapter.high_expert if expert == "high" else adapter.low_expert
    return {
        k.replace(".base_layer.", "."): v.clone()
        for k, v in module.state_dict().items()
        if not any(part.startswith("lora_") for part in k.split("."))
    }


def _metrics(summary) -> list[dict]:
    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    return [r for r in records if "actor/grad_norm" in r]


def test_sampling_is_the_same_whichever_expert_is_trained(a14b_path):
    """Before training, the adapter of trained_expert=None, high and low samples the same ODE video
    bit for bit (the experts are routed by role), with `transformer` the chosen expert."""
    from flowrl.models.registry import load_adapter

    params = SamplingParams(
        height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=4, noise_level=0.0, logprobs=False,
        sde_window=(0, 3), seed=3, guidance_scale=4.5,
    )  # fmt: skip
    videos = {}
    for expert in (None, "high", "low"):
        adapter = load_adapter(a14b_path, trained_expert=expert)
        trained = adapter.pipeline.transformer_2 if expert == "low" else adapter.pipeline.transformer
        assert adapter.transformer is trained and adapter.transformer_2 is not trained
        sigmas = adapter.sigmas(4, SIZE, SIZE)[:-1]
        assert adapter.is_trained_sigma(sigmas).tolist() == [expert != "low"] * 3 + [expert == "low"]
        engine = DiffusionEngine(adapter)
        try:
            videos[expert] = engine.generate(PROMPT, params).all_latents
        finally:
            engine.shutdown()
    assert torch.equal(videos[None], videos["high"]) and torch.equal(videos[None], videos["low"])


@pytest.mark.parametrize("expert", ["high", "low"])
def test_flow_grpo_lora_trains_its_expert_alone(build_trainer, a14b_path, tmp_path, expert):
    """Two FlowGRPO steps with a LoRA on one expert: the other expert's weights are the
    checkpoint's bit for bit, the trained expert's LoRA moved, its gradient is nonzero, and the
    rollout log-probs of its window steps are the trainer's."""
    from flowrl.models.registry import load_adapter

    cfg = _train_config(
        a14b_path, tmp_path, f"model.trained_expert={expert}", "trainer.total_steps=2", *LORA, *WINDOWS[expert]
    )
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    steps = _metrics(summary)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(np.isfinite(r["actor/policy_loss"]) and r["actor/grad_norm"] > 0 for r in steps)
    assert all(r["actor/logprob_gap_max"] < 1e-6 for r in steps)
    base = load_adapter(a14b_path)
    frozen = _expert_state(trainer.adapter, OTHER[expert])
    assert frozen.keys() == _expert_state(base, OTHER[expert]).keys()
    assert all(torch.equal(frozen[k], v) for k, v in _expert_state(base, OTHER[expert]).items())
    assert not any("lora_" in name for name, _ in trainer.adapter.transformer_2.named_parameters())
    lora_b = [p for name, p in trainer.adapter.transformer.named_parameters() if "lora_B" in name]
    assert lora_b and max(float(p.detach().abs().max()) for p in lora_b) > 0  # initialised at zero


def test_full_fine_tuning_of_the_high_expert_leaves_the_low_one(build_trainer, a14b_path, tmp_path):
    from flowrl.models.registry import load_adapter

    cfg = _train_config(
        a14b_path, tmp_path, "model.trained_expert=high", "trainer.total_steps=1", "trainer.lr=1e-3",
        "trainer.lora.enabled=false", *WINDOWS["high"],
    )  # fmt: skip
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    assert np.isfinite(_metrics(summary)[0]["actor/policy_loss"])
    base = load_adapter(a14b_path)
    low, high = _expert_state(trainer.adapter, "low"), _expert_state(trainer.adapter, "high")
    assert all(torch.equal(low[k], v) for k, v in _expert_state(base, "low").items())
    assert any(not torch.equal(high[k], v) for k, v in _expert_state(base, "high").items())
    # The export writes the trained expert as the checkpoint's `transformer` folder.
    info = json.loads((Path(summary["final_weights"]) / "flowrl_run.json").read_text())
    assert info["trained_expert"] == "high" and info["trained_component"] == "transformer"
    assert not (Path(summary["final_weights"]) / "transformer").is_symlink()
    assert (Path(summary["final_weights"]) / "transformer_2").is_symlink()


def test_forward_process_trains_only_its_experts_timesteps(build_trainer, a14b_path, tmp_path, monkeypatch):
    """DiffusionNFT on the low expert: every planned pair's sigma is below the boundary, drawn from
    the two timesteps of six the low expert predicts (the FLOP count's too); the high expert stays
    the checkpoint's."""
    from flowrl.models.registry import load_adapter
    from flowrl.trainer.forward_process import trained_timesteps

    cfg = _train_config(
        a14b_path, tmp_path, "model.trained_expert=low", "algorithm.name=diffusion_nft", "trainer.total_steps=1",
        "rollout.sampling.num_inference_steps=6", "rollout.sampling.noise_level=0.0",
        "rollout.sampling.logprobs=false", "rollout.sampling.guidance_scale=1.0",
        "algorithm.train_timestep_fraction=1.0", *LORA,
    )  # fmt: skip
    trainer = build_trainer(cfg)
    batches = []
    prepare = trainer.algorithm.prepare
    monkeypatch.setattr(trainer.algorithm, "prepare", lambda *a: batches.append(prepare(*a)) or batches[-1])
    summary = trainer.fit()
    assert np.isfinite(_metrics(summary)[0]["actor/loss"]) and _metrics(summary)[0]["actor/grad_norm"] > 0
    boundary = trainer.adapter.boundary_sigma
    schedule = trainer.adapter.sigmas(6, SIZE, SIZE)[:-1]
    (batch,) = batches
    assert torch.equal(batch.timesteps, schedule[schedule < boundary].expand(len(batch.specs), 2))
    sigmas = torch.cat([pair.sigma for pairs in batch.steps for pair in pairs])
    assert sigmas.numel() and bool((sigmas < boundary).all())
    assert batch.plan.num_trained_steps == 2 == trained_timesteps(trainer.adapter, cfg.rollout.sampling)
    base = load_adapter(a14b_path)
    high = _expert_state(trainer.adapter, "high")
    assert all(torch.equal(high[k], v) for k, v in _expert_state(base, "high").items())


def test_windows_on_the_other_experts_steps_are_refused_with_the_range(build_trainer, a14b_path, tmp_path):
    # The default window (steps 0-4 of 6) reaches the high expert's steps 0-3.
    cfg = _train_config(a14b_path, tmp_path, "model.trained_expert=low", "rollout.sampling.num_inference_steps=6")
    with pytest.raises(ValueError, match=r"sde_window=null .* steps 0\.\.4, but the low expert .* predicts steps "
                       r"4\.\.5 of 6.*set rollout.sampling.sde_window=\[4, 5\]"):  # fmt: skip
        build_trainer(cfg)
    cfg = _train_config(
        a14b_path, tmp_path, "model.trained_expert=high", "rollout.sampling.num_inference_steps=6",
        "rollout.sampling.sde_window_size=2", "rollout.sampling.sde_window_range=[2,5]",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"sde_window_size=2 with rollout.sampling.sde_window_range=\[2, 5\] .* "
                       r"predicts steps 0\.\.3 of 6.*sde_window_range=\[0, 4\] with sde_window_size <= 4"):  # fmt: skip
        build_trainer(cfg)
    cfg = _train_config(
        a14b_path, tmp_path, "model.trained_expert=low", "rollout.sampling.num_inference_steps=6",
        "rollout.sampling.sde_window=[3,5]",
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^rollout.sampling.sde_window=\[3, 5\] lets the SDE window take steps 3\.\.4"
    ):
        build_trainer(cfg)
    # A forward-process run needs one timestep of its expert: at 2 steps (sigmas 1, 0.923) all are high.
    cfg = _train_config(
        a14b_path, tmp_path, "model.trained_expert=low", "algorithm.name=diffusion_nft",
        "rollout.sampling.num_inference_steps=2", "rollout.sampling.noise_level=0.0",
        "rollout.sampling.logprobs=false", "rollout.sampling.guidance_scale=1.0",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"predicts none of the 2 steps of rollout.sampling.num_inference_steps=2"):
        build_trainer(cfg)
    # At 4 steps the low expert predicts the last step alone, which is never an SDE step.
    cfg = _train_config(a14b_path, tmp_path, "model.trained_expert=low", "rollout.sampling.num_inference_steps=4")
    with pytest.raises(ValueError, match=r"predicts steps 3\.\.3 of 4 .* none an SDE step"):
        build_trainer(cfg)


def test_the_expert_setting_is_needed_by_two_experts_and_refused_by_one(build_trainer, a14b_path, tmp_path):
    from flowrl.models.debug.tiny import build_tiny_checkpoint
    from flowrl.models.registry import load_adapter

    with pytest.raises(
        ValueError, match=r"has two experts .* set model.trained_expert=high or model.trained_expert=low"
    ):
        build_trainer(_train_config(a14b_path, tmp_path, *WINDOWS["high"]))
    wan21 = build_tiny_checkpoint("wan", tmp_path / "wan21", seed=0)
    message = r"model.trained_expert='low' picks one expert of a two-expert .* leave model.trained_expert null"
    with pytest.raises(ValueError, match=message):
        build_trainer(_train_config(wan21, tmp_path / "run", "model.trained_expert=low"))
    with pytest.raises(ValueError, match=message):  # flowrl eval, generate and serve load through here
        load_adapter(wan21, trained_expert="low")


def test_a_low_experts_lora_export_loads_into_transformer_2(build_trainer, a14b_path, tmp_path):
    """The exported LoRA of a low-expert run, loaded by WanPipeline with load_into_transformer_2,
    gives the video the trainer's model gives (and differs from the base's); the exported pipeline
    folder holds the fused expert as transformer_2; flowrl's own loader, from the run's saved
    config, puts the LoRA back into the low expert."""
    from diffusers import WanPipeline

    from flowrl.eval.weights import WeightLoader, run_sources
    from flowrl.models.registry import load_adapter

    cfg = _train_config(
        a14b_path, tmp_path, "model.trained_expert=low", "trainer.total_steps=1", *LORA, *WINDOWS["low"]
    )
    trainer = build_trainer(cfg)
    final = Path(trainer.fit()["final_weights"])
    info = json.loads((final / "flowrl_run.json").read_text())
    assert info["trained_expert"] == "low" and "load_into_transformer_2=True" in info["load_lora"]
    assert (final / "transformer").is_symlink() and not (final / "transformer_2").is_symlink()

    def sample(pipe):
        return pipe(
            prompt=PROMPT, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=6,
            generator=torch.Generator().manual_seed(0), max_sequence_length=32, output_type="pt",
        ).frames  # fmt: skip

    pipe = WanPipeline.from_pretrained(str(a14b_path))
    pipe.set_progress_bar_config(disable=True)
    base = sample(pipe)
    pipe.load_lora_weights(str(final / "lora"), load_into_transformer_2=True)
    with_lora = sample(pipe)
    assert (with_lora - base).abs().max() > 1e-4
    trained = sample(trainer.adapter.pipeline)
    torch.testing.assert_close(with_lora, trained, rtol=1e-4, atol=1e-5)
    fused = WanPipeline.from_pretrained(str(final))
    fused.set_progress_bar_config(disable=True)
    torch.testing.assert_close(sample(fused), trained, rtol=1e-4, atol=1e-5)
    # flowrl's loader: the adapter of the run's config, the LoRA in its low expert.
    (source,) = run_sources(tmp_path)
    adapter = load_adapter(a14b_path, **cfg.model.adapter_options())
    loader = WeightLoader(adapter)
    loader.prepare([source])
    loader.load(source)
    latents = torch.randn((1, *adapter.latent_shape(SIZE, SIZE, num_frames=FRAMES)), generator=torch.Generator())
    cond = adapter.encode_prompts([PROMPT])
    with torch.no_grad():
        for sigma in (0.95, 0.5):  # each expert's side
            args = (latents, torch.tensor([sigma]), cond, [None], torch.ones(1), SIZE, SIZE)
            torch.testing.assert_close(adapter.velocity(*args), trainer.adapter.velocity(*args), rtol=0, atol=1e-6)


def test_a_started_replica_serves_the_trained_expert_as_its_transformer(a14b_path, tmp_path):
    """A rollout server the trainer starts (rollout_backend.replica_serve_args) holds the trained
    expert as the `transformer` that weight updates go into."""
    import argparse

    from flowrl.cli import serve as serve_cli
    from flowrl.rollout.backends import replica_serve_args

    cfg = _train_config(a14b_path, tmp_path, "model.trained_expert=low", "rollout.num_replicas=1")
    parser = argparse.ArgumentParser()
    serve_cli.build_parser(parser)
    engine, _, _ = serve_cli._open(parser.parse_args(["--model", str(a14b_path), *replica_serve_args(cfg)]))
    try:
        assert engine.adapter.transformer is engine.adapter.pipeline.transformer_2
    finally:
        engine.shutdown()


def test_random_a14b_has_two_experts_of_the_14b_architecture_at_the_published_boundary(monkeypatch):
    """`random:wan2.2-a14b` (speed and memory work on a GPU) builds both experts of Wan2.1-14B's
    architecture, routes at the checkpoint's boundary with its flow shift, and takes
    model.trained_expert as a folder does (built here at narrow widths: the wiring, not the size)."""
    from flowrl.models.debug import architectures
    from flowrl.models.debug.random_weights import published_parameter_count
    from flowrl.models.registry import load_adapter, model_has_two_experts, read_model_family

    assert read_model_family("random:wan2.2-a14b") == "wan2.2" and model_has_two_experts("random:wan2.2-a14b")
    assert not model_has_two_experts("random:wan2.1-14b")
    cls, config, vae_cls, vae_config, scheduler = architectures.RANDOM_WEIGHT_MODULES["wan2.2-a14b"]
    assert config == architectures.WAN21_14B_TRANSFORMER and vae_config == architectures.WAN21_VAE
    # Two experts of 14.3 B each, and the Wan2.1 VAE (0.13 B).
    assert 28.0e9 < published_parameter_count("wan2.2-a14b") < 29.5e9
    narrow = dict(config, num_attention_heads=2, attention_head_dim=16, ffn_dim=32, text_dim=8, freq_dim=16)
    monkeypatch.setitem(
        architectures.RANDOM_WEIGHT_MODULES,
        "wan2.2-a14b",
        (cls, narrow, vae_cls, dict(vae_config, base_dim=4, z_dim=16), scheduler),
    )
    adapter = load_adapter("random:wan2.2-a14b", num_layers=1, trained_expert="low", warn=False)
    pipeline = adapter.pipeline
    assert adapter.boundary_sigma == 0.875 and pipeline.scheduler.config.flow_shift == 12.0
    assert adapter.transformer is pipeline.transformer_2 and adapter.transformer_2 is pipeline.transformer
    high, low = pipeline.transformer, pipeline.transformer_2
    assert len(high.blocks) == len(low.blocks) == 1
    assert not torch.equal(high.blocks[0].ffn.net[2].weight, low.blocks[0].ffn.net[2].weight)


def test_random_a14b_on_a_cpu_is_refused_pointing_at_the_tiny_two_expert_model(monkeypatch, capsys):
    from flowrl.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["train", "--config", "recipes/wan21_1_3b_ocr_lora.yaml", "model.path=random:wan2.2-a14b"]
    argv += ["model.trained_expert=high", "data.train_path=null", "data.val_path=null"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "28.7 B parameters" in err and "needs a GPU" in err
    assert "flowrl make-tiny --kind wan2.2-a14b OUT, then model.path=OUT" in err


def test_random_wan22_pipelines_carry_their_checkpoints_settings():
    """A `random:` Wan2.2 pipeline (the bench's diffusers baseline) is configured as the checkpoint's
    model_index.json: TI2V-5B with per-token timesteps, A14B with its boundary."""
    from flowrl.models.debug.architectures import PIPELINE_SETTINGS
    from flowrl.models.registry import load_adapter

    assert PIPELINE_SETTINGS["wan2.2-5b"] == {"expand_timesteps": True}
    assert load_adapter("random:tiny-wan2.2", warn=False).pipeline.config.expand_timesteps is True
    assert not load_adapter("random:tiny-wan", warn=False).pipeline.config.expand_timesteps
